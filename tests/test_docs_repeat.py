"""The project's prose (README, docs/*.md) holds each paragraph once: a paragraph pasted into
several places makes a document say something of measurements that did not produce it."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def repeated_paragraphs(text: str, min_lines: int = 3) -> list[str]:
  """The paragraphs (blocks between blank lines) of at least ``min_lines`` lines that ``text``
  holds more than once."""
  paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text)]
  counts = collections.Counter(p for p in paragraphs if p.count("\n") + 1 >= min_lines)
  return [p for p, n in counts.items() if n > 1]


def test_repeated_paragraphs_are_found():
  once = "a\nb\nc"
  assert repeated_paragraphs(f"{once}\n\nx\ny\nz\n\n{once}\n") == [once]
  assert repeated_paragraphs("a\nb\n\na\nb\n") == []  # two lines: a table header, say


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_paragraph_stands_twice(path: Path):
  repeated = repeated_paragraphs(path.read_text())
  assert not repeated, f"{path.name}: these paragraphs stand more than once: " + " | ".join(
    p[:80] for p in repeated
  )
