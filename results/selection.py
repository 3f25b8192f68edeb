"""Which runs fill a table cell, and which row of the paper's numbers stands beside them.

A cell's runs are the completed runs matching its criteria ({run field: value or tuple of
values}), one configuration of them (the one with the most seeds), one run per seed; the paper's
row is looked up in ``results/paper/<name>.csv``. The paper's protocols (:data:`PAPER_IMAGE`,
:data:`PAPER_TEXT`) decide which runs may fill the paper's own tables.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results.runs import Run, is_done, is_number, rfield
from training import registry

PAPER_DIR = Path(__file__).resolve().parent / "paper"


TAUS = (1, 2, 4, 8, 16, 32)
SENSITIVITY_ALPHAS = (0.9, 0.99, 0.999)
SENSITIVITY_TAUS = (2, 4, 8)
PAPER_ALPHA = 0.99  # the paper's "second moment" for all optimizers
# Never in a paper table: lr_tune's candidates, the studies beyond the paper, which have their
# own tables (curvature_every: build_curvature_every; recipe: warm-up, cosine decay and weight
# decay), and steptime's short runs alone, which only time their configurations (step_key).
EXCLUDED_SWEEPS = frozenset({"lr_tune", "curvature_every", "recipe", "steptime"})
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
  "fisher_forward",  # the d-pass's forward: eval (the authors' images) or shared
  "fisher_batch",  # the d-pass on the batch's first m examples (None: the whole batch)
  "batchnorm",
  "batchnorm_groups",
  "precision",
  "state_dtype",
  "settings",
  "optimizer_options",  # an optimizer's own keys set away from its YAML (run_record.OPTIONS)
  "recipe",  # the lr schedule and weight decay away from the paper's (run_record.RECIPE)
)
# The paper's protocols: only runs matching one fill the paper's tables.
PAPER_IMAGE = {"dataset": "cifar100", "length": "200ep"}
PAPER_TEXT = {"dataset": "xsum", "model": "t5-small", "length": "1ep"}
# The sweeps whose runs a table's cells prefer (select_runs).
TABLE_SWEEPS = {
  "table1": ("table1",),
  "table2": ("table2",),
  "table3": ("table3", "table4", "table34"),
  "table4": ("table3", "table4", "table34"),
}


def same_value(a: Any, b: Any) -> bool:
  """Equality that treats 0.99 and 0.9900000001 (or 4 and 4.0) as the same value."""
  if is_number(a) and is_number(b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
  return a == b


def _accepts(value: Any, want: Any) -> bool:
  """`want` is one allowed value, or a tuple of them."""
  options = want if isinstance(want, tuple) else (want,)
  return any(same_value(value, w) for w in options)


def sort_key(value: Any) -> tuple[int, Any]:
  """Sorts numbers, then strings, then None."""
  if is_number(value):
    return (0, value)
  return (2, "") if value is None else (1, str(value))


def config_key(run: Run) -> tuple:
  """The run's hyperparameters (everything but the seed), hashable (a mapping as its sorted
  items)."""
  return tuple(_hashable(rfield(run, k)) for k in CONFIG_KEYS)


def step_key(run: Run) -> tuple:
  """:func:`config_key` without what leaves a training step's program and cost as they are: the
  run's length and its evaluation spacing. Runs with one step key time each other's steps (a
  short run alone of the steptime sweep times a 30-epoch cell whose runs shared a GPU)."""
  settings = rfield(run, "settings")
  if isinstance(settings, str):
    settings = json.dumps({k: v for k, v in json.loads(settings).items() if k != "eval_every"})
  return tuple(
    _hashable(settings if k == "settings" else rfield(run, k)) for k in CONFIG_KEYS if k != "length"
  )


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
  default = [r for r in pool if is_default_variant(r, criteria)]
  fallback = None
  if pool and not default:  # every run left is a non-default variant of one optimizer
    want = default_variant(rfield(pool[0], "optimizer"), rfield(pool[0], "dataset"))
    fallback = (
      "no run of the default variant (" + ", ".join(f"{k}={v}" for k, v in want.items()) + ")"
    )
  pool = default or pool
  if fallback and pool:
    used = _describe(pool[0], list(want))
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


def default_variant(optimizer: str, dataset: str | None = None) -> dict[str, Any]:
  """The run fields of `optimizer`'s default variant: DEFAULT_VARIANT's, float32 numerics
  (compute, and the curvature state where there is one), and for the methods with a d-pass the
  paper's curvature (:func:`paper_curvature`: every step, the whole batch, the paper's forward)."""
  variant = {**DEFAULT_VARIANT.get(optimizer, {}), "precision": "float32"}
  if registry.keeps_curvature(optimizer):
    variant["state_dtype"] = "float32"
    variant.update(paper_curvature(dataset))
  return variant


CURVATURE_FIELDS = ("curvature_every", "fisher_forward", "fisher_batch")


def paper_curvature(dataset: str | None) -> dict[str, Any]:
  """The paper's curvature schedule and d-pass: every step, over the whole batch, with a forward
  of its own in evaluation mode on the image datasets (the authors' code: BatchNorm with its
  running statistics) and sharing the training forward on the text one (no BatchNorm)."""
  forward = "shared" if dataset == PAPER_TEXT["dataset"] else "eval"
  return dict(zip(CURVATURE_FIELDS, (1, forward, None), strict=True))


def is_default_variant(run: Run, fixed: Iterable[str] = ()) -> bool:
  """Whether `run` is its optimizer's default variant (:func:`default_variant`) in the fields
  other than ``fixed`` (those a cell's criteria already set). A record without one of the
  curvature fields ran the paper's (they were added with their alternatives)."""
  want = default_variant(rfield(run, "optimizer"), rfield(run, "dataset"))
  return all(
    rfield(run, k) == v or (k in CURVATURE_FIELDS and rfield(run, k) is None)
    for k, v in want.items()
    if k not in fixed
  )


def paper_dpass(run: Run) -> bool:
  """Whether `run` computed its curvature as the paper does (:func:`paper_curvature`)."""
  want = paper_curvature(rfield(run, "dataset"))
  return all(rfield(run, k) in (v, None) for k, v in want.items())


def dpass_text(forward: str | None, batch: int | None, dataset: str | None) -> str:
  """ "shared forward, first 32 examples": how a d-pass differs from the paper's on ``dataset``
  (:func:`paper_curvature`); "" for the paper's."""
  parts = [] if forward in (paper_curvature(dataset)["fisher_forward"], None) else [forward]
  parts = [f"{p} forward" for p in parts] + ([f"first {batch} examples"] if batch else [])
  return ", ".join(parts)


def curvature_text(run: Run) -> str:
  """The run's curvature schedule and d-pass where they are not the paper's
  (:func:`paper_curvature`): ", K=8, d-pass shared forward"; "" for the paper's."""
  every = rfield(run, "curvature_every")
  text = f", K={every}" if every not in (1, None) else ""
  what = dpass_text(*(rfield(run, k) for k in ("fisher_forward", "fisher_batch", "dataset")))
  return text + (f", d-pass {what}" if what else "")


# A comparison of two cells (results/comparisons.py): (family, label, a, b).
ComparisonPair = tuple[str, str, Selection, Selection]


def matches(run: Run, criteria: dict[str, Any]) -> bool:
  return all(_accepts(rfield(run, k), v) for k, v in criteria.items())


def tuple_key(values: tuple) -> tuple:
  return tuple(sort_key(v) for v in values)


def cell_criteria(optimizer: str, tau: Any, **base: Any) -> dict[str, Any]:
  """Cell criteria; the curvature methods must use the paper's alpha (or leave it unset)."""
  crit = dict(base, optimizer=optimizer)
  if tau is not None:
    crit.update(tau=tau, alpha=(PAPER_ALPHA, None))
  return crit


def table1_cell(runs: Iterable[Run], optimizer: str, tau: Any = None, **base: Any) -> Selection:
  """The runs filling ``optimizer``'s cell (at ``tau``) of a Table 1 over the runs matching
  ``base`` (the protocol: dataset, length, model): :func:`select_runs` with
  :func:`cell_criteria`, the table1 sweep's runs preferred."""
  return select_runs(runs, cell_criteria(optimizer, tau, **base), TABLE_SWEEPS["table1"])


def found_optimizers(runs: Iterable[Run], **base: Any) -> set[tuple[str, Any]]:
  """(optimizer, tau) pairs among runs that some cell of a table with `base` would use."""
  return {
    (rfield(r, "optimizer"), rfield(r, "tau"))
    for r in runs
    if is_done(r)
    and rfield(r, "sweep") not in EXCLUDED_SWEEPS
    and all(_accepts(rfield(r, k), v) for k, v in base.items())
    and (rfield(r, "tau") is None or _accepts(rfield(r, "alpha"), (PAPER_ALPHA, None)))
  }


def image_protocol(dataset: str = "cifar100", length: str | None = None) -> dict[str, Any]:
  """Criteria of an image-table set: the dataset and run length (the paper's length for the
  paper's dataset when not given; any length otherwise)."""
  if length is None and dataset == PAPER_IMAGE["dataset"]:
    length = PAPER_IMAGE["length"]
  return {"dataset": dataset} | ({"length": length} if length is not None else {})


def comparable(protocol: dict[str, Any], paper: dict[str, Any]) -> bool:
  return all(protocol.get(k) == v for k, v in paper.items())


def text_protocol(model: str = "t5-small", length: str | None = "1ep") -> dict[str, Any]:
  """Criteria of a Table 2 set: XSUM, the model (by name) and the run length."""
  return {"dataset": "xsum", "model": model} | ({"length": length} if length is not None else {})


def tabulated(runs: Iterable[Run]) -> list[Run]:
  return [r for r in runs if is_done(r) and rfield(r, "sweep") not in EXCLUDED_SWEEPS]


def models_in(runs: Iterable[Run]) -> list[str]:
  """The models of `runs`, the paper's first (ResNet-18, ResNet-50), then by name."""
  found = {rfield(r, "model") for r in runs} - {None}
  paper = [m for m in ("resnet18", "resnet50") if m in found]
  return paper + sorted(found - set(paper))


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
    if all(same_value(_parse(row.get(k, "")), v) for k, v in keys.items()):
      return row
  return None
