"""A run's metrics as arrays (:class:`Series`) and its time to accuracy: what the tables and
the plots both read, below both (numpy and the run records only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from results import records

VAL_METRICS = ("val_accuracy", "rougeL")


@dataclass
class Series:
  """The numeric content of one metrics.jsonl, as arrays (NaN where a value is missing)."""

  train: dict[str, np.ndarray] = field(default_factory=dict)  # step, wall, loss
  eval: dict[str, np.ndarray] = field(default_factory=dict)  # step, wall, value
  eval_metric: str | None = None
  spectrum_steps: list[int] = field(default_factory=list)
  spectrum: list[dict[str, list[float]]] = field(default_factory=list)


def as_float(x: Any) -> float:
  """``x`` as a float, NaN where it is not a number (bools included)."""
  return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _arrays(rows: list[tuple[float, ...]], names: Sequence[str]) -> dict[str, np.ndarray]:
  data = np.array(rows, dtype=float).reshape(-1, len(names))
  return {name: data[:, i] for i, name in enumerate(names)}


def read_series(
  run_dir: str | Path, *, spectrum: bool = True, eval_metric: str | None = None
) -> Series:
  """Train, eval and (unless ``spectrum=False``: the largest part to read) spectrum events of a
  run as arrays; the evaluations' value is ``eval_metric``, by default the first of VAL_METRICS
  the run records."""
  train, evals, series = [], [], Series(eval_metric=eval_metric)
  for event in records.read_events(run_dir):
    kind, step = event.get("event"), as_float(event.get("step"))
    if kind == "train":
      train.append((step, as_float(event.get("wall_time_s")), as_float(event.get("train_loss"))))
    elif kind == "eval":
      series.eval_metric = series.eval_metric or next((m for m in VAL_METRICS if m in event), None)
      value = as_float(event.get(series.eval_metric)) if series.eval_metric else math.nan
      evals.append((step, as_float(event.get("wall_time_s")), value))
  for event in records.read_spectrum(run_dir) if spectrum else ():
    if isinstance(event.get("sigma"), dict):
      step = as_float(event.get("step"))
      series.spectrum_steps.append(int(step) if math.isfinite(step) else len(series.spectrum))
      series.spectrum.append(event["sigma"])
  series.train = _arrays(train, ("step", "wall", "loss"))
  series.eval = _arrays(evals, ("step", "wall", "value"))
  return series


def last_value(evals: dict[str, np.ndarray]) -> float | None:
  """The value of the last of ``evals`` (:attr:`Series.eval`: the evaluation at the end of the
  run's training); None without evaluations or where it is not finite."""
  if "value" not in evals or not evals["value"].size:
    return None
  value = float(evals["value"][np.argmax(evals["step"])])
  return value if math.isfinite(value) else None


def first_time_at(series: Series, level: float) -> float:
  """Wall-clock seconds at the first eval whose metric reached `level` (NaN if never)."""
  value, wall = series.eval.get("value"), series.eval.get("wall")
  if value is None or not value.size:
    return math.nan
  hit = np.flatnonzero(np.nan_to_num(value, nan=-np.inf) >= level)
  return float(wall[hit[0]]) if hit.size else math.nan


def accuracy_times(series: Series, levels: Sequence[float]) -> dict[str, float] | None:
  """One run's validation accuracy over time: its best ("best"), last ("final"), the
  wall-clock seconds to first reach its best ("to_best") and each level (``str(level)``; NaN
  if never). None for runs without accuracy evaluations (seq2seq runs)."""
  if series.eval_metric != "val_accuracy":
    return None
  value = series.eval["value"]
  best = float(np.nanmax(value))
  times = {"best": best, "final": float(value[-1]), "to_best": first_time_at(series, best)}
  return times | {str(level): first_time_at(series, level) for level in levels}
