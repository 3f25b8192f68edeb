"""Run a sweep's jobs on a pool of GPUs: one job per GPU at a time, never two on one device
unless asked (``--jobs-per-device``).

    python -m sweeps.gpu_pool [--devices 0,1,2,3] [--jobs-per-device N] [--dry-run] [--rerun] \
        -- +sweep=table1 seed=0,1,2

Hydra's joblib launcher runs jobs in parallel but pins no device: each job would see every GPU
and JAX would put them all on the first one. This pool expands the sweep exactly as
``train.py -m`` does (sweeps/expand.py), then starts each job as its own process,
``python train.py -m <that job's overrides>`` (a one-job multirun, so Hydra itself picks the same
run dir as the whole sweep would), with ``CUDA_VISIBLE_DEVICES`` set to one free device of the
pool. A device goes back to the pool only when its job's process has exited, so concurrent jobs
hold distinct devices (unless ``--jobs-per-device`` allows more), and every job starts in a
fresh process (JAX reads CUDA_VISIBLE_DEVICES once, at start-up).

- Devices: ``--devices`` (comma-separated ids or UUIDs), else $CUDA_VISIBLE_DEVICES, else every
  GPU that ``nvidia-smi`` lists; with none of these (a CPU machine) the jobs run one at a time
  (N with ``--jobs-per-device N``) with CUDA_VISIBLE_DEVICES left as it is.
- Each job is a separate process, so a failing job (train.py exits 1) does not touch the
  others (``train.py -m`` also runs every job, one at a time, and exits 1 with
  a list of the failed ones).
- Jobs whose run dir already holds a completed summary.json of the same resolved config are
  skipped (``--rerun`` runs them anyway; train.py then resumes from the last checkpoint).
- Each job's output goes to ``<run dir>/train.log`` (appended); the pool prints one line per start
  and end. It exits non-zero if a job failed, except for runs that diverged (NaN/Inf loss:
  train.py exits 1 after writing summary.json with status "failed"), which are results (an lr
  too large, say) that results/tables.py skips and sweeps/best_lr.py marks as diverged.
- ``--jobs-per-device N`` runs up to N jobs on each device at once, for runs whose accuracy
  alone counts (a ResNet-18 step at batch 128 leaves most of a large GPU idle: four to six runs
  on one H200 give up to about twice the throughput of one, results/cifar10/CAMPAIGN.md,
  "Cost"). Each such job runs with ``GINGER_DEVICE_SHARED=1`` (its summary.json says
  ``device_shared``, and results/tables.py leaves its step time and memory out) and
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``. Time and memory figures come only from runs alone on
  their device: the default, 1.
- ``--command`` replaces ``python train.py -m`` (the job's overrides are appended): the tests use
  it to record what each child would get, without a GPU.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sweeps.expand import ROOT, Job, expand
from training import run_record

DEVICE_ENV = "CUDA_VISIBLE_DEVICES"
# The environment of jobs that share a device (run_pool's jobs_per_device > 1).
SHARED_ENV = {"GINGER_DEVICE_SHARED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def detect_devices() -> list[str]:
  """$CUDA_VISIBLE_DEVICES if set, else the GPUs nvidia-smi lists (empty if none)."""
  visible = os.environ.get(DEVICE_ENV)
  if visible is not None and visible.strip():
    return [d.strip() for d in visible.split(",") if d.strip()]
  try:
    out = subprocess.run(
      ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      check=True,
      timeout=60,
    ).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [line.strip() for line in out.splitlines() if line.strip()]


def is_completed(job: Job) -> bool:
  """Whether the job's run dir holds a completed summary.json of exactly this config."""
  return run_record.status(ROOT / job.run_dir, job.config) == "completed"


def diverged_run(job: Job) -> bool:
  """Whether the job stopped because its loss became NaN/Inf (train.py then writes a
  summary.json with status "failed"): a result of the sweep, not a broken job."""
  return run_record.status(ROOT / job.run_dir, job.config) == "failed"


def run_pool(
  commands: Sequence[Sequence[str]],
  devices: Sequence[str | None],
  logs: Sequence[Path | None] | None = None,
  cwd: Path = ROOT,
  labels: Sequence[str] | None = None,
  jobs_per_device: int = 1,
) -> list[int]:
  """Run `commands`, at most `jobs_per_device` per device at a time, each with
  CUDA_VISIBLE_DEVICES set to the device it holds (a None device leaves the environment as it
  is). Returns the exit codes in the order of `commands`.

  With `jobs_per_device` > 1 the jobs are spread over the devices (the first len(devices)
  jobs on distinct ones) and each gets SHARED_ENV: ``GINGER_DEVICE_SHARED=1``, so that its
  run record keeps its time and memory figures out of the tables, and
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so that JAX takes the device's memory as it needs
  it instead of 75 % of it at start-up, which would leave the device's other jobs too little."""
  if not devices:
    raise ValueError("no devices: pass --devices (e.g. --devices 0,1,2,3)")
  if len(set(devices)) != len(devices):
    raise ValueError(f"devices must be distinct, got {list(devices)}")
  if jobs_per_device < 1:
    raise ValueError(f"jobs_per_device must be at least 1, got {jobs_per_device}")
  free: queue.Queue[str | None] = queue.Queue()
  for _ in range(jobs_per_device):
    for device in devices:
      free.put(device)
  logs = list(logs) if logs is not None else [None] * len(commands)
  labels = list(labels) if labels is not None else [shlex.join(c) for c in commands]
  total, lock = len(commands), threading.Lock()

  def say(text: str) -> None:
    with lock:
      print(text, flush=True)

  def work(i: int) -> int:
    device = free.get()  # blocks until a device has a free slot; one worker per slot
    try:
      env = dict(os.environ) | (SHARED_ENV if jobs_per_device > 1 else {})
      if device is not None:
        env[DEVICE_ENV] = device
      where = "the default device" if device is None else f"device {device}"
      say(f"[{i + 1}/{total}] start on {where}: {labels[i]}")
      start = time.perf_counter()
      log = logs[i]
      if log is not None:
        (cwd / log).parent.mkdir(parents=True, exist_ok=True)
        with open(cwd / log, "a") as f:
          rc = subprocess.run(
            list(commands[i]), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT
          ).returncode
      else:
        rc = subprocess.run(list(commands[i]), cwd=cwd, env=env).returncode
      say(
        f"[{i + 1}/{total}] {'done' if rc == 0 else f'FAILED (exit {rc})'} on {where} "
        f"after {time.perf_counter() - start:.0f}s: {labels[i]}"
        + (f" (log: {log})" if log is not None and rc else "")
      )
      return rc
    finally:
      free.put(device)

  with ThreadPoolExecutor(max_workers=len(devices) * jobs_per_device) as pool:
    return list(pool.map(work, range(total)))


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m sweeps.gpu_pool",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--devices",
    default=None,
    help="comma-separated device ids (default: $CUDA_VISIBLE_DEVICES, else "
    "all GPUs nvidia-smi lists)",
  )
  parser.add_argument(
    "--command",
    default=f"{shlex.quote(sys.executable)} train.py -m",
    help="what runs one job, before its overrides (default: %(default)s)",
  )
  parser.add_argument(
    "--jobs-per-device",
    type=int,
    default=1,
    metavar="N",
    help="run up to N jobs on each device at once, for runs whose accuracy alone counts: "
    "their run records mark them as sharing a device, and the tables leave their times and "
    "memory out (default: %(default)s)",
  )
  parser.add_argument(
    "--rerun",
    action="store_true",
    help="also run jobs whose run dir holds a completed summary.json",
  )
  parser.add_argument("--dry-run", action="store_true", help="print the jobs, run nothing")
  parser.add_argument(
    "overrides",
    nargs=argparse.REMAINDER,
    help="train.py -m overrides (after --), e.g. +sweep=table1 seed=0,1,2",
  )
  args = parser.parse_args(argv)
  if args.jobs_per_device < 1:
    parser.error(f"--jobs-per-device must be at least 1, got {args.jobs_per_device}")
  overrides = [o for o in args.overrides if o != "--"]
  jobs = expand(overrides)
  todo = [j for j in jobs if args.rerun or not is_completed(j)]
  devices = (
    [d.strip() for d in args.devices.split(",") if d.strip()]
    if args.devices is not None
    else detect_devices()
  )
  print(
    f"{len(jobs)} jobs, {len(jobs) - len(todo)} already completed (skipped), "
    f"{len(todo)} to run on devices {devices or '(none found)'}"
    + (f", {args.jobs_per_device} jobs per device" if args.jobs_per_device > 1 else ""),
    flush=True,
  )
  prefix = shlex.split(args.command)
  commands = [prefix + list(j.overrides) for j in todo]
  if args.dry_run or not todo:
    for job, command in zip(todo, commands, strict=True):
      print(f"{job.run_dir}  lr={job.config['lr']}\n    {shlex.join(command)}")
    return 0
  if not devices:
    print(
      "no GPUs found: running the jobs one at a time, CUDA_VISIBLE_DEVICES untouched", flush=True
    )
  if os.environ.get("JAX_PLATFORMS") == "cpu" and args.devices is None and devices:
    print(
      "warning: JAX_PLATFORMS=cpu, so the jobs will not use the GPUs (unset it, or "
      "`make ... JAX_PLATFORMS=`)",
      file=sys.stderr,
    )
  codes = run_pool(
    commands,
    devices or [None],
    logs=[j.run_dir / "train.log" for j in todo],
    labels=[str(j.run_dir) for j in todo],
    jobs_per_device=args.jobs_per_device,
  )
  bad = [j for j, rc in zip(todo, codes, strict=True) if rc]
  diverged = [str(j.run_dir) for j in bad if diverged_run(j)]
  failed = [str(j.run_dir) for j in bad if not diverged_run(j)]
  print(
    f"{len(todo) - len(bad)} of {len(todo)} jobs completed"
    + (
      f"; {len(diverged)} diverged (summary.json status failed, a result that the tables "
      f"skip): " + ", ".join(diverged)
      if diverged
      else ""
    )
    + ("; FAILED: " + ", ".join(failed) if failed else ""),
    flush=True,
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
