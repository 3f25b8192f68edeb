"""Hydra's submitit launchers for train.py: every job of a multirun in a process of its own, as
a SLURM job (``hydra/launcher=submitit_slurm``) or on this machine (``submitit_local``), its exit
reported as ``train.py -m`` reports the jobs it runs itself.

``register()`` (train.py calls it before Hydra composes) puts these in place of
hydra-submitit-launcher's two configs of the same names: the same keys (``hydra.launcher.<key>``
on the command line), with train.py's defaults (:class:`SlurmConf`, :class:`LocalConf`: one GPU
and one process per job, a day's time limit) and the launcher classes below. Hydra instantiates
launchers only from its ``hydra_plugins`` namespace: hydra_plugins/ginger_launchers/ names them
there.

hydra-submitit-launcher's launchers (pinned, 1.2.0) hand Hydra each job's result and stop at
the first job that left none. These run the jobs the same way, in the same run dirs (nothing
here touches ``hydra.sweep.dir`` or ``hydra.sweep.subdir``), and bring back from each job's
process what train.py's exit status needs (training/multirun.py): its run dir, why it failed (a
user error's message; for a bug, the error, its traceback in the job's log), or the signal that
stopped it. A job that left no result (killed: out of memory, cancelled, past its time limit) is
listed by its overrides and log. The launching process then prints the list and exits as an
in-process multirun does: 0, 1 if a job failed, or 128 + the signal if one was stopped.

The signal SLURM sends ``signal_delay_s`` seconds before a job's time limit is SIGTERM here
(submitit's default is SIGUSR2, which submitit itself handles): the training loop answers it
by saving a checkpoint after the step in flight and stopping, and rerunning the command
continues the run from there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from hydra_plugins.hydra_submitit_launcher.config import (
  BaseQueueConf,
  LocalQueueConf,
  SlurmQueueConf,
)
from omegaconf import OmegaConf

from training import multirun, run_record
from training.errors import Interrupted

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]

# submitit reads the signal from this variable when it is imported, in the launching process
# (sbatch --signal=<signal>@<signal_delay_s>) and in each job's (the handler it installs).
SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"
SIGNAL = "TERM"


@dataclasses.dataclass
class Outcome:
  """What a job's process sends back: its run dir, its line in the list of failed jobs (None:
  it did not fail), and 128 + the signal that stopped it (None: no signal did)."""

  run_dir: str | None
  failure: str | None = None
  stopped: int | None = None
  result: JobReturn | None = None  # Hydra's result of a job that ran to its end


class _Reporting(plugin.BaseSubmititLauncher):
  """The plugin's launcher, each job's outcome brought back to the launching process."""

  def __call__(
    self,
    sweep_overrides: list[str],
    job_dir_key: str,
    job_num: int,
    job_id: str,
    singleton_state: dict[type, Singleton],
  ) -> Outcome:
    """Runs one job (in its own process) and returns its outcome."""
    run_record.register_resolvers()  # ${run_name:...} of the run-dir templates
    failed = len(multirun.failed)
    try:
      ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
    except SystemExit as stop:
      cause = stop.__context__
      if not isinstance(cause, Interrupted):  # submitit's own exit (a requeue): as it is
        raise
      run_dir = multirun.jobs[-1] if multirun.jobs else None
      return Outcome(run_dir, f"{run_dir}: Interrupted: {cause}", stopped=cause.exit_code)
    run_dir = str(ret.hydra_cfg.hydra.runtime.output_dir)
    if ret.status is JobStatus.FAILED:  # a bug: train.main let it through
      error = ret._return_value
      log.error("%s: raised an unexpected error", run_dir, exc_info=error)
      why = f"{type(error).__name__}: {error}"
      return Outcome(
        run_dir, f"{run_dir}: raised an unexpected error (traceback in its log): {why}"
      )
    if len(multirun.failed) > failed:
      return Outcome(run_dir, multirun.failed[-1])
    return Outcome(run_dir, result=ret)

  def executor(self) -> Any:
    """submitit's executor with this config's parameters (as the plugin builds it), its jobs
    warned of their time limit by ``SIGNAL``."""
    os.environ.setdefault(SIGNAL_ENV, SIGNAL)
    # Each job's process unpickles this launcher and train.py's task: it imports them from the
    # repository, wherever it starts (submitit passes this environment on, as sbatch does).
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in path:
      os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, path)])
    import submitit

    submitit.JobEnvironment.USR_SIG = os.environ[SIGNAL_ENV]
    specific = {"max_num_timeout"}
    executor = submitit.AutoExecutor(
      cluster=self._EXECUTOR,
      folder=self.params["submitit_folder"],
      **{f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in specific},
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
      **{
        k if k in base else f"{self._EXECUTOR}_{k}": v
        for k, v in self.params.items()
        if k not in specific | {"submitit_folder"}
      }
    )
    return executor

  def launch(
    self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
  ) -> Sequence[JobReturn]:
    """Submits every job, waits for them all and records each one's outcome (the plugin's
    ``launch``, with its results gathered one job at a time)."""
    assert self.config is not None and job_overrides
    executor = self.executor()
    sweep_dir = Path(str(self.config.hydra.sweep.dir))
    log.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR, sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in self.config.hydra.sweep:
      os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
    labels, job_params = [], []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
      labels.append(f"#{idx} ({' '.join(filter_overrides(overrides))})")
      log.info("\t%s", labels[-1])
      job_params.append(
        (list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
      )
    jobs = executor.map_array(self, *zip(*job_params, strict=True))
    returns = []
    for label, overrides, job in zip(labels, job_overrides, jobs, strict=True):
      outcome = _outcome(job, label)
      multirun.jobs.append(outcome.run_dir or label)
      if outcome.failure is not None:
        line = f"{outcome.failure}\n    its log: {job.paths.stdout}"
        log.error("%s", line)
        multirun.failed.append(line)
      if outcome.stopped is not None:
        multirun.stopped.append(outcome.stopped)
      returns.append(
        outcome.result or JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
      )
    return returns


def _outcome(job: Any, label: str) -> Outcome:
  """The job's outcome, or one saying that it left none (its process was killed)."""
  try:
    return job.results()[0]
  except Exception as e:  # submitit's UncompletedJobError (or FailedJobError, with a trace)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    why = next((line for line in lines if line.startswith("has not produced")), lines[0])
    return Outcome(None, f"job {label}: left no result: {why}")


class SlurmLauncher(_Reporting, plugin.SlurmLauncher):
  """One SLURM job per run (a job array)."""


class LocalLauncher(_Reporting, plugin.LocalLauncher):
  """One process per run on this machine, all at once."""


@dataclasses.dataclass
class SlurmConf(SlurmQueueConf):
  """``hydra/launcher=submitit_slurm``: one SLURM job per run, one GPU each. Every other key of
  hydra-submitit-launcher's config is there too (``partition``, ``account``, ``qos``,
  ``constraint``, ``setup``, ``additional_parameters``, ...), as sbatch options through
  submitit."""

  _target_: str = "hydra_plugins.ginger_launchers.SlurmLauncher"
  timeout_min: int = 24 * 60  # a run stopped by its time limit continues when rerun
  gpus_per_node: int | None = 1  # train.py uses every GPU it is given: one per run
  tasks_per_node: int = 1  # one process per run (several: jax.distributed over the tasks)
  cpus_per_task: int | None = 8  # XLA's compilation and the input pipeline
  mem_gb: int | None = 64  # host memory
  # SIGTERM this long before the time limit: time to save a checkpoint after the step in
  # flight and stop (a ResNet-50 Ginger checkpoint takes seconds; 5 minutes leave room).
  signal_delay_s: int = 300
  max_num_timeout: int = 0  # no requeue after the time limit: rerunning the command continues


@dataclasses.dataclass
class LocalConf(LocalQueueConf):
  """``hydra/launcher=submitit_local``: every run at once, each in a process of its own on this
  machine, as a SLURM multirun runs them (SIGTERM 30 s before the time limit). Not a GPU pool:
  with ``gpus_per_node=0`` the jobs see no GPU (submitit empties CUDA_VISIBLE_DEVICES), with 1
  every job gets GPU 0; sweeps/gpu_pool.py runs one job per GPU of one machine."""

  _target_: str = "hydra_plugins.ginger_launchers.LocalLauncher"
  timeout_min: int = 24 * 60
  gpus_per_node: int | None = 0
  tasks_per_node: int = 1


def register() -> None:
  """Puts :class:`SlurmConf` and :class:`LocalConf` in place of hydra-submitit-launcher's
  ``submitit_slurm`` and ``submitit_local``. Hydra stores the plugin's configs when it first
  scans its plugins (running their modules again), so the scan happens here first."""
  Plugins.instance()
  store = ConfigStore.instance()
  store.store(group="hydra/launcher", name="submitit_slurm", node=SlurmConf, provider="train.py")
  store.store(group="hydra/launcher", name="submitit_local", node=LocalConf, provider="train.py")
