"""The curvature_every sweep (configs/sweep/curvature_every.yaml): Ginger tau=8 at K = 1, 2, 4,
8 and Adam, what its jobs train and where they go, and the make target and campaign phase that
start it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from sweeps import expand

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("ginger_tau8", "ginger_tau8_k2", "ginger_tau8_k4", "ginger_tau8_k8", "adam")


@pytest.fixture(scope="module")
def standin() -> list[expand.Job]:
  return expand.expand(["+sweep=curvature_every", "scale=standin", "seed=0,1"])


def test_ten_jobs_longest_first(standin: list[expand.Job]) -> None:
  assert len(standin) == 10
  arms = [
    o.split("=", 1)[1] for job in standin for o in job.overrides if o.startswith("+sweep/arm")
  ]
  assert arms == [arm for arm in ARMS for _ in (0, 1)]  # the pool starts them in this order
  assert [job.run["seed"] for job in standin] == [0, 1] * 5
  assert len({job.run_dir for job in standin}) == 10


def test_ginger_tau8_at_four_periods_and_adam_at_the_same_length(standin) -> None:
  tuned = OmegaConf.load(ROOT / "configs" / "best_lr" / "cifar10_resnet18_30ep.yaml")
  cells = set()
  for job in standin:
    run, c = job.run, job.config
    assert run["sweep"] == "curvature_every" and run["dataset"] == "cifar10"
    assert (run["model"], c["epochs"], c["max_steps"], c["batch_size"]) == (
      "resnet18",
      10,
      None,
      128,
    )
    assert c["data"]["holdout"] == 0  # validated on the test split, as the tables' runs
    assert run["lr"] == float(tuned[run["optimizer"]]["lr"])  # the tuned lr, fixed across K
    assert c["lr_from"].startswith("lr_tune")
    cells.add((run["optimizer"], run["tau"], run["curvature_every"]))
    if run["optimizer"] == "ginger":
      assert (run["alpha"], run["rho"], run["block"]) == (0.99, 1.0, "per_tensor")
  assert cells == {("ginger", 8, k) for k in (1, 2, 4, 8)} | {("adam", None, None)}
  dirs = sorted(str(job.run_dir) for job in standin)
  assert dirs[0] == "multirun/curvature_every/cifar10_resnet18_30ep/adam,lr=0.001/seed=0"
  assert "multirun/curvature_every/cifar10_resnet18_30ep/ginger_tau8_k4,lr=0.0005/seed=1" in dirs


def test_smoke_scale_composes() -> None:
  jobs = expand.expand(["+sweep=curvature_every", "scale=smoke"])
  assert len(jobs) == 5 and {j.run["dataset"] for j in jobs} == {"digits"}


def test_make_target_and_campaign_phase() -> None:
  env = {**os.environ, "MAKEFLAGS": ""}
  make = subprocess.run(
    ["make", "-n", "curvature_every", "SCALE=standin", "SEEDS=0,1"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env=env,
    check=True,
  ).stdout
  make = " ".join(make.split())  # the Makefile leaves a double space where GPUS is empty
  assert "sweeps.best_lr --experiments cifar10_resnet18_30ep" in make
  assert "sweeps.gpu_pool -- +sweep=curvature_every scale=standin seed=0,1" in make
  # The campaign phase, with `echo` standing in for python: what the pool would be given.
  campaign = subprocess.run(
    ["bash", "sweeps/standin_campaign.sh", "curvature_every"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**env, "PY": "echo", "SEEDS": "0,1"},
    check=True,
  ).stdout
  expected = "-m sweeps.gpu_pool -- scale=standin logger=none +sweep=curvature_every seed=0,1"
  assert expected in campaign


def test_plots_tell_the_periods_apart(tmp_path: Path) -> None:
  """Curves and time to accuracy of the sweep: one line per K (not one 'ginger τ=8')."""
  from results import plots, series, time_to_accuracy

  metas = [{"optimizer": "ginger", "tau": 8, "curvature_every": k, "lr": 5e-4} for k in (1, 4)] + [
    {"optimizer": "adam", "tau": None, "curvature_every": None, "lr": 1e-3}
  ]
  assert plots.config_labels(metas) == [
    "ginger τ=8 curvature_every=1",
    "ginger τ=8 curvature_every=4",
    "adam",
  ]
  evaluated = series.Series(
    eval={
      "step": np.array([1.0, 2.0, 3.0]),
      "wall": np.array([10.0, 20.0, 30.0]),
      "value": np.array([80.0, 90.0, 86.0]),
    },
    eval_metric="val_accuracy",
  )
  times = series.accuracy_times(evaluated, (85.0, 95.0))
  assert times["best"] == 90.0 and times["final"] == 86.0 and times["to_best"] == 20.0
  assert times["85.0"] == 20.0 and np.isnan(times["95.0"])
  assert series.accuracy_times(series.Series(eval_metric="rougeL"), (85.0,)) is None
  assert "curvature_every" in time_to_accuracy.TABLE_SWEEPS
