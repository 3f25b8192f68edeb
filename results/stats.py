"""Differences of means with Welch's 95 % confidence interval: the statistics every comparison
in the results tables and REPRODUCTION.md carries.

For samples ``a`` (n_a runs) and ``b`` (n_b runs) of one metric, the difference of means
``d = mean(a) - mean(b)`` has standard error ``s = sqrt(v_a + v_b)``, ``v = var / n`` (sample
variances), and by Welch-Satterthwaite ``df = s^4 / (v_a^2 / (n_a - 1) + v_b^2 / (n_b - 1))``
degrees of freedom; the interval is ``d +- t_{0.975, df} s`` (``scipy.stats.ttest_ind`` with
``equal_var=False``). It needs two runs on each side. An interval that contains 0 is a tie.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from scipy import stats as _scipy

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Difference:
  """``mean(a) - mean(b)`` with its Welch interval (None where a side has fewer than two runs
  or both have no spread)."""

  delta: float
  low: float | None
  high: float | None
  n_a: int
  n_b: int

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
    out = f"{self.delta:+.{digits}f}"
    if self.low is not None and self.high is not None:
      out += f" [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"
    return out


def welch(a: Iterable[float], b: Iterable[float], confidence: float = CONFIDENCE) -> Difference:
  """``mean(a) - mean(b)`` and its Welch ``confidence`` interval (module docstring)."""
  a, b = [float(x) for x in a], [float(x) for x in b]
  if not a or not b:
    raise ValueError(f"welch needs runs on both sides, got {len(a)} and {len(b)}.")
  delta = sum(a) / len(a) - sum(b) / len(b)
  low = high = None
  if len(a) >= 2 and len(b) >= 2:
    result = _scipy.ttest_ind(a, b, equal_var=False)
    interval = result.confidence_interval(confidence)
    if math.isfinite(interval.low) and math.isfinite(interval.high):
      low, high = float(interval.low), float(interval.high)
  return Difference(delta, low, high, len(a), len(b))
