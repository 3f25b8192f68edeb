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


def test_the_table_of_todays_optimizers(runs):
  [(name, table)] = newcomers.newcomer_tables(runs)
  assert name == "newcomers_cifar10_30ep"
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
  [(_, table)] = newcomers.newcomer_tables([r for r in runs if rfield(r, "optimizer") != "kfac"])
  assert "K-FAC" not in {r.label for r in table.rows}
  assert any("no completed runs" in note and "K-FAC" in note for note in table.notes)


def test_each_difference_has_its_familys_simultaneous_interval(runs):
  """Beside Welch's 95 % interval, each difference has the family's simultaneous one
  (Bonferroni: each of the family's m comparisons at 1 - 0.05 / m, so that all m cover their
  true differences together with probability >= 95 %), computed here from scipy's t with
  Welch's degrees of freedom; it holds the uncorrected interval."""
  from scipy import stats as sps

  from results import selection

  [(_, table)] = newcomers.newcomer_tables(runs)
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

  [(_, table)] = newcomers.newcomer_tables(runs)
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
