"""The Ginger ablation: its variants (clip rho, curvature block, lr, gamma) side by side at each
base setting, and the comparisons the results make between them."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from results.metrics import (
  COST,
  MEMORY_CAPTION,
  NO_PAPER,
  QUALITY,
  SAME_SETTINGS,
  STEP_MEMORY,
  Metric,
  first_number,
  number_alone,
  primary_number,
  summary_number,
  units,
)
from results.runs import Run, is_done, rfield
from results.selection import (
  EXCLUDED_SWEEPS,
  PAPER_ALPHA,
  PAPER_IMAGE,
  PAPER_TEXT,
  ComparisonPair,
  Selection,
  comparable,
  load_paper,
  matches,
  one_configuration,
  paper_dpass,
  paper_row,
  tuple_key,
)
from results.table_model import Row, Table, finish, group_cells, group_columns, not_comparable

ABLATION_BASE = ("dataset", "model", "setting", "length", "tau", "alpha")
ABLATION_VARIANT = ("rho", "block", "lr", "gamma")


def ablation_metrics(dataset: Any) -> list[Metric]:
  """Ablation columns; paper numbers only where the paper has them (CIFAR-100, XSUM)."""
  image = dataset == "cifar100"
  primary = "acc" if image else ("rougeL" if dataset == "xsum" else None)
  val_loss = first_number("val_loss_at_best", "val_loss")
  train_loss = summary_number("min_train_loss", 1e6)
  return [
    Metric("Acc / R-L", primary_number, primary, "f2", part=QUALITY),
    Metric("Val loss", val_loss, "val_loss" if image else None, "f3", part=QUALITY),
    Metric(
      "Train loss 1e-6", train_loss, "min_train_loss_1e-6" if image else None, "f2", part=QUALITY
    ),
    Metric("Step s", number_alone("step_time_s"), None, "f3", paired=False, part=COST),
    Metric("Mem GB", number_alone("peak_memory_bytes", 1e-9), None, "f2", paired=False, part=COST),
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


def ablation_groups(runs: Iterable[Run]) -> dict[tuple, dict[tuple, list[Run]]]:
  """Completed Ginger runs: base config -> variant (rho, block, lr, gamma) -> runs."""
  groups: dict[tuple, dict[tuple, list[Run]]] = {}
  for run in runs:
    if rfield(run, "optimizer") != "ginger" or not is_done(run):
      continue
    if rfield(run, "sweep") in EXCLUDED_SWEEPS or not paper_dpass(run):
      continue
    base = tuple(rfield(run, k) for k in ABLATION_BASE)
    variant = tuple(rfield(run, k) for k in ABLATION_VARIANT)
    groups.setdefault(base, {}).setdefault(variant, []).append(run)
  return groups


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
    title = "Ablation: Ginger clip (rho) and block, " + not_comparable(
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
    ablation_groups(runs).items(), key=lambda kv: tuple_key(kv[0])
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
  return finish(table, used, notes)


CLIPPED_PER_TENSOR = {"rho": 1.0, "block": "per_tensor"}


def _variant_text(rho: Any, block: Any, lr: Any = None) -> str:
  """ "ρ=1 per-tensor", "no clip global": an ablation variant in a comparison's label, with its
  ``lr`` where one is given."""
  clip = "no clip" if rho is None else f"ρ={rho:g}"
  return f"{clip} {str(block).replace('_', '-')}" + ("" if lr is None else f" lr={lr:g}")


def _cells_of(cells: dict[tuple, Any], rho: Any, block: Any) -> list:
  """The cells of one clip and block, whatever their lr and gamma."""
  return [cell for key, cell in cells.items() if key[:2] == (rho, block)]


def ablation_pairs(
  runs: Sequence[Run], protocol: dict[str, Any], adam: Selection
) -> list[ComparisonPair]:
  """The ablation's comparisons at each tau (and alpha) where Ginger has variants: every
  variant against the authors' (clip rho = 1, per-tensor blocks) and against Adam, and the
  unclipped variants' blocks against each other. A variant's cell is its ablation row's: one
  per (clip, block, lr, gamma), named by its lr where its clip and block ran at several."""
  pairs = []
  for base, variants in sorted(
    ablation_groups(r for r in runs if matches(r, protocol)).items(),
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
