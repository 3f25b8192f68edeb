"""Tables of the studies beyond the paper: Ginger with the curvature updated every K steps
(sweep curvature_every), and how much the element-wise clip acts (the training log's
``clip_fraction``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from results import records, series, stats
from results.metrics import Stat, aggregate, fmt_num, fmt_stat, is_shared
from results.runs import Run, is_done, is_number, rfield
from results.selection import (
  CURVATURE_FIELDS,
  PAPER_ALPHA,
  ComparisonPair,
  Selection,
  curvature_text,
  default_variant,
  dpass_text,
  image_protocol,
  is_default_variant,
  matches,
  one_configuration,
  paper_curvature,
  select_runs,
  sort_key,
  tuple_key,
)
from results.table_model import (
  MODEL_NAMES,
  Column,
  Row,
  Table,
  finish,
  optimizer_label,
  set_name,
  set_text,
)

CURVATURE_EVERY_SWEEP = "curvature_every"
CURVATURE_EVERY_LEVEL = 85.0  # % validation accuracy: the time-to-accuracy mark
CURVATURE_EVERY_ROW = ("model", "optimizer", "tau", "curvature_every")


def _finite(values: Iterable[Any]) -> list[float]:
  return [float(v) for v in values if is_number(v) and math.isfinite(v)]


def _times_cell(values: Sequence[float], n: int) -> str:
  """Mean ± std of the seeds that got there, "(k/n seeds)" when not all did; "never"."""
  reached = _finite(values)
  if not reached:
    return "never" if n else ""
  text = fmt_stat(aggregate(reached), "f0")
  return text if len(reached) == n else f"{text} ({len(reached)}/{n} seeds)"


def time_to_target_cell(values: Sequence[float], fmt: str = ".0f") -> str:
  """Seconds to a target over seeds as AlgoPerf scores them: the median with a seed that
  never reached it (NaN or inf) at infinity, then (reached / seeds): "45 (5/5)", "not reached
  (2/5)" when half or more missed; "" without seeds."""
  if not values:
    return ""
  times = [v if is_number(v) and math.isfinite(v) else math.inf for v in values]
  median = stats.median_time(times)
  reached = sum(math.isfinite(t) for t in times)
  text = format(median, fmt) if math.isfinite(median) else "not reached"
  return f"{text} ({reached}/{len(times)})"


def _accuracy_times(run: Run, levels: Sequence[float]) -> dict[str, float] | None:
  """:func:`results.series.accuracy_times` of the run's metrics (None without them)."""
  return series.accuracy_times(series.read_series(run["path"], spectrum=False), levels)


def build_curvature_every(
  runs: Sequence[Run], dataset: str, length: str | None, level: float = CURVATURE_EVERY_LEVEL
) -> Table:
  """Ginger with the curvature updated every K steps (sweep curvature_every), beside Adam.

  One row per (model, optimizer, tau, K) among the completed runs of the sweep at this
  dataset and run length: best and final validation accuracy (mean ± sample std over seeds),
  the median step time (each run's median, then the mean over seeds) and its ratio to Adam's
  (same model, same table), and the wall-clock seconds from the run's start to the first
  evaluation at ``level`` % and at the run's best (results/plots.py's time to accuracy).
  """
  protocol = image_protocol(dataset, length)
  mine = [
    r
    for r in runs
    if rfield(r, "sweep") == CURVATURE_EVERY_SWEEP and is_done(r) and matches(r, protocol)
  ]
  keys = sorted(
    {tuple(rfield(r, k) for k in CURVATURE_EVERY_ROW) for r in mine},
    key=lambda k: (sort_key(k[0]), k[1] != "adam", tuple_key(k[1:])),
  )
  table = _curvature_every_table(dataset, length, level)
  models = {k[0] for k in keys}
  adam_ms: dict[Any, float | None] = {}
  used, notes, previous_model = [], [], None
  for key in keys:
    model, optimizer, tau, every = key
    crit = {**protocol, **dict(zip(CURVATURE_EVERY_ROW, key, strict=True))}
    sel = select_runs(mine, crit, (CURVATURE_EVERY_SWEEP,))
    ms = aggregate(
      1e3 * r["step_time_s"]
      for r in sel.runs
      if is_number(r.get("step_time_s")) and not is_shared(r)
    )
    if optimizer == "adam":
      adam_ms[model] = ms.mean
    ratio = ms.mean / adam_ms[model] if ms.mean and adam_ms.get(model) else None
    label = optimizer_label(optimizer, tau)
    if len(models) > 1:
      label = f"{MODEL_NAMES.get(model, model)} {label}"
    cells = ["" if optimizer != "ginger" else str(every)]
    cells += _curvature_every_cells(sel, ms, ratio, level)
    new_model = bool(table.rows) and model != previous_model
    table.rows.append(Row(label, cells, rule_before=new_model))
    previous_model = model
    used += sel.runs
    if sel.note:
      notes.append(f"{label}, K={every}: {sel.note}.")
  if not table.rows:
    table.notes.append("No completed runs of the curvature_every sweep at this length yet.")
  return finish(table, used, notes)


def _curvature_every_table(dataset: str, length: str | None, level: float) -> Table:
  """The curvature_every table of one set of runs, its title, caption and columns, no rows."""
  what = set_text(dataset, length)
  title = (
    f"Ginger with the curvature updated every K steps, {what} - beyond the paper "
    "(it updates every step), NOT COMPARABLE with its numbers"
  )
  caption = (
    "K = curvature_every: Ginger's d-pass and curvature update on steps 0, K, 2K, ... only, "
    "every step preconditioned with the current curvature (K = 1: the paper). Best / final "
    "acc = best / last validation accuracy (%); ms/step = median step time; × Adam = its "
    f"ratio to Adam's; s to {level:g}% = wall-clock seconds from the run's start (compilation "
    "and evaluations included) to the first evaluation at that accuracy, the median over "
    "seeds with a seed that never got there counted as infinitely slow (AlgoPerf's rule), "
    "then (reached / seeds); s to best = the same to the run's best evaluation, mean over "
    "seeds. ± = sample std over seeds; "
    "timings are only comparable on one kind of device (see the last note)."
  )
  labels = ["K", "seeds", "Best acc", "Final acc", "ms/step", "× Adam"]
  labels += [f"s to {level:g}%", "s to best"]
  return Table(
    set_name("curvature_every", dataset, length),
    title,
    caption,
    "Optimizer",
    [Column("", label) for label in labels],
  )


def _curvature_every_cells(
  sel: Selection, ms: Stat, ratio: float | None, level: float
) -> list[str]:
  """A row's cells after K: the seeds, best and final accuracy, the step time ``ms`` and its
  ``ratio`` to Adam's, and the seconds to ``level`` % and to the best (runs alone only)."""
  times = [{} if is_shared(r) else _accuracy_times(r, (level,)) or {} for r in sel.runs]
  return [
    ", ".join(str(rfield(r, "seed")) for r in sel.runs),
    fmt_stat(aggregate(r.get("best_val_accuracy") for r in sel.runs), "f2"),
    fmt_stat(aggregate(_finite(t.get("final") for t in times)), "f2"),
    fmt_stat(ms, "f1"),
    fmt_num(ratio, "f2"),
    time_to_target_cell([t.get(str(level), math.nan) for t in times]),
    _times_cell([t.get("to_best") for t in times], len(sel.runs)),
  ]


def curvature_every_tables(runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table) per (dataset, run length) of the curvature_every sweep's runs."""
  found = {
    (rfield(r, "dataset"), rfield(r, "length"))
    for r in runs
    if rfield(r, "sweep") == CURVATURE_EVERY_SWEEP and is_done(r) and rfield(r, "setting") is None
  }
  out = []
  for dataset, length in sorted(found, key=tuple_key):
    table = build_curvature_every(runs, dataset, length)
    out.append((table.name, table))
  return out


def curvature_every_pairs(runs: Sequence[Run], protocol: dict[str, Any]) -> list[ComparisonPair]:
  """The curvature_every sweep's comparisons (one family): each Ginger K against Adam of the
  same sweep and each K > 1 against K = 1 at the same tau, the cells of its table."""

  def cell(optimizer: str, tau: Any = None, every: Any = None) -> Selection:
    crit = {**protocol, "optimizer": optimizer, "tau": tau, "curvature_every": every}
    sel = select_runs(runs, crit, (CURVATURE_EVERY_SWEEP,))
    sel.runs = [r for r in sel.runs if rfield(r, "sweep") == CURVATURE_EVERY_SWEEP]
    return sel

  arms = sorted(
    {
      (rfield(r, "tau"), rfield(r, "curvature_every"))
      for r in runs
      if rfield(r, "sweep") == CURVATURE_EVERY_SWEEP
      and rfield(r, "optimizer") == "ginger"
      and matches(r, protocol)
    },
    key=tuple_key,
  )
  adam, pairs = cell("adam"), []
  for tau, every in arms:
    ginger = cell("ginger", tau, every)
    pairs.append(("curvature every K", f"Ginger τ={tau} K={every} − Adam", ginger, adam))
    if every != 1 and (tau, 1) in arms:
      label = f"Ginger τ={tau} K={every} − K=1"
      pairs.append(("curvature every K", label, ginger, cell("ginger", tau, 1)))
  return pairs


CLIP_EPOCHS = ((0, 1), (1, 5), (5, 10), (10, 20), (20, None))


def _clip_series(run: Run) -> list[tuple[float, float]]:
  """(epoch, clip_fraction) of a run's training log lines that have it."""
  return [
    (float(e["epoch"]), float(e["clip_fraction"]))
    for e in records.read_events(run["path"])
    if e.get("event") == "train" and is_number(e.get("clip_fraction")) and is_number(e.get("epoch"))
  ]


def build_clip_fraction(runs: Sequence[Run], dataset: str, length: str | None = None) -> Table:
  """The share of update entries that the element-wise clip changes (training log's
  ``clip_fraction``), by stretch of training, per run that logged it."""
  protocol = image_protocol(dataset, length)
  shares = {
    r["path"]: share
    for r in runs
    if is_done(r) and matches(r, protocol) and (share := _clip_series(r))
  }  # each run's metrics read once
  logged = sorted(
    (r for r in runs if r["path"] in shares),
    key=lambda r: tuple_key(tuple(rfield(r, k) for k in CLIP_ROW)),
  )
  spans = [f"epochs {a}-{b}" if b else f"epochs {a}-end" for a, b in CLIP_EPOCHS]
  columns = [Column("", label) for label in ("lr", "seed", *spans, "whole run", "Best acc")]
  what = set_text(dataset, length)
  caption = (
    "Mean over the logged steps (every log_every-th step) of the share of update entries with "
    "|u| >= rho, u = G^{-1} m the preconditioned update before the learning rate: the entries "
    "the clip to [-rho, rho] changes, or, for a run without the clip, those the authors' clip "
    "(rho = 1) would change."
  )
  table = Table(
    set_name("clip_fraction", dataset, length),
    f"How much the clip acts: {what}",
    caption,
    "Run",
    columns,
  )
  for run in logged:
    logged_share = shares[run["path"]]
    cells = [f"{rfield(run, 'lr'):g}", str(rfield(run, "seed"))]
    for a, b in CLIP_EPOCHS:
      part = [f for e, f in logged_share if e > a and (b is None or e <= b)]
      cells.append(f"{100 * statistics.mean(part):.1f} %" if part else "")
    cells += [f"{100 * statistics.mean(f for _, f in logged_share):.1f} %"]
    cells += [fmt_num(run.get("best_val_accuracy"), "f2")]
    clip = "clip ρ=1" if rfield(run, "rho") is not None else "no clip (share |u| ≥ 1)"
    label = f"{optimizer_label(rfield(run, 'optimizer'), rfield(run, 'tau'))}, {clip}"
    if rfield(run, "alpha") not in (PAPER_ALPHA, None):
      label += f", α={rfield(run, 'alpha')}"
    label += curvature_text(run)
    table.rows.append(Row(f"{label}, {rfield(run, 'block')} ({rfield(run, 'sweep')})", cells))
  return finish(table, logged, [])


CLIP_ROW = (
  "optimizer",
  "tau",
  "rho",
  "block",
  "alpha",
  "curvature_every",
  "fisher_forward",
  "fisher_batch",
  "sweep",
  "seed",
)


# The d-pass study (beyond the paper): Ginger's d-pass with the shared training forward or on
# part of the batch, against the paper's d-pass at the same tau and K. Its runs come from the
# table1 sweep (K = 1, and K > 1 with another d-pass) and the curvature_every sweep (the
# paper's d-pass at K > 1, and the cold races' runs at 30 epochs): both run the same
# protocol, so an arm pools them, one run per seed, the newest (the tables' rule).
DPASS_SWEEPS = ("table1", CURVATURE_EVERY_SWEEP)
DPASS_FAMILY = "d-pass − the paper's d-pass"
DPASS_ARM = ("model", "tau", "curvature_every", "fisher_forward", "fisher_batch")


def _dpass_cell(runs: Sequence[Run], crit: dict[str, Any]) -> Selection:
  """The runs of one d-pass arm in :data:`DPASS_SWEEPS`: one per seed, the newest."""
  mine = [r for r in runs if is_done(r) and rfield(r, "sweep") in DPASS_SWEEPS and matches(r, crit)]
  return one_configuration(mine)


def _dpass_arms(runs: Sequence[Run], protocol: dict[str, Any]) -> list[tuple]:
  """:data:`DPASS_ARM` of every Ginger arm whose d-pass is not the paper's (its forward or its
  examples), among the runs of :data:`DPASS_SWEEPS` that are the default variant otherwise."""
  forward = paper_curvature(protocol.get("dataset"))["fisher_forward"]
  found = {
    tuple(rfield(r, k) for k in DPASS_ARM)
    for r in runs
    if rfield(r, "optimizer") == "ginger"
    and rfield(r, "sweep") in DPASS_SWEEPS
    and is_done(r)
    and matches(r, protocol)
    and is_default_variant(r, CURVATURE_FIELDS)
    and (rfield(r, "fisher_forward") not in (forward, None) or rfield(r, "fisher_batch"))
  }
  return sorted(found, key=tuple_key)


def dpass_pairs(runs: Sequence[Run], protocol: dict[str, Any]) -> list[ComparisonPair]:
  """Each d-pass arm (:func:`_dpass_arms`) against the paper's d-pass at the same model, tau and
  K: one family over the arms of a protocol."""
  paper = paper_curvature(protocol.get("dataset"))
  pairs = []
  for model, tau, every, forward, batch in _dpass_arms(runs, protocol):
    base = {k: v for k, v in default_variant("ginger").items() if k not in CURVATURE_FIELDS}
    base |= {**protocol, "model": model, "optimizer": "ginger", "tau": tau}
    base |= {"alpha": (PAPER_ALPHA, None), "curvature_every": every}
    ours = _dpass_cell(runs, {**base, "fisher_forward": forward, "fisher_batch": batch})
    theirs = _dpass_cell(runs, {**base, **paper, "curvature_every": every})
    what = dpass_text(forward, batch, protocol.get("dataset"))
    label = f"Ginger τ={tau} K={every}, d-pass {what} − the paper's d-pass"
    pairs.append((DPASS_FAMILY, label, ours, theirs))
  return pairs
