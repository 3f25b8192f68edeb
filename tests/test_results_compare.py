"""results.compare (what `make train` prints): one row per run, alpha shown, torn files skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from results import compare


def _summary(root: Path, name: str, text: str) -> None:
  (root / name).mkdir()
  (root / name / "summary.json").write_text(text)


def test_compare_shows_alpha_and_skips_a_torn_summary(
  tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
  for name, run in {
    "adam": {"optimizer": "adam", "tau": None, "alpha": None, "lr": 1e-3},
    "ginger": {"optimizer": "ginger", "tau": 4, "alpha": 0.9, "lr": 2e-4},
  }.items():
    _summary(tmp_path, name, json.dumps({"run": run, "best_val_accuracy": 97.5, "steps": 88}))
  _summary(tmp_path, "torn", '{"run": {"optim')
  compare.main([str(tmp_path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "| optimizer | tau | alpha | lr | best val acc % | steps |"
  assert lines[2:] == [
    "| adam |  |  | 0.001 | 97.5 | 88 |",
    "| ginger | 4 | 0.9 | 0.0002 | 97.5 | 88 |",
  ]


def test_compare_names_non_float32_numerics(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
  """Two Ginger runs that differ only in their state's dtype are told apart: the state and
  compute dtypes get columns once a run is not float32 (float32 runs alone show none)."""
  base = {"optimizer": "ginger", "tau": 4, "alpha": 0.9, "lr": 2e-4, "precision": "float32"}
  for name, dtype in {"f32": "float32", "bf16": "bfloat16"}.items():
    summary = {"run": {**base, "state_dtype": dtype}, "best_val_accuracy": 97.5}
    _summary(tmp_path, name, json.dumps(summary))
  compare.main([str(tmp_path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "| optimizer | tau | alpha | lr | state | best val acc % |"
  assert lines[2:] == [
    "| ginger | 4 | 0.9 | 0.0002 | bfloat16 | 97.5 |",
    "| ginger | 4 | 0.9 | 0.0002 | float32 | 97.5 |",
  ]


def test_compare_shows_cost_columns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
  """FLOPs by the analytic count, memory in GB (1e9 bytes), and whether the run shared its GPU:
  the cost figures REPRODUCTION.md quotes from runs no table holds."""
  summary = {
    "run": {"optimizer": "adam", "lr": 1e-3},
    "flops_per_iter": {"analytic": 996968562404.0, "xla": 9.9e9},
    "step_memory_bytes": 3787941913,
    "peak_memory_bytes": 6439506432,
  }
  _summary(tmp_path, "adam", json.dumps(summary))
  compare.main([str(tmp_path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "| optimizer | lr | FLOPs/iter (analytic) | step GB | peak GB |"
  assert lines[2] == "| adam | 0.001 | 9.97e+11 | 3.79 | 6.44 |"


def test_without_a_root_every_run_is_listed_with_status_and_dir(
  tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
  """`python -m results.compare`: the runs under outputs/ and multirun/, finished or not."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "outputs").mkdir()
  (tmp_path / "multirun").mkdir()
  done = {"run": {"optimizer": "adam", "lr": 1e-3}, "status": "completed", "steps": 88}
  _summary(tmp_path / "outputs", "adam", json.dumps(done))
  (tmp_path / "multirun" / "live").mkdir()
  (tmp_path / "multirun" / "live" / "metrics.jsonl").write_text('{"event": "train"}\n')
  compare.main([])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "| optimizer | lr | steps | status | run dir |"
  assert lines[2:] == [
    "|  |  |  | running or stopped | multirun/live |",
    "| adam | 0.001 | 88 | completed | outputs/adam |",
  ]


def test_distinct_curve_colours():
  """Past ten configurations the curves keep colours one can tell apart (tab20 pairs each hue
  with a lighter one: 14 arms drew Momentum and QNG tau 8 in two pinks)."""
  import itertools

  import numpy as np

  from results.plot_style import distinct_colors

  for n in (3, 10, 14, 20):
    colours = distinct_colors(n)
    assert len(set(colours)) == n
    gaps = [
      np.linalg.norm(np.subtract(a[:3], b[:3])) for a, b in itertools.combinations(colours, 2)
    ]
    assert min(gaps) >= 0.25, (n, min(gaps))
