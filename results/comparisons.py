"""Every comparison of best validation accuracy the results make, with its Welch 95 % interval,
its reading after Holm's correction over its family and the family's simultaneous 95 % interval
(Bonferroni; results/stats.py); the same comparisons on the final accuracy (each run's last
evaluation)."""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from results import stats
from results.ablation import CLIPPED_PER_TENSOR, ablation_pairs
from results.metrics import aggregate, fmt_stat
from results.runs import Run, is_number, length_text, rfield
from results.selection import (
  PAPER_ALPHA,
  SENSITIVITY_ALPHAS,
  SENSITIVITY_TAUS,
  TABLE_SWEEPS,
  ComparisonPair,
  Selection,
  cell_criteria,
  found_optimizers,
  image_protocol,
  matches,
  models_in,
  select_runs,
  sort_key,
  tabulated,
  text_protocol,
  tuple_key,
)
from results.series import last_value, read_series
from results.studies import build_clip_fraction, curvature_every_pairs, dpass_pairs
from results.table_model import (
  MODEL_NAMES,
  SETTING_NAMES,
  Column,
  Row,
  Table,
  finish,
  optimizer_label,
  set_name,
  set_text,
  slug,
)
from training import registry

QNG_CONTROL_SWEEP = "qng_control"


def accuracies(sel: Selection) -> list[float]:
  return [float(r["best_val_accuracy"]) for r in sel.runs if is_number(r.get("best_val_accuracy"))]


def final_accuracies() -> Callable[[Selection], list[float]]:
  """A cell's final accuracies: each run's last evaluation (the end of its training), every
  run's evaluations read once however many comparisons its cell is in."""

  @functools.cache
  def last(path: str) -> float | None:
    return last_value(read_series(path, spectrum=False, eval_metric="val_accuracy").eval)

  def values(sel: Selection) -> list[float]:
    return [v for v in (last(r["path"]) for r in sel.runs) if v is not None]

  return values


def min_losses(sel: Selection) -> list[float]:
  return [float(r["min_train_loss"]) for r in sel.runs if is_number(r.get("min_train_loss"))]


def _sample_text(values: Sequence[float]) -> str:
  return f"{fmt_stat(aggregate(values), 'f2')} (n={len(values)})"


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
  found = found_optimizers(runs, **protocol)
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
  pairs += curvature_every_pairs(runs, protocol)
  pairs += dpass_pairs(runs, protocol)
  pairs += ablation_pairs(runs, protocol, adam)
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


COMPARISON_LABELS = (
  "A",
  "B",
  "A − B [95 % CI]",
  "Reading",
  "Family (m)",
  "p (Holm)",
  "Reading (Holm)",
  "Simultaneous 95 %",
)


def build_comparisons(
  runs: Sequence[Run], dataset: str, models: Sequence[str], length: str | None = None
) -> Table:
  """Every comparison the results make, with its Welch 95 % interval and its reading after
  Holm's correction over its family (results/stats.py): one row per (model, comparison) that
  has runs on both sides."""
  what = "Best validation accuracy (%)"
  return _build_comparisons(runs, dataset, models, length, what, accuracies)


def build_final_comparisons(
  runs: Sequence[Run], dataset: str, models: Sequence[str], length: str | None = None
) -> Table:
  """:func:`build_comparisons` on the final accuracy, each run's last evaluation: the best of
  a run's ~30 evaluations of the scored split reads higher than its last, the more so the
  noisier its curve, so a comparison that holds at both does not rest on that choice."""
  what = "Final validation accuracy (%; each run's last evaluation, at the end of its training)"
  return _build_comparisons(
    runs, dataset, models, length, what, final_accuracies(), "comparisons_final", "final"
  )


def _build_comparisons(
  runs: Sequence[Run],
  dataset: str,
  models: Sequence[str],
  length: str | None,
  what: str,
  values: Callable[[Selection], list[float]],
  prefix: str = "comparisons",
  figure: str = "",
) -> Table:
  """The comparisons table of ``values`` (``what``, in its caption), named ``prefix``_<set>;
  a ``figure`` other than the best accuracy ("final") ends its title."""
  protocol = image_protocol(dataset, length)
  caption = (
    f"{what}: A and B as mean ± sample std (n seeds); A − B = difference "
    "of means [Welch 95 % interval, uncorrected]; reading: above / below where that interval "
    "excludes 0, tie where it contains 0, n < 2 where a side has one run (no interval). Family "
    "(m): the comparisons of one model read together (e.g. Ginger − Adam at every τ), m of "
    "them tested; p (Holm): Welch's p-value adjusted by Holm's step-down procedure over the "
    "family, which keeps the chance of any false above / below in the family at 5 %; reading "
    "(Holm): above / below where it is below 0.05. A sentence about a family uses the Holm "
    "reading. Simultaneous 95 %: A − B's interval at 1 − 0.05 / m (Bonferroni), so that the "
    "family's m intervals cover their differences together with probability at least 95 % "
    "(Holm, the more powerful, can read above or below where it still holds 0). A cell pools "
    "the runs of one resolved configuration (the cell of Tables 1 and 3 "
    "it comes from; a rerun of a seed replaces the earlier run), on any card: accuracy does "
    "not depend on the card's kind."
  )
  title = f"Comparisons with 95 % intervals, Holm-corrected by family: {set_text(dataset, length)}"
  if figure:
    title += f" ({figure} validation accuracy)"
  name = set_name(prefix, dataset, length)
  table = Table(name, title, caption, "Comparison", [])
  pairs = _by_model(models, lambda m: _comparison_pairs(runs, {**protocol, "model": m}))
  return _fill(table, pairs, values)


def _by_model(models: Sequence[str], pairs_of) -> list[tuple[str, list[ComparisonPair]]]:
  """(section name, comparisons) per model: ``pairs_of(model)``, named by the model where
  there are several."""
  return [(MODEL_NAMES.get(m, m) if len(models) > 1 else "", pairs_of(m)) for m in models]


def _fill(
  table: Table,
  sections: Sequence[tuple[str, Sequence[ComparisonPair]]],
  values: Callable[[Selection], list[float]] = accuracies,
) -> Table:
  """``table`` with :data:`COMPARISON_LABELS`' columns and, per (name, comparisons) section,
  the rows of :func:`_comparison_rows` over ``values``, labelled "<name>: " where named."""
  table.columns = [Column("", label) for label in COMPARISON_LABELS]
  used = []
  for name, pairs in sections:
    rows, section_runs = _comparison_rows(pairs, values)
    prefix = f"{name}: " if name else ""
    for k, (label, cells) in enumerate(rows):
      table.rows.append(Row(prefix + label, cells, rule_before=k == 0 and bool(table.rows)))
    used += [r for r in section_runs if r not in used]
  return finish(table, used, [])


def _comparison_rows(
  pairs: Sequence[ComparisonPair], values: Callable[[Selection], list[float]] = accuracies
) -> tuple[list[tuple[str, list[str]]], list[Run]]:
  """(label, cells) of the comparisons with runs on both sides, in order, the Holm and
  simultaneous columns computed over each family's comparisons of ``values`` (best accuracy by
  default); and the runs they use."""
  tested, used = [], []
  by_family: dict[str, list[int]] = collections.defaultdict(list)
  for family, label, a, b in pairs:
    va, vb = values(a), values(b)
    if va and vb:
      by_family[family].append(len(tested))
      tested.append((family, label, va, vb))
      used += [r for r in a.runs + b.runs if r not in used]
  read: dict[int, stats.FamilyComparison] = {}
  for ks in by_family.values():
    samples = [(tested[k][2], tested[k][3]) for k in ks]
    read.update(zip(ks, stats.read_family(samples), strict=True))
  out = []
  for k, (family, label, va, vb) in enumerate(tested):
    c = read[k]
    cells = [_sample_text(va), _sample_text(vb), c.welch.text(), c.welch.verdict]
    cells += [f"{family} ({c.m})", "" if c.p_holm is None else _p_text(c.p_holm), c.reading]
    out.append((label, [*cells, c.simultaneous.interval_text()]))
  return out, used


def _p_text(p: float) -> str:
  """A p-value to two significant digits, "< 0.0001" below that."""
  return "< 0.0001" if p < 1e-4 else f"{p:.2g}"


def comparison_tables(runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table): the comparisons, the d-pass study and the clip-fraction table of every
  image set, and the training-loss comparisons of every XSUM set
  (:func:`loss_comparison_tables`)."""
  done = tabulated(runs)
  out = []
  sets = {(rfield(r, "dataset"), rfield(r, "length")) for r in done if rfield(r, "setting") is None}
  for dataset, length in sorted(sets, key=tuple_key):
    protocol = image_protocol(dataset, length)
    models = models_in([r for r in done if matches(r, protocol)])
    for build in (build_comparisons, build_final_comparisons):
      table = build(runs, dataset, models, length)
      if table.rows:
        out.append((table.name, table))
    dpass = build_dpass(runs, dataset, length)
    if dpass.rows:
      out.append((dpass.name, dpass))
    clip = build_clip_fraction(runs, dataset, length)
    if clip.rows:
      out.append((clip.name, clip))
  return out + loss_comparison_tables(runs)


def build_dpass(runs: Sequence[Run], dataset: str, length: str | None = None) -> Table:
  """Ginger's d-pass with the shared training forward or on part of the batch against the
  paper's d-pass (:func:`results.studies.dpass_pairs`), every model of the set, as the
  comparisons table shows them."""
  protocol = image_protocol(dataset, length)
  what = set_text(dataset, length)
  caption = (
    "Best validation accuracy (%) of Ginger with another d-pass (A) and with the paper's (B: "
    "over the whole batch, with a forward of its own in evaluation mode, the authors' code) at "
    "the same tau and curvature_every K: mean ± sample std (n seeds), A − B [Welch 95 % "
    "interval], the reading after Holm's correction over the family and the family's "
    "simultaneous interval (as the comparisons table). The runs shared a GPU: their step "
    "times are in docs/benchmarks.md "
    "(bench.train_step, each run alone)."
  )
  title = f"Ginger's d-pass: the shared forward and part of the batch, {what} - beyond the paper"
  table = Table(set_name("dpass", dataset, length), title, caption, "Comparison", [])
  models = models_in([r for r in tabulated(runs) if matches(r, protocol)])
  return _fill(table, _by_model(models, lambda m: dpass_pairs(runs, {**protocol, "model": m})))


def _loss_pairs(runs: Sequence[Run], protocol: dict[str, Any]) -> list[ComparisonPair]:
  """Table 2's comparisons of one setting: each Ginger tau against Adam, and each pair of taus
  (the paper: a larger tau lowers the training loss in full fine-tuning), one family each."""
  sweeps = TABLE_SWEEPS["table2"]

  def cell(optimizer: str, tau: Any = None) -> Selection:
    return select_runs(runs, cell_criteria(optimizer, tau, **protocol), sweeps)

  name = SETTING_NAMES[protocol["setting"]]
  found = found_optimizers(runs, **protocol)
  taus = sorted({t for o, t in found if o == "ginger" and t is not None}, key=sort_key)
  adam = cell("adam")
  pairs = [
    (f"Ginger − Adam over τ, {name}", f"Ginger τ={tau} − Adam", cell("ginger", tau), adam)
    for tau in taus
  ]
  for low, high in itertools.combinations(taus, 2):
    label = f"Ginger τ={high} − τ={low}"
    pairs.append((f"Ginger τ pairs, {name}", label, cell("ginger", high), cell("ginger", low)))
  return pairs


def loss_comparison_tables(runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table): per XSUM set of runs (model, length), the minimum training loss
  compared as :func:`_loss_pairs` says, per setting, Welch and Holm as the image comparisons;
  only a set where some family has a test (two runs a side)."""
  done = [r for r in tabulated(runs) if rfield(r, "setting") is not None]
  out = []
  for model, length in sorted(
    {(rfield(r, "model"), rfield(r, "length")) for r in done}, key=tuple_key
  ):
    protocol = text_protocol(model, length)
    caption = (
      "Minimum training loss (lower is better): A and B as mean ± sample std (n seeds); A − B "
      "[Welch 95 % interval, uncorrected]; reading: below (A's loss lower) / above where that "
      "interval excludes 0, tie where it contains 0, n < 2 where a side has one run. Family "
      "(m), p (Holm) and the simultaneous interval as in the image comparisons: over each "
      "setting's Ginger − Adam comparisons and over its pairs of taus."
    )
    title = (
      f"Training loss compared, Holm-corrected by family: XSUM, {model}, {length_text(length)}"
    )
    table = Table(f"comparisons_{slug(model)}_{slug(length)}", title, caption, "Comparison", [])
    sections = [
      (name, _loss_pairs(runs, {**protocol, "setting": setting}))
      for setting, name in SETTING_NAMES.items()
    ]
    table = _fill(table, sections, min_losses)
    holm = COMPARISON_LABELS.index("p (Holm)")
    if any(row.cells[holm] for row in table.rows):  # some comparison had two runs a side
      out.append((table.name, table))
  return out
