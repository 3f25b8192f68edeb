"""The statistics every comparison in the results tables, `bench.race` and REPRODUCTION.md carries.

**Differences of means (Welch).** For samples ``a`` (n_a runs) and ``b`` (n_b runs) of one
metric, the difference of means ``d = mean(a) - mean(b)`` has standard error
``s = sqrt(v_a + v_b)``, ``v = var / n`` (sample variances), and by Welch-Satterthwaite
``df = s^4 / (v_a^2 / (n_a - 1) + v_b^2 / (n_b - 1))`` degrees of freedom; the interval is
``d +- t_{1 - (1 - c) / 2, df} s`` at confidence ``c`` and the two-sided p-value is
``2 P(T_df > |d| / s)`` (``scipy.stats.ttest_ind`` with ``equal_var=False``). It needs two runs
on each side. The 95 % interval excludes 0 exactly when p < 0.05 (the same t and df).

**Families and Holm's correction.** A family is a set of comparisons read together, e.g.
Ginger - Adam at every tau of one model: a sentence such as "Ginger ties Adam at every tau"
is a claim about the whole family, and m tests at 5 % each make some false "above" likely
(at m = 6 independent ties, 1 - 0.95^6 = 26 %). Holm's step-down procedure keeps the
family-wise error rate (the chance of any false above / below in the family) at alpha = 0.05:
with the m p-values sorted, ``p_(1) <= ... <= p_(m)``, the adjusted p-values are
``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``, and a comparison is read as above / below
when ``p~ < alpha``. Holm rejects everything Bonferroni (``m p < alpha``) rejects, and more.
Bonferroni's simultaneous intervals (each at confidence ``1 - alpha / m``) all cover their
true differences with probability ``>= 1 - alpha``: :func:`bonferroni`. :func:`read_family`
reads a family at once: Welch, Holm and the simultaneous intervals over its tested m.

**Time to a target (AlgoPerf's rule).** A run that does not reach the target within its
budget has time ``inf`` (a miss), not a dropped run: :func:`time_to_target`. An arm's summary
is the median over its seeds with the misses at ``inf`` (``inf`` when half or more miss).
Arm X against baseline Y is a rank comparison on the extended reals, where misses tie with
each other above every finite time: the two-sided Wilcoxon-Mann-Whitney rank-sum test, exact
(the permutation distribution of the rank sum over all ``C(n_x + n_y, n_x)`` splits of the
pooled midranks, so ties and misses are handled exactly; two-sided p = twice the smaller
tail, as ``scipy.stats.mannwhitneyu`` with ``method=PermutationMethod()``). Reading: "faster"
/ "slower" where p < alpha. The estimate of the difference is Hodges-Lehmann's: the median of
the ``n_x n_y`` pairwise differences ``x_i - y_j`` (``-inf`` for a finite ``x_i`` against a
missed ``y_j``, ``+inf`` the other way, and a miss against a miss counted half each way). Its
interval is the rank test inverted (Moses): every shift ``delta`` for which the test of
``x - delta`` (misses staying misses) against ``y`` does not reject, its hull reported; an end
is ``-inf`` / ``+inf`` where no finite shift is rejected on that side (e.g. a baseline that
never reaches the target: no finite delay of the arm makes it as slow). The test needs no
distributional assumption; the interval assumes a shift of the finite times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE


@dataclass(frozen=True)
class Difference:
  """``mean(a) - mean(b)`` with its Welch interval and two-sided p-value (None where a side
  has fewer than two runs or both have no spread)."""

  delta: float
  low: float | None
  high: float | None
  n_a: int
  n_b: int
  p: float | None = None

  @property
  def verdict(self) -> str:
    """ "above" / "below" when the interval excludes 0, "tie" when it contains it, "n < 2"
    when there is no interval."""
    if self.low is None or self.high is None:
      return "n < 2"
    if self.low > 0:
      return "above"
    if self.high < 0:
      return "below"
    return "tie"

  def text(self, digits: int = 2) -> str:
    """``+0.20 [-0.23, +0.62]`` (the interval left out where there is none)."""
    return f"{self.delta:+.{digits}f} {self.interval_text(digits)}".rstrip()

  def interval_text(self, digits: int = 2) -> str:
    """``[-0.23, +0.62]``; blank where there is no interval."""
    if self.low is None or self.high is None:
      return ""
    return f"[{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def welch(a: Iterable[float], b: Iterable[float], confidence: float = CONFIDENCE) -> Difference:
  """``mean(a) - mean(b)``, its Welch ``confidence`` interval and p-value (module docstring)."""
  a, b = [float(x) for x in a], [float(x) for x in b]
  if not a or not b:
    raise ValueError(f"welch needs runs on both sides, got {len(a)} and {len(b)}.")
  delta = sum(a) / len(a) - sum(b) / len(b)
  low = high = p = None
  if len(a) >= 2 and len(b) >= 2:
    result = _scipy.ttest_ind(a, b, equal_var=False)
    interval = result.confidence_interval(confidence)
    if math.isfinite(interval.low) and math.isfinite(interval.high):
      low, high, p = float(interval.low), float(interval.high), float(result.pvalue)
  return Difference(delta, low, high, len(a), len(b), p)


def bonferroni(
  a: Iterable[float], b: Iterable[float], m: int, confidence: float = CONFIDENCE
) -> Difference:
  """The Welch interval of one of ``m`` comparisons at the simultaneous ``confidence``: each
  at ``1 - (1 - confidence) / m``, so that all m cover at once with probability at least
  ``confidence`` (Bonferroni's inequality)."""
  if m < 1:
    raise ValueError(f"bonferroni needs a family of m >= 1 comparisons, got m={m}.")
  return welch(a, b, 1 - (1 - confidence) / m)


def holm(p_values: Sequence[float | None]) -> list[float | None]:
  """Holm's step-down adjusted p-values (module docstring), in the order given; None (no
  test, e.g. a side with one run) stays None and does not count in the family's m."""
  tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
  if any(not 0 <= p <= 1 for p, _ in tested):
    raise ValueError(f"holm needs p-values in [0, 1], got {list(p_values)}.")
  m = len(tested)
  adjusted: list[float | None] = [None] * len(p_values)
  running = 0.0
  for rank, (p, i) in enumerate(tested):
    running = max(running, min(1.0, (m - rank) * p))
    adjusted[i] = running
  return adjusted


def holm_verdicts(differences: Sequence[Difference], alpha: float = ALPHA) -> list[str]:
  """The reading of each of one family's Welch differences after Holm's correction: "above"
  / "below" where its adjusted p-value is below ``alpha``, "tie" otherwise, "n < 2" where
  it has no test."""
  adjusted = holm([d.p for d in differences])
  return [
    _reading(d.delta, p, alpha, ("above", "below"))
    for d, p in zip(differences, adjusted, strict=True)
  ]


@dataclass(frozen=True)
class FamilyComparison:
  """One comparison read within its family (module docstring): Welch's uncorrected interval,
  the family's simultaneous one (Bonferroni over the m tested comparisons; no interval without
  a test), the Holm-adjusted p-value and its reading, and m."""

  welch: Difference
  simultaneous: Difference
  p_holm: float | None
  reading: str
  m: int


def read_family(
  samples: Sequence[tuple[Sequence[float], Sequence[float]]],
  alpha: float = ALPHA,
  confidence: float = CONFIDENCE,
) -> list[FamilyComparison]:
  """Each ``(a, b)`` of one family compared (``mean(a) - mean(b)``) and read together: the
  comparisons with a test (two runs a side) are the family's m, over which Holm's correction
  and the simultaneous intervals run."""
  diffs = [welch(a, b, confidence) for a, b in samples]
  m = sum(d.p is not None for d in diffs)
  return [
    FamilyComparison(
      d,
      bonferroni(a, b, m, confidence) if d.p is not None else d,
      p,
      _reading(d.delta, p, alpha, ("above", "below")),  # as holm_verdicts, from p once
      m,
    )
    for (a, b), d, p in zip(samples, diffs, holm([d.p for d in diffs]), strict=True)
  ]


def _reading(delta: float, p: float | None, alpha: float, words: tuple[str, str]) -> str:
  if p is None:
    return "n < 2"
  if p >= alpha:
    return "tie"
  return words[0] if delta > 0 else words[1]


# ----------------------------------------------------------------------- time to a target


def time_to_target(
  times: Sequence[tuple[float, float]], target: float, budget: float | None = None
) -> float:
  """The first time at which a run's metric reached ``target`` (higher is better), from its
  (time, value) evaluations in order; ``inf`` (a miss) if none did, or only after ``budget``."""
  for time, value in times:
    if value >= target:
      return time if budget is None or time <= budget else math.inf
  return math.inf


def median_time(times: Sequence[float]) -> float:
  """The median over seeds, misses at ``inf`` (AlgoPerf): ``inf`` when half or more miss."""
  return float(np.median(_times(times)))


@dataclass(frozen=True)
class RaceDifference:
  """Arm X against baseline Y in time to a target, misses at ``inf`` (module docstring)."""

  median: float  # X's median time over seeds (inf when half or more miss)
  baseline_median: float
  reached: int  # X's runs that reached the target
  n: int
  baseline_reached: int
  baseline_n: int
  shift: float  # Hodges-Lehmann estimate of X - Y (+-inf, or nan where it is undefined)
  low: float | None  # the hull of the rank test's inverted acceptance set (+-inf allowed)
  high: float | None
  p: float  # two-sided exact rank-sum p-value
  faster: bool  # X's rank sum below its mean under no difference

  @property
  def verdict(self) -> str:
    """ "faster" / "slower" where the rank test rejects at 5 %, "tie" where it does not."""
    return race_verdict(self, self.p)

  def text(self, digits: int = 1) -> str:
    """``-4.1 [-9.0, +inf]``: the shift and its interval (``nan``: undefined)."""
    out = _signed(self.shift, digits)
    if self.low is not None and self.high is not None:
      out += f" [{_signed(self.low, digits)}, {_signed(self.high, digits)}]"
    return out


def smallest_rank_sum_p(n: int, m: int) -> float:
  """The smallest two-sided p-value the exact rank-sum test can give samples of ``n`` and ``m``:
  ``2 / C(n + m, n)``, the two most extreme orderings of the pooled ranks (fewer seeds than
  that allows can never read faster or slower at 5 %: 3 against 3 gives 0.1)."""
  return min(1.0, 2.0 / math.comb(n + m, n))


def smallest_holm_rank_sum_p(sizes: Sequence[tuple[int, int]]) -> float:
  """The smallest Holm-adjusted p-value a family of exact rank-sum tests on ``sizes`` (seeds,
  the reference's seeds) can give: Holm's first step multiplies the family's smallest p by
  its m, and no later step adjusts below it, so ``min(1, m * min_i 2 / C(n_i + m_i, n_i))``
  (four seeds against four read at 0.029 alone, at 0.086 in a family of three)."""
  if not sizes:
    raise ValueError("smallest_holm_rank_sum_p needs at least one test's sizes.")
  return min(1.0, len(sizes) * min(smallest_rank_sum_p(n, m) for n, m in sizes))


def race_verdict(d: RaceDifference, p: float | None, alpha: float = ALPHA) -> str:
  """The reading of a race difference at (possibly Holm-adjusted) p-value ``p``."""
  return _reading(-1.0 if d.faster else 1.0, p, alpha, ("slower", "faster"))


def _signed(x: float, digits: int) -> str:
  if math.isnan(x):
    return "undefined"
  return f"{x:+.{digits}f}" if math.isfinite(x) else ("+inf" if x > 0 else "-inf")


def _doubled_ranks(x: np.ndarray, y: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
  """Twice the pooled midranks of ``x - delta`` (misses staying ``inf``) and ``y``: integers.
  Across the samples each pair is compared as ``x_i - y_j`` against ``delta``, so that a tie at
  a pairwise difference is exact in floating point."""
  with np.errstate(invalid="ignore"):
    sign = np.sign(np.subtract.outer(x, y) - delta)
  x_miss, y_miss = np.isinf(x)[:, None], np.isinf(y)[None, :]
  sign = np.where(x_miss & y_miss, 0, np.where(x_miss, 1, np.where(y_miss, -1, sign)))

  def within(v: np.ndarray) -> np.ndarray:  # 2 (1 + #smaller + #equal others / 2)
    less = (v[None, :] < v[:, None]).sum(1)
    return 2 + 2 * less + (v[None, :] == v[:, None]).sum(1) - 1

  rx = within(x) + 2 * (sign > 0).sum(1) + (sign == 0).sum(1)
  ry = within(y) + 2 * (sign < 0).sum(0) + (sign == 0).sum(0)
  return rx.astype(int), ry.astype(int)


def _rank_sum_p(rx: np.ndarray, ry: np.ndarray) -> float:
  """Exact two-sided p-value of the rank sum ``sum(rx)`` over every split of the pooled ranks
  into ``len(rx)`` and ``len(ry)``: twice the smaller tail, at most 1. The null distribution of
  the sum of k of the pooled (doubled, integer) ranks is counted by dynamic programming."""
  pooled, k = np.concatenate([rx, ry]), len(rx)
  total = int(pooled.sum())
  counts = np.zeros((k + 1, total + 1))
  counts[0, 0] = 1.0
  for r in pooled:
    for j in range(k, 0, -1):
      counts[j, r:] += counts[j - 1, : total + 1 - r]
  null = counts[k] / math.comb(len(pooled), k)
  w = int(rx.sum())
  return float(min(1.0, 2 * min(null[: w + 1].sum(), null[w:].sum())))


def rank_sum_p(x: Sequence[float], y: Sequence[float], delta: float = 0.0) -> float:
  """The exact two-sided Wilcoxon-Mann-Whitney p-value of ``x - delta`` against ``y``, misses
  (``inf``) tied above every finite time (module docstring)."""
  return _rank_sum_p(*_doubled_ranks(_times(x), _times(y), delta))


def hodges_lehmann(x: Sequence[float], y: Sequence[float]) -> float:
  """The median of the pairwise differences ``x_i - y_j``, a miss against a miss counted once
  as ``-inf`` and once as ``+inf`` (every other pair twice): ``nan`` where the middle falls
  between the two (as many arms' misses above as below)."""
  pairs = []
  for a in _times(x):
    for b in _times(y):
      pairs += [-math.inf, math.inf] if math.isinf(a) and math.isinf(b) else [a - b, a - b]
  with np.errstate(invalid="ignore"):
    return float(np.median(pairs))


def shift_interval(
  x: Sequence[float], y: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float | None, float | None]:
  """The hull of the shifts ``delta`` whose rank test (:func:`rank_sum_p`) does not reject at
  ``1 - confidence``; the test's statistic changes only at the finite pairwise differences, so
  each of them and each open stretch between them (and beyond them: an end at +-inf) is tested
  once. (None, None) where every shift is rejected."""
  x, y = _times(x), _times(y)
  finite = np.unique(np.subtract.outer(x[np.isfinite(x)], y[np.isfinite(y)]))
  if not finite.size:
    regions = [(-math.inf, math.inf, 0.0)]
  else:
    regions = [(-math.inf, finite[0], finite[0] - 1.0), (finite[-1], math.inf, finite[-1] + 1.0)]
    regions += [(d, d, d) for d in finite]
    regions += [(a, b, (a + b) / 2) for a, b in zip(finite[:-1], finite[1:], strict=True)]
  kept = [(lo, hi) for lo, hi, delta in regions if rank_sum_p(x, y, delta) >= 1 - confidence]
  if not kept:
    return None, None
  return float(min(lo for lo, _ in kept)), float(max(hi for _, hi in kept))


def race_difference(
  times: Sequence[float], baseline: Sequence[float], confidence: float = CONFIDENCE
) -> RaceDifference:
  """An arm's times to a target against a baseline's, misses as ``inf`` (module docstring)."""
  x, y = _times(times), _times(baseline)
  rx, ry = _doubled_ranks(x, y, 0.0)
  low, high = shift_interval(x, y, confidence)
  return RaceDifference(
    median=median_time(x),
    baseline_median=median_time(y),
    reached=int(np.isfinite(x).sum()),
    n=len(x),
    baseline_reached=int(np.isfinite(y).sum()),
    baseline_n=len(y),
    shift=hodges_lehmann(x, y),
    low=low,
    high=high,
    p=_rank_sum_p(rx, ry),
    faster=bool(rx.sum() < len(x) * (len(x) + len(y) + 1)),
  )


def _times(values: Sequence[float]) -> np.ndarray:
  """Times to a target as an array: finite and >= 0, or ``inf`` for a miss."""
  out = np.asarray([float(v) for v in values], dtype=float)
  if not out.size or np.isnan(out).any() or (out < 0).any() or np.isneginf(out).any():
    raise ValueError(
      f"times to a target must be one or more seconds >= 0 or inf (a miss), got {list(values)}."
    )
  return out
