"""Our runs beside the Ginger paper's Tables 1-4, plus a Ginger ablation table.

Reads the `summary.json` of every run dir under the given roots (Hydra output dirs written by
train.py, plain or packed into archives by results/records.py) and writes `table1.md/.tex` ...
`table4.md/.tex` and `table_ablation.md/.tex` into --out (default results/local/, ignored by
git; `make tables` writes the committed campaign's into results/cifar10/)::

    python -m results.tables [roots...] [--out DIR] [--dataset cifar10] [--flops xla]
    python -m results.tables multirun --dataset digits --models resnet_tiny   # smoke sweeps

Each metric gets three columns: ours (mean ± sample std over seeds; no std for one seed), the
paper's number (verbatim from `results/paper/*.csv`) and the difference ours - paper. Tables of
other settings (NOT COMPARABLE) have no difference column: the paper's number stands beside
ours, labelled with the paper's setting. A table wider than MAX_COLUMNS is shown as several, one
per model (or setting), then per kind of column (accuracy and loss, cost). Cells with no
completed run are blank. See `results/README.md` for units and how runs are chosen.

Only runs of the paper's protocol (its dataset, model and run length: CIFAR-100 for 200 epochs;
pretrained t5-small on XSUM for 1 epoch) fill the paper's tables. Every other set of runs (a
stand-in dataset, a random-init model, a shorter schedule) gets its own tables, one set per
(dataset, run length), named after both (``table1_cifar10_30ep.md``) and titled NOT COMPARABLE.
Runs of different lengths never share a cell. Runs of the curvature_every sweep (Ginger with the
curvature updated every K steps, beyond the paper) enter only their own table,
``curvature_every_<dataset>_<length>.md``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import itertools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from results import records, series, stats
from results.runs import (  # noqa: F401 (the run list, read through this module too)
  DEFAULT_ROOTS,
  DONE_STATUSES,
  NOT_SETTINGS,
  NUMBER_KEYS,
  DamagedRecordError,
  Run,
  check_numbers,
  collect_runs,
  find_run_dirs,
  is_done,
  is_number,
  length_text,
  load_summary,
  missing_roots,
  rfield,
  run_length,
  settings_of,
  skip_reason,
)
from training import registry

PAPER_DIR = Path(__file__).resolve().parent / "paper"
# Where tables of your own runs go by default: beside the source, ignored by git (.gitignore);
# the committed campaign's are written with --out results/cifar10 (make tables).
DEFAULT_OUT = "results/local"
TAUS = (1, 2, 4, 8, 16, 32)
SENSITIVITY_ALPHAS = (0.9, 0.99, 0.999)
SENSITIVITY_TAUS = (2, 4, 8)
PAPER_ALPHA = 0.99  # the paper's "second moment" for all optimizers
# Never in a paper table: lr_tune's candidates, and the studies beyond the paper, which have
# their own tables (curvature_every: build_curvature_every).
EXCLUDED_SWEEPS = frozenset({"lr_tune", "curvature_every"})
# The variant an optimizer's cells in Tables 1-4 stand for: Ginger's config defaults, as the
# authors' code runs it (clip rho=1, one (U, sigma) per tensor). The other variants (sweep
# ablation) share tau and alpha with it and belong to the ablation table.
DEFAULT_VARIANT = {
  "ginger": {"rho": 1.0, "block": "per_tensor"},
  "qng": {"rho": None, "block": "global"},
}
CONFIG_KEYS = (
  "experiment",
  "model",
  "dataset",
  "setting",
  "optimizer",
  "tau",
  "alpha",
  "gamma",
  "rho",
  "block",
  "lr",
  "length",
  "curvature_every",
  "batchnorm",
  "batchnorm_groups",
  "precision",
  "state_dtype",
  "settings",
  "optimizer_options",  # an optimizer's own keys set away from its YAML (run_record.OPTIONS)
)
# The paper's protocols: only runs matching one fill the paper's tables.
PAPER_IMAGE = {"dataset": "cifar100", "length": "200ep"}
PAPER_TEXT = {"dataset": "xsum", "model": "t5-small", "length": "1ep"}
DATASET_NAMES = {"cifar100": "CIFAR-100", "cifar10": "CIFAR-10", "xsum": "XSUM"}
MODEL_NAMES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}
FLOPS_SOURCES = ("analytic", "xla")
TABLE_SWEEPS = {
  "table1": ("table1",),
  "table2": ("table2",),
  "table3": ("table3", "table4", "table34"),
  "table4": ("table3", "table4", "table34"),
}

# ----------------------------------------------------------------------------- selection


def _same(a: Any, b: Any) -> bool:
  """Equality that treats 0.99 and 0.9900000001 (or 4 and 4.0) as the same value."""
  if is_number(a) and is_number(b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
  return a == b


def _accepts(value: Any, want: Any) -> bool:
  """`want` is one allowed value, or a tuple of them."""
  options = want if isinstance(want, tuple) else (want,)
  return any(_same(value, w) for w in options)


def sort_key(value: Any) -> tuple[int, Any]:
  """Sorts numbers, then strings, then None."""
  if is_number(value):
    return (0, value)
  return (2, "") if value is None else (1, str(value))


def config_key(run: Run) -> tuple:
  """The run's hyperparameters (everything but the seed), hashable (a mapping as its sorted
  items)."""
  return tuple(_hashable(rfield(run, k)) for k in CONFIG_KEYS)


def _hashable(value: Any) -> Any:
  return tuple(sorted(value.items())) if isinstance(value, dict) else value


def dedupe_seeds(runs: Iterable[Run]) -> list[Run]:
  """One run per seed: the newest summary.json wins (a rerun replaces the earlier one)."""
  best: dict[Any, Run] = {}
  for run in runs:
    seed = rfield(run, "seed")
    key = seed if seed is not None else run.get("path")
    if key not in best or run.get("mtime", 0) > best[key].get("mtime", 0):
      best[key] = run
  return sorted(best.values(), key=lambda r: sort_key(rfield(r, "seed")))


@dataclass
class Selection:
  """The runs chosen for one table cell, and a note when several configurations matched."""

  runs: list[Run]
  note: str | None = None


def _describe(run: Run, keys: Sequence[str]) -> str:
  return ", ".join(f"{k}={rfield(run, k)}" for k in keys)


def select_runs(
  runs: Iterable[Run], criteria: dict[str, Any], sweeps: Sequence[str] = ()
) -> Selection:
  """Completed runs matching `criteria` ({run field: value or tuple of values}).

  Runs of an excluded sweep (lr_tune, curvature_every) count only where `sweeps` names that
  sweep. Runs of one of `sweeps` are preferred over others, then runs of the optimizer's default
  variant (DEFAULT_VARIANT: an ablation variant fills a cell only where the default has no run,
  and the note says so). If the remaining runs hold several
  configurations (e.g. two learning rates), the one with the most seeds (then the newest) is
  used and the note says so.
  """
  pool = [
    r
    for r in runs
    if is_done(r)
    and (rfield(r, "sweep") not in EXCLUDED_SWEEPS or rfield(r, "sweep") in sweeps)
    and all(_accepts(rfield(r, k), w) for k, w in criteria.items())
  ]
  pool = [r for r in pool if rfield(r, "sweep") in sweeps] or pool
  default = [r for r in pool if is_default_variant(r)]
  fallback = None
  if pool and not default:  # every run left is a non-default variant of one optimizer
    want = default_variant(rfield(pool[0], "optimizer"))
    fallback = (
      "no run of the default variant (" + ", ".join(f"{k}={v}" for k, v in want.items()) + ")"
    )
  pool = default or pool
  if fallback and pool:
    used = _describe(pool[0], list(default_variant(rfield(pool[0], "optimizer"))))
    fallback = f"{fallback}; used {used}"
  return one_configuration(pool, fallback)


def one_configuration(runs: Sequence[Run], note: str | None = None) -> Selection:
  """The runs of one configuration (:func:`config_key`; one run per seed, the newest): the one
  with the most seeds (then the newest) when there are several, and a note naming what
  differs. ``note``: said first where the selection has a note."""
  groups: dict[tuple, list[Run]] = {}
  for run in runs:
    groups.setdefault(config_key(run), []).append(run)
  if not groups:
    return Selection([])
  chosen = {k: dedupe_seeds(v) for k, v in groups.items()}
  best = max(chosen.values(), key=lambda rs: (len(rs), max(r.get("mtime", 0) for r in rs)))
  if len(chosen) == 1:
    return Selection(best, f"{note} (n={len(best)})" if note else None)
  varying = [k for i, k in enumerate(CONFIG_KEYS) if len({repr(g[i]) for g in chosen}) > 1]
  fields = [k for k in varying if k != "settings"]
  used = _describe(best[0], fields)
  if "settings" in varying:  # name the settings that differ, not their digest
    firsts = [group[0]["settings"] for group in chosen.values()]
    differ = {k for f in firsts for k in f if len({repr(x.get(k)) for x in firsts}) > 1}
    keys = sorted(differ - set(fields))  # a setting that is also a field is named once
    own = ", ".join(f"{k}={best[0]['settings'].get(k)}" for k in keys)
    used = ", ".join(part for part in (used, own) if part)
  matched = f"{len(chosen)} configurations matched"
  return Selection(best, f"{note + '; ' if note else ''}{matched}; used {used} (n={len(best)})")


def default_variant(optimizer: str) -> dict[str, Any]:
  """The run fields of `optimizer`'s default variant: DEFAULT_VARIANT's, and float32 numerics
  (compute, and the curvature state where there is one)."""
  numerics = {"precision": "float32"}
  if registry.keeps_curvature(optimizer):
    numerics["state_dtype"] = "float32"
  return {**DEFAULT_VARIANT.get(optimizer, {}), **numerics}


def is_default_variant(run: Run) -> bool:
  """Whether `run` is its optimizer's default variant (:func:`default_variant`)."""
  want = default_variant(rfield(run, "optimizer"))
  return all(rfield(run, k) == v for k, v in want.items())


# ----------------------------------------------------------------------------- numbers


@dataclass(frozen=True)
class Stat:
  """Mean, sample std (None for fewer than two values) and count of one metric."""

  mean: float | None
  std: float | None
  n: int


def aggregate(values: Iterable[Any]) -> Stat:
  """Mean ± sample std of the numeric values (None and non-numbers are ignored)."""
  xs = [float(v) for v in values if is_number(v)]
  if not xs:
    return Stat(None, None, 0)
  std = statistics.stdev(xs) if len(xs) > 1 else None
  return Stat(statistics.fmean(xs), std, len(xs))


def fmt_num(x: float | None, style: str, signed: bool = False) -> str:
  """Format `x` as "f2"/"f3" (fixed decimals) or "sci" ("2.21e9"); blank for None."""
  if x is None:
    return ""
  if not math.isfinite(x):
    return str(x)
  sign = "+" if signed else ""
  if style == "sci":
    mantissa, exponent = f"{x:{sign}.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"
  return f"{x:{sign}.{int(style[1:])}f}"


def fmt_stat(stat: Stat, style: str) -> str:
  """ "mean ± std", or just the mean for one seed, or blank."""
  if stat.mean is None:
    return ""
  text = fmt_num(stat.mean, style)
  return text if stat.std is None else f"{text} ± {fmt_num(stat.std, style)}"


def _parse(text: str) -> Any:
  """A CSV cell as int, float, str, or None when empty."""
  if text == "":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def load_paper(name: str) -> list[dict[str, str]]:
  """Rows of results/paper/<name>.csv, values as the paper prints them."""
  with open(PAPER_DIR / f"{name}.csv", newline="") as f:
    return list(csv.DictReader(f))


def paper_row(rows: Iterable[dict[str, str]], **keys: Any) -> dict[str, str] | None:
  """The paper row whose columns equal `keys` (None matches an empty cell)."""
  for row in rows:
    if all(_same(_parse(row.get(k, "")), v) for k, v in keys.items()):
      return row
  return None


# ----------------------------------------------------------------------------- metrics


def _get(key: str, scale: float = 1.0) -> Callable[[Run], float | None]:
  """Getter for a top-level summary number, multiplied by `scale`."""

  def get(run: Run) -> float | None:
    value = run.get(key)
    return value * scale if is_number(value) else None

  return get


def is_shared(run: Run) -> bool:
  """Whether the run shared its device (summary.json's ``device_shared``): its accuracy counts,
  its times and memory do not."""
  return bool(run.get("device_shared"))


def _alone(key: str, scale: float = 1.0) -> Callable[[Run], float | None]:
  """:func:`_get` for a time or memory figure: None for a run that shared its device."""
  get = _get(key, scale)
  return lambda run: None if is_shared(run) else get(run)


def _flops(source: str) -> Callable[[Run], float | None]:
  """Getter for flops_per_iter[source] ("analytic" or "xla")."""

  def get(run: Run) -> float | None:
    flops = run.get("flops_per_iter")
    value = flops.get(source) if isinstance(flops, dict) else None
    return value if is_number(value) else None

  return get


def _first(*keys: str) -> Callable[[Run], float | None]:
  """Getter for the first of `keys` that the summary has as a number."""

  def get(run: Run) -> float | None:
    values = (_get(k)(run) for k in keys)
    return next((v for v in values if v is not None), None)

  return get


_primary = _first("best_val_accuracy", "rougeL")  # image runs: accuracy; seq2seq: ROUGE-L


@dataclass(frozen=True)
class Metric:
  """One reported number: label, getter (display units), paper CSV column, format style, and
  the part of a table too wide for one (MAX_COLUMNS) it goes to (:data:`QUALITY`, ...)."""

  label: str
  value: Callable[[Run], float | None]
  paper_key: str | None
  style: str
  paired: bool = True  # False: only our column (no paper/difference columns)
  part: str = ""


# The parts a table wider than MAX_COLUMNS is split into, by what its columns measure.
QUALITY = "accuracy and loss"
COST = "cost"
ROUGE = "ROUGE"
PERPLEXITY_AND_COST = "perplexity and cost"


@dataclass(frozen=True)
class PaperColumns:
  """How a table shows the paper's number beside ours: the paper column's sub-label ("" for
  no paper column) and whether the difference ours - paper follows it. Only a table of the
  paper's own settings has the difference: between other settings it would be noise."""

  label: str = "paper"
  delta: bool = True


SAME_SETTINGS = PaperColumns()
NO_PAPER = PaperColumns("", delta=False)


def paper_beside(setting: str) -> PaperColumns:
  """The paper's number beside ours, labelled with the paper's setting ("paper (CIFAR-100,
  200 ep.)"), without a difference: a table of other settings (NOT COMPARABLE)."""
  return PaperColumns(f"paper ({setting})", delta=False)


# The training step's own memory (summary.json's step_memory_bytes: XLA's memory analysis of the
# compiled step), beside "Mem GB", the process's lifetime high-water mark, which also holds
# compilation and autotuning scratch and the evaluation's memory (T5-small full, Ginger tau 32,
# one H100: 16.2 GB, set by evaluation, against the step's 10.1 GB; 21.2 GB while the loop built
# the state before compiling, the extra XLA's autotuning).
# Ours only: the paper reports one peak (PyTorch's). Blank where summary.json lacks it.
MEMORY_CAPTION = (
  "memory in GB (bytes/1e9): Mem = the process's peak (compilation and autotuning included), "
  "Step = the training step's own (XLA's memory analysis)."
)
STEP_MEMORY = Metric(
  "Step GB", _alone("step_memory_bytes", 1e-9), None, "f2", paired=False, part=COST
)


def image_metrics(flops: str = "analytic") -> list[Metric]:
  """Table 1's columns for one model."""
  return [
    Metric("Acc", _get("best_val_accuracy"), "acc", "f2", part=QUALITY),
    Metric("Val loss", _get("val_loss_at_best"), "val_loss", "f3", part=QUALITY),
    Metric(
      "Train loss 1e-6", _get("min_train_loss", 1e6), "min_train_loss_1e-6", "f2", part=QUALITY
    ),
    Metric(f"FLOPs ({flops})", _flops(flops), "flops_per_iter", "sci", part=COST),
    Metric("Mem GB", _alone("peak_memory_bytes", 1e-9), "peak_mem_gb", "f2", part=COST),
    STEP_MEMORY,
  ]


def xsum_metrics(flops: str = "analytic") -> list[Metric]:
  """Table 2's columns for one setting."""
  cost = PERPLEXITY_AND_COST
  return [
    Metric("R1", _get("rouge1"), "rouge1", "f2", part=ROUGE),
    Metric("R2", _get("rouge2"), "rouge2", "f2", part=ROUGE),
    Metric("RL", _get("rougeL"), "rougeL", "f2", part=ROUGE),
    Metric("Train ppl", _get("train_perplexity"), "train_ppl", "f3", part=cost),
    Metric(f"FLOPs ({flops})", _flops(flops), "flops_per_iter", "sci", part=cost),
    Metric("Mem GB", _alone("peak_memory_bytes", 1e-9), "peak_mem_gb", "f2", part=cost),
    replace(STEP_MEMORY, part=cost),
  ]


def metric_cells(
  runs: Sequence[Run],
  metric: Metric,
  paper: dict[str, str] | None,
  columns: PaperColumns = SAME_SETTINGS,
) -> list[str]:
  """[ours, paper, ours - paper] for a paired metric (the paper's cells as ``columns`` has
  them), [ours] otherwise."""
  stat = aggregate(metric.value(r) for r in runs)
  ours = fmt_stat(stat, metric.style)
  if not metric.paired:
    return [ours]
  theirs = (paper or {}).get(metric.paper_key or "", "") or ""
  diff = ""
  if stat.mean is not None and theirs:
    diff = fmt_num(stat.mean - float(theirs), metric.style, signed=True)
  return [ours] + [theirs] * bool(columns.label) + [diff] * columns.delta


# ----------------------------------------------------------------------------- table model


@dataclass
class Column:
  """A column: group (tau in Tables 3/4; "" for none), metric label, sub-label ("ours",
  "paper", "Δ"; "" for columns that are not one of a metric's), the section it is shown in
  (model, setting; "" for none: see :func:`blocks`) and the part of a too wide section it
  goes to ("" for every part, like n)."""

  group: str
  label: str
  sub: str = ""
  section: str = ""
  part: str = ""

  def header(self) -> str:
    """One-line header for markdown: "<group> <label> [paper|Δ]"."""
    return " ".join(x for x in (self.group, self.label, self.sub) if x and x != "ours")


@dataclass
class Row:
  """A row: label, one text cell per column, whether a rule precedes it, and the section it
  is shown in ("" for none: see :func:`blocks`)."""

  label: str
  cells: list[str]
  rule_before: bool = False
  section: str = ""


@dataclass
class Table:
  """A rendered-ready table: every cell is already text ("" = blank)."""

  name: str
  title: str
  caption: str
  row_header: str
  columns: list[Column]
  rows: list[Row] = field(default_factory=list)
  notes: list[str] = field(default_factory=list)


def group_columns(
  section: str, metrics: Sequence[Metric], paper: PaperColumns, group: str = "", n: bool = True
) -> list[Column]:
  """n (unless not ``n``), then ours/paper/Δ per metric (as ``paper`` has them), all in
  ``section`` and ``group``."""
  cols = [Column(group, "n", section=section)] if n else []
  for m in metrics:
    subs = ["ours", paper.label, "Δ" if paper.delta else ""] if m.paired else []
    subs = [sub for sub in subs if sub]
    cols += [Column(group, m.label, sub, section, m.part) for sub in subs[1:] and subs or [""]]
  return cols


def group_cells(
  sel: Selection,
  metrics: Sequence[Metric],
  paper: dict[str, str] | None,
  columns: PaperColumns,
) -> list[str]:
  """Cells matching `group_columns`: n (blank if none) and each metric's cells."""
  cells = [str(len(sel.runs)) if sel.runs else ""]
  for m in metrics:
    cells += metric_cells(sel.runs, m, paper, columns)
  return cells


def _tau_text(tau: Any) -> str:
  return "" if tau is None else f" (τ={tau})"


def optimizer_label(optimizer: str, tau: Any) -> str:
  """ "QNG (τ=4)", "Adam", as in the paper."""
  return registry.display_name(optimizer) + _tau_text(tau)


def provenance_note(runs: Iterable[Run]) -> str | None:
  """Which devices, JAX versions and commits produced the runs in a table."""
  counts: dict[str, dict[str, int]] = {"device": {}, "jax": {}, "git": {}}
  for run in {r["path"]: r for r in runs}.values():
    for kind, value in (
      ("device", _device(run)),
      ("jax", _jax(run)),
      ("git", str(run.get("git_commit") or "?")[:10]),
    ):
      counts[kind][value] = counts[kind].get(value, 0) + 1
  if not counts["device"]:
    return None
  parts = [
    f"{k}: " + ", ".join(f"{v} ({n})" for v, n in sorted(c.items())) for k, c in counts.items()
  ]
  note = "From summary.json of the runs used - " + "; ".join(parts) + "."
  shared = sum(is_shared(r) for r in {r["path"]: r for r in runs}.values())
  if shared:
    note += (
      f" {shared} of them shared a GPU with other runs (device_shared): they count in the "
      "accuracy and loss columns, not in the time and memory ones (n there is the runs alone)."
    )
  return note


def _device(run: Run) -> str:
  device = run.get("device")
  if isinstance(device, dict):
    for key in ("device_kind", "kind", "name", "platform"):
      if device.get(key):
        return str(device[key])
    return json.dumps(device, sort_keys=True)
  return str(device) if device else "?"


def _jax(run: Run) -> str:
  versions = run.get("versions")
  return str(versions.get("jax", "?")) if isinstance(versions, dict) else "?"


def _finish(table: Table, used: list[Run], notes: list[str]) -> Table:
  """Attach the cell notes and the provenance note."""
  table.notes += notes
  note = provenance_note(used)
  table.notes.append(note or "No completed runs found: all our cells are blank.")
  return table


# ----------------------------------------------------------------------------- tables


UNITS = (
  "ours = mean ± sample std over n seeds (no std for one seed); paper = the paper's number; "
  "Δ = ours - paper; blank = no completed run."
)


def units(paper: PaperColumns, seeds: str = "n seeds") -> str:
  """The caption's last sentence: what ours, paper and Δ are (``seeds``: where n is said)."""
  ours = f"ours = mean ± sample std over {seeds} (no std for one seed)"
  if paper.delta:
    return UNITS.replace("n seeds", seeds)
  if paper.label:
    return (
      f"{ours}; {paper.label} = the paper's number in its own setting, beside ours for the shape "
      "only: the settings differ, so no difference ours - paper is given; blank = no completed run."
    )
  return f"{ours}; blank = no completed run."


# The paper's settings in a column label (paper_beside), per table.
PAPER_IMAGE_TEXT = "CIFAR-100, 200 ep."
PAPER_TEXT_TEXT = "pretrained t5-small, 1 ep."


def _optimizer_keys(
  found: Iterable[tuple[str, Any]], order: Sequence[str]
) -> list[tuple[str, Any]]:
  """The paper's (optimizer, tau) rows plus any other optimizer or tau found in our runs, in
  `order`. An optimizer without tau has one row; the paper's with tau one per paper tau."""
  paper = [o for o in order if o in registry.PAPER_ORDER]
  keys = {(o, None) for o in paper if not registry.reads(o, "tau")}
  keys |= {(o, t) for o in paper if registry.reads(o, "tau") for t in TAUS}
  keys |= {(o, t if registry.reads(o, "tau") else None) for o, t in found if o in order}
  return sorted(keys, key=lambda k: (order.index(k[0]), sort_key(k[1])))


def cell_criteria(optimizer: str, tau: Any, **base: Any) -> dict[str, Any]:
  """Cell criteria; the curvature methods must use the paper's alpha (or leave it unset)."""
  crit = dict(base, optimizer=optimizer)
  if tau is not None:
    crit.update(tau=tau, alpha=(PAPER_ALPHA, None))
  return crit


def _found(runs: Iterable[Run], **base: Any) -> set[tuple[str, Any]]:
  """(optimizer, tau) pairs among runs that some cell of a table with `base` would use."""
  return {
    (rfield(r, "optimizer"), rfield(r, "tau"))
    for r in runs
    if is_done(r)
    and rfield(r, "sweep") not in EXCLUDED_SWEEPS
    and all(_accepts(rfield(r, k), v) for k, v in base.items())
    and (rfield(r, "tau") is None or _accepts(rfield(r, "alpha"), (PAPER_ALPHA, None)))
  }


def _optimizer_table(
  name: str,
  title: str,
  caption: str,
  runs: Sequence[Run],
  groups: Sequence[tuple[str, dict]],
  metrics: Sequence[Metric],
  order: Sequence[str],
  paper: list[dict],
  sweeps: Sequence[str],
  paper_keys: Sequence[str],
  paper_columns: PaperColumns,
) -> Table:
  """A Table 1/2-style table: rows (optimizer, tau), one section per group of `groups`; the
  paper's row is looked up by optimizer, tau and the group's `paper_keys`."""
  columns = [c for group, _ in groups for c in group_columns(group, metrics, paper_columns)]
  table = Table(name, title, caption, "Optimizer", columns)
  found: set[tuple[str, Any]] = set()
  for _, base in groups:
    found |= _found(runs, **base)
  used, notes = [], []
  for optimizer, tau in _optimizer_keys(found, order):
    label = optimizer_label(optimizer, tau)
    cells: list[str] = []
    for name, base in groups:
      sel = select_runs(runs, cell_criteria(optimizer, tau, **base), sweeps)
      keys = {k: base[k] for k in paper_keys}
      theirs = paper_row(paper, optimizer=optimizer, tau=tau, **keys)
      cells += group_cells(sel, metrics, theirs, paper_columns)
      used += sel.runs
      if sel.note:
        notes.append(f"{name} / {label}: {sel.note}.")
    rule = optimizer == "ginger" and not any(r.label.startswith("Ginger") for r in table.rows)
    table.rows.append(Row(label, cells, rule_before=rule))
  return _finish(table, used, notes)


def image_protocol(dataset: str = "cifar100", length: str | None = None) -> dict[str, Any]:
  """Criteria of an image-table set: the dataset and run length (the paper's length for the
  paper's dataset when not given; any length otherwise)."""
  if length is None and dataset == PAPER_IMAGE["dataset"]:
    length = PAPER_IMAGE["length"]
  return {"dataset": dataset} | ({"length": length} if length is not None else {})


def comparable(protocol: dict[str, Any], paper: dict[str, Any]) -> bool:
  return all(protocol.get(k) == v for k, v in paper.items())


def _not_comparable(protocol: dict[str, Any], paper_text: str) -> str:
  """ "CIFAR-10, 30 epochs - NOT COMPARABLE with the paper (paper: ...)"."""
  dataset = protocol.get("dataset")
  what = ", ".join(
    str(x)
    for x in (
      DATASET_NAMES.get(dataset, dataset),
      protocol.get("model"),
      protocol.get("length") and length_text(protocol["length"]),
    )
    if x
  )
  return f"{what} - NOT COMPARABLE with the paper (paper: {paper_text})"


def build_table1(
  runs: Sequence[Run],
  dataset: str = "cifar100",
  models: Sequence[str] = ("resnet18", "resnet50"),
  flops: str = "analytic",
  length: str | None = None,
) -> Table:
  """Table 1: one row per optimizer (and tau), a column group per model."""
  protocol = image_protocol(dataset, length)
  metrics = image_metrics(flops)
  groups = [(MODEL_NAMES.get(m, m), {**protocol, "model": m}) for m in models]
  title = "Table 1: CIFAR-100, 200 epochs (paper Table 1)"
  paper_columns = SAME_SETTINGS
  if not comparable(protocol, PAPER_IMAGE):
    title = "Table 1: " + _not_comparable(protocol, "CIFAR-100, 200 epochs")
    paper_columns = paper_beside(PAPER_IMAGE_TEXT)
  caption = (
    f"Best validation accuracy (%), validation loss at that eval, minimum training "
    f"loss (x1e-6, like the paper), FLOPs per iteration ({flops} count), {MEMORY_CAPTION} "
    + units(paper_columns)
  )
  return _optimizer_table(
    "table1",
    title,
    caption,
    runs,
    groups,
    metrics,
    registry.table_order(),
    load_paper("table1_cifar100"),
    TABLE_SWEEPS["table1"],
    ("model",),
    paper_columns,
  )


def text_protocol(model: str = "t5-small", length: str | None = "1ep") -> dict[str, Any]:
  """Criteria of a Table 2 set: XSUM, the model (by name) and the run length."""
  return {"dataset": "xsum", "model": model} | ({"length": length} if length is not None else {})


def build_table2(
  runs: Sequence[Run], flops: str = "analytic", model: str = "t5-small", length: str | None = "1ep"
) -> Table:
  """Table 2: XSUM, one row per optimizer (and tau), column groups LoRA and Full."""
  protocol = text_protocol(model, length)
  metrics = xsum_metrics(flops)
  groups = [
    ("LoRA", {**protocol, "setting": "lora"}),
    ("Full", {**protocol, "setting": "full"}),
  ]
  title = "Table 2: XSUM, pretrained t5-small, 1 epoch (paper Table 2)"
  paper_columns = SAME_SETTINGS
  if not comparable(protocol, PAPER_TEXT):
    title = "Table 2: " + _not_comparable(protocol, "XSUM, pretrained t5-small, 1 epoch")
    paper_columns = paper_beside(PAPER_TEXT_TEXT)
  caption = (
    f"ROUGE-1/2/L (%), training perplexity, FLOPs per iteration ({flops} count), "
    f"{MEMORY_CAPTION} " + units(paper_columns)
  )
  return _optimizer_table(
    "table2",
    title,
    caption,
    runs,
    groups,
    metrics,
    registry.table_order(first=("adam",)),  # the paper's Table 2 lists Adam first
    load_paper("table2_xsum"),
    TABLE_SWEEPS["table2"],
    ("setting",),
    paper_columns,
  )


def _sensitivity(
  runs: Sequence[Run],
  name: str,
  metric: Metric,
  dataset: str,
  model: str = "resnet18",
  length: str | None = None,
) -> Table:
  """Tables 3/4: Ginger on ResNet-18, rows alpha, column groups tau."""
  protocol = image_protocol(dataset, length)
  what = "best validation accuracy (%)" if name == "table3" else "minimum training loss (x1e-6)"
  number = name[-1]
  title = (
    f"Table {number}: Ginger sensitivity, {what}, ResNet-18 / CIFAR-100, 200 epochs "
    f"(paper Table {number})"
  )
  paper_columns = SAME_SETTINGS
  if not comparable(protocol, PAPER_IMAGE) or model != "resnet18":
    title = f"Table {number}: Ginger sensitivity, {what}, " + _not_comparable(
      {**protocol, "model": model}, "ResNet-18 / CIFAR-100, 200 epochs"
    )
    paper_columns = paper_beside(PAPER_IMAGE_TEXT)
  columns = [
    c for t in SENSITIVITY_TAUS for c in group_columns("", [metric], paper_columns, f"τ={t}", False)
  ]
  caption = f"Ginger, {what}, rows alpha, columns tau. " + units(
    paper_columns, "n seeds, given as (n=...) in the cell"
  )
  table = Table(name, title, caption, "α \\ τ", columns)
  paper, used, notes = load_paper("table34_sensitivity"), [], []
  for alpha in SENSITIVITY_ALPHAS:
    cells: list[str] = []
    for tau in SENSITIVITY_TAUS:
      crit = {**protocol, "model": model, "optimizer": "ginger", "tau": tau, "alpha": alpha}
      sel = select_runs(runs, crit, TABLE_SWEEPS[name])
      theirs = metric_cells(sel.runs, metric, paper_row(paper, alpha=alpha, tau=tau), paper_columns)
      if theirs[0]:  # the seed count in the cell: a column per tau would make 13 columns
        theirs[0] += f" (n={len(sel.runs)})"
      cells += theirs
      used += sel.runs
      if sel.note:
        notes.append(f"α={alpha}, τ={tau}: {sel.note}.")
    table.rows.append(Row(str(alpha), cells))
  return _finish(table, used, notes)


def build_table3(
  runs: Sequence[Run], dataset: str = "cifar100", model: str = "resnet18", length: str | None = None
) -> Table:
  """Table 3 (paper: "Validation accuracy"): best val accuracy over alpha x tau."""
  metric = Metric("Acc", _get("best_val_accuracy"), "val_acc", "f2")
  return _sensitivity(runs, "table3", metric, dataset, model, length)


def build_table4(
  runs: Sequence[Run], dataset: str = "cifar100", model: str = "resnet18", length: str | None = None
) -> Table:
  """Table 4 (paper: "Training loss"): min training loss (x1e-6) over alpha x tau."""
  metric = Metric("Train loss 1e-6", _get("min_train_loss", 1e6), "min_train_loss_1e-6", "f2")
  return _sensitivity(runs, "table4", metric, dataset, model, length)


# ----------------------------------------------------------------------------- ablation

ABLATION_BASE = ("dataset", "model", "setting", "length", "tau", "alpha")
ABLATION_VARIANT = ("rho", "block", "lr", "gamma")


def ablation_metrics(dataset: Any) -> list[Metric]:
  """Ablation columns; paper numbers only where the paper has them (CIFAR-100, XSUM)."""
  image = dataset == "cifar100"
  primary = "acc" if image else ("rougeL" if dataset == "xsum" else None)
  val_loss = _first("val_loss_at_best", "val_loss")
  train_loss = _get("min_train_loss", 1e6)
  return [
    Metric("Acc / R-L", _primary, primary, "f2", part=QUALITY),
    Metric("Val loss", val_loss, "val_loss" if image else None, "f3", part=QUALITY),
    Metric(
      "Train loss 1e-6", train_loss, "min_train_loss_1e-6" if image else None, "f2", part=QUALITY
    ),
    Metric("Step s", _alone("step_time_s"), None, "f3", paired=False, part=COST),
    Metric("Mem GB", _alone("peak_memory_bytes", 1e-9), None, "f2", paired=False, part=COST),
    STEP_MEMORY,
  ]


def _ablation_paper(base: dict[str, Any]) -> dict[str, str] | None:
  """The paper's Ginger row at the same model/setting and tau, if the paper has one."""
  if comparable(base, PAPER_IMAGE):
    return paper_row(
      load_paper("table1_cifar100"), optimizer="ginger", tau=base["tau"], model=base["model"]
    )
  if comparable(base, PAPER_TEXT):
    return paper_row(
      load_paper("table2_xsum"), optimizer="ginger", tau=base["tau"], setting=base["setting"]
    )
  return None


def _ablation_groups(runs: Iterable[Run]) -> dict[tuple, dict[tuple, list[Run]]]:
  """Completed Ginger runs: base config -> variant (rho, block, lr, gamma) -> runs."""
  groups: dict[tuple, dict[tuple, list[Run]]] = {}
  for run in runs:
    if rfield(run, "optimizer") != "ginger" or not is_done(run):
      continue
    if rfield(run, "sweep") in EXCLUDED_SWEEPS:
      continue
    base = tuple(rfield(run, k) for k in ABLATION_BASE)
    variant = tuple(rfield(run, k) for k in ABLATION_VARIANT)
    groups.setdefault(base, {}).setdefault(variant, []).append(run)
  return groups


def matches(run: Run, criteria: dict[str, Any]) -> bool:
  return all(_accepts(rfield(run, k), v) for k, v in criteria.items())


def tuple_key(values: tuple) -> tuple:
  return tuple(sort_key(v) for v in values)


def build_ablation(runs: Sequence[Run], protocol: dict[str, Any] | None = None) -> Table:
  """Ginger with vs without the element-wise clip rho, per-tensor vs global block.

  One row per variant (rho, block, lr, gamma) of every base setting (dataset, model, setting,
  length, tau, alpha) that has at least two variants among completed Ginger runs, one section
  per base setting: runs of the paper's protocols (``protocol=None``), or of one stand-in
  ``protocol`` (then NOT COMPARABLE, and without the paper's numbers).
  """
  if protocol is None:
    runs = [r for r in runs if matches(r, PAPER_IMAGE) or matches(r, PAPER_TEXT)]
    title = "Ablation: Ginger clip (rho) and block (paper protocols)"
    paper_columns = SAME_SETTINGS
    paper_text = (
      "paper = the paper's Ginger number at the same model (or XSUM setting) and tau; the "
      "paper does not name its variant (the authors' code clips with rho=1, per tensor). "
    )
  else:
    runs = [r for r in runs if matches(r, protocol)]
    title = "Ablation: Ginger clip (rho) and block, " + _not_comparable(
      protocol, "the paper's Ginger numbers"
    )
    paper_columns, paper_text = NO_PAPER, ""
  columns = group_columns("", ablation_metrics("cifar100"), paper_columns)
  caption = (
    "Ginger ablation: element-wise clip rho (no clip: rho = none) and curvature block "
    "(per_tensor / global), at the lr and gamma named. " + paper_text + "Acc / R-L = best "
    "val. accuracy (%) or ROUGE-L; Step s = median step time; "
    + MEMORY_CAPTION
    + " "
    + units(paper_columns)
  )
  table = Table("table_ablation", title, caption, "Variant", columns)
  used: list[Run] = []
  notes: list[str] = []
  for base_values, variants in sorted(
    _ablation_groups(runs).items(), key=lambda kv: tuple_key(kv[0])
  ):
    if len(variants) < 2:
      continue
    base = dict(zip(ABLATION_BASE, base_values, strict=True))
    label = " ".join(str(base[k]) for k in ("dataset", "model", "setting", "length") if base[k])
    label += f" τ={base['tau']} α={base['alpha']}"
    metrics, paper = ablation_metrics(base["dataset"]), _ablation_paper(base)
    for variant, vruns in sorted(variants.items(), key=lambda kv: tuple_key(kv[0])):
      rho, block, lr, gamma = ("none" if v is None else str(v) for v in variant)
      sel = one_configuration(vruns)  # one configuration of the variant (settings, numerics)
      if sel.note:
        notes.append(f"{label}, rho={rho} block={block} lr={lr} gamma={gamma}: {sel.note}")
      clip = "no clip" if rho == "none" else f"ρ={rho}"
      name = f"{clip}, {block}, lr={lr}, γ={gamma}"
      cells = group_cells(sel, metrics, paper, paper_columns)
      table.rows.append(Row(name, cells, section=label))
      used += sel.runs
  if not table.rows:
    table.notes.append("No setting has two or more Ginger variants (rho/block/lr/gamma) yet.")
  return _finish(table, used, notes)


# ----------------------------------------------------------------------------- curvature every K

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
  what = _set_text(dataset, length)
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
  table = Table(
    _set_name("curvature_every", dataset, length),
    title,
    caption,
    "Optimizer",
    [Column("", label) for label in labels],
  )
  models = {k[0] for k in keys}
  adam_ms: dict[Any, float | None] = {}
  used, notes, previous_model = [], [], None
  for key in keys:
    model, optimizer, tau, every = key
    crit = {**protocol, **dict(zip(CURVATURE_EVERY_ROW, key, strict=True))}
    sel = select_runs(mine, crit, (CURVATURE_EVERY_SWEEP,))
    times = [{} if is_shared(r) else _accuracy_times(r, (level,)) or {} for r in sel.runs]
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
    n = len(sel.runs)
    cells = [
      "" if optimizer != "ginger" else str(every),
      ", ".join(str(rfield(r, "seed")) for r in sel.runs),
      fmt_stat(aggregate(r.get("best_val_accuracy") for r in sel.runs), "f2"),
      fmt_stat(aggregate(_finite(t.get("final") for t in times)), "f2"),
      fmt_stat(ms, "f1"),
      fmt_num(ratio, "f2"),
      time_to_target_cell([t.get(str(level), math.nan) for t in times]),
      _times_cell([t.get("to_best") for t in times], n),
    ]
    new_model = bool(table.rows) and model != previous_model
    table.rows.append(Row(label, cells, rule_before=new_model))
    previous_model = model
    used += sel.runs
    if sel.note:
      notes.append(f"{label}, K={every}: {sel.note}.")
  if not table.rows:
    table.notes.append("No completed runs of the curvature_every sweep at this length yet.")
  return _finish(table, used, notes)


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


# ----------------------------------------------------------------------------- comparisons


def _set_name(prefix: str, dataset: str, length: str | None) -> str:
  """ "comparisons_cifar10_30ep": a table's file name for a set of runs."""
  return f"{prefix}_{slug(dataset)}" + (f"_{slug(length)}" if length else "")


def _set_text(dataset: str, length: str | None) -> str:
  """ "CIFAR-10, 30 epochs": a set of runs named in a table's title."""
  return ", ".join(
    str(x) for x in (DATASET_NAMES.get(dataset, dataset), length and length_text(length)) if x
  )


QNG_CONTROL_SWEEP = "qng_control"
CLIPPED_PER_TENSOR = {"rho": 1.0, "block": "per_tensor"}


def _accuracies(sel: Selection) -> list[float]:
  return [float(r["best_val_accuracy"]) for r in sel.runs if is_number(r.get("best_val_accuracy"))]


def _sample_text(values: Sequence[float]) -> str:
  return f"{fmt_stat(aggregate(values), 'f2')} (n={len(values)})"


ComparisonPair = tuple[str, str, Selection, Selection]  # (family, label, a, b)


def _comparison_pairs(runs: Sequence[Run], protocol: dict[str, Any]) -> list[ComparisonPair]:
  """(family, label, a, b) for every comparison of best validation accuracy that
  REPRODUCTION.md makes on one model: each Ginger tau against Adam, Momentum and QNG at that
  tau; QNG against Adam; Momentum against Adam; the pairs of taus of Ginger and of QNG; the clip
  control (QNG with Ginger's clip and blocks) where it has runs; the ablation; and each alpha
  of Tables 3/4 against the paper's alpha at the same tau. A family is the set of comparisons
  one sentence reads together (e.g. Ginger - Adam at every tau): Holm's correction runs over it."""
  table1 = TABLE_SWEEPS["table1"]

  def cell(optimizer: str, tau: Any = None, sweeps: Sequence[str] = table1, **extra) -> Selection:
    return select_runs(runs, {**cell_criteria(optimizer, tau, **protocol), **extra}, sweeps)

  adam, momentum = cell("adam"), cell("momentum")
  found = _found(runs, **protocol)
  taus = sorted({t for o, t in found if o == "ginger" and t is not None}, key=sort_key)
  qng_taus = sorted({t for o, t in found if o == "qng" and t is not None}, key=sort_key)
  pairs = []
  for tau in taus:
    ginger, qng = cell("ginger", tau), cell("qng", tau)
    pairs += [
      ("Ginger − Adam over τ", f"Ginger τ={tau} − Adam", ginger, adam),
      ("Ginger − Momentum over τ", f"Ginger τ={tau} − Momentum", ginger, momentum),
      ("Ginger − QNG over τ", f"Ginger τ={tau} − QNG τ={tau}", ginger, qng),
    ]
  for tau in qng_taus:
    pairs.append(("QNG − Adam over τ", f"QNG τ={tau} − Adam", cell("qng", tau), adam))
  pairs.append(("Momentum − Adam", "Momentum − Adam", momentum, adam))
  for name, optimizer, opt_taus in (("Ginger", "ginger", taus), ("QNG", "qng", qng_taus)):
    for low, high in itertools.combinations(opt_taus, 2):
      label = f"{name} τ={high} − τ={low}"
      pairs.append((f"{name} τ pairs", label, cell(optimizer, high), cell(optimizer, low)))
  pairs += _control_pairs(cell, taus)
  pairs += _curvature_every_pairs(runs, protocol)
  pairs += _ablation_pairs(runs, protocol, adam)
  sensitivity = TABLE_SWEEPS["table3"]
  for alpha in SENSITIVITY_ALPHAS:
    for tau in SENSITIVITY_TAUS:
      if alpha == PAPER_ALPHA:
        continue
      base = {**protocol, "optimizer": "ginger", "tau": tau}
      a = select_runs(runs, {**base, "alpha": alpha}, sensitivity)
      b = select_runs(runs, {**base, "alpha": PAPER_ALPHA}, sensitivity)
      family = f"α − {PAPER_ALPHA} over α and τ"
      pairs.append((family, f"Ginger α={alpha} − α={PAPER_ALPHA}, τ={tau}", a, b))
  return pairs + newcomer_pairs(cell, found)


def newcomer_family(arm: tuple[str, Any]) -> str:
  """ "newcomers − Adam": the family of every optimizer compared with ``arm``."""
  return f"newcomers − {optimizer_label(*arm)}"


def newcomer_pairs(
  cell: Callable[..., Selection], found: set[tuple[str, Any]]
) -> list[ComparisonPair]:
  """The comparisons the registry asks for (``registry.Optimizer.compared_with``: Adam and
  Ginger τ=8 for every optimizer beyond the paper's): for each arm, every optimizer compared
  with it that has runs, one Holm family per arm (:func:`newcomer_family`)."""
  arms = dict.fromkeys(arm for n in registry.table_order() for arm in registry.get(n).arms)
  have = {o for o, _tau in found}
  pairs = []
  for arm in arms:
    reference = cell(*arm)
    for name in registry.compared(arm):
      if name in have:
        label = f"{registry.display_name(name)} − {optimizer_label(*arm)}"
        pairs.append((newcomer_family(arm), label, cell(name), reference))
  return pairs


def _control_pairs(cell: Callable[..., Selection], taus: Sequence[Any]) -> list[ComparisonPair]:
  """The clip control's comparisons (one family): at each tau where QNG with Ginger's clip and
  blocks has runs, Ginger against it and it against unclipped QNG."""
  pairs = []
  for tau in taus:
    control = cell("qng", tau, (QNG_CONTROL_SWEEP,), **CLIPPED_PER_TENSOR)
    control.runs = [r for r in control.runs if rfield(r, "sweep") == QNG_CONTROL_SWEEP]
    if control.runs:
      pairs += [
        ("clip control", f"Ginger τ={tau} − QNG τ={tau} clipped", cell("ginger", tau), control),
        ("clip control", f"QNG τ={tau} clipped − QNG τ={tau}", control, cell("qng", tau)),
      ]
  return pairs


def _curvature_every_pairs(runs: Sequence[Run], protocol: dict[str, Any]) -> list[ComparisonPair]:
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


def _variant_text(rho: Any, block: Any, lr: Any = None) -> str:
  """ "ρ=1 per-tensor", "no clip global": an ablation variant in a comparison's label, with its
  ``lr`` where one is given."""
  clip = "no clip" if rho is None else f"ρ={rho:g}"
  return f"{clip} {str(block).replace('_', '-')}" + ("" if lr is None else f" lr={lr:g}")


def _cells_of(cells: dict[tuple, Any], rho: Any, block: Any) -> list:
  """The cells of one clip and block, whatever their lr and gamma."""
  return [cell for key, cell in cells.items() if key[:2] == (rho, block)]


def _ablation_pairs(
  runs: Sequence[Run], protocol: dict[str, Any], adam: Selection
) -> list[ComparisonPair]:
  """The ablation's comparisons at each tau (and alpha) where Ginger has variants: every
  variant against the authors' (clip rho = 1, per-tensor blocks) and against Adam, and the
  unclipped variants' blocks against each other. A variant's cell is its ablation row's: one
  per (clip, block, lr, gamma), named by its lr where its clip and block ran at several."""
  pairs = []
  for base, variants in sorted(
    _ablation_groups(r for r in runs if matches(r, protocol)).items(),
    key=lambda kv: tuple_key(kv[0]),
  ):
    if len(variants) < 2:
      continue
    setting = dict(zip(ABLATION_BASE, base, strict=True))
    where = f"τ={setting['tau']}"  # and the alpha where not the paper's: one label per setting
    where += f" α={setting['alpha']}" if setting["alpha"] not in (PAPER_ALPHA, None) else ""
    configs = collections.Counter((rho, block) for rho, block, _lr, _gamma in variants)
    cells: dict[tuple, tuple[str, Selection]] = {}  # (rho, block, lr, gamma) -> (text, runs)
    for (rho, block, lr, gamma), vruns in sorted(variants.items(), key=lambda kv: tuple_key(kv[0])):
      text = _variant_text(rho, block, lr if configs[(rho, block)] > 1 else None)
      cells[(rho, block, lr, gamma)] = (text, one_configuration(vruns))
    authors = (CLIPPED_PER_TENSOR["rho"], CLIPPED_PER_TENSOR["block"])
    references = _cells_of(cells, *authors)
    for key, (text, cell) in cells.items():
      if key[:2] == authors:
        continue
      for reference_text, reference in references:
        label = f"Ginger {where} {text} − {reference_text}"
        pairs.append((f"ablation {where}", label, cell, reference))
      pairs.append((f"ablation {where}", f"Ginger {where} {text} − Adam", cell, adam))
    free = (_cells_of(cells, None, "global"), _cells_of(cells, None, "per_tensor"))
    for free_global, free_tensor in itertools.product(*free):
      label = f"Ginger {where} {free_global[0]} − {free_tensor[0]}"
      pairs.append((f"ablation {where}", label, free_global[1], free_tensor[1]))
  return pairs


def build_comparisons(
  runs: Sequence[Run], dataset: str, models: Sequence[str], length: str | None = None
) -> Table:
  """Every comparison the results make, with its Welch 95 % interval and its reading after
  Holm's correction over its family (results/stats.py): one row per (model, comparison) that
  has runs on both sides."""
  protocol = image_protocol(dataset, length)
  caption = (
    "Best validation accuracy (%): A and B as mean ± sample std (n seeds); A − B = difference "
    "of means [Welch 95 % interval, uncorrected]; reading: above / below where that interval "
    "excludes 0, tie where it contains 0, n < 2 where a side has one run (no interval). Family "
    "(m): the comparisons of one model read together (e.g. Ginger − Adam at every τ), m of "
    "them tested; p (Holm): Welch's p-value adjusted by Holm's step-down procedure over the "
    "family, which keeps the chance of any false above / below in the family at 5 %; reading "
    "(Holm): above / below where it is below 0.05. A sentence about a family uses the Holm "
    "reading. A cell pools the runs of one resolved configuration (the cell of Tables 1 and 3 "
    "it comes from; a rerun of a seed replaces the earlier run), on any card: accuracy does "
    "not depend on the card's kind."
  )
  labels = ("A", "B", "A − B [95 % CI]", "Reading", "Family (m)", "p (Holm)", "Reading (Holm)")
  table = Table(
    _set_name("comparisons", dataset, length),
    f"Comparisons with 95 % intervals, Holm-corrected by family: {_set_text(dataset, length)}",
    caption,
    "Comparison",
    [Column("", label) for label in labels],
  )
  used = []
  for model in models:
    rows, model_runs = _comparison_rows(runs, {**protocol, "model": model})
    prefix = f"{MODEL_NAMES.get(model, model)}: " if len(models) > 1 else ""
    for k, (label, cells) in enumerate(rows):
      table.rows.append(Row(prefix + label, cells, rule_before=k == 0 and bool(table.rows)))
    used += [r for r in model_runs if r not in used]
  return _finish(table, used, [])


def _comparison_rows(
  runs: Sequence[Run], protocol: dict[str, Any]
) -> tuple[list[tuple[str, list[str]]], list[Run]]:
  """(label, cells) of one model's comparisons with runs on both sides, in order, the Holm
  columns computed over each family's comparisons; and the runs they use."""
  tested, used = [], []
  for family, label, a, b in _comparison_pairs(runs, protocol):
    va, vb = _accuracies(a), _accuracies(b)
    if va and vb:
      tested.append((family, label, va, vb, stats.welch(va, vb)))
      used += [r for r in a.runs + b.runs if r not in used]
  by_family: dict[str, list[int]] = collections.defaultdict(list)
  for k, (family, *_rest) in enumerate(tested):
    by_family[family].append(k)
  holm: dict[int, tuple[float | None, str, int]] = {}
  for ks in by_family.values():
    diffs = [tested[k][4] for k in ks]
    m = sum(d.p is not None for d in diffs)
    for k, p, reading in zip(
      ks, stats.holm([d.p for d in diffs]), stats.holm_verdicts(diffs), strict=True
    ):
      holm[k] = (p, reading, m)
  out = []
  for k, (family, label, va, vb, diff) in enumerate(tested):
    p, reading, m = holm[k]
    cells = [_sample_text(va), _sample_text(vb), diff.text(), diff.verdict]
    cells += [f"{family} ({m})", "" if p is None else _p_text(p), reading]
    out.append((label, cells))
  return out, used


def _p_text(p: float) -> str:
  """A p-value to two significant digits, "< 0.0001" below that."""
  return "< 0.0001" if p < 1e-4 else f"{p:.2g}"


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
  what = _set_text(dataset, length)
  caption = (
    "Mean over the logged steps (every log_every-th step) of the share of update entries with "
    "|u| >= rho, u = G^{-1} m the preconditioned update before the learning rate: the entries "
    "the clip to [-rho, rho] changes, or, for a run without the clip, those the authors' clip "
    "(rho = 1) would change."
  )
  table = Table(
    _set_name("clip_fraction", dataset, length),
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
    if rfield(run, "curvature_every") not in (1, None):
      label += f", K={rfield(run, 'curvature_every')}"
    table.rows.append(Row(f"{label}, {rfield(run, 'block')} ({rfield(run, 'sweep')})", cells))
  return _finish(table, logged, [])


CLIP_ROW = ("optimizer", "tau", "rho", "block", "alpha", "curvature_every", "sweep", "seed")


def comparison_tables(runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table): the comparisons and the clip-fraction table of every image set."""
  done = tabulated(runs)
  out = []
  sets = {(rfield(r, "dataset"), rfield(r, "length")) for r in done if rfield(r, "setting") is None}
  for dataset, length in sorted(sets, key=tuple_key):
    protocol = image_protocol(dataset, length)
    models = _models_in([r for r in done if matches(r, protocol)])
    table = build_comparisons(runs, dataset, models, length)
    if table.rows:
      out.append((table.name, table))
    clip = build_clip_fraction(runs, dataset, length)
    if clip.rows:
      out.append((clip.name, clip))
  return out


def build_all(
  runs: Sequence[Run],
  dataset: str = "cifar100",
  flops: str = "analytic",
  models: Sequence[str] = ("resnet18", "resnet50"),
  length: str | None = None,
) -> list[Table]:
  """The paper's five tables for one image protocol; Tables 3/4 use the first of ``models``."""
  return [
    build_table1(runs, dataset, models=models, flops=flops, length=length),
    build_table2(runs, flops=flops),
    build_table3(runs, dataset, models[0], length),
    build_table4(runs, dataset, models[0], length),
    build_ablation(runs),
  ]


def tabulated(runs: Iterable[Run]) -> list[Run]:
  return [r for r in runs if is_done(r) and rfield(r, "sweep") not in EXCLUDED_SWEEPS]


def _models_in(runs: Iterable[Run]) -> list[str]:
  """The models of `runs`, the paper's first (ResNet-18, ResNet-50), then by name."""
  found = {rfield(r, "model") for r in runs} - {None}
  paper = [m for m in ("resnet18", "resnet50") if m in found]
  return paper + sorted(found - set(paper))


def standin_tables(runs: Sequence[Run], flops: str = "analytic") -> list[tuple[str, Table]]:
  """(file name, table) for every set of runs outside the paper's protocols.

  Image runs are grouped by (dataset, run length), XSUM-style runs (those with a fine-tuning
  setting) by (model, run length); each set gets Tables 1, 3, 4 (images) or Table 2 (text), and
  the ablation where one of its settings has two or more Ginger variants, named
  ``<table>_<dataset or model>_<length>``.
  """
  done = tabulated(runs)
  out: list[tuple[str, Table]] = []
  images = {
    (rfield(r, "dataset"), rfield(r, "length"))
    for r in done
    if rfield(r, "setting") is None and not matches(r, PAPER_IMAGE)
  }
  for dataset, length in sorted(images, key=tuple_key):
    protocol = {"dataset": dataset, "length": length}
    members = [r for r in done if matches(r, protocol) and rfield(r, "setting") is None]
    models = _models_in(members)
    suffix = f"_{slug(dataset)}_{slug(length)}"
    out += [
      ("table1" + suffix, build_table1(runs, dataset, models, flops, length)),
      ("table3" + suffix, build_table3(runs, dataset, models[0], length)),
      ("table4" + suffix, build_table4(runs, dataset, models[0], length)),
    ]
    out += _ablation_if_any(build_ablation(runs, protocol), suffix)
  texts = {
    (rfield(r, "model"), rfield(r, "length"))
    for r in done
    if rfield(r, "setting") is not None and not matches(r, PAPER_TEXT)
  }
  for model, length in sorted(texts, key=tuple_key):
    suffix = f"_{slug(model)}_{slug(length)}"
    protocol = {"model": model, "length": length}
    out += [
      ("table2" + suffix, build_table2(runs, flops, model, length)),
    ]
    out += _ablation_if_any(build_ablation(runs, protocol), suffix)
  return out


def _ablation_if_any(table: Table, suffix: str) -> list[tuple[str, Table]]:
  """A stand-in set's ablation table, unless none of its settings has two Ginger variants."""
  return [("table_ablation" + suffix, table)] if table.rows else []


def slug(value: Any) -> str:
  """A file-name-safe form of a dataset, model or length: "t5-small-random" -> "t5_small_random"."""
  return re.sub(r"[^A-Za-z0-9]+", "_", str(value)).strip("_")


# ----------------------------------------------------------------------------- rendering


MAX_COLUMNS = 12  # columns of a rendered table, its row labels included


def blocks(table: Table) -> list[tuple[str, Table]]:
  """The tables ``table`` is shown as, each with its heading ("" for a table shown whole).

  One per row section (the ablation's base settings) and column section (Table 1's models,
  Table 2's settings), in order; a section wider than :data:`MAX_COLUMNS` is split by its
  columns' parts (accuracy and loss, cost), the columns of no part (n) in each.
  """
  row_sections = list(dict.fromkeys(r.section for r in table.rows)) or [""]
  col_sections = list(dict.fromkeys(c.section for c in table.columns)) or [""]
  out = []
  for row_section in row_sections:
    rows = [r for r in table.rows if r.section == row_section]
    for col_section in col_sections:
      shown = [i for i, c in enumerate(table.columns) if c.section == col_section]
      parts = [("", shown)]
      if 1 + len(shown) > MAX_COLUMNS:
        names = dict.fromkeys(table.columns[i].part for i in shown if table.columns[i].part)
        parts = [(p, [i for i in shown if table.columns[i].part in ("", p)]) for p in names]
      for part, index in parts:
        heading = ": ".join(x for x in (row_section, col_section, part) if x)
        heading = heading[:1].upper() + heading[1:] if heading == part else heading
        block = Table(
          table.name,
          table.title,
          table.caption,
          table.row_header,
          [table.columns[i] for i in index],
          [
            Row(r.label, [r.cells[i] for i in index], r.rule_before and j > 0, r.section)
            for j, r in enumerate(rows)
          ],
        )
        out.append((heading, block))
  return out


def _md_cell(text: str) -> str:
  return text.replace("|", "\\|")


def to_markdown(table: Table) -> str:
  """GitHub pipe tables (:func:`blocks`, each under its heading) with title, caption and
  notes; headers read "<group> <label>"."""
  lines = [f"## {table.title}", "", table.caption]
  for heading, block in blocks(table):
    lines += ["", f"### {heading}", ""] if heading else [""]
    headers = [block.row_header] + [c.header() for c in block.columns]
    lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
    lines.append("|---|" + "---:|" * len(block.columns))
    for row in block.rows:
      lines.append("| " + " | ".join(_md_cell(c) for c in [row.label, *row.cells]) + " |")
  if table.notes:
    lines.append("")
    lines += [f"- {note}" for note in table.notes]
  return "\n".join(lines) + "\n"


LATEX_CHARS = {
  "\\": r"\textbackslash{}",
  "&": r"\&",
  "%": r"\%",
  "$": r"\$",
  "#": r"\#",
  "_": r"\_",
  "{": r"\{",
  "}": r"\}",
  "~": r"\textasciitilde{}",
  "^": r"\textasciicircum{}",
  "±": r"$\pm$",
  "Δ": r"$\Delta$",
  "τ": r"$\tau$",
  "α": r"$\alpha$",
  "ρ": r"$\rho$",
  "γ": r"$\gamma$",
  "×": r"$\times$",
}


def latex_escape(text: str) -> str:
  """Escape LaTeX specials and turn the few Greek/math characters we use into math."""
  return "".join(LATEX_CHARS.get(ch, ch) for ch in text)


def _spans(columns: Sequence[Column], key: Callable[[Column], Any]) -> list[tuple[Any, int, int]]:
  """(key, first, last) LaTeX column numbers (1-based, after the label column) of each run of
  consecutive columns with the same key."""
  spans: list[tuple[Any, int, int]] = []
  for i, col in enumerate(columns, start=2):
    if spans and spans[-1][0] == key(col):
      spans[-1] = (spans[-1][0], spans[-1][1], i)
    else:
      spans.append((key(col), i, i))
  return spans


def _span_row(spans: list[tuple[Any, int, int]], text: Callable[[Any], str]) -> list[str]:
  """A header row of multicolumns over `spans`, then the cmidrules under the named ones."""
  cells = [""] + [
    rf"\multicolumn{{{b - a + 1}}}{{c}}{{{latex_escape(text(k))}}}" if text(k) else ""
    for k, a, b in spans
  ]
  rules = " ".join(rf"\cmidrule(lr){{{a}-{b}}}" for k, a, b in spans if text(k) and b > a)
  return ["    " + " & ".join(cells) + r" \\"] + (["    " + rules] if rules else [])


def _latex_header(table: Table) -> list[str]:
  """Up to three header rows: groups, metrics (over ours/paper/Δ), then the sub-labels."""
  lines = []
  cols = table.columns
  if any(c.group for c in cols):
    lines += _span_row(_spans(cols, lambda c: c.group), str)
  has_subs = any(c.sub for c in cols)
  if has_subs:
    lines += _span_row(
      _spans(cols, lambda c: (c.group, c.label) if c.sub else id(c)),
      lambda k: k[1] if isinstance(k, tuple) else "",
    )
  labels = [table.row_header] + [c.sub or c.label for c in cols]  # n etc. on the last row
  lines.append("    " + " & ".join(latex_escape(x) for x in labels) + r" \\")
  return lines


def _caption_title(table: Table) -> str:
  """The title without its "Table N: " prefix (LaTeX numbers the caption itself)."""
  return re.sub(r"^Table \d+:\s*", "", table.title)


LABEL_CHARS = {"τ": "tau", "α": "alpha", "ρ": "rho", "γ": "gamma"}


def _latex_label(table: Table, heading: str) -> str:
  """tab:repro-<name>[-<heading>], letters, digits and dashes only."""
  text = "".join(LABEL_CHARS.get(ch, ch) for ch in f"{table.name} {heading}")
  return "tab:repro-" + slug(text).replace("_", "-").lower()


def to_latex(table: Table) -> str:
  """Booktabs table* environments (need booktabs and graphicx), one per :func:`blocks`, laid
  out like the paper's tables."""
  lines = ["% Generated by `python -m results.tables`; do not edit by hand."]
  for heading, block in blocks(table):
    title = _caption_title(table) + (f". {heading}" if heading else "")
    lines += [
      r"\begin{table*}[t]",
      r"  \centering",
      r"  \small",
      f"  \\caption{{{latex_escape(title)}. {latex_escape(table.caption)}}}",
      f"  \\label{{{_latex_label(table, heading)}}}",
      r"  \resizebox{\textwidth}{!}{%",
      r"  \begin{tabular}{l" + "r" * len(block.columns) + "}",
      r"    \toprule",
      *_latex_header(block),
      r"    \midrule",
    ]
    for row in block.rows:
      if row.rule_before:
        lines.append(r"    \midrule")
      cells = [row.label, *row.cells]
      lines.append("    " + " & ".join(latex_escape(c) for c in cells) + r" \\")
    lines += [r"    \bottomrule", r"  \end{tabular}}", r"\end{table*}"]
  lines += [f"% {note}" for note in table.notes]
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """Command-line options."""
  parser = argparse.ArgumentParser(
    prog="python -m results.tables",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("roots", nargs="*", help="dirs to scan (default: outputs multirun)")
  parser.add_argument(
    "--out", default=DEFAULT_OUT, help=f"where to write the tables (default: {DEFAULT_OUT})"
  )
  parser.add_argument(
    "--standin-only",
    action="store_true",
    help="write only the stand-in tables found (not the paper's, which would be blank)",
  )
  parser.add_argument(
    "--dataset",
    default=None,
    help="write only Tables 1, 3, 4 of this dataset (with --length, of that run length), "
    "named table<N>_<dataset>[_<length>]",
  )
  parser.add_argument("--length", default=None, help="with --dataset: e.g. 30ep or 450steps")
  parser.add_argument(
    "--models",
    nargs="+",
    default=None,
    help="with --dataset: models of Table 1's column groups; Tables 3/4 use the first "
    "(default: the models found)",
  )
  parser.add_argument(
    "--flops",
    choices=FLOPS_SOURCES,
    default="analytic",
    help="which FLOP count of summary.json to report",
  )
  return parser.parse_args(argv)


def run_report(roots: Sequence[str], runs: Sequence[Run]) -> str:
  """One line: how many run dirs were found, used and skipped (and why)."""
  dirs = find_run_dirs(roots)
  status: dict[str, int] = {}
  for run in runs:
    key = "completed" if is_done(run) else str(run.get("status"))
    status[key] = status.get(key, 0) + 1
  parts = [f"{n} {k}" for k, n in sorted(status.items())]
  parts.append(f"{len(dirs) - len(runs)} without a usable summary.json (skipped)")
  used = {str(run.get("path")) for run in runs}
  skipped = [f"\n  skipped {d}: {skip_reason(d)}" for d in dirs if str(d) not in used]
  return f"{len(dirs)} run dirs under {', '.join(roots)}: " + ", ".join(parts) + "".join(skipped)


def tables_to_write(args: argparse.Namespace, runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table) pairs that the command line asks for."""
  if args.dataset is not None:
    protocol = image_protocol(args.dataset, args.length)
    members = [r for r in tabulated(runs) if matches(r, protocol)]
    models = args.models or _models_in(members) or ["resnet18", "resnet50"]
    suffix = "".join(f"_{slug(x)}" for x in (args.dataset, args.length) if x)
    return [
      ("table1" + suffix, build_table1(runs, args.dataset, models, args.flops, args.length)),
      ("table3" + suffix, build_table3(runs, args.dataset, models[0], args.length)),
      ("table4" + suffix, build_table4(runs, args.dataset, models[0], args.length)),
    ]
  paper = [] if args.standin_only else [(t.name, t) for t in build_all(runs, flops=args.flops)]
  tables = paper + standin_tables(runs, args.flops) + curvature_every_tables(runs)
  return tables + comparison_tables(runs)


def main(argv: Sequence[str] | None = None) -> int:
  """Scan the roots, build the tables and write <out>/<name>.md and .tex."""
  args = parse_args(argv)
  if error := missing_roots(args.roots):
    print(f"error: {error}", file=sys.stderr)
    return 2
  roots = args.roots or list(DEFAULT_ROOTS)
  try:
    runs = collect_runs(roots)
  except (DamagedRecordError, records.ArchiveError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(run_report(roots, runs), file=sys.stderr)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for name, table in tables_to_write(args, runs):
    (out / f"{name}.md").write_text(to_markdown(table))
    (out / f"{name}.tex").write_text(to_latex(table))
    print(f"wrote {out / name}.md and .tex", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
