"""results/lr_tuning.py: the lr_tune runs' candidates and their figure (score against lr, the
pick circled, divergences marked), and the curves plot's layout for runs that shared a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import pytest

from results import lr_tuning, plots


def run(optimizer, lr, score=None, *, seed=0, status="completed", tau=None, sweep="lr_tune"):
  """A summary as results.runs.load_summary gives it."""
  return {
    "run": {
      "experiment": "cifar10_resnet18_30ep",
      "optimizer": optimizer,
      "lr": lr,
      "seed": seed,
      "tau": tau,
      "rho": 1.0 if optimizer == "ginger" else None,
      "sweep": sweep,
      "length": "8ep",
    },
    "config": {"model": {"family": "resnet"}, "data": {"holdout": 5000}},
    "status": status,
    "best_val_accuracy": score,
    "path": f"{optimizer}-{lr}-{seed}",
    "mtime": 0.0,
  }


RUNS = [
  run("adam", 1e-2, 80.0),
  run("adam", 1e-3, 84.0),
  run("adam", 1e-3, 86.0, seed=1),
  run("adam", 1e-4, 70.0),
  run("adam", 0.5, status="failed"),
  run("ginger", 5e-4, 82.0, tau=4),
  run("ginger", 5e-3, 88.0, tau=4),
  run("ginger", 5e-3, seed=1, status="failed", tau=4),  # an lr that diverges once is out
  run("adam", 5e-2, 99.0, sweep="table1"),  # not a tuning run
]


def line(ax, label):
  (found,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
  return found


def test_tunings_score_each_lr_by_its_mean_and_pick_the_best_eligible():
  adam, ginger = lr_tuning.tunings(RUNS)
  assert (adam.optimizer, adam.metric) == ("adam", "best_val_accuracy")
  assert [(c.lr, c.mean()) for c in adam.candidates] == [
    (0.5, None),
    (1e-2, 80.0),
    (1e-3, 85.0),
    (1e-4, 70.0),
  ]
  assert adam.best.lr == 1e-3
  assert ginger.best.lr == 5e-4  # 5e-3 scored higher once but diverged on seed 1


def test_the_figure_draws_the_means_the_seeds_the_pick_and_the_divergences():
  fig = lr_tuning.figure("cifar10_resnet18_30ep", lr_tuning.tunings(RUNS))
  try:
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    adam = line(ax, "adam")
    assert list(adam.get_xdata()) == [1e-2, 1e-3, 1e-4]
    assert list(adam.get_ydata()) == [80.0, 85.0, 70.0]
    assert list(line(ax, "ginger τ=4").get_xdata()) == [5e-4]
    color = adam.get_color()
    mine = [ln for ln in ax.get_lines() if ln.get_color() == color and ln is not adam]
    seeds = [ln for ln in mine if ln.get_marker() == "."]
    assert [list(ln.get_ydata()) for ln in seeds] == [[84.0, 86.0]]
    (pick,) = [ln for ln in mine if ln.get_marker() == "o"]
    assert (list(pick.get_xdata()), list(pick.get_ydata())) == ([1e-3], [85.0])
    assert pick.get_markerfacecolor() == "none"
    (diverged,) = [ln for ln in mine if ln.get_marker() == "x"]
    assert list(diverged.get_xdata()) == [0.5]
  finally:
    plt.close(fig)


def write(root: Path, name: str, summary: dict, evals: int = 3) -> None:
  """A run dir with summary.json and a few train and eval events."""
  run_dir = root / name
  run_dir.mkdir(parents=True)
  events = []
  for step in range(1, evals + 1):
    events.append({"event": "train", "step": step, "train_loss": 1.0 / step, "wall_time_s": step})
    events.append({"event": "eval", "step": step, "val_accuracy": 10.0 * step, "wall_time_s": step})
  (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, events)) + "\n")
  (run_dir / "summary.json").write_text(json.dumps(summary))


def test_plots_write_one_lr_figure_per_tuned_experiment(tmp_path):
  for k, summary in enumerate(RUNS):
    write(tmp_path / "runs", f"r{k}", {key: v for key, v in summary.items() if key != "path"})
  out = tmp_path / "plots"
  assert plots.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
  assert sorted(p.name for p in out.glob("lr_*.png")) == ["lr_cifar10_resnet18_30ep.png"]


@pytest.mark.parametrize("shared", [True, False])
def test_curves_of_runs_that_all_shared_their_gpu_have_no_wall_clock_column(tmp_path, shared):
  """Wall-clock seconds are a run's own only alone on its device: with every run shared, the
  figure holds the step column alone (half as wide) instead of two empty panels."""
  for seed in (0, 1):
    summary = run("adam", 1e-3, 85.0, seed=seed, sweep="table1") | {"device_shared": shared}
    write(tmp_path / "runs", f"s{seed}", summary)
  (path,) = plots.plot_curves(plots.load_runs([tmp_path / "runs"]), tmp_path)
  height, width, _ = matplotlib.image.imread(path).shape
  assert (width / height < 1.2) if shared else (width / height > 1.5)
