"""Ginger beside today's optimizers: one table per stand-in workload, not the paper's.

Every registered optimizer beyond the paper's four (Muon, schedule-free AdamW, ... : the entries
of training/registry.py whose ``compared_with`` names arms) gets a row once it has completed
runs of the set: its best validation figure over seeds (the highest accuracy of an image model,
the lowest loss of an XSUM model) and its final one (each run's last evaluation, at the end of
training), each with its difference from each arm it is compared with (Adam and
Ginger τ=8 by default) with Welch's 95 % interval, the family's simultaneous 95 % interval
(Bonferroni) and the reading after Holm's correction over the family of every optimizer compared
with that arm (the families of the comparisons file, :func:`results.comparisons.newcomer_pairs`),
its times to the profiles' targets (results/profiles.py's workloads: the image accuracies, the T5
stand-in's validation losses), its step time and memory (from runs alone on their device), its
optimizer state and its FLOPs per step (a ResNet's counted from the model's parameter shapes,
``registry.update_flops``; a T5's the analytic count the run recorded). The arms have rows of
their own above.
``make tables`` writes ``newcomers_<dataset>_<length>.md`` (one per image model beyond
ResNet-18 with a suffix) and ``newcomers_<xsum model>_<length>_<setting>.md``, and ``.tex``::

    python -m results.newcomers results/cifar10/runs --out results/cifar10
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from results import profiles, stats
from results.comparisons import newcomer_family, newcomer_pairs
from results.metrics import aggregate, flops_number, fmt_num, fmt_stat, summary_number
from results.render import tables_command
from results.runs import Run, is_number, length_text, rfield
from results.selection import (
  TABLE_SWEEPS,
  ComparisonPair,
  Selection,
  cell_criteria,
  found_optimizers,
  select_runs,
  tabulated,
  tuple_key,
)
from results.series import last_value
from results.table_model import (
  MODEL_NAMES,
  Column,
  Row,
  Table,
  device_name,
  finish,
  optimizer_label,
  set_name,
  set_text,
  slug,
)
from training import registry

# The image shapes of the stand-in datasets whose FLOPs are counted (the ResNets' forward pass
# is traced at this input size).
IMAGE_SHAPES = {"cifar10": (32, 32, 3), "cifar100": (32, 32, 3)}

# The parts the table is shown in (results.render.blocks), each beside the seeds column.
SETTING_TEXT = {"full": "full fine-tuning", "lora": "LoRA"}  # Table 2's settings, in a title
ACCURACY, LOSS, TIME, COST = "accuracy", "validation loss", "time to a target", "cost"
FINAL_ACCURACY, FINAL_LOSS = "final accuracy", "final validation loss"


@functools.cache
def _resnet_layout(model: str, dataset: str) -> tuple[Any, float] | None:
  """The trained parameters' shapes of ``model`` on ``dataset`` and its forward FLOPs per
  example (both from the abstract model: nothing is allocated); None for another dataset."""
  if dataset not in IMAGE_SHAPES:
    return None
  from flax import nnx

  from data.images import NUM_CLASSES
  from models import flops
  from models.resnet import build_resnet

  shape = IMAGE_SHAPES[dataset]
  classes = NUM_CLASSES[dataset]
  abstract = nnx.eval_shape(
    lambda: build_resnet(model, classes, in_channels=shape[-1], rngs=nnx.Rngs(0))
  )
  forward = flops.FLOPS_PER_MAC * flops.resnet_forward_macs(model, classes, shape)
  return nnx.state(abstract, nnx.Param), float(forward)


def step_flops(run: Run) -> float | None:
  """One training step's FLOPs for ``run``'s config, counted now from the ResNet's parameter
  shapes as train.py counts them (``registry.step_flops``: the passes, the d-pass and the
  update, the mean over ``curvature_every`` steps); None for a model or dataset this module
  does not count (T5, a toy dataset)."""
  config = run.get("config") or {}
  model, data = config.get("model") or {}, config.get("data") or {}
  found = model.get("family") == "resnet" and _resnet_layout(model.get("name"), data.get("name"))
  if not found or registry.find(rfield(run, "optimizer")) is None:
    return None
  params, forward = found
  opt = registry.optimizer_config(_completed(config, registry.get(rfield(run, "optimizer"))))
  return registry.step_flops(
    opt,
    params,
    forward_flops=forward * int(config["batch_size"]),
    batch_size=int(config["batch_size"]),
    fisher_forward=config.get("fisher_forward"),
    fisher_batch=config.get("fisher_batch"),
  )


Evaluations = Callable[[Run], dict[str, np.ndarray]]


def evaluations(workload: profiles.Workload) -> Evaluations:
  """A run's evaluations of ``workload``'s metric (:func:`results.profiles.eval_series`), each
  run's read once: a table reads them for its best values, its differences and its times."""
  read: dict[int, dict[str, np.ndarray]] = {}  # by the run's identity: a run record is a dict

  def of(run: Run) -> dict[str, np.ndarray]:
    if id(run) not in read:
      read[id(run)] = profiles.eval_series(run, workload)
    return read[id(run)]

  return of


def best_value(run: Run, workload: profiles.Workload, evals: Evaluations) -> float | None:
  """The run's best evaluation of ``workload``'s metric: its highest validation accuracy (the
  summary's ``best_val_accuracy``) or its lowest validation loss over its evaluations
  (``evals``; the summary's ``val_loss`` is the evaluation of highest ROUGE-L); None without
  one."""
  if not workload.lower_is_better:
    value = run.get("best_val_accuracy")
    return float(value) if is_number(value) else None
  values = evals(run).get("value", np.array([]))
  finite = values[np.isfinite(values)]
  return float(finite.min()) if finite.size else None


Figure = Callable[[Run], float | None]


def figures(workload: profiles.Workload, evals: Evaluations) -> dict[str, Figure]:
  """The table's two validation figures of a run: its best evaluation (:func:`best_value`) and
  its final one, the last (at the end of its training; :func:`results.series.last_value`)."""
  return {
    "best": lambda run: best_value(run, workload, evals),
    "final": lambda run: last_value(evals(run)),
  }


def _values(runs: Sequence[Run], value: Figure) -> list[float]:
  """``value`` of each of ``runs`` that has one."""
  return [v for v in (value(r) for r in runs) if v is not None]


def _completed(config: dict[str, Any], optimizer: registry.Optimizer) -> dict[str, Any]:
  """``config`` with each key ``optimizer`` reads that a run recorded before the key existed
  (``passes``) as null, the value that keeps what such a run computed."""
  config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
  for key in optimizer.keys:
    *parents, last = key.split(".")
    node = config
    for part in parents:
      node = node.setdefault(part, {})
    node.setdefault(last, None)
  return config


def _stat(runs: Sequence[Run], value, style: str) -> str:
  values = _values(runs, value)
  return fmt_stat(aggregate(values), style) if values else ""


def _differences(
  pairs: Sequence[ComparisonPair], values: Callable[[Selection], list[float]]
) -> dict[tuple[str, str], tuple[str, str, str]]:
  """(optimizer label, family) -> (Welch interval text, the family's simultaneous interval,
  Holm reading) of the cells' ``values`` for the newcomers' comparisons with runs on both
  sides, each family read at once (:func:`results.stats.read_family`)."""
  tested = collections.defaultdict(list)
  for family, label, a, b in pairs:
    va, vb = values(a), values(b)
    if va and vb:
      tested[family].append((label, (va, vb)))
  out = {}
  for family, rows in tested.items():
    for (label, _), c in zip(rows, stats.read_family([s for _, s in rows]), strict=True):
      out[(label, family)] = (c.welch.text(), c.simultaneous.interval_text(), c.reading)
  return out


def build_newcomers(
  runs: Sequence[Run], dataset: str, model: str, length: str | None = None
) -> Table:
  """The table of today's optimizers on the image ``model`` for one set of runs (see the
  module)."""
  name = set_name("newcomers", dataset, length) + ("" if model == "resnet18" else f"_{model}")
  title = (
    f"{MODEL_NAMES.get(model, model)} stand-in: today's optimizers ({set_text(dataset, length)})"
  )
  return build_workload_table(runs, profiles.image_workload(dataset, model, length), name, title)


def build_text_newcomers(
  runs: Sequence[Run], model: str, length: str | None, setting: str
) -> Table:
  """The table of today's optimizers on an XSUM ``model`` in ``setting`` (full or LoRA) for one
  set of runs, timed to the profiles' validation losses where the set is one of their
  workloads (:func:`results.profiles.text_workload`)."""
  workload = profiles.text_workload(model, length, setting)
  name = f"newcomers_{slug(model)}_{slug(length)}_{setting}"
  what = f"XSUM, {length_text(length)}, {SETTING_TEXT.get(setting, setting)}"
  return build_workload_table(runs, workload, name, f"{model}: today's optimizers ({what})")


def build_workload_table(
  runs: Sequence[Run], workload: profiles.Workload, name: str, title: str
) -> Table:
  """The table of today's optimizers on ``workload`` (see the module)."""
  sweeps = TABLE_SWEEPS[workload.sweep]

  def cell(optimizer: str, tau: Any = None) -> Selection:
    return select_runs(runs, cell_criteria(optimizer, tau, **workload.criteria), sweeps)

  found = found_optimizers(runs, **workload.criteria)
  pairs = newcomer_pairs(cell, found)
  arms = list(dict.fromkeys(arm for n in registry.table_order() for arm in registry.get(n).arms))
  newcomers = [n for n in registry.table_order() if registry.get(n).arms]
  have = {o for o, _tau in found}
  evals = evaluations(workload)
  figure = figures(workload, evals)
  diffs = {
    name: _differences(pairs, lambda sel, value=value: _values(sel.runs, value))
    for name, value in figure.items()
  }
  arm_labels = [optimizer_label(*arm) for arm in arms]
  table = Table(
    name, title, _caption(arm_labels, workload), "Optimizer", _columns(arm_labels, workload)
  )
  rows = [(optimizer_label(*arm), cell(*arm)) for arm in arms]
  rows += [(registry.display_name(n), cell(n)) for n in newcomers if n in have]
  alone = {label: profiles.current_alone_runs(sel.runs, runs) for label, sel in rows}
  baseline = optimizer_label("adam", None)
  times, notes = _times_to_targets(rows, alone, baseline, workload, evals)
  used = []
  for k, (label, sel) in enumerate(rows):
    cells = _row_cells(label, sel, arms, figure, diffs, times[label], alone[label], workload)
    table.rows.append(Row(label, cells, rule_before=k == len(arms)))
    used += [r for r in sel.runs if r not in used]
  if used and all(figure["best"](r) == figure["final"](r) for r in used):
    notes.append("Every run's best evaluation is its last: the final part repeats the first.")
  cannot = [n for n in newcomers if not profiles.runs_family(n, workload)]
  for n in cannot:
    notes.append(
      f"{registry.display_name(n)} cannot run this model (model.family={workload.family}: its "
      "registry entry's families)."
    )
  missing = [registry.display_name(n) for n in newcomers if n not in have and n not in cannot]
  if missing:
    notes.append(f"Registered, no completed runs of this set yet: {', '.join(missing)}.")
  return finish(table, used, notes)


def target_head(workload: profiles.Workload, target: float) -> str:
  """ "s to 85 %" (an accuracy), "s to loss 6" (a validation loss)."""
  return f"s to loss {target:g}" if workload.lower_is_better else f"s to {target:g} %"


def _columns(arm_labels: Sequence[str], workload: profiles.Workload) -> list[Column]:
  """The table's columns in its four parts: the best validation figure and the final one (each
  with the difference from each arm), the times to the profiles' targets, and the cost; the
  seeds column in every part."""
  if workload.lower_is_better:
    figures = (("Val loss", "", LOSS), ("Final loss", "final ", FINAL_LOSS))
  else:
    figures = (("Acc", "", ACCURACY), ("Final acc", "final ", FINAL_ACCURACY))
  columns = [Column("", "n")]
  for head, prefix, part in figures:
    columns.append(Column("", head, part=part))
    for label in arm_labels:
      columns += [
        Column(f"{prefix}− {label}", "[95 % CI]", part=part),
        Column(f"{prefix}− {label}", "[simultaneous 95 %]", part=part),
        Column(f"{prefix}− {label}", "Holm", part=part),
      ]
  for target in workload.targets:
    head = target_head(workload, target)
    columns += [
      Column("", head, part=TIME),
      Column("", f"{head} − Adam, Holm", part=TIME),
    ]
  costs = ("Step ms", "Step GB", "State MB", "GFLOPs/step")
  return columns + [Column("", label, part=COST) for label in costs]


def rank_test_floor_notes(
  families: Sequence[Sequence[tuple[int, int]]], baseline: str
) -> list[str]:
  """A note where no time can read faster or slower than ``baseline``'s at any target: every
  family's smallest Holm-adjusted p (each test's sizes as (seeds, the baseline's seeds);
  :func:`results.stats.smallest_holm_rank_sum_p`) at least 0.05, whatever the medians."""
  families = [f for f in families if f]
  if not families or any(stats.smallest_holm_rank_sum_p(f) < stats.ALPHA for f in families):
    return []
  sizes = sorted({s for f in families for s in f})
  seeds = " and ".join(f"{n} against {m}" for n, m in sizes)
  floors = " and ".join(f"{stats.smallest_rank_sum_p(n, m):.2f}" for n, m in sizes)
  nearest = min(families, key=stats.smallest_holm_rank_sum_p)  # the family nearest to reading
  holm, m = stats.smallest_holm_rank_sum_p(nearest), len(nearest)
  after = f", {holm:.2f} after Holm over {m} optimizers" if m > 1 else ""
  return [
    f"At {seeds} seeds the exact rank test's smallest two-sided p is {floors}{after}: no time "
    f"can read faster or slower than {baseline}'s here, whatever the medians."
  ]


def _times_to_targets(
  rows: Sequence[tuple[str, Selection]],
  alone: dict[str, list[Run]],
  baseline: str,
  workload: profiles.Workload,
  evals: Evaluations,
) -> tuple[dict[str, list[str]], list[str]]:
  """Per row label, for each of ``workload``'s targets: the median seconds to the
  target over seeds (each seed's steps to it times the median step of the row's current runs
  ``alone``, misses infinite: :func:`results.profiles.seed_times`) with reached / seeds,
  and its reading against ``baseline``'s (the exact rank test, misses counted, Holm over the
  rows at that target); blank cells without a run alone, and for the baseline's reading. A row
  whose step time was measured on another device than the baseline's gets no reading (an
  H100's step is not an H200's): the notes name it."""
  out: dict[str, list[str]] = {label: [] for label, _ in rows}
  step_s = {label: profiles.median_step(runs) for label, runs in alone.items()}
  device = {label: device_name(runs[0]) for label, runs in alone.items() if runs}
  elsewhere = [
    label for label in device if baseline in device and device[label] != device[baseline]
  ]
  families: list[list[tuple[int, int]]] = []  # per target, (seeds, the baseline's) per test
  for target in workload.targets:
    seconds = {
      label: profiles.seed_times(sel.runs, target, step_s[label], workload, evals)
      for label, sel in rows
    }
    base = seconds.get(baseline)
    tested = {
      label: stats.race_difference(t, base)
      for label, t in seconds.items()
      if t and base and label != baseline and label not in elsewhere
    }
    adjusted = dict(zip(tested, stats.holm([d.p for d in tested.values()]), strict=True))
    families.append([(d.n, d.baseline_n) for d in tested.values()])
    for label, t in seconds.items():
      if not t:
        out[label] += ["", ""]
        continue
      shown = profiles.seconds_text(stats.median_time(t))
      reached = sum(math.isfinite(x) for x in t)
      reading = stats.race_verdict(tested[label], adjusted[label]) if label in tested else ""
      out[label] += [f"{shown} ({reached}/{len(t)})", reading]
  what = "times are not compared" if workload.targets else "step time does not compare"
  notes = [
    f"Step time measured on {device[label]}, {baseline}'s on {device[baseline]}: {label}'s "
    f"{what} with {baseline}'s."
    for label in elsewhere
  ]
  notes += rank_test_floor_notes(families, baseline)
  return out, notes


def _row_cells(
  label: str,
  sel: Selection,
  arms: Sequence[tuple[str, Any]],
  figure: dict[str, Figure],
  diffs: dict[str, dict[tuple[str, str], Any]],
  times: Sequence[str],
  alone: Sequence[Run],
  workload: profiles.Workload,
) -> list[str]:
  """One row's cells: seeds; each of the validation ``figure``s (best, then final) with its
  difference, simultaneous interval and Holm reading against each arm (``diffs`` of that
  figure; blank for an arm itself, or without runs); the ``times`` to the targets; then the
  costs: step time and memory from the configuration's current runs ``alone`` on their
  device."""
  runs = sel.runs
  cells = [str(len(runs))]
  for name, value in figure.items():
    cells.append(_stat(runs, value, "f2"))
    for arm in arms:
      key = (f"{label} − {optimizer_label(*arm)}", newcomer_family(arm))
      cells += list(diffs[name].get(key, ("", "", "")))
  costs = [
    _median(alone, summary_number("step_time_s", 1e3), "f2"),
    _median(alone, summary_number("step_memory_bytes", 1e-9), "f2"),
    _median(runs, summary_number("optimizer_state_bytes_per_device", 1e-6), "f1"),
    _median(runs, lambda r: _scaled(_flops(r, workload), 1e-9), "f1"),
  ]
  return cells + list(times) + costs


def _flops(run: Run, workload: profiles.Workload) -> float | None:
  """A step's FLOPs: a ResNet's counted now (:func:`step_flops`), another model's the analytic
  count the run recorded."""
  return step_flops(run) if workload.family == "resnet" else flops_number("analytic")(run)


def _median(runs: Sequence[Run], value, style: str) -> str:
  """The median of a figure that does not vary from seed to seed (a state's size, a count)."""
  values = _values(runs, value)
  return fmt_num(statistics.median(values), style) if values else ""


def _scaled(value: float | None, scale: float) -> float | None:
  return value * scale if is_number(value) else None


def _caption(arm_labels: Sequence[str], workload: profiles.Workload) -> str:
  arms = " and ".join(arm_labels)
  if workload.lower_is_better:
    best = "Lowest validation loss over the run's evaluations (lower is better)"
    reading = "above / below (below: a lower loss)"
    target = "s to loss T: time to a validation loss of T"
    flops = "the analytic count the runs recorded (3x the forward pass and the update)"
  else:
    best = "Best validation accuracy (%)"
    reading = "above / below"
    target = "s to T %: time to a validation accuracy of T %"
    flops = (
      "one training step (3x the forward pass, the d-pass where the optimizer has one, and the "
      "optimizer's update counted from the model's parameter shapes by its registry entry; for "
      "Muon, Newton-Schulz on each matrix)"
    )
  text = (
    f"{best}, mean ± sample std over seeds (n). − arm: the difference of"
    f" means from {arms} [Welch 95 % interval, uncorrected]; [simultaneous 95 %]: the family's"
    " intervals, each at 1 − 0.05 / m over the family's m comparisons (Bonferroni: all m cover"
    " their differences together with probability at least 95 %); Holm: the reading after Holm's "
    f"correction over the family of every optimizer compared with that arm ({reading} "
    "where the adjusted p is below 0.05, tie otherwise; n < 2 where a side has one run; Holm "
    "can read above or below where the simultaneous interval still holds 0). Final: the last "
    "evaluation, at the end of training, with the same statistics (final − arm, families of "
    "their own); the best of a run's evaluations reads higher than its last, and the more so "
    "the noisier its curve. "
  )
  if workload.targets:
    text += (
      f"{target} as AlgoPerf scores it (results/profiles.py): "
      "the median over seeds of each seed's steps to the target times its configuration's step "
      "time alone, a seed that misses counting as infinitely slow, then (reached / seeds); − "
      "Adam, Holm: faster / slower / tie by the exact rank test with the misses counted, Holm "
      "over the table's optimizers at that target (blank without a run alone). "
    )
  return text + (
    "Step ms and Step"
    " GB: median step time and the step's own memory (XLA's memory analysis) of the "
    "runs alone on their device with the configuration's step (any sweep and length: `make "
    "steptime` runs 600 steps), at the newest commit among them (blank without one)"
    + ("; the times to a target use the same step time. " if workload.targets else ". ")
    + "State MB: the optimizer state's bytes per device as the runs recorded them (their "
    f"median). GFLOPs/step: {flops}."
  )


def newcomer_tables(runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table): one per (dataset, length, model) of image runs and per (model, length,
  setting) of XSUM runs where an optimizer beyond the paper's has completed runs."""
  newcomers = {n for n in registry.names() if registry.get(n).arms}
  done = [r for r in tabulated(runs) if rfield(r, "optimizer") in newcomers]
  images = {
    (rfield(r, "dataset"), rfield(r, "length"), rfield(r, "model"))
    for r in done
    if rfield(r, "setting") is None
  }
  texts = {
    (rfield(r, "model"), rfield(r, "length"), rfield(r, "setting"))
    for r in done
    if rfield(r, "setting") is not None
  }
  tables = [build_newcomers(runs, d, m, length) for d, length, m in sorted(images, key=tuple_key)]
  tables += [build_text_newcomers(runs, *key) for key in sorted(texts, key=tuple_key)]
  return [(table.name, table) for table in tables]


def main(argv: Sequence[str] | None = None) -> int:
  """Scan the roots and write <out>/newcomers_<set>.md and .tex."""
  return tables_command("python -m results.newcomers", __doc__, newcomer_tables, argv)


if __name__ == "__main__":
  sys.exit(main())
