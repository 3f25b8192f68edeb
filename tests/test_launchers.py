"""train.py -m through the submitit launchers (training/launchers.py): the configs' defaults, and
real multiruns through ``hydra/launcher=submitit_local`` (submitit, one process per job), whose
run dirs, results and exit status are those of an in-process multirun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from training import launchers, run_record

ROOT = Path(__file__).resolve().parents[1]
FAST = ["logger=none", "max_steps=2", "eval_every=2", "log_every=1", "checkpoint_every=2"]


def hydra_config(*overrides):
  launchers.register()
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose("config", overrides=list(overrides), return_hydra_config=True).hydra


def multirun(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "train.py", "-m", "hydra/launcher=submitit_local", *overrides],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )


def test_slurm_config_gives_each_job_one_gpu_and_keeps_the_run_dirs():
  for sweep in ([], ["+sweep=table1", "scale=smoke"]):
    slurm = hydra_config("hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", *sweep)
    launcher = slurm.launcher
    assert launcher._target_ == "hydra_plugins.ginger_launchers.SlurmLauncher"
    assert launcher.partition == "gpu"
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)
    assert launcher.timeout_min == 24 * 60 and launcher.signal_delay_s == 300
    assert launcher.max_num_timeout == 0
    basic = hydra_config(*sweep)
    assert basic.launcher._target_.startswith("hydra._internal.core_plugins.basic_launcher")
    assert (slurm.sweep, slurm.run) == (basic.sweep, basic.run)  # the run dirs' templates
  local = hydra_config("hydra/launcher=submitit_local").launcher
  assert local._target_ == "hydra_plugins.ginger_launchers.LocalLauncher"
  assert (local.gpus_per_node, local.tasks_per_node) == (0, 1)


def test_submitit_local_pins_every_job_to_the_same_gpu(tmp_path):
  """Why one machine's GPUs go through sweeps/gpu_pool.py and not submitit's local executor:
  asked for one GPU a job, the executor gives every job the first GPU
  (``CUDA_VISIBLE_DEVICES=0``) and starts them all at once, where the pool gives each job a
  device of its own and waits for a free one (tests/test_sweeps.py
  ``test_gpu_pool_pins_distinct_devices``). Real submitit, real processes: no GPU is needed to
  see what each job is pinned to."""
  import submitit

  executor = submitit.LocalExecutor(folder=tmp_path)
  executor.update_parameters(gpus_per_node=1, timeout_min=2)
  jobs = [executor.submit(os.getenv, "CUDA_VISIBLE_DEVICES") for _ in range(3)]
  assert [job.result() for job in jobs] == ["0", "0", "0"]


def test_slurm_jobs_ask_for_one_gpu_and_sigterm_before_the_time_limit(tmp_path, monkeypatch):
  """The sbatch script submitit writes for submitit_slurm's config (no cluster: a stand-in
  `srun` on PATH lets submitit build its SLURM executor)."""
  import submitit
  from omegaconf import OmegaConf

  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
  (tmp_path / "bin" / "srun").chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("PYTHONPATH", str(ROOT))  # what executor() would add
  monkeypatch.delenv(launchers.SIGNAL_ENV, raising=False)
  monkeypatch.setattr(submitit.JobEnvironment, "USR_SIG", submitit.JobEnvironment.USR_SIG)
  config = hydra_config("hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu").launcher
  params = OmegaConf.to_container(config, resolve=False)
  del params["_target_"]
  params.update(submitit_folder=str(tmp_path / "%j"), name="train")
  executor = launchers.SlurmLauncher(**params).executor()
  assert os.environ[launchers.SIGNAL_ENV] == "TERM"  # the jobs' submitit handles SIGTERM
  sbatch = executor._executor._make_submission_file_text("python -m job", "uid")
  for line in (
    "--partition=gpu",
    "--gpus-per-node=1",
    "--ntasks-per-node=1",
    "--nodes=1",
    "--cpus-per-task=8",
    "--mem=64GB",
    "--time=1440",
    "--signal=TERM@300",
  ):
    assert f"#SBATCH {line}\n" in sbatch, sbatch


# ~24 s on 2 cores (two job processes, each importing JAX and compiling): `make test-all`; the
# launcher's config is checked above, `results.compare` in tests/test_results_compare.py.
@pytest.mark.slow
def test_submitit_local_multirun_runs_every_job_in_its_run_dir(tmp_path):
  out = multirun("experiment=demo", "optimizer=adam,momentum", *FAST, f"hydra.sweep.dir={tmp_path}")
  text = out.stdout + out.stderr
  assert out.returncode == 0, text[-3000:]
  for optimizer in ("adam", "momentum"):  # the run dirs of an in-process multirun
    summary = run_record.read_summary(tmp_path / f"eval_every=2,max_steps=2,optimizer={optimizer}")
    assert summary["status"] == "completed" and summary["steps"] == 2, summary
  assert len(list((tmp_path / ".submitit").glob("*/*_result.pkl"))) == 2  # two processes
  compare = subprocess.run(
    [sys.executable, "-m", "results.compare", str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert compare.returncode == 0, compare.stderr
  rows = [
    line for line in compare.stdout.splitlines() if line.startswith("| ") and "---" not in line
  ]
  column = [cell.strip() for cell in rows[0].split("|")].index("optimizer")
  assert sorted(row.split("|")[column].strip() for row in rows[1:]) == ["adam", "momentum"], (
    compare.stdout
  )


@pytest.mark.slow  # ~20 s; failed jobs listed with the default launcher: tests/test_train.py, fast
def test_submitit_local_multirun_lists_failed_jobs(tmp_path):
  out = multirun(
    "experiment=demo", "optimizer=ginger", "tau=0,-1", *FAST, f"hydra.sweep.dir={tmp_path}"
  )
  text = out.stdout + out.stderr
  assert out.returncode == 1, text[-3000:]
  listed = text[text.index("2 of 2 jobs failed") :]  # each failure's message, and its job's log
  for tau in (0, -1):
    assert f"optimizer=ginger,tau={tau}: ConfigError" in listed, listed
    assert f"tau={tau}: must be an integer >= 1" in listed, listed
  assert listed.count("its log: ") == 2 and "Traceback" not in text


@pytest.mark.slow  # ~40 s on 2 cores: the job runs until 30 s before its one-minute limit
def test_submitit_local_time_limit_stops_a_job_with_a_checkpoint(tmp_path):
  """submitit sends the signal 30 s before the time limit (SLURM: signal_delay_s): SIGTERM,
  which the loop answers with a checkpoint; the launching process exits 128 + SIGTERM."""
  overrides = ["experiment=demo", "optimizer=adam", "logger=none", "epochs=200"]
  out = multirun(*overrides, "hydra.launcher.timeout_min=1", f"hydra.sweep.dir={tmp_path}")
  text = out.stdout + out.stderr
  assert out.returncode == 128 + signal.SIGTERM, text[-3000:]
  run_dir = tmp_path / "epochs=200,optimizer=adam"
  summary = run_record.read_summary(run_dir)
  assert summary["status"] == "interrupted", summary
  assert f"{run_dir}: Interrupted: stopped by SIGTERM at step {summary['steps']}" in text, text
  assert (run_dir / "checkpoints" / str(summary["steps"])).is_dir()


def test_make_targets_submit_to_slurm_with_launcher_slurm():
  make = subprocess.run(
    ["make", "-n", "table1", "LAUNCHER=slurm", "PARTITION=gpu", "SEEDS=0,1"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "MAKEFLAGS": ""},
    check=True,
  ).stdout
  make = " ".join(make.split())
  expected = "train.py -m hydra/launcher=submitit_slurm hydra.launcher.partition=gpu +sweep=table1"
  assert f"{expected} scale=full seed=0,1" in make, make
  assert "sweeps.gpu_pool" not in make
