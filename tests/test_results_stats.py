"""results.stats.welch against the textbook formula and scipy's own t quantiles."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from results.stats import welch

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
