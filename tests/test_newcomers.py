"""results.newcomers: the table of today's optimizers, from the committed records."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from results import newcomers
from results.runs import collect_runs, rfield

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "cifar10" / "runs"


def newton_schulz(m: int, n: int) -> int:
  """One iteration on an m x n matrix, m <= n: 4 m^2 n + 2 m^3 FLOPs."""
  m, n = sorted((m, n))
  return 4 * m * m * n + 2 * m**3


# ResNet-18's hidden matrices as Muon sees them (kh kw in, out): each stage's 3x3 filters and
# the 1x1 shortcut of stages 2-4; the first convolution and the head are AdamW's.
RESNET18_MATRICES = (
  [(576, 64)] * 4
  + [(576, 128), (64, 128)]
  + [(1152, 128)] * 3
  + [(1152, 256), (128, 256)]
  + [(2304, 256)] * 3
  + [(2304, 512), (256, 512)]
  + [(4608, 512)] * 3
)


@pytest.fixture(scope="module")
def runs():
  return collect_runs([COMMITTED])


def test_step_flops_are_the_records_own_and_muons_newton_schulz(runs):
  """Counted again from each record's config, a step's FLOPs are what the run recorded for
  every optimizer whose update count is unchanged (Adam, Momentum, QNG, Ginger); Muon's add
  ns_steps Newton-Schulz iterations on each of ResNet-18's hidden matrices to the element-wise
  count its older records hold (its newer records count them already)."""
  seen = set()
  for run in runs:
    if rfield(run, "model") != "resnet18" or rfield(run, "sweep") != "table1":
      continue
    recorded, counted = run["flops_per_iter"]["analytic"], newcomers.step_flops(run)
    optimizer = rfield(run, "optimizer")
    seen.add(optimizer)
    if optimizer == "muon":
      steps = run["config"]["optimizer"]["ns_steps"]
      extra = steps * sum(newton_schulz(m, n) for m, n in RESNET18_MATRICES)
      older = counted - recorded == pytest.approx(extra, rel=1e-12)
      assert older or math.isclose(counted, recorded, rel_tol=1e-12), run["path"]
    else:
      assert math.isclose(counted, recorded, rel_tol=1e-12), run["path"]
  assert {"adam", "momentum", "qng", "ginger", "muon", "soap"} <= seen


def tables_of(runs) -> dict:
  return dict(newcomers.newcomer_tables(runs))


def test_the_table_of_todays_optimizers(runs):
  tables = tables_of(runs)
  assert list(tables) == [
    "newcomers_cifar10_30ep",
    "newcomers_cifar10_30ep_resnet50",
    "newcomers_t5_small_random_2ep_full",
  ]
  table = tables["newcomers_cifar10_30ep"]
  rows = {r.label: r.cells for r in table.rows}
  assert list(rows)[:2] == ["Adam", "Ginger (τ=8)"] and "Muon" in rows
  n, acc, adam, _, adam_holm, ginger, _, ginger_holm = rows["Muon"][:8]
  assert n == "9" and acc.startswith("88.99")
  assert adam.startswith("+1.02 [") and ginger.startswith("+0.87 [")
  assert adam_holm in ("above", "tie", "below") and ginger_holm in ("above", "tie", "below")
  assert rows["Adam"][2:8] == [""] * 6  # an arm is not compared with itself
  assert rows["SF-AdamW"][:2] == ["9", "89.09 ± 0.20"]
  assert rows["SOAP"][:2] == ["4", "89.04 ± 0.24"]
  assert rows["K-FAC"][:2] == ["3", "89.18 ± 0.22"]
  assert not any("no completed runs" in note for note in table.notes)
  # a registered optimizer without runs of the set is named, not silently left out
  without_kfac = [r for r in runs if rfield(r, "optimizer") != "kfac"]
  table = tables_of(without_kfac)["newcomers_cifar10_30ep"]
  assert "K-FAC" not in {r.label for r in table.rows}
  assert any("no completed runs" in note and "K-FAC" in note for note in table.notes)
  # ResNet-50: Muon and schedule-free AdamW at their own tuned lrs, two seeds each
  resnet50 = tables_of(runs)["newcomers_cifar10_30ep_resnet50"]
  rows = {r.label: r.cells for r in resnet50.rows}
  assert list(rows) == ["Adam", "Ginger (τ=8)", "Muon", "SF-AdamW"]
  assert rows["Muon"][:2] == ["2", "88.82 ± 0.35"] and rows["SF-AdamW"][:2] == ["2", "89.08 ± 0.06"]
  assert any("SOAP, K-FAC" in note for note in resnet50.notes)


def test_each_difference_has_its_familys_simultaneous_interval(runs):
  """Beside Welch's 95 % interval, each difference has the family's simultaneous one
  (Bonferroni: each of the family's m comparisons at 1 - 0.05 / m, so that all m cover their
  true differences together with probability >= 95 %), computed here from scipy's t with
  Welch's degrees of freedom; it holds the uncorrected interval."""
  from scipy import stats as sps

  from results import selection

  table = tables_of(runs)["newcomers_cifar10_30ep"]
  heads = [f"{c.group} {c.label}".strip() for c in table.columns]
  rows = {r.label: dict(zip(heads, r.cells, strict=True)) for r in table.rows}
  protocol = {**selection.image_protocol("cifar10", "30ep"), "model": "resnet18"}

  def accuracies(optimizer, tau=None):
    sel = selection.table1_cell(runs, optimizer, tau, **protocol)
    return np.array([r["best_val_accuracy"] for r in sel.runs])

  newcomer_rows = {
    "Muon": "muon",
    "SF-AdamW": "schedule_free_adamw",
    "SOAP": "soap",
    "K-FAC": "kfac",
  }
  m = len(newcomer_rows)  # every newcomer has two runs or more: the whole family is tested
  for arm, (optimizer, tau) in {"Adam": ("adam", None), "Ginger (τ=8)": ("ginger", 8)}.items():
    b = accuracies(optimizer, tau)
    assert rows["Adam"][f"− {arm} [simultaneous 95 %]"] == ""
    for label, name in newcomer_rows.items():
      a = accuracies(name)
      va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
      df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
      half = sps.t.ppf(1 - 0.05 / (2 * m), df) * math.sqrt(va + vb)
      delta = a.mean() - b.mean()
      expected = f"[{delta - half:+.2f}, {delta + half:+.2f}]"
      assert rows[label][f"− {arm} [simultaneous 95 %]"] == expected, (label, arm)
      low, high = (float(x) for x in expected.strip("[]").split(", "))
      welch = rows[label][f"− {arm} [95 % CI]"].split("[")[1].rstrip("]").split(", ")
      assert low <= float(welch[0]) and float(welch[1]) <= high


def test_the_table_times_each_optimizer_to_the_profiles_targets(runs):
  """Per target of the performance profiles: the median over seeds of each seed's steps to the
  target times its configuration's step alone (misses infinite), with reached / seeds, as
  results.profiles counts them; and its reading against Adam (the exact rank test, misses
  counted, Holm over the table's optimizers). Adam's own reading is blank."""
  from results import profiles, selection, stats

  table = tables_of(runs)["newcomers_cifar10_30ep"]
  heads = [f"{c.group} {c.label}".strip() for c in table.columns]
  rows = {r.label: dict(zip(heads, r.cells, strict=True)) for r in table.rows}
  protocol = {**selection.image_protocol("cifar10", "30ep"), "model": "resnet18"}
  for target in profiles.TARGETS:
    time_head, reading_head = f"s to {target:g} %", f"s to {target:g} % − Adam, Holm"
    adam_runs = selection.table1_cell(runs, "adam", **protocol).runs
    adam = profiles.seed_times(adam_runs, target, profiles.alone_step_time(adam_runs, runs))
    assert rows["Adam"][reading_head] == ""
    for label, optimizer, tau in (("Muon", "muon", None), ("Ginger (τ=8)", "ginger", 8)):
      sel = selection.table1_cell(runs, optimizer, tau, **protocol)
      times = profiles.seed_times(sel.runs, target, profiles.alone_step_time(sel.runs, runs))
      median = stats.median_time(times)
      reached = sum(math.isfinite(t) for t in times)
      shown = f"{median:.0f}" if math.isfinite(median) else "not reached"
      assert rows[label][time_head] == f"{shown} ({reached}/{len(times)})"
      assert rows[label][reading_head] in ("faster", "slower", "tie")
      if reached == 0 and all(math.isfinite(t) for t in adam):
        assert rows[label][reading_head] != "faster"


def test_the_t5_table_reads_the_lowest_validation_loss_and_the_step_time_sweep(runs):
  """The T5 stand-in's full fine-tuning: each row's lowest validation loss over its evaluations
  (mean ± std over seeds), compared with Adam's by Welch (below: a lower loss), its times to the
  profiles' losses as the profile counts them, its step from the step-time sweep's run alone
  and the FLOPs its runs recorded; K-FAC, which cannot run T5, named; at three seeds a side the
  rank test cannot read faster or slower, and the notes say so."""
  from scipy import stats as sps

  from results import profiles, selection

  table = tables_of(runs)["newcomers_t5_small_random_2ep_full"]
  heads = [c.header() for c in table.columns]
  rows = {r.label: dict(zip(heads, r.cells, strict=True)) for r in table.rows}
  assert list(rows) == ["Adam", "Ginger (τ=8)", "Muon", "SF-AdamW", "SOAP"]
  workload = profiles.text_workload("t5-small-random", "2ep")
  assert workload.targets == (6.0, 4.5)

  def lowest(optimizer, tau=None):
    criteria = selection.cell_criteria(optimizer, tau, **workload.criteria)
    sel = selection.select_runs(runs, criteria, ("table2",))
    out = []
    for run in sel.runs:
      evals = profiles.eval_series(run, workload)["value"]
      assert evals.min() <= run["val_loss"] + 1e-12  # the summary's is at the best ROUGE-L
      out.append(evals.min())
    return np.array(out), sel.runs

  adam, _ = lowest("adam")
  muon, muon_runs = lowest("muon")
  assert (
    len(muon) == 3 and rows["Muon"]["Val loss"] == f"{muon.mean():.2f} ± {muon.std(ddof=1):.2f}"
  )
  welch = sps.ttest_ind(muon, adam, equal_var=False).confidence_interval(0.95)
  delta = muon.mean() - adam.mean()
  expected = f"{delta:+.2f} [{welch.low:+.2f}, {welch.high:+.2f}]"
  assert rows["Muon"]["− Adam [95 % CI]"] == expected
  assert rows["Muon"]["− Adam Holm"] == ("below" if welch.high < 0 else "tie")

  timing = profiles.workload_times(runs, "cifar10", "30ep")
  for level, target in enumerate(workload.targets):
    seconds = timing.times[level]["T5 stand-in"]["SF-AdamW"]
    cell = rows["SF-AdamW"][f"s to loss {target:g}"]
    assert cell == f"{profiles.seconds_text(seconds)} (3/3)"
    assert rows["Muon"][f"s to loss {target:g} − Adam, Holm"] == "tie"

  steptime = [
    r for r in runs if rfield(r, "sweep") == "steptime" and rfield(r, "model") == "t5-small-random"
  ]
  [muon_alone] = [r for r in steptime if rfield(r, "optimizer") == "muon"]
  assert rows["Muon"]["Step ms"] == f"{muon_alone['step_time_s'] * 1e3:.2f}"
  assert rows["Muon"]["GFLOPs/step"] == f"{muon_runs[0]['flops_per_iter']['analytic'] * 1e-9:.1f}"
  assert any("K-FAC cannot run this model" in note for note in table.notes)
  assert any("smallest two-sided p is 0.10" in note for note in table.notes)


def test_a_text_set_without_the_profiles_targets_has_no_time_columns(runs):
  """LoRA on the stand-in is no workload of the profiles: its table has the validation loss and
  the cost only, and a step timed on another device than Adam's is said not to compare."""
  table = newcomers.build_text_newcomers(runs, "t5-small-random", "2ep", "lora")
  assert table.name == "newcomers_t5_small_random_2ep_lora"
  assert table.title == "t5-small-random: today's optimizers (XSUM, 2 epochs, LoRA)"
  heads = [c.header() for c in table.columns]
  assert "Val loss" in heads and "Step ms" in heads
  assert not any(h.startswith("s to ") for h in heads)
  assert [r.label for r in table.rows] == ["Adam", "Ginger (τ=8)"]
  assert any(n.endswith("step time does not compare with Adam's.") for n in table.notes)


def test_the_final_figure_is_each_runs_last_evaluation_compared_as_the_best_is(runs):
  """Beside the best evaluation (the highest of ~30 on the scored split, which reads higher the
  noisier a curve), each row has its final one: the last evaluation, at the end of training
  (mean ± std over seeds), with Welch's interval against each arm and Holm's reading over the
  family; on T5 the final validation loss."""
  from scipy import stats as sps

  from results import profiles, selection

  def last(run, workload):
    series = profiles.eval_series(run, workload)
    return float(series["value"][np.argmax(series["step"])])

  image = profiles.image_workload("cifar10", "resnet18", "30ep")
  text = profiles.text_workload("t5-small-random", "2ep")
  protocol = {**selection.image_protocol("cifar10", "30ep"), "model": "resnet18"}
  cases = (
    ("newcomers_cifar10_30ep", "Final acc", image, "Muon", "muon", ("table1",)),
    (
      "newcomers_t5_small_random_2ep_full",
      "Final loss",
      text,
      "SF-AdamW",
      "schedule_free_adamw",
      ("table2",),
    ),
  )
  for name, head, workload, label, optimizer, sweeps in cases:
    table = tables_of(runs)[name]
    heads = [c.header() for c in table.columns]
    assert len(set(heads)) == len(heads)
    rows = {r.label: dict(zip(heads, r.cells, strict=True)) for r in table.rows}
    if workload is image:
      sel = selection.table1_cell(runs, optimizer, None, **protocol)
      base = selection.table1_cell(runs, "adam", None, **protocol)
    else:
      sel = selection.select_runs(
        runs, selection.cell_criteria(optimizer, None, **text.criteria), sweeps
      )
      base = selection.select_runs(
        runs, selection.cell_criteria("adam", None, **text.criteria), sweeps
      )
    a = np.array([last(r, workload) for r in sel.runs])
    b = np.array([last(r, workload) for r in base.runs])
    assert rows[label][head] == f"{a.mean():.2f} ± {a.std(ddof=1):.2f}"
    welch = sps.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    expected = f"{a.mean() - b.mean():+.2f} [{welch.low:+.2f}, {welch.high:+.2f}]"
    assert rows[label]["final − Adam [95 % CI]"] == expected
    assert rows[label]["final − Adam Holm"] in ("above", "tie", "below")
    assert rows["Adam"]["final − Adam [95 % CI]"] == ""
  # on T5 every run's lowest loss is its last (the loss still falls at 2 epochs): a note says
  # the final part repeats the first; on ResNet-18 it does not
  repeats = "Every run's best evaluation is its last: the final part repeats the first."
  assert repeats in tables_of(runs)["newcomers_t5_small_random_2ep_full"].notes
  assert repeats not in tables_of(runs)["newcomers_cifar10_30ep"].notes
  # the best of an image run's evaluations is never below its last
  for run in selection.table1_cell(runs, "muon", None, **protocol).runs:
    assert run["best_val_accuracy"] >= last(run, image) - 1e-9


def test_the_rank_test_floor_note_counts_holms_family():
  """The note that no time can read appears where every target's family, after Holm, cannot
  reach 5 %: four seeds against four read at 0.029 alone but not among three optimizers; five
  against five can; a family without tests says nothing."""
  assert newcomers.rank_test_floor_notes([[(4, 4)]], "Adam") == []
  (note,) = newcomers.rank_test_floor_notes([[(4, 4)] * 3, [(4, 4)] * 3], "Adam")
  assert note.startswith("At 4 against 4 seeds the exact rank test's smallest two-sided p is 0.03")
  assert "0.09 after Holm over 3 optimizers" in note and "than Adam's" in note
  assert newcomers.rank_test_floor_notes([[(5, 5)] * 3], "Adam") == []
  (note,) = newcomers.rank_test_floor_notes([[(2, 3), (3, 3), (2, 3)]], "Adam")
  assert "2 against 3 and 3 against 3 seeds" in note and "0.20 and 0.10" in note
  assert newcomers.rank_test_floor_notes([[], []], "Adam") == []
