"""The README's library snippet, run as written on a small real problem: the loss must fall."""

from __future__ import annotations

from readme_snippet import check_falls, snippet, train

from data.images import _digits_table


def test_readme_snippet_trains() -> None:
  pixels, labels = _digits_table()  # scikit-learn's digits, without importing it (~2.5 s)
  check_falls(train(snippet(), pixels, labels))
