"""The paper's Tables 1-4 from our runs (and the same tables for every set of runs outside the
paper's protocols, titled NOT COMPARABLE): rows optimizer (and tau), or alpha by tau."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from results.ablation import build_ablation
from results.metrics import (
  MEMORY_CAPTION,
  SAME_SETTINGS,
  Metric,
  PaperColumns,
  image_metrics,
  metric_cells,
  paper_beside,
  summary_number,
  units,
  xsum_metrics,
)
from results.runs import Run, rfield
from results.selection import (
  PAPER_IMAGE,
  PAPER_TEXT,
  SENSITIVITY_ALPHAS,
  SENSITIVITY_TAUS,
  TABLE_SWEEPS,
  TAUS,
  cell_criteria,
  comparable,
  found_optimizers,
  image_protocol,
  load_paper,
  matches,
  models_in,
  paper_row,
  select_runs,
  sort_key,
  tabulated,
  text_protocol,
  tuple_key,
)
from results.table_model import (
  MODEL_NAMES,
  SETTING_NAMES,
  Row,
  Table,
  finish,
  group_cells,
  group_columns,
  not_comparable,
  optimizer_label,
  slug,
)
from training import registry

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
    found |= found_optimizers(runs, **base)
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
  return finish(table, used, notes)


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
    title = "Table 1: " + not_comparable(protocol, "CIFAR-100, 200 epochs")
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


def build_table2(
  runs: Sequence[Run], flops: str = "analytic", model: str = "t5-small", length: str | None = "1ep"
) -> Table:
  """Table 2: XSUM, one row per optimizer (and tau), column groups LoRA and Full."""
  protocol = text_protocol(model, length)
  metrics = xsum_metrics(flops)
  groups = [(name, {**protocol, "setting": setting}) for setting, name in SETTING_NAMES.items()]
  title = "Table 2: XSUM, pretrained t5-small, 1 epoch (paper Table 2)"
  paper_columns = SAME_SETTINGS
  if not comparable(protocol, PAPER_TEXT):
    title = "Table 2: " + not_comparable(protocol, "XSUM, pretrained t5-small, 1 epoch")
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
    title = f"Table {number}: Ginger sensitivity, {what}, " + not_comparable(
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
  return finish(table, used, notes)


def build_table3(
  runs: Sequence[Run], dataset: str = "cifar100", model: str = "resnet18", length: str | None = None
) -> Table:
  """Table 3 (paper: "Validation accuracy"): best val accuracy over alpha x tau."""
  metric = Metric("Acc", summary_number("best_val_accuracy"), "val_acc", "f2")
  return _sensitivity(runs, "table3", metric, dataset, model, length)


def build_table4(
  runs: Sequence[Run], dataset: str = "cifar100", model: str = "resnet18", length: str | None = None
) -> Table:
  """Table 4 (paper: "Training loss"): min training loss (x1e-6) over alpha x tau."""
  metric = Metric(
    "Train loss 1e-6", summary_number("min_train_loss", 1e6), "min_train_loss_1e-6", "f2"
  )
  return _sensitivity(runs, "table4", metric, dataset, model, length)


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
    models = models_in(members)
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
