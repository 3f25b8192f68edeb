"""results.stats.welch against the textbook formula and scipy's own t quantiles."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from results.stats import (
  Difference,
  bonferroni,
  hodges_lehmann,
  holm,
  holm_verdicts,
  median_time,
  race_difference,
  rank_sum_p,
  read_family,
  smallest_holm_rank_sum_p,
  smallest_rank_sum_p,
  time_to_target,
  welch,
)

samples = st.lists(st.floats(80, 95, allow_nan=False), min_size=2, max_size=8).filter(
  lambda xs: np.std(xs) > 1e-6
)


@settings(max_examples=60, deadline=None)
@given(samples, samples)
def test_interval_is_the_welch_satterthwaite_formula(a, b):
  d = welch(a, b)
  va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
  se = math.sqrt(va + vb)
  df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
  half = scipy_stats.t.ppf(0.975, df) * se
  assert d.delta == pytest.approx(np.mean(a) - np.mean(b), abs=1e-9)
  assert d.low == pytest.approx(d.delta - half, rel=1e-6, abs=1e-9)
  assert d.high == pytest.approx(d.delta + half, rel=1e-6, abs=1e-9)


def test_verdicts_and_text():
  assert welch([88.0, 88.2, 88.1], [87.0, 87.1, 86.9]).verdict == "above"
  assert welch([87.0, 87.1, 86.9], [88.0, 88.2, 88.1]).verdict == "below"
  tie = welch([88.0, 87.0, 88.5], [87.9, 88.1, 87.5])
  assert tie.verdict == "tie" and tie.low < 0 < tie.high
  one = welch([88.0], [87.0, 87.5])
  assert one.verdict == "n < 2" and one.text() == "+0.75"
  assert welch([1.0, 2.0], [0.0, 0.5]).text(1).count("[") == 1
  with pytest.raises(ValueError, match="runs on both sides"):
    welch([], [1.0])


# ------------------------------------------------------------------ families and corrections


def _multipletests():
  """statsmodels' multipletests, the reference implementation of Holm's procedure."""
  multitest = pytest.importorskip(
    "statsmodels.stats.multitest",
    reason="statsmodels (the reference for Holm's procedure) is not installed",
  )
  return multitest.multipletests


@pytest.mark.parametrize(
  "p",
  [
    [0.01, 0.04, 0.03, 0.005],
    [0.2, 0.001, 0.049, 0.012, 0.3, 0.0125],
    [0.5],
    [0.01, 0.01, 0.02],  # ties
    [0.9, 0.8, 0.95],  # adjusted values capped at 1
  ],
)
def test_holm_matches_statsmodels(p):
  reject, adjusted, _, _ = _multipletests()(p, alpha=0.05, method="holm")
  np.testing.assert_allclose(holm(p), adjusted, rtol=1e-12)
  d = [Difference(1.0, 0.5, 1.5, 3, 3, x) for x in p]
  assert [v == "above" for v in holm_verdicts(d)] == list(reject)


@settings(max_examples=25, deadline=None)  # statsmodels ~60 ms a call
@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_matches_statsmodels_on_any_family(p):
  _, adjusted, _, _ = _multipletests()(p, alpha=0.05, method="holm")
  np.testing.assert_allclose(holm(p), adjusted, rtol=1e-12, atol=1e-15)


def test_holm_by_hand_and_untested_comparisons():
  """m = 3 tested (None does not count): 0.01 * 3, max(0.03, 0.02 * 2), max(0.04, 0.04 * 1)."""
  assert holm([0.02, None, 0.01, 0.04]) == pytest.approx([0.04, None, 0.03, 0.04])
  assert holm([]) == []
  with pytest.raises(ValueError, match="p-values in"):
    holm([1.5])


def test_holm_turns_a_family_of_marginal_wins_into_ties():
  """Six 95 % intervals just above 0 are six "above" uncorrected; over the family of six,
  Holm keeps only those whose p-value survives m p < 0.05 step by step."""
  rng = np.random.default_rng(0)
  base = rng.normal(87.8, 0.01, 2)
  arms = [base + 0.45 + rng.normal(0, 0.15, 2) for _ in range(6)]
  diffs = [welch(a, base) for a in arms]
  adjusted = holm([d.p for d in diffs])
  for d, p, reading in zip(diffs, adjusted, holm_verdicts(diffs)):
    assert (d.verdict == "above") == (d.p < 0.05)  # interval and p-value agree
    assert reading == ("above" if p < 0.05 else "tie")
  assert holm_verdicts([Difference(1.0, None, None, 1, 3)]) == ["n < 2"]


def test_welch_p_is_scipys_and_dual_to_the_interval():
  a, b = [88.1, 88.3, 87.9, 88.2], [87.6, 87.9, 87.7]
  d = welch(a, b)
  assert d.p == pytest.approx(scipy_stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-12)
  at_p = welch(a, b, confidence=1 - d.p)  # the interval at confidence 1 - p touches 0
  assert at_p.low == pytest.approx(0.0, abs=1e-9)


def test_bonferroni_interval_is_welch_at_one_minus_alpha_over_m():
  a, b, m = [88.1, 88.3, 87.9], [87.6, 87.9, 87.7, 87.5], 6
  d = bonferroni(a, b, m)
  va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
  df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
  half = scipy_stats.t.ppf(1 - 0.05 / (2 * m), df) * math.sqrt(va + vb)
  assert d.low == pytest.approx(d.delta - half, rel=1e-9)
  assert d.high - d.low > welch(a, b).high - welch(a, b).low
  with pytest.raises(ValueError, match="m >= 1"):
    bonferroni(a, b, 0)


def test_a_family_is_read_once_welch_holm_and_bonferroni_over_its_tested_m():
  """Each comparison of a family gets Welch's interval, Holm's adjusted p and reading, and the
  simultaneous interval at 1 - 0.05 / m, m counting only the comparisons with a test (a side
  with one run has none, and no simultaneous interval)."""
  base = [87.9, 88.1, 88.0]
  samples = [([88.6, 88.9, 88.7], base), ([88.0, 88.3], base), ([89.0], base)]
  family = read_family(samples)
  assert [c.m for c in family] == [2, 2, 2]
  diffs = [welch(a, b) for a, b in samples]
  assert [c.welch for c in family] == diffs
  assert [c.p_holm for c in family] == holm([d.p for d in diffs])
  assert [c.reading for c in family] == holm_verdicts(diffs)
  assert family[0].simultaneous == bonferroni(*samples[0], 2)
  assert family[1].simultaneous == bonferroni(*samples[1], 2)
  assert family[2].simultaneous.interval_text() == "" and family[2].reading == "n < 2"
  assert read_family([]) == []


# ------------------------------------------------------------------------ time to a target

INF = math.inf


def test_time_to_target_is_the_first_evaluation_at_the_target_within_the_budget():
  evals = [(10.0, 80.0), (20.0, 85.5), (30.0, 84.0), (40.0, 86.0)]
  assert time_to_target(evals, 85.0) == 20.0
  assert time_to_target(evals, 86.0) == 40.0
  assert time_to_target(evals, 86.0, budget=35.0) == INF
  assert time_to_target(evals, 90.0) == INF


def test_median_counts_misses_as_infinite():
  assert median_time([30.0, 40.0, 50.0, INF, INF]) == 50.0
  assert median_time([30.0, INF, INF]) == INF
  assert median_time([30.0, 40.0, INF, INF]) == INF  # the middle pair holds a miss
  assert median_time([INF] * 5) == INF
  with pytest.raises(ValueError, match="seconds >= 0 or inf"):
    median_time([])
  with pytest.raises(ValueError, match="seconds >= 0 or inf"):
    median_time([math.nan])


censored = st.lists(st.one_of(st.floats(1, 100), st.just(INF)), min_size=2, max_size=6)


@settings(max_examples=40, deadline=None)
@given(censored, censored)
def test_rank_test_is_scipys_exact_permutation_test(x, y):
  """Misses tie above every finite time; the p-value is the exact permutation distribution's
  (scipy enumerates every split where there are at most n_resamples of them)."""
  want = scipy_stats.mannwhitneyu(
    x, y, method=scipy_stats.PermutationMethod(n_resamples=10_000)
  ).pvalue
  assert rank_sum_p(x, y) == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(2, 6))
def test_smallest_rank_sum_p_is_the_exact_tests_at_full_separation(n, m):
  """No p-value of the exact rank test on n against m seeds is below the bound, and fully
  separated samples (every time of one below every time of the other, misses included) reach
  it: scipy's exact permutation test gives it there."""
  x, y = list(range(1, n + 1)), [100.0 + k for k in range(m - 1)] + [INF]
  want = scipy_stats.mannwhitneyu(
    x, y, method=scipy_stats.PermutationMethod(n_resamples=10_000)
  ).pvalue
  assert smallest_rank_sum_p(n, m) == pytest.approx(want, rel=1e-9)
  assert rank_sum_p(x, y) == pytest.approx(want, rel=1e-9)
  assert smallest_rank_sum_p(3, 3) == pytest.approx(0.1)  # three seeds a side never read


@settings(max_examples=40, deadline=None)
@given(
  st.lists(st.tuples(st.integers(2, 6), st.integers(2, 6)), min_size=1, max_size=5),
  st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5),
)
def test_smallest_holm_rank_sum_p_bounds_every_adjusted_p_of_the_family(sizes, slack):
  """Any p-values the family's rank tests can give (each at least its sizes' floor) adjust,
  under Holm, to no less than the bound; the family at its floors reaches it. Four seeds a side
  read at 0.029 alone, not after Holm over three."""
  floors = [smallest_rank_sum_p(n, m) for n, m in sizes]
  bound = smallest_holm_rank_sum_p(sizes)
  p_values = [f + (1 - f) * s for f, s in zip(floors, slack, strict=False)]
  assert min(holm(p_values)) >= bound - 1e-12
  assert min(holm(floors)) == pytest.approx(bound, rel=1e-12)
  assert smallest_rank_sum_p(4, 4) < 0.05 <= smallest_holm_rank_sum_p([(4, 4)] * 3)


def test_shift_interval_is_moses_on_uncensored_samples():
  """5 against 5, no misses: the 95 % interval is [D_(3), D_(23)] of the 25 sorted pairwise
  differences (P(U <= 2) = 4 / 252 <= 0.025 < P(U <= 3) = 7 / 252), the estimate their
  median."""
  x, y = [1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 11.5, 12.0, 13.0, 14.0]
  diffs = np.sort(np.subtract.outer(x, y).ravel())
  d = race_difference(x, y)
  assert (d.low, d.high) == (diffs[2], diffs[22])
  assert d.shift == np.median(diffs) and d.verdict == "faster"
  assert (d.median, d.baseline_median, d.reached, d.baseline_reached) == (3.0, 12.0, 5, 5)


def test_a_baseline_that_never_reaches_the_target_still_compares():
  """Two of five arm runs reach it, no baseline run does: the medians are both inf, the arm
  is ahead in rank but 2 of 5 against 0 of 5 is no evidence (exact p = 2 * C(8,3) / C(10,5)),
  and no finite shift can be rejected."""
  d = race_difference([91.5, 75.0, INF, INF, INF], [INF] * 5)
  assert (d.reached, d.n, d.baseline_reached, d.baseline_n) == (2, 5, 0, 5)
  assert d.median == d.baseline_median == INF
  assert d.p == pytest.approx(2 * math.comb(8, 3) / math.comb(10, 5))
  assert d.faster and d.verdict == "tie"
  assert (d.low, d.high) == (-INF, INF) and d.shift == -INF
  assert d.text() == "-inf [-inf, +inf]"


def test_misses_decide_where_the_reached_runs_alone_would_not():
  """The arm reaches the target in all five seeds, the baseline in two, a little faster: over
  the reached seeds alone the baseline looks faster; with the misses the arm is faster."""
  arm, baseline = [50.0, 52.0, 54.0, 56.0, 58.0], [45.0, 47.0, INF, INF, INF]
  assert welch(arm, baseline[:2]).delta > 0
  d = race_difference(arm, baseline)
  assert d.median == 54.0 and d.baseline_median == INF and d.faster
  assert d.low == -INF and d.high < INF  # no finite head start is too large
  assert race_difference([INF] * 5, [40.0, 41.0, 42.0, 43.0, 44.0]).verdict == "slower"


def test_every_shift_rejected_leaves_no_interval():
  d = race_difference([INF] * 5, [40.0, 41.0, 42.0, 43.0, 44.0])
  assert (d.low, d.high) == (None, None) and d.shift == INF and d.text() == "+inf"
  assert math.isnan(hodges_lehmann([INF], [INF])) and race_difference([INF], [INF]).p == 1.0
