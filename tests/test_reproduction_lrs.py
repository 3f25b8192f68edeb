"""results/REPRODUCTION.md's learning-rate tables say what configs/best_lr holds: each row's tuned
lr and held-out accuracy, its runner-up's, and (ResNet-50) the score at ResNet-18's lr there.
The YAML files are written by `python -m sweeps.best_lr` from the committed lr_tune records, so
a row that disagrees is a stale document."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "results" / "REPRODUCTION.md"
BEST_LR = ROOT / "configs" / "best_lr"

NAMES = {
  "Momentum": "momentum",
  "Adam": "adam",
  "QNG (tau 8)": "qng",
  "Ginger (tau 4)": "ginger",
  "QNG clipped, per tensor (tau 8)": "qng_clipped",
  "Muon": "muon",
  "schedule-free AdamW": "schedule_free_adamw",
  "SOAP": "soap",
  "K-FAC": "kfac",
}


def tables() -> dict[str, list[list[str]]]:
  """The section's tables by model: the rows under "ResNet-18:" and "ResNet-50 (...):"."""
  text = DOC.read_text()
  section = text[text.index("## Learning rates") :]
  section = section[: section.index("\n## ", 1)]
  out: dict[str, list[list[str]]] = {}
  model = None
  for line in section.splitlines():
    if m := re.match(r"^(ResNet-\d+)[ :]", line):
      model = m.group(1)
    elif line.startswith("| ") and model and not line.startswith("| optimizer"):
      out.setdefault(model, []).append([c.strip() for c in line.strip("|").split("|")])
  return out


def scores(experiment: str) -> dict[str, dict]:
  return yaml.safe_load((BEST_LR / f"{experiment}.yaml").read_text())


def score_at(entry: dict, lr: float) -> float:
  (candidate,) = [c for c in entry["candidates"] if c["lr"] == pytest.approx(lr, rel=1e-9)]
  return candidate["score"]


def accuracy(cell: str) -> float:
  assert cell.endswith(" %"), cell
  return float(cell[:-2])


def lr_and_score(cell: str) -> tuple[list[float], float]:
  """'5e-4 and 5e-3: 81.04 %' -> ([5e-4, 5e-3], 81.04)."""
  lrs, score = cell.split(": ")
  return [float(x) for x in lrs.split(" and ")], accuracy(score)


def test_both_models_have_a_table_naming_every_optimizer_they_tuned():
  found = tables()
  assert set(found) == {"ResNet-18", "ResNet-50"}
  for model, rows in found.items():
    experiment = f"cifar10_{model.lower().replace('-', '')}_30ep"
    names = {NAMES[row[0]] for row in rows}
    tuned = {k for k, v in scores(experiment).items() if v.get("candidates")}
    # unclipped Ginger's grid (5e-5 .. 1e-8) is the ablation's, discussed in its own section
    assert tuned - names <= {"ginger_unclipped"}, (model, tuned - names)


@pytest.mark.parametrize("model", ["ResNet-18", "ResNet-50"])
def test_each_row_is_its_best_lr_entry(model):
  experiment = f"cifar10_{model.lower().replace('-', '')}_30ep"
  entries = scores(experiment)
  resnet18 = scores("cifar10_resnet18_30ep")
  for row in tables()[model]:
    name = NAMES[row[0]]
    entry = entries[name]
    assert float(row[1]) == pytest.approx(entry["lr"], rel=1e-9), row
    assert accuracy(row[2]) == pytest.approx(entry["score"], abs=5e-3), row
    lrs, runner_up = lr_and_score(row[3])
    others = [c["score"] for c in entry["candidates"] if c["score"] is not None]
    others.remove(entry["score"])
    assert runner_up == pytest.approx(max(others), abs=5e-3), row
    for lr in lrs:
      assert score_at(entry, lr) == pytest.approx(runner_up, abs=5e-3), row
    if len(row) > 4:
      (lr,), at = lr_and_score(row[4])
      assert lr == pytest.approx(resnet18[name]["lr"], rel=1e-9), row
      assert score_at(entry, lr) == pytest.approx(at, abs=5e-3), row
