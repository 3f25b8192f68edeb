"""A table ready to render (every cell already text), and what tables of every kind share: the
optimizer's label, the notes on the runs used, the names and titles of a set of runs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from results.metrics import Metric, PaperColumns, is_shared, metric_cells
from results.runs import Run, length_text
from results.selection import Selection
from training import registry

# Where tables of your own runs go by default: beside the source, ignored by git (.gitignore);
# the committed campaign's are written with --out results/cifar10 (make tables).
DEFAULT_OUT = "results/local"
DATASET_NAMES = {"cifar100": "CIFAR-100", "cifar10": "CIFAR-10", "xsum": "XSUM"}
MODEL_NAMES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}
# Table 2's settings, in its order, with their names in tables.
SETTING_NAMES = {"lora": "LoRA", "full": "Full"}


@dataclass
class Column:
  """A column: group (tau in Tables 3/4; "" for none), metric label, sub-label ("ours",
  "paper", "Δ"; "" for columns that are not one of a metric's), the section it is shown in
  (model, setting; "" for none: see :func:`results.render.blocks`) and the part of a too wide
  section it goes to ("" for every part, like n)."""

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
  is shown in ("" for none: see :func:`results.render.blocks`)."""

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
      ("device", device_name(run)),
      ("jax", _jax(run)),
      ("git", commit_name(run)),
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


def commit_name(run: Run) -> str:
  """The run's code commit, its first 10 hex digits ("?" where unrecorded)."""
  return str(run.get("git_commit") or "?")[:10]


def device_name(run: Run) -> str:
  """The run's device as summary.json names it ("NVIDIA H200"; "?" where unrecorded)."""
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


def finish(table: Table, used: list[Run], notes: list[str]) -> Table:
  """Attach the cell notes and the provenance note."""
  table.notes += notes
  note = provenance_note(used)
  table.notes.append(note or "No completed runs found: all our cells are blank.")
  return table


def not_comparable(protocol: dict[str, Any], paper_text: str) -> str:
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


def set_name(prefix: str, dataset: str, length: str | None) -> str:
  """ "comparisons_cifar10_30ep": a table's file name for a set of runs."""
  return f"{prefix}_{slug(dataset)}" + (f"_{slug(length)}" if length else "")


def set_text(dataset: str, length: str | None) -> str:
  """ "CIFAR-10, 30 epochs": a set of runs named in a table's title."""
  return ", ".join(
    str(x) for x in (DATASET_NAMES.get(dataset, dataset), length and length_text(length)) if x
  )


def slug(value: Any) -> str:
  """A file-name-safe form of a dataset, model or length: "t5-small-random" -> "t5_small_random"."""
  return re.sub(r"[^A-Za-z0-9]+", "_", str(value)).strip("_")
