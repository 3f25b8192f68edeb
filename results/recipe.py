"""Does the ranking survive the recipe? Each optimizer of the recipe sweep
(configs/sweep/recipe.yaml) on a stand-in model under both protocols: the paper's (a constant
lr, no weight decay: its Table 1 cell) and the common recipe (warm-up, cosine decay, decoupled
weight decay: the sweep's runs, ``run.recipe`` in their summary.json).

Per optimizer: the best validation accuracy over seeds under each protocol and its rank among
the optimizers by mean (1: best), and the difference recipe − constant with Welch's 95 %
interval and the family's simultaneous one, read after Holm's correction over the optimizers of
the table (one family). A rank
is an order of means, not a test: the comparisons file says which differences its seeds show.
``make tables`` writes ``recipe_<dataset>_<length>.md`` and ``.tex`` once recipe runs exist::

    python -m results.recipe results/cifar10/runs --out results/cifar10
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from results import stats
from results.comparisons import accuracies
from results.metrics import aggregate, fmt_stat
from results.render import tables_command
from results.runs import Run, is_done, rfield
from results.selection import (
  Selection,
  cell_criteria,
  image_protocol,
  matches,
  select_runs,
  table1_cell,
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
from training import registry

SWEEP = "recipe"
FAMILY = "recipe − constant"


def recipe_runs(runs: Sequence[Run]) -> list[Run]:
  """The completed runs of the recipe sweep."""
  return [r for r in runs if is_done(r) and rfield(r, "sweep") == SWEEP]


def arms(runs: Sequence[Run], protocol: dict[str, Any]) -> list[tuple[str, Any]]:
  """The (optimizer, tau) pairs with recipe runs of ``protocol``, in the tables' order."""
  found = {
    (rfield(r, "optimizer"), rfield(r, "tau")) for r in recipe_runs(runs) if matches(r, protocol)
  }
  order = {name: k for k, name in enumerate(registry.table_order())}
  return sorted(found, key=lambda arm: (order.get(arm[0], len(order)), tuple_key(arm)))


def ranks(means: dict[str, float]) -> dict[str, int]:
  """1 for the highest mean, and so on (equal means share the better rank)."""
  ordered = sorted(means.values(), reverse=True)
  return {label: ordered.index(mean) + 1 for label, mean in means.items()}


def build_recipe(runs: Sequence[Run], dataset: str, model: str, length: str | None) -> Table:
  """The table of one (dataset, length, model): see the module."""
  protocol = {**image_protocol(dataset, length), "model": model}
  pool = recipe_runs(runs)
  cells: list[tuple[str, Selection, Selection]] = []
  for optimizer, tau in arms(runs, protocol):
    constant = table1_cell(runs, optimizer, tau, **protocol)
    recipe = select_runs(pool, cell_criteria(optimizer, tau, **protocol), (SWEEP,))
    cells.append((optimizer_label(optimizer, tau), constant, recipe))
  samples = {label: (accuracies(recipe), accuracies(constant)) for label, constant, recipe in cells}
  tested = {label: (r, c) for label, (r, c) in samples.items() if r and c}
  # one family: the table's optimizers, recipe − constant
  compared = dict(zip(tested, stats.read_family(list(tested.values())), strict=True))
  means: dict[str, dict[str, float]] = {"constant": {}, "recipe": {}}
  for label, constant, recipe in cells:
    for side, sel in (("constant", constant), ("recipe", recipe)):
      if values := accuracies(sel):
        means[side][label] = statistics.fmean(values)
  rank = {side: ranks(by_label) for side, by_label in means.items()}
  columns = [
    Column("constant lr", "n"),
    Column("constant lr", "Acc"),
    Column("constant lr", "rank"),
    Column("recipe", "n"),
    Column("recipe", "Acc"),
    Column("recipe", "rank"),
    Column(FAMILY, "[95 % CI]"),
    Column(FAMILY, "[simultaneous 95 %]"),
    Column(FAMILY, "Holm"),
  ]
  table = Table(
    set_name("recipe", dataset, length) + ("" if model == "resnet18" else f"_{model}"),
    f"{MODEL_NAMES.get(model, model)} stand-in: the paper's constant lr against the common "
    f"recipe ({set_text(dataset, length)})",
    _caption(),
    "Optimizer",
    columns,
  )
  used: list[Run] = []
  for label, constant, recipe in cells:
    row = []
    for side, sel in (("constant", constant), ("recipe", recipe)):
      values = accuracies(sel)
      row += [
        str(len(values)) if values else "",
        fmt_stat(aggregate(values), "f2") if values else "",
        str(rank[side][label]) if label in rank[side] else "",
      ]
    if read := compared.get(label):
      row += [read.welch.text(), read.simultaneous.interval_text(), read.reading]
    else:
      row += ["", "", ""]
    table.rows.append(Row(label, row))
    used += [r for r in (*constant.runs, *recipe.runs) if r not in used]
  return finish(table, used, [])


def _caption() -> str:
  return (
    "Best validation accuracy (%), mean ± sample std over seeds (n), under the paper's "
    "protocol (constant lr, no weight decay: the Table 1 cell) and the common recipe "
    "(configs/sweep/recipe.yaml: the same peak lr, 2 epochs of linear warm-up, a cosine decay "
    "to 0 except for schedule-free AdamW, decoupled weight decay as each recipe arm sets it: "
    "lr × weight_decay = 5e-5 a step at the ResNet-18 stand-in's tuned lrs); rank: by mean "
    "among the optimizers of the table (1: best), an order, not a test. recipe − constant: "
    "Welch's 95 % interval (uncorrected) and the family's simultaneous one (Bonferroni, each "
    "at 1 − 0.05 / m); Holm: above / below / tie after Holm's correction over the table's "
    "optimizers (one family); n < 2 where a side has one run."
  )


def recipe_tables(runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table): one per (dataset, length, model) with recipe runs."""
  sets = {
    (rfield(r, "dataset"), rfield(r, "length"), rfield(r, "model")) for r in recipe_runs(runs)
  }
  return [
    (table.name, table)
    for table in (build_recipe(runs, d, m, n) for d, n, m in sorted(sets, key=tuple_key))
  ]


def main(argv: Sequence[str] | None = None) -> int:
  """Scan the roots and write <out>/recipe_<set>.md and .tex."""
  return tables_command("python -m results.recipe", __doc__, recipe_tables, argv)


if __name__ == "__main__":
  sys.exit(main())
