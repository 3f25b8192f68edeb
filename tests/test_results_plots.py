"""Plots from fabricated run dirs: non-empty PNG files are written; bad data is survived."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from results import plots, time_to_accuracy
from training import run_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(
  root: Path, name: str, run: dict[str, Any] | None, events: list[dict], **summary: Any
) -> Path:
  """A run dir with metrics.jsonl, spectrum.jsonl.gz (the "spectrum" events, if any) and (if
  `run` is given) summary.json."""
  run_dir = root / name
  run_dir.mkdir(parents=True)
  logged = [e for e in events if e["event"] != "spectrum"]
  lines = [json.dumps(e) for e in logged] + ['{"event": "train", "step": 9']  # torn last line
  (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  run_record.append_spectrum(run_dir, [e for e in events if e["event"] == "spectrum"])
  if run is not None:
    fields = {
      "experiment": "cifar10_resnet18",
      "dataset": "cifar10",
      "model": "resnet18",
      "seed": 0,
      "alpha": 0.99,
      "lr": 1e-3,
      **run,
    }
    (run_dir / "summary.json").write_text(
      json.dumps({"run": fields, "status": "completed", **summary})
    )
  return run_dir


def events(loss0: float, spectrum: bool = False) -> list[dict]:
  """Train/eval (and spectrum) events for 5 steps; one eval lacks its accuracy."""
  out: list[dict] = []
  for step in range(1, 6):
    out.append(
      {
        "event": "train",
        "step": step,
        "train_loss": loss0 / step,
        "lr": 1e-3,
        "wall_time_s": 0.1 * step,
      }
    )
    acc = {} if step == 3 else {"val_accuracy": 10.0 * step}
    out.append(
      {
        "event": "eval",
        "step": step,
        "val_loss": 1.0 / step,
        "wall_time_s": 0.1 * step + 0.05,
        **acc,
      }
    )
    if spectrum:
      sigma = {"conv/kernel": [3.0 * step, 2.0, 1.0, 0.0], "dense/kernel": [0.5, 0.1], "bias": []}
      out.append({"event": "spectrum", "step": step, "sigma": sigma})
  return out


def is_png(path: Path) -> bool:
  """A non-empty PNG file."""
  return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def make_root(tmp_path: Path) -> Path:
  """Ginger tau 2/4 (with spectra), QNG tau 2, Adam, a summary-less run, an empty run."""
  root = tmp_path / "outputs"
  write_run(
    root, "g2", {"optimizer": "ginger", "tau": 2}, events(2.0, True), best_val_accuracy=50.0
  )
  write_run(
    root, "g4", {"optimizer": "ginger", "tau": 4}, events(2.5, True), best_val_accuracy=52.0
  )
  write_run(root, "q2", {"optimizer": "qng", "tau": 2}, events(3.0), best_val_accuracy=48.0)
  write_run(
    root,
    "adam",
    {"optimizer": "adam", "tau": None, "alpha": None},
    events(3.5),
    best_val_accuracy=45.0,
  )
  write_run(root, "killed", None, events(4.0))
  (root / "empty").mkdir()
  (root / "empty" / "metrics.jsonl").write_text("")
  return root


def test_cli_writes_pngs(tmp_path: Path) -> None:
  root, out = make_root(tmp_path), tmp_path / "plots"
  assert plots.main([str(root), "--out", str(out), "--max-spectrum", "1"]) == 0
  names = sorted(p.name for p in out.iterdir())
  assert "curves_cifar10_resnet18-cifar10-resnet18.png" in names
  assert "curves_no-summary-outputs.png" in names
  assert "tau_cifar10.png" in names
  assert [n for n in names if n.startswith("spectrum_")] == [
    "spectrum_" + plots.slug("-".join((root / "g2").resolve().parts[-4:])) + ".png"
  ]
  assert all(is_png(out / n) for n in names)


def test_read_series_and_spectrum_choice(tmp_path: Path) -> None:
  root = make_root(tmp_path)
  series = plots.read_series(root / "g4")
  assert series.train["loss"].shape == (5,) and series.eval_metric == "val_accuracy"
  assert series.spectrum_steps == [1, 2, 3, 4, 5]
  assert plots.pick_params(series, None, limit=1) == ["conv/kernel"]
  assert plots.pick_params(series, ["dense/kernel", "missing"]) == ["dense/kernel"]
  assert plots.spectrum_matrix(series, "dense/kernel").shape == (5, 2)
  path = plots.plot_spectrum(root / "g4", tmp_path, ["dense/kernel", "bias"])
  assert path is not None and is_png(path)
  assert plots.plot_spectrum(root / "q2", tmp_path) is None  # no spectrum events
  assert plots.read_series(tmp_path / "nowhere").train["step"].size == 0


def test_config_labels_show_only_varying_keys() -> None:
  metas = [
    {"optimizer": "ginger", "tau": 4, "rho": 1.0, "lr": 1e-3, "alpha": 0.99},
    {"optimizer": "ginger", "tau": 4, "rho": None, "lr": 1e-3, "alpha": 0.99},
    {"optimizer": "adam", "lr": 1e-3},
    {"optimizer": "adam", "lr": 1e-4},
  ]
  assert plots.config_labels(metas) == [
    "ginger τ=4 rho=1.0",
    "ginger τ=4 rho=None",
    "adam lr=0.001",
    "adam lr=0.0001",
  ]


def test_nothing_to_plot(tmp_path: Path) -> None:
  out = tmp_path / "plots"
  (tmp_path / "empty").mkdir()
  assert plots.main([str(tmp_path / "empty"), "--out", str(out)]) == 0
  assert list(out.iterdir()) == []


def test_a_missing_root_is_an_error(tmp_path: Path, capsys) -> None:
  """A root named on the command line that does not exist (a typo) is refused, not read as
  no runs."""
  out = tmp_path / "plots"
  assert plots.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
  assert "no such run root(s)" in capsys.readouterr().err and not out.exists()


def test_time_to_accuracy(tmp_path: Path) -> None:
  """Seconds to the first eval at or above each level, the median over seeds with misses as
  infinitely slow, and reached / seeds; only table-sweep runs count."""
  root = tmp_path / "runs"
  for seed, offset in ((0, 0.0), (1, 1.0)):
    evs = [
      {"event": "eval", "step": s, "wall_time_s": 10.0 * s + offset, "val_accuracy": 20.0 * s}
      for s in range(1, 5)
    ]  # 20, 40, 60, 80 % at 10, 20, 30, 40 s (+1 s for seed 1)
    write_run(root, f"a{seed}", {"optimizer": "adam", "seed": seed, "sweep": "table1"}, evs)
  write_run(root, "tune", {"optimizer": "adam", "sweep": "lr_tune"}, evs)
  infos = plots.load_runs([root])
  (rows,) = time_to_accuracy.time_to_accuracy(infos, levels=(60.0, 85.0)).values()
  (row,) = rows
  assert row["60.0"] == [30.0, 31.0] and row["best"] == [80.0, 80.0]
  assert all(v != v for v in row["85.0"])  # NaN: never reached
  (tmp_path / "out").mkdir()
  written = time_to_accuracy.plot_time_to_accuracy(infos, tmp_path / "out", levels=(60.0, 85.0))
  md = next(p for p in written if p.suffix == ".md").read_text()
  assert "| adam | 80.00 | 40 | 30 (2/2) | not reached (0/2) |" in md
  assert is_png(next(p for p in written if p.suffix == ".png"))


def test_spectrum_files_of_two_sweeps_do_not_collide(tmp_path: Path) -> None:
  """multirun/<sweep>/<exp>/<arm>/<seed>: the same arm and seed in two sweeps (Table 1's
  ginger_tau8 and the curvature_every sweep's) get two spectrum files, not one overwritten."""
  root = tmp_path / "multirun"
  paths = [
    write_run(
      root,
      f"{sweep}/exp/ginger_tau8/seed=0",
      {"optimizer": "ginger", "tau": 8, "sweep": sweep},
      events(2.0, True),
    )
    for sweep in ("table1", "curvature_every")
  ]
  (out := tmp_path / "plots").mkdir()
  written = {plots.plot_spectrum(p, out) for p in paths}
  assert len(written) == 2 and all(p is not None and is_png(p) for p in written)


def test_default_spectrum_runs_prefer_table1_and_one_seed_per_arm(tmp_path: Path) -> None:
  """The main table's runs first, and one seed per configuration, so that the few spectrum
  plots show different configurations."""
  root = tmp_path / "multirun"
  for sweep, arm, seed in [
    ("curvature_every", "ginger_tau8_k2", 0),
    ("table1", "ginger_tau2", 0),
    ("table1", "ginger_tau2", 1),
    ("table1", "ginger_tau8", 0),
  ]:
    tau = int(arm.split("_")[1][3:])
    run = {"optimizer": "ginger", "tau": tau, "sweep": sweep, "seed": seed}
    write_run(root, f"{sweep}/exp/{arm}/seed={seed}", run, events(2.0, True))
  infos = plots.load_runs([root])
  chosen = plots.default_spectrum_runs(infos, limit=2)
  assert [p.relative_to(root).as_posix() for p in chosen] == [
    "table1/exp/ginger_tau2/seed=0",
    "table1/exp/ginger_tau8/seed=0",
  ]


def test_time_to_accuracy_leaves_out_runs_that_shared_their_device(tmp_path):
  """Wall-clock seconds are a run's own only alone on its device: a run with
  ``device_shared`` is not in the time-to-accuracy report."""
  evals = [{"event": "eval", "step": 10, "wall_time_s": 5.0, "val_accuracy": 90.0}]
  for seed, shared in ((0, False), (1, True)):
    run = {"optimizer": "adam", "seed": seed, "sweep": "table1"}
    write_run(tmp_path, str(seed), run, evals, device_shared=shared)
  report = time_to_accuracy.time_to_accuracy(plots.load_runs([tmp_path]))
  (rows,) = report.values()
  assert [len(row["best"]) for row in rows] == [1]


def test_time_to_accuracy_draws_every_row_beside_a_failed_run(tmp_path, monkeypatch):
  """A failed run is in neither the report nor the plot: one varying a key (its lr) does not
  relabel the plot's configurations, so every row of the report keeps its curve, and each run's
  series is read once."""
  evals = [
    {"event": "eval", "step": s, "wall_time_s": 10.0 * s, "val_accuracy": 20.0 * s}
    for s in range(1, 5)
  ]
  for seed in (0, 1):
    write_run(tmp_path, f"a{seed}", {"optimizer": "adam", "seed": seed, "sweep": "table1"}, evals)
  write_run(
    tmp_path, "failed", {"optimizer": "adam", "lr": 1e-4, "sweep": "table1"}, evals, status="failed"
  )
  infos = plots.load_runs([tmp_path])
  reads = []
  real = time_to_accuracy.read_series
  monkeypatch.setattr(
    time_to_accuracy, "read_series", lambda path, **kw: reads.append(path) or real(path, **kw)
  )
  drawn = []
  monkeypatch.setattr(
    time_to_accuracy, "plot_xy", lambda ax, x, y, label, color: drawn.append((label, x, y))
  )
  (tmp_path / "out").mkdir()
  written = time_to_accuracy.plot_time_to_accuracy(infos, tmp_path / "out", levels=(60.0,))
  md = next(p for p in written if p.suffix == ".md").read_text()
  assert "| adam | 80.00 | 40 | 30 (2/2) |" in md
  ((label, x, y),) = drawn
  assert label == "adam" and y[x == 60.0] == [30.0] and np.isnan(y[x == 85.0])
  assert sorted(p.name for p in reads) == ["a0", "a1"]
