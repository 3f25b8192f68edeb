"""Every interval the README and the results' documents quote stands in a committed generated
table, or in the output of the command the document names for it: a rerun that moves a number
in a table leaves no stale copy in a sentence."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from bench import race
from results import stats

ROOT = Path(__file__).resolve().parents[1]
CAMPAIGN = ROOT / "results" / "cifar10"
DOCS = ("README.md", "results/REPRODUCTION.md", "docs/ginger-math.md", "docs/training.md")
INTERVAL = re.compile(r"\[[+-]\d+\.\d+, [+-]\d+\.\d+\]")


def normalized(text: str) -> str:
  return text.replace("−", "-")  # the tables' minus sign and the prose's hyphen alike


@pytest.fixture(scope="module")
def generated() -> str:
  """The committed tables, and the outputs of the commands the documents cite beside them."""
  tables = sorted(CAMPAIGN.glob("*.md")) + sorted((CAMPAIGN / "plots").glob("*.md"))
  return "\n".join(normalized(p.read_text()) for p in tables)


@pytest.fixture(scope="module")
def cited() -> str:
  """REPRODUCTION's first-run race (`python -m bench.race results/cifar10/runs/race_cold
  --target 85`) and the ablation's cross-cell difference it computes in its text."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    race.main([str(CAMPAIGN / "runs" / "race_cold"), "--target", "85"])
  ablation = stats.welch([86.86, 86.48], [88.16, 87.75, 88.24]).text()
  return normalized(out.getvalue()) + "\n" + ablation


@pytest.mark.parametrize("doc", DOCS)
def test_every_quoted_interval_is_a_generated_one(doc, generated, cited):
  text = normalized((ROOT / doc).read_text())
  quoted = INTERVAL.findall(text)
  assert quoted or doc.startswith("docs/"), doc
  stale = sorted({q for q in quoted if q not in generated and q not in cited})
  assert not stale, f"{doc} quotes intervals no generated table holds: {stale}"
