"""The jobs of one ``train.py`` process and how they ended: what its exit status and its list of
failed jobs report (train.py's ``cli``).

Jobs run in this process (Hydra's basic launcher) record themselves (train.py's ``main``); the
submitit launchers (training/launchers.py) run each job in a process of its own and record here,
in the launching process, what the job's process recorded there.
"""

from __future__ import annotations

import sys

jobs: list[str] = []  # run dirs of the jobs (one, or a multirun's)
failed: list[str] = []  # "<run dir>: <why>" of the jobs that failed
# 128 + the signal number of the jobs stopped by SIGTERM or SIGINT (checkpoint saved) in
# processes of their own; a job run in this process exits with it at once instead.
stopped: list[int] = []


def report() -> None:
  """Prints the list of failed jobs (to stderr) when a multirun had any."""
  if failed and len(jobs) > 1:
    print(
      f"{len(failed)} of {len(jobs)} jobs failed:\n" + "\n".join(f"  {f}" for f in failed),
      file=sys.stderr,
      flush=True,
    )


def exit_status() -> int:
  """0; 128 + the signal of a job stopped by a signal; else 1 if any job failed."""
  if stopped:
    return stopped[0]
  return 1 if failed else 0
