"""The README's library snippet, run as written on a small real problem: the loss must fall."""

from __future__ import annotations

import re

import numpy as np
from readme_snippet import check_falls, snippet, train

from data.images import _digits_table


def test_readme_snippet_trains() -> None:
  pixels, labels = _digits_table()  # scikit-learn's digits, without importing it (~2.5 s)
  check_falls(train(snippet(), pixels, labels))


def test_every_optimizer_the_snippet_names_runs_as_printed() -> None:
  """A call the snippet shows in a comment (``ginger.qng(...)``) replaces the ``tx = ...``
  line and trains as printed: the arguments are the ones it takes."""
  source = snippet()
  shown = re.findall(r"#.*?(ginger\.\w+\(.*\))", source)
  named = set(re.findall(r"ginger\.(ginger|qng)\b", source))
  assert {call.split("(")[0].split(".")[1] for call in shown} | {"ginger"} >= named, shown
  pixels, labels = _digits_table()
  for call in shown:
    line = re.search(r"^tx = .*$", source, re.M).group(0)
    losses = train(source.replace(line, f"tx = {call}"), pixels, labels)
    assert np.all(np.isfinite(losses)) and losses[-10:].mean() < losses[:10].mean(), (call, losses)
