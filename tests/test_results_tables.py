"""Tables from fabricated run dirs: exact rows, seed statistics, blanks, paper columns, CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

from results import (
  ablation,
  comparisons,
  metrics,
  paper_tables,
  render,
  selection,
  stats,
  studies,
  tables,
)

BASE_RUN = {
  "experiment": "cifar100_resnet18",
  "optimizer": "adam",
  "tau": None,
  "alpha": None,
  "gamma": None,
  "rho": None,
  "block": None,
  "lr": 1e-3,
  "seed": 0,
  "model": "resnet18",
  "dataset": "cifar100",
  "setting": None,
  "sweep": "table1",
}


def make_run(
  root: Path,
  name: str,
  run: dict[str, Any] | None = None,
  status: str = "completed",
  events: list[dict] | None = None,
  **summary: Any,
) -> Path:
  """A run dir with summary.json (unless `run` is None) and optionally metrics.jsonl."""
  run_dir = root / name
  run_dir.mkdir(parents=True)
  if run is not None:
    run = {**BASE_RUN, **run}
    run = {**recorded(run), **run}
    # The paper's run length unless a test says otherwise (summary["config"] sets a run's length).
    epochs = 1 if run["dataset"] == "xsum" else 200
    body = {
      "run": run,
      "config": {"epochs": epochs, "max_steps": None},
      "status": status,
      "device": "NVIDIA H100",
      "versions": {"jax": "0.7.0"},
      "git_commit": "abc1234def5678",
      **summary,
    }
    (run_dir / "summary.json").write_text(json.dumps(body))
  if events is not None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  return run_dir


def recorded(run: dict[str, Any]) -> dict[str, Any]:
  """The fields train.py records in every "run" block (run_record.identity), at the defaults of
  configs/ for this optimizer and model: K = 1, batchnorm sync, float32 numerics."""
  curvature = run["optimizer"] in ("ginger", "qng")
  resnet = str(run["model"]).startswith("resnet")
  return {
    "curvature_every": 1 if run["optimizer"] == "ginger" else None,
    "batchnorm": "sync" if resnet else None,
    "batchnorm_groups": None,
    "precision": "float32",
    "state_dtype": "float32" if curvature else None,
  }


def image(acc: float, val: float, loss: float, flops: float, mem: int) -> dict[str, Any]:
  """Summary metrics of an image run."""
  return {
    "best_val_accuracy": acc,
    "val_loss_at_best": val,
    "min_train_loss": loss,
    "flops_per_iter": {"analytic": flops, "xla": flops / 2},
    "peak_memory_bytes": mem,
  }


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
  """Adam (2 seeds), Ginger tau=4 (1 seed), a killed QNG run, a failed Ginger tau=8 run."""
  root = tmp_path / "multirun" / "2025-01-01" / "table1"
  make_run(root, "0", {"seed": 0}, **image(72.0, 1.2, 1e-5, 2.4e9, 3_200_000_000))
  make_run(root, "1", {"seed": 1}, **image(73.0, 1.3, 2e-5, 2.4e9, 3_300_000_000))
  ginger = {
    "optimizer": "ginger",
    "tau": 4,
    "alpha": 0.99,
    "gamma": 1e-5,
    "rho": 1.0,
    "block": "per_tensor",
    "lr": 2e-4,
  }
  make_run(root, "2", ginger, **image(73.5, 1.25, 5e-6, 4.1e9, 3_400_000_000))
  make_run(root, "3", None, events=[{"event": "train", "step": 1, "train_loss": 4.6}])
  make_run(root, "4", {**ginger, "tau": 8}, status="failed", **image(1.0, 9.0, 1.0, 1e9, 1))
  return tmp_path


def test_collect_runs_skips_dir_without_summary(runs_root: Path) -> None:
  (runs_root / "multirun" / "bad").mkdir()
  (runs_root / "multirun" / "bad" / "summary.json").write_text("{not json")
  runs = tables.collect_runs([runs_root / "multirun", runs_root / "missing-root"])
  assert sorted(Path(r["path"]).name for r in runs) == ["0", "1", "2", "4"]
  assert len(tables.find_run_dirs([runs_root])) == 6  # 5 runs + the bad one
  report = tables.run_report([str(runs_root)], runs)
  assert "3 completed" in report and "1 failed" in report and "2 without" in report


def sections(markdown: str) -> dict[str, list[str]]:
  """The lines of each "### " section of a table's markdown, by heading."""
  out: dict[str, list[str]] = {}
  for line in markdown.splitlines():
    if line.startswith("### "):
      out[line[4:]] = []
    elif out and line.startswith("|"):
      out[list(out)[-1]].append(line)
  return out


def header_rows(markdown: str) -> list[list[str]]:
  """The header cells of every pipe table in ``markdown`` (the line above a |---| line)."""
  lines = markdown.splitlines()
  return [
    [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    for line, below in zip(lines, lines[1:], strict=False)
    if below.startswith("|---")
  ]


def test_table1_markdown_rows(runs_root: Path) -> None:
  """One table per model and kind of column: accuracy and loss, then cost."""
  md = render.to_markdown(paper_tables.build_table1(tables.collect_runs([runs_root])))
  parts = sections(md)
  assert list(parts) == [
    "ResNet-18: accuracy and loss",
    "ResNet-18: cost",
    "ResNet-50: accuracy and loss",
    "ResNet-50: cost",
  ]
  quality, cost = parts["ResNet-18: accuracy and loss"], parts["ResNet-18: cost"]
  assert quality[0] == (
    "| Optimizer | n | Acc | Acc paper | Acc Δ | Val loss | Val loss paper | Val loss Δ "
    "| Train loss 1e-6 | Train loss 1e-6 paper | Train loss 1e-6 Δ |"
  )
  assert cost[0] == (
    "| Optimizer | n | FLOPs (analytic) | FLOPs (analytic) paper | FLOPs (analytic) Δ | Mem GB "
    "| Mem GB paper | Mem GB Δ | Step GB |"
  )
  assert (
    "| Adam | 2 | 72.50 ± 0.71 | 71.61 | +0.89 | 1.250 ± 0.071 | 1.249 | +0.001 "
    "| 15.00 ± 7.07 | 9.57 | +5.43 |"
  ) in quality
  assert "| Adam | 2 | 2.40e9 ± 0.00e0 | 2.36e9 | +4.00e7 | 3.25 ± 0.07 | 3.16 | +0.09 |  |" in cost
  assert (
    "| Ginger (τ=4) | 1 | 73.50 | 72.90 | +0.60 | 1.250 | 1.263 | -0.013 | 5.00 | 13.37 | -8.37 |"
  ) in quality
  assert "| Ginger (τ=4) | 1 | 4.10e9 | 4.08e9 | +2.00e7 | 3.40 | 3.33 | +0.07 |  |" in cost
  # the killed run (no summary.json) leaves its row blank; ResNet-50 has no runs
  assert "| QNG (τ=2) |  |  | 72.30 |  |  | 1.347 |  |  | 23.97 |  |" in quality
  assert (
    "| Adam |  |  | 71.59 |  |  | 1.241 |  |  | 60.65 |  |"
    in (parts["ResNet-50: accuracy and loss"])
  )
  assert any(line.startswith("| Ginger (τ=8) |  |  | 72.89 |") for line in quality)  # failed
  assert md.splitlines()[0] == "## Table 1: CIFAR-100, 200 epochs (paper Table 1)"
  assert all(len(lines) == 2 + 14 for lines in parts.values())  # header, rule, paper rows
  assert "NVIDIA H100 (3)" in md and "jax: 0.7.0 (3)" in md


def test_table1_latex(runs_root: Path) -> None:
  tex = render.to_latex(paper_tables.build_table1(tables.collect_runs([runs_root])))
  assert (
    r"    Adam & 2 & 72.50 $\pm$ 0.71 & 71.61 & +0.89 & 1.250 $\pm$ 0.071 & 1.249 & "
    r"+0.001 & 15.00 $\pm$ 7.07 & 9.57 & +5.43 \\"
  ) in tex
  assert r" &  & \multicolumn{3}{c}{Acc} & \multicolumn{3}{c}{Val loss} & " in tex
  assert r"\cmidrule(lr){3-5} \cmidrule(lr){6-8} \cmidrule(lr){9-11}" in tex
  assert "    Optimizer & n & ours & paper & $\\Delta$ & ours & paper & $\\Delta$ & " in tex
  assert (
    r"\caption{CIFAR-100, 200 epochs (paper Table 1). ResNet-18: accuracy and loss. Best "
    r"validation accuracy (\%)"
  ) in tex
  assert r"\label{tab:repro-table1-resnet-50-cost}" in tex
  assert "\\midrule\n    Ginger ($\\tau$=1) &" in tex  # rule between baselines and Ginger
  assert tex.count(r"\begin{tabular}") == tex.count(r"\end{table*}") == 4  # as the markdown
  assert tex.rstrip().endswith("(3); git: abc1234def (3).")


def test_table1_dataset_override_and_extra_tau(tmp_path: Path) -> None:
  extra = {"optimizer": "ginger", "tau": 64, "alpha": 0.99, "dataset": "cifar10"}
  make_run(tmp_path, "a", extra, **image(90.0, 0.3, 1e-6, 1e9, 10**9))
  runs = tables.collect_runs([tmp_path])
  table = paper_tables.build_table1(runs, dataset="cifar10")
  assert table.title.startswith("Table 1: CIFAR-10 - NOT COMPARABLE with the paper")
  row = next(r for r in table.rows if r.label == "Ginger (τ=64)")
  assert row.cells[:4] == ["1", "90.00", "", "0.300"]  # n, Acc, no paper number, Val loss
  assert all(r.label != "Ginger (τ=64)" for r in paper_tables.build_table1(runs).rows)


def test_selection_note_names_a_differing_setting_once(tmp_path: Path) -> None:
  """A setting that is also a run field (lr, in every real run's config) is named once in the
  note, not once as the field and again as the setting."""
  for i, (lr, seed) in enumerate([(1e-3, 0), (1e-3, 1), (5e-3, 0)]):
    run = {"lr": lr, "seed": seed}
    make_run(tmp_path, f"r{i}", run, config={"epochs": 200, "max_steps": None, "lr": lr})
  sel = selection.select_runs(tables.collect_runs([tmp_path]), {"optimizer": "adam"}, ())
  assert sel.note == "2 configurations matched; used lr=0.001 (n=2)"


def test_selection_rules(tmp_path: Path) -> None:
  """Reruns of a seed count once (newest wins); lr_tune never counts; the configuration with
  the most seeds wins and a note says so; runs of the table's own sweep are preferred."""
  specs = [
    ("a", 1e-3, "table1", 0, 70.0),
    ("b", 1e-3, "table1", 0, 71.0),
    ("e", 1e-3, "table1", 1, 72.0),
    ("c", 5e-3, None, 3, 60.0),
    ("d", 1e-3, "lr_tune", 5, 10.0),
  ]
  for i, (name, lr, sweep, seed, acc) in enumerate(specs):
    run_dir = make_run(
      tmp_path, name, {"lr": lr, "sweep": sweep, "seed": seed}, best_val_accuracy=acc
    )
    os.utime(run_dir / "summary.json", (1000 + i, 1000 + i))
  runs = tables.collect_runs([tmp_path])
  sel = selection.select_runs(runs, {"optimizer": "adam"}, ())
  assert [r["best_val_accuracy"] for r in sel.runs] == [71.0, 72.0]
  assert sel.note == "2 configurations matched; used lr=0.001 (n=2)"
  preferred = selection.select_runs(runs, {"optimizer": "adam"}, ("table1",))
  assert preferred.note is None and len(preferred.runs) == 2
  only_c = selection.select_runs(runs, {"optimizer": "adam", "lr": 5e-3}, ("table1",))
  assert [r["best_val_accuracy"] for r in only_c.runs] == [60.0]


def test_table2_xsum(tmp_path: Path) -> None:
  xsum = {"dataset": "xsum", "model": "t5-small", "setting": "lora", "sweep": "table2"}
  for seed, r1 in ((0, 31.0), (1, 32.0)):
    make_run(
      tmp_path,
      f"s{seed}",
      {**xsum, "seed": seed},
      rouge1=r1,
      rouge2=9.0,
      rougeL=24.0,
      train_perplexity=10.0,
      peak_memory_bytes=2_700_000_000,
      step_memory_bytes=1_900_000_000,
      flops_per_iter={"analytic": None, "xla": 5.6e9},
    )
  table = paper_tables.build_table2(tables.collect_runs([tmp_path]), flops="xla")
  adam = table.rows[0]
  assert adam.label == "Adam"
  assert adam.cells[:20] == [
    "2",
    "31.50 ± 0.71",
    "31.06",
    "+0.44",
    "9.00 ± 0.00",
    "9.09",
    "-0.09",
    "24.00 ± 0.00",
    "24.10",
    "-0.10",
    "10.000 ± 0.000",
    "10.236",
    "-0.236",
    "5.60e9 ± 0.00e0",
    "5.61e9",
    "-1.00e7",
    "2.70 ± 0.00",
    "2.67",
    "+0.03",
    "1.90 ± 0.00",  # the step's own memory, beside the lifetime high-water mark (no paper cell)
  ]
  assert adam.cells[20:22] == ["", ""] and adam.cells[22] == "32.61"  # Full: paper only
  assert [c.label for c in table.columns][13] == "FLOPs (xla)"
  assert [c.label for c in table.columns][16:20] == ["Mem GB", "Mem GB", "Mem GB", "Step GB"]


def test_tables_3_and_4(tmp_path: Path) -> None:
  """Table 3 is validation accuracy, Table 4 min training loss x1e-6 (alpha rows, tau cols)."""
  sens = {"optimizer": "ginger", "sweep": "table3", "alpha": 0.9, "tau": 4}
  make_run(tmp_path, "a", {**sens, "seed": 0}, best_val_accuracy=73.0, min_train_loss=6e-6)
  make_run(tmp_path, "b", {**sens, "seed": 1}, best_val_accuracy=74.0, min_train_loss=7e-6)
  runs = tables.collect_runs([tmp_path])
  md3 = render.to_markdown(paper_tables.build_table3(runs)).splitlines()
  md4 = render.to_markdown(paper_tables.build_table4(runs)).splitlines()
  # The seed count in the cell (a column per tau would make the table 13 columns wide).
  assert "| 0.9 |  | 73.24 |  | 73.50 ± 0.71 (n=2) | 73.35 | +0.15 |  | 73.15 |  |" in md3
  assert "| 0.9 |  | 14.82 |  | 6.50 ± 0.71 (n=2) | 6.03 | +0.47 |  | 10.62 |  |" in md4
  assert "| 0.999 |  | 52.98 |  |  | 11.92 |  |  | 17.55 |  |" in md4
  assert md3[4].startswith("| α \\ τ | τ=2 Acc | τ=2 Acc paper | τ=2 Acc Δ | τ=4 Acc |")


def test_tables_3_and_4_for_smoke_model(tmp_path: Path) -> None:
  """Smoke-scale sweeps (digits / resnet_tiny) fill Tables 3/4 when asked for that model,
  labelled as not comparable; the default (ResNet-18 / CIFAR-100) table stays blank."""
  smoke = {
    "optimizer": "ginger",
    "sweep": "table34",
    "alpha": 0.9,
    "tau": 2,
    "model": "resnet_tiny",
    "dataset": "digits",
  }
  make_run(tmp_path, "s", smoke, best_val_accuracy=91.0, min_train_loss=0.5)
  runs = tables.collect_runs([tmp_path])
  smoke_md = render.to_markdown(paper_tables.build_table3(runs, "digits", "resnet_tiny"))
  assert "NOT COMPARABLE" in smoke_md and "| 0.9 | 91.00 (n=1) | 73.24 |  | 73.35 |" in smoke_md
  assert "91.00" not in render.to_markdown(paper_tables.build_table3(runs))


def test_ablation_rows(tmp_path: Path) -> None:
  abl = {
    "optimizer": "ginger",
    "tau": 4,
    "alpha": 0.99,
    "gamma": 1e-5,
    "lr": 2e-4,
    "sweep": "ablation",
  }
  make_run(
    tmp_path,
    "clip",
    {**abl, "rho": 1.0, "block": "per_tensor"},
    best_val_accuracy=72.0,
    step_time_s=0.05,
  )
  make_run(tmp_path, "noclip", {**abl, "rho": None, "block": "per_tensor"}, best_val_accuracy=70.0)
  make_run(tmp_path, "alone", {**abl, "tau": 8, "rho": None}, best_val_accuracy=1.0)
  table = ablation.build_ablation(tables.collect_runs([tmp_path]))
  parts = sections(render.to_markdown(table))
  base = "cifar100 resnet18 200ep τ=4 α=0.99"
  assert list(parts) == [f"{base}: accuracy and loss", f"{base}: cost"]
  assert parts[f"{base}: accuracy and loss"][2:] == [
    "| ρ=1.0, per_tensor, lr=0.0002, γ=1e-05 | 1 | 72.00 | 72.90 | -0.90 |  | 1.263 |  |  "
    "| 13.37 |  |",
    "| no clip, per_tensor, lr=0.0002, γ=1e-05 | 1 | 70.00 | 72.90 | -2.90 |  | 1.263 |  |  "
    "| 13.37 |  |",
  ]
  assert parts[f"{base}: cost"] == [
    "| Variant | n | Step s | Mem GB | Step GB |",
    "|---|---:|---:|---:|---:|",
    "| ρ=1.0, per_tensor, lr=0.0002, γ=1e-05 | 1 | 0.050 |  |  |",
    "| no clip, per_tensor, lr=0.0002, γ=1e-05 | 1 |  |  |  |",
  ]
  assert len(table.rows) == 2  # tau=8 has a single variant: no ablation


def test_empty_tables_and_latex_escaping() -> None:
  table = ablation.build_ablation([])
  assert table.rows == [] and "No setting" in table.notes[0]
  assert render.latex_escape("a_b & 5% ±") == r"a\_b \& 5\% $\pm$"
  assert metrics.fmt_num(None, "f2") == "" and metrics.fmt_num(-1.5e-7, "sci", True) == "-1.50e-7"


def test_cli_writes_files(runs_root: Path, tmp_path: Path) -> None:
  out = tmp_path / "tables"
  assert tables.main([str(runs_root / "multirun"), "--out", str(out)]) == 0
  names = sorted(p.name for p in out.iterdir())
  assert names == sorted(
    f"{t}.{ext}"
    for t in (
      "table1",
      "table2",
      "table3",
      "table4",
      "table_ablation",
      "comparisons_cifar100_200ep",
    )
    for ext in ("md", "tex")
  )
  assert "| Adam | 2 | 72.50 ± 0.71 |" in (out / "table1.md").read_text()
  assert tables.main([str(runs_root), "--out", str(out), "--dataset", "cifar10"]) == 0
  assert "NOT COMPARABLE" in (out / "table1_cifar10.md").read_text()
  assert "NOT COMPARABLE" not in (out / "table1.md").read_text()


def test_only_the_papers_protocol_fills_paper_cells(tmp_path: Path) -> None:
  """A toy XSUM run (random t5, 2 epochs) and a 20-epoch CIFAR-100 run stay out of the paper's
  tables; each lands in a stand-in table named and titled after its dataset/model and length."""
  toy = {"dataset": "xsum", "model": "t5-small-random", "setting": "full", "sweep": "table2"}
  make_run(
    tmp_path,
    "toy",
    {**toy, "optimizer": "ginger", "tau": 4},
    rougeL=7.97,
    **{"config": {"epochs": 2, "max_steps": None}},
  )
  short = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "sweep": "table34"}
  short |= {"rho": 1.0, "block": "per_tensor"}
  make_run(
    tmp_path, "short", short, best_val_accuracy=50.0, config={"epochs": 20, "max_steps": None}
  )
  unclipped = {**short, "rho": None, "lr": 1e-6, "sweep": "ablation"}
  make_run(
    tmp_path,
    "unclipped",
    unclipped,
    best_val_accuracy=49.0,
    config={"epochs": 20, "max_steps": None},
  )
  runs = tables.collect_runs([tmp_path])
  assert "| Ginger (τ=4) |  |  |" in render.to_markdown(paper_tables.build_table2(runs))
  assert "50.00" not in render.to_markdown(paper_tables.build_table3(runs))
  written = dict(paper_tables.standin_tables(runs))
  # one Ginger variant in the text set: no ablation table for it
  assert set(written) == {
    "table2_t5_small_random_2ep",
    "table1_cifar100_20ep",
    "table3_cifar100_20ep",
    "table4_cifar100_20ep",
    "table_ablation_cifar100_20ep",
  }
  t2 = render.to_markdown(written["table2_t5_small_random_2ep"])
  assert t2.startswith("## Table 2: XSUM, t5-small-random, 2 epochs - NOT COMPARABLE")
  assert "7.97" in t2
  t3 = render.to_markdown(written["table3_cifar100_20ep"])
  assert "CIFAR-100, resnet18, 20 epochs - NOT COMPARABLE" in t3 and "50.00" in t3
  assert "49.00" not in t3 and "49.00" in render.to_markdown(
    written["table_ablation_cifar100_20ep"]
  )


def test_runs_of_different_lengths_never_share_a_cell(tmp_path: Path) -> None:
  """A newer 20-step run does not replace an 88-step run of the same settings (issue: it did)."""
  base = {"dataset": "digits", "model": "resnet_tiny", "optimizer": "ginger", "tau": 4}
  base |= {"alpha": 0.99, "sweep": "table34"}
  make_run(tmp_path, "long", base, best_val_accuracy=90.0, config={"epochs": 2, "max_steps": 88})
  newer = make_run(
    tmp_path, "short", base, best_val_accuracy=40.0, config={"epochs": 2, "max_steps": 20}
  )
  os.utime(newer / "summary.json", (2e9, 2e9))
  written = dict(paper_tables.standin_tables(tables.collect_runs([tmp_path])))
  long_t3 = render.to_markdown(written["table3_digits_88steps"])
  short_t3 = render.to_markdown(written["table3_digits_20steps"])
  assert "90.00" in long_t3 and "40.00" not in long_t3
  assert "40.00" in short_t3 and "90.00" not in short_t3
  assert "88 steps - NOT COMPARABLE" in long_t3


def test_committed_standin_tables_regenerate_from_committed_records(tmp_path: Path) -> None:
  """results/cifar10/'s tables are exactly what its committed run records give (make tables):
  archives (results/records.py), tests/test_results_records.py checks that they are all."""
  committed = Path(__file__).resolve().parents[1] / "results" / "cifar10"
  assert any(p.name.endswith(".runs.jsonl.gz") for p in (committed / "runs").rglob("*"))
  assert tables.main([str(committed / "runs"), "--out", str(tmp_path), "--standin-only"]) == 0
  regenerated = sorted(p.name for p in tmp_path.iterdir())
  assert regenerated, "no tables from the committed records"
  for name in regenerated:
    assert (tmp_path / name).read_text() == (committed / name).read_text(), name


COMMITTED = Path(__file__).resolve().parents[1] / "results" / "cifar10"


def every_table_runs(root: Path) -> Path:
  """Runs that fill every table, of the paper's settings and of others (CIFAR-10 for 30
  epochs, a random-init t5 for 2): Table 1 on both models, Table 2 in both settings, Tables
  3/4, and the ablation (a clipped and an unclipped Ginger)."""
  image = {
    "best_val_accuracy": 80.0,
    "val_loss_at_best": 0.5,
    "min_train_loss": 1e-3,
    "flops_per_iter": {"analytic": 1e9},
    "peak_memory_bytes": 10**9,
    "step_memory_bytes": 10**9,
    "step_time_s": 0.01,
  }
  text = {
    "rouge1": 30.0,
    "rouge2": 9.0,
    "rougeL": 24.0,
    "train_perplexity": 10.0,
    **{k: image[k] for k in ("flops_per_iter", "peak_memory_bytes", "step_memory_bytes")},
  }
  ginger = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "gamma": 1e-5, "rho": 1.0}
  ginger |= {"block": "per_tensor"}
  arms = [{}, ginger, {**ginger, "rho": None, "sweep": "ablation"}]
  sensitivity = {**ginger, "alpha": 0.9, "sweep": "table34"}

  def config(epochs: int) -> dict:
    return {"config": {"epochs": epochs, "max_steps": None}}

  for name, dataset, epochs in (("paper", "cifar100", 200), ("standin", "cifar10", 30)):
    for model in ("resnet18", "resnet50"):
      for i, arm in enumerate([*arms, sensitivity]):
        run = {"dataset": dataset, "model": model, **arm}
        make_run(root, f"{name}/{model}/{i}", run, **config(epochs), **image)
  for name, model, epochs in (("paper", "t5-small", 1), ("standin", "t5-small-random", 2)):
    for setting in ("lora", "full"):
      for i, arm in enumerate(arms):
        run = {"dataset": "xsum", "model": model, "setting": setting, "sweep": "table2", **arm}
        make_run(root, f"{name}-xsum/{setting}/{i}", run, **config(epochs), **text)
  return root


@pytest.fixture
def every_table(tmp_path: Path) -> dict[str, str]:
  """The markdown of every table `python -m results.tables` writes for every_table_runs."""
  out = tmp_path / "out"
  assert tables.main([str(every_table_runs(tmp_path / "runs")), "--out", str(out)]) == 0
  written = {p.stem: p.read_text() for p in sorted(out.glob("*.md"))}
  assert set(written) == {
    *("table1", "table2", "table3", "table4", "table_ablation"),
    *("table1_cifar10_30ep", "table3_cifar10_30ep", "table4_cifar10_30ep"),
    *("table_ablation_cifar10_30ep", "table2_t5_small_random_2ep"),
    *("table_ablation_t5_small_random_2ep", "comparisons_cifar100_200ep"),
    "comparisons_cifar10_30ep",
  }
  return written


def committed_markdown() -> dict[str, str]:
  """Every committed markdown file of the campaign: its tables and the plots' tables."""
  files = sorted(COMMITTED.glob("*.md")) + sorted((COMMITTED / "plots").glob("*.md"))
  assert len(files) > 10
  return {str(p.relative_to(COMMITTED)): p.read_text() for p in files}


def test_tables_of_other_settings_have_no_difference_with_the_paper(every_table) -> None:
  """A table titled NOT COMPARABLE has no Δ (ours - paper) column: between other settings the
  difference is noise. The paper's number may stand beside ours, labelled with the paper's
  setting. Tables of the paper's settings keep ours / paper / Δ."""
  for name, md in {**every_table, **committed_markdown()}.items():
    headers = [cell for row in header_rows(md) for cell in row]
    if "NOT COMPARABLE" in md.splitlines()[0]:
      assert not any("Δ" in cell for cell in headers), name
      assert "Δ" not in md.split("\n\n")[1], name  # nor in the caption
  beside = {
    "table1_cifar10_30ep": "Acc paper (CIFAR-100, 200 ep.)",
    "table3_cifar10_30ep": "τ=4 Acc paper (CIFAR-100, 200 ep.)",
    "table2_t5_small_random_2ep": "RL paper (pretrained t5-small, 1 ep.)",
  }
  for name, label in beside.items():
    assert label in {cell for row in header_rows(every_table[name]) for cell in row}, name
  for name, label in (("table1", "Acc Δ"), ("table2", "RL Δ"), ("table3", "τ=4 Acc Δ")):
    assert label in {cell for row in header_rows(every_table[name]) for cell in row}, name
  assert "Acc / R-L Δ" in header_rows(every_table["table_ablation"])[0]
  assert "paper" not in " ".join(header_rows(every_table["table_ablation_cifar10_30ep"])[0])


def test_a_table_too_wide_without_parts_is_refused_not_dropped() -> None:
  """A section wider than MAX_COLUMNS whose columns name no part cannot be split: rendering it
  raises (naming the table) instead of writing a file without its rows."""
  from results.table_model import Column, Row, Table

  columns = [Column("", f"c{i}") for i in range(render.MAX_COLUMNS)]
  wide = Table("wide", "A wide table", "", "Row", columns, [Row("r", ["1"] * len(columns))])
  with pytest.raises(ValueError, match="wide"):
    render.to_markdown(wide)
  columns[-1] = Column("", "c_last", part="other")
  for column in columns[1:-1]:
    column.part = "first"
  split = render.to_markdown(Table("split", "Split", "", "Row", columns, wide.rows))
  assert "### First" in split and "### Other" in split


def test_no_table_is_wider_than_twelve_columns(every_table) -> None:
  """Every table, written or committed, has at most 12 columns (its row labels included):
  Table 1 is one table per model, Table 2 one per setting, each split into accuracy (or ROUGE)
  and cost where still wider."""
  for name, md in {**every_table, **committed_markdown()}.items():
    for header in header_rows(md):
      assert len(header) <= 12, (name, header)
  table1 = sections(every_table["table1"])
  assert list(table1) == [
    f"ResNet-{n}: {part}" for n in (18, 50) for part in ("accuracy and loss", "cost")
  ]
  assert list(sections(every_table["table2_t5_small_random_2ep"])) == [
    f"{s}: {part}" for s in ("LoRA", "Full") for part in ("ROUGE", "perplexity and cost")
  ]


def test_tables_of_your_runs_are_written_where_git_ignores_them(
  runs_root: Path, monkeypatch
) -> None:
  """`python -m results.tables` over the default roots (outputs/, multirun/: your runs, not the
  committed campaign) writes its tables into a folder that git ignores, not beside the
  committed files of the source tree; likewise results.plots."""
  from results import plots

  monkeypatch.chdir(runs_root)  # holds multirun/, as a checkout does after `make train`
  assert tables.main([]) == 0
  (table1,) = runs_root.rglob("table1.md")
  written = table1.relative_to(runs_root).as_posix()
  repo = Path(__file__).resolve().parents[1]
  if shutil.which("git") is None or not (repo / ".git").exists():
    pytest.skip("not a git checkout")
  for path in (written, f"{plots.DEFAULT_OUT}/curves_demo.png"):
    ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=repo, check=False)
    assert ignored.returncode == 0, f"{path} would be written into the source tree"


def test_curvature_every_is_part_of_a_cells_identity(tmp_path: Path) -> None:
  """Ginger every step (K=1) and every 4th step never average."""
  ginger = {"optimizer": "ginger", "tau": 4, "alpha": 0.99}
  make_run(tmp_path, "k1s0", {**ginger, "curvature_every": 1}, best_val_accuracy=72.0)
  make_run(tmp_path, "k1", {**ginger, "seed": 1, "curvature_every": 1}, best_val_accuracy=74.0)
  make_run(tmp_path, "k4", {**ginger, "seed": 2, "curvature_every": 4}, best_val_accuracy=10.0)
  sel = selection.select_runs(tables.collect_runs([tmp_path]), {"optimizer": "ginger", "tau": 4})
  assert sorted(r["best_val_accuracy"] for r in sel.runs) == [72.0, 74.0]
  assert "2 configurations matched" in sel.note and "curvature_every=1" in sel.note


def curvature_every_runs(root: Path) -> Path:
  """The curvature_every sweep at 10 epochs: Adam and Ginger tau=8 at K = 1, 4 (seeds 0, 1),
  K = 8 (seed 0 only, never reaching 85 %), and a K=2 run that diverged."""
  base = {"dataset": "cifar10", "model": "resnet18", "sweep": "curvature_every", "alpha": 0.99}
  ginger = {**base, "optimizer": "ginger", "tau": 8, "lr": 5e-4, "gamma": 1e-5, "rho": 1.0}
  config = {"config": {"epochs": 10, "max_steps": None}}

  def evals(accuracies: list[float], seconds: float) -> list[dict]:
    """One eval per epoch, `seconds` apart, with these accuracies."""
    return [
      {"event": "eval", "step": 390 * (i + 1), "wall_time_s": seconds * (i + 1), "val_accuracy": a}
      for i, a in enumerate(accuracies)
    ]

  adam = {**base, "optimizer": "adam", "alpha": None}
  arms = [
    ("adam", adam, [(60.0, 80.0, 86.0, 85.0), (62.0, 84.0, 85.5, 87.0)], (6e-3, 6.2e-3), 3.0),
    ("k1", {**ginger, "curvature_every": 1}, [(70, 85, 88, 87), (70, 86, 89, 89)], (1e-2,) * 2, 5),
    ("k4", {**ginger, "curvature_every": 4}, [(70, 84, 87, 87), (71, 85, 86, 85)], (7e-3,) * 2, 4),
    ("k8", {**ginger, "curvature_every": 8}, [(60, 70, 80, 84)], (6.6e-3,), 3.5),
  ]
  for name, run, accuracy_runs, step_times, seconds in arms:
    for seed, (accuracies, step_time) in enumerate(zip(accuracy_runs, step_times, strict=True)):
      make_run(
        root,
        f"{name}/seed={seed}",
        {**run, "seed": seed},
        events=evals(list(accuracies), seconds),
        best_val_accuracy=max(accuracies),
        step_time_s=step_time,
        **config,
      )
  make_run(
    root,
    "k2/seed=0",
    {**ginger, "curvature_every": 2},
    status="failed",
    best_val_accuracy=10.0,
    **config,
  )
  return root


def test_curvature_every_table(tmp_path: Path) -> None:
  runs = tables.collect_runs([curvature_every_runs(tmp_path)])
  (name, table), *others = studies.curvature_every_tables(runs)
  assert name == "curvature_every_cifar10_10ep" and not others
  md = render.to_markdown(table)
  assert "CIFAR-10, 10 epochs" in table.title and "NOT COMPARABLE" in table.title
  header = (
    "| Optimizer | K | seeds | Best acc | Final acc | ms/step | × Adam | s to 85% | s to best |"
  )
  rows = [
    # Adam: best 86.0 at 9 s and 87.0 at 12 s; 85 % first at 9 s in both.
    "| Adam |  | 0, 1 | 86.50 ± 0.71 | 86.00 ± 1.41 | 6.1 ± 0.1 | 1.00 | 9 (2/2) | 10 ± 2 |",
    "| Ginger (τ=8) | 1 | 0, 1 | 88.50 ± 0.71 | 88.00 ± 1.41 | 10.0 ± 0.0 | 1.64 | 10 (2/2) "
    "| 15 ± 0 |",
    "| Ginger (τ=8) | 4 | 0, 1 | 86.50 ± 0.71 | 86.00 ± 1.41 | 7.0 ± 0.0 | 1.15 | 10 (2/2) "
    "| 12 ± 0 |",
    # One seed, never at 85 %: counted, not dropped; the diverged K=2 run has no row.
    "| Ginger (τ=8) | 8 | 0 | 84.00 | 84.00 | 6.6 | 1.08 | not reached (0/1) | 14 |",
  ]
  assert md.split("\n")[4 : 4 + 2 + len(rows)] == [header, "|---|" + "---:|" * 8, *rows]
  assert "K=2" not in md and "| 2 |" not in md
  assert "NVIDIA H100 (7)" in table.notes[-1]  # provenance: the 7 runs used


def test_curvature_every_runs_enter_no_other_table(tmp_path: Path) -> None:
  """Its K=1 and Adam runs are 10-epoch runs of the sweep: no Table 1 at 10 epochs from them,
  and a Table 1 cell at 30 epochs never takes one."""
  root = curvature_every_runs(tmp_path / "runs")
  runs = tables.collect_runs([root])
  assert paper_tables.standin_tables(runs) == []
  assert selection.tabulated(runs) == []
  crit = {"dataset": "cifar10", "optimizer": "adam"}
  assert selection.select_runs(runs, crit).runs == []
  assert len(selection.select_runs(runs, crit, ("curvature_every",)).runs) == 2
  out = tmp_path / "out"
  assert tables.main([str(root), "--out", str(out), "--standin-only"]) == 0
  assert sorted(p.name for p in out.iterdir()) == [
    "curvature_every_cifar10_10ep.md",
    "curvature_every_cifar10_10ep.tex",
  ]
  assert r"\times" in (out / "curvature_every_cifar10_10ep.tex").read_text()


def test_batchnorm_modes_never_share_a_cell(tmp_path: Path) -> None:
  """per_device runs, and per_device runs on other device counts, are other configurations than
  sync runs."""

  def run(name: str, seed: int, **fields: Any) -> None:
    d = tmp_path / name
    d.mkdir()
    base = {"experiment": "e", "model": "resnet18", "dataset": "cifar10", "optimizer": "adam"}
    summary = {"run": {**base, "lr": 1e-3, "seed": seed, **fields}, "status": "completed"}
    (d / "summary.json").write_text(json.dumps(summary))

  run("sync0", 0, batchnorm="sync", batchnorm_groups=None)
  run("sync1", 1, batchnorm="sync", batchnorm_groups=None)
  run("per4", 0, batchnorm="per_device", batchnorm_groups=4)
  run("per2", 0, batchnorm="per_device", batchnorm_groups=2)
  runs = tables.collect_runs([tmp_path])
  keys = {selection.config_key(r) for r in runs}
  assert len(keys) == 3
  sync0, sync1 = (r for r in runs if "sync" in Path(r["path"]).name)
  assert selection.config_key(sync0) == selection.config_key(sync1)


def test_ginger_cells_prefer_the_default_variant(tmp_path: Path) -> None:
  """A Ginger cell of Tables 1-4 takes the default variant (rho=1, per-tensor: the optimizer
  config's and the authors' code's) even when ablation variants of the same (tau, alpha) have
  more seeds or are newer; with no default-variant run it falls back and says which it used."""
  ginger = {"optimizer": "ginger", "tau": 4, "alpha": 0.99}
  specs = [
    ("default", {"rho": 1.0, "block": "per_tensor", "sweep": "table1"}, 0, 88.0),
    ("unclipped0", {"rho": None, "block": "per_tensor", "sweep": "ablation"}, 0, 86.0),
    ("unclipped1", {"rho": None, "block": "per_tensor", "sweep": "ablation"}, 1, 86.5),
    ("global0", {"rho": 1.0, "block": "global", "sweep": "ablation"}, 0, 86.2),
  ]
  for i, (name, variant, seed, acc) in enumerate(specs):
    run_dir = make_run(tmp_path, name, {**ginger, **variant, "seed": seed}, best_val_accuracy=acc)
    os.utime(run_dir / "summary.json", (1000 + i, 1000 + i))
  runs = tables.collect_runs([tmp_path])
  crit = selection.cell_criteria("ginger", 4)
  for sweeps in ((), ("table34",)):
    sel = selection.select_runs(runs, crit, sweeps)
    assert [r["best_val_accuracy"] for r in sel.runs] == [88.0]
    assert sel.note is None
  others = [r for r in runs if tables.rfield(r, "sweep") == "ablation"]
  fallback = selection.select_runs(others, crit)
  assert [r["best_val_accuracy"] for r in fallback.runs] == [86.0, 86.5]
  assert "default variant" in fallback.note and "rho=None" in fallback.note


def test_state_dtype_and_precision_are_part_of_a_cells_identity(tmp_path: Path) -> None:
  """A Ginger run with a bf16 state (or bf16 compute) is another configuration: it never averages
  with, nor (as the newer run of a seed) replaces, the float32 runs a Table 1-4 cell stands for;
  it fills a cell only where no float32 run exists, and the note says so."""
  ginger = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  make_run(tmp_path, "f32s0", ginger, best_val_accuracy=72.0)
  make_run(tmp_path, "f32", {**ginger, "seed": 1, "state_dtype": "float32"}, best_val_accuracy=74.0)
  make_run(tmp_path, "bf16", {**ginger, "state_dtype": "bfloat16"}, best_val_accuracy=10.0)
  make_run(tmp_path, "bf16c", {**ginger, "seed": 1, "precision": "bfloat16"}, best_val_accuracy=9.0)
  runs = tables.collect_runs([tmp_path])
  sel = selection.select_runs(runs, {"optimizer": "ginger", "tau": 4})
  assert sorted(r["best_val_accuracy"] for r in sel.runs) == [72.0, 74.0]
  only_bf16 = [r for r in runs if Path(r["path"]).name == "bf16"]
  sel = selection.select_runs(only_bf16, {"optimizer": "ginger", "tau": 4})
  assert [r["best_val_accuracy"] for r in sel.runs] == [10.0]
  assert "no run of the default variant" in sel.note and "state_dtype=bfloat16" in sel.note


def test_runs_differing_in_any_setting_never_share_a_cell(tmp_path: Path) -> None:
  """Two runs of one identity that differ in a setting outside the "run" block (here the batch
  size) are two configurations: never averaged, and a rerun of a seed at another batch size does
  not replace the first; the note names the key. The seed, the sweep, its labels (arm, scale) and
  where the data lies are not settings."""
  ginger = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}

  def config(batch_size: int, **more: Any) -> dict:
    return {"config": {"epochs": 200, "max_steps": None, "batch_size": batch_size, **more}}

  make_run(tmp_path, "b128s0", ginger, best_val_accuracy=72.0, **config(128, seed=0))
  make_run(tmp_path, "b128s1", {**ginger, "seed": 1}, best_val_accuracy=74.0, **config(128, seed=1))
  elsewhere = config(128, seed=2, sweep="table3", arm="ginger_tau4", scale="full")
  elsewhere["config"]["data"] = {"path": "/elsewhere/cifar"}
  make_run(tmp_path, "b128s2", {**ginger, "seed": 2}, best_val_accuracy=73.0, **elsewhere)
  make_run(tmp_path, "b256s0", ginger, best_val_accuracy=10.0, **config(256, seed=0))
  sel = selection.select_runs(tables.collect_runs([tmp_path]), {"optimizer": "ginger", "tau": 4})
  assert sorted(r["best_val_accuracy"] for r in sel.runs) == [72.0, 73.0, 74.0]
  assert "2 configurations matched" in sel.note and "batch_size=128" in sel.note


def test_ablation_rows_keep_one_configuration_per_variant(tmp_path: Path) -> None:
  """The ablation table's variants (rho, block, lr, gamma) hold one configuration each: a run of
  the same variant at another batch size does not replace or average with it; a note says so."""
  ginger = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "sweep": "ablation"}
  clip = {**ginger, "rho": 1.0, "block": "per_tensor"}

  def config(batch_size: int) -> dict:
    return {"config": {"epochs": 200, "max_steps": None, "batch_size": batch_size}}

  make_run(tmp_path, "clip128", clip, best_val_accuracy=72.0, **config(128))
  make_run(tmp_path, "clip128s1", {**clip, "seed": 1}, best_val_accuracy=74.0, **config(128))
  make_run(tmp_path, "clip256", clip, best_val_accuracy=10.0, **config(256))
  make_run(
    tmp_path, "noclip", {**ginger, "rho": None, "block": "per_tensor"}, best_val_accuracy=60.0
  )
  table = ablation.build_ablation(tables.collect_runs([tmp_path]))
  assert any("2 configurations matched" in n and "batch_size=128" in n for n in table.notes)
  clip_row = next(row.cells for row in table.rows if row.label.startswith("ρ=1.0"))
  assert "73.00 ± 1.41" in clip_row  # the batch-128 pair, the batch-256 run neither mixed in
  # nor replacing seed 0


def test_a_missing_root_is_an_error(tmp_path: Path, capsys) -> None:
  """A root named on the command line that does not exist (a typo) is refused; before, it wrote
  blank tables and exited 0."""
  out = tmp_path / "tables"
  assert tables.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
  assert f"no such run root(s): {tmp_path / 'missing'}" in capsys.readouterr().err
  assert not out.exists()


def test_a_run_that_shared_its_device_counts_for_accuracy_not_memory(tmp_path: Path) -> None:
  """A third Adam seed run beside others on one GPU (``device_shared``): it joins the mean
  accuracy (n = 3), while the memory column stays the two runs alone (3.25, not ~5)."""
  root = tmp_path / "table1"
  make_run(root, "0", {"seed": 0}, **image(72.0, 1.2, 1e-5, 2.4e9, 3_200_000_000))
  make_run(root, "1", {"seed": 1}, **image(73.0, 1.3, 2e-5, 2.4e9, 3_300_000_000))
  shared = image(75.0, 1.25, 1.5e-5, 2.4e9, 9_900_000_000)
  make_run(root, "2", {"seed": 2}, device_shared=True, **shared)
  md = render.to_markdown(paper_tables.build_table1(tables.collect_runs([root])))
  adam, adam_cost = (line for line in md.splitlines() if line.startswith("| Adam | 3 |"))
  assert adam.startswith("| Adam | 3 | 73.33 ± 1.53 |"), adam
  assert "| 3.25 ± 0.07 | 3.16 |" in adam_cost, adam_cost
  assert "1 of them shared a GPU with other runs" in md


def test_train_records_whether_the_device_was_shared(monkeypatch) -> None:
  from training import summary

  monkeypatch.delenv("GINGER_DEVICE_SHARED", raising=False)
  assert summary.device_shared() is False
  monkeypatch.setenv("GINGER_DEVICE_SHARED", "1")
  assert summary.device_shared() is True
  monkeypatch.setenv("GINGER_DEVICE_SHARED", "0")
  assert summary.device_shared() is False


def test_damaged_records_are_named(tmp_path: Path, capsys) -> None:
  """A truncated summary.json is skipped and named with why; a value of the wrong type is an
  error naming the file and the key (it used to count as a run with a blank cell)."""
  root = tmp_path / "runs"
  make_run(root, "good", {"seed": 0}, **image(72.0, 1.2, 1e-5, 2.4e9, 3_200_000_000))
  torn = make_run(root, "torn", {"seed": 1}, **image(73.0, 1.3, 2e-5, 2.4e9, 3_300_000_000))
  (torn / "summary.json").write_text((torn / "summary.json").read_text()[:40])
  assert tables.main([str(root), "--out", str(tmp_path / "out")]) == 0
  assert f"skipped {torn}: summary.json is not a readable JSON object" in capsys.readouterr().err
  make_run(root, "oops", {"seed": 2}, **{**image(1.0, 1.0, 1.0, 1.0, 1), "best_val_accuracy": "x"})
  assert tables.main([str(root), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert str(root / "oops" / "summary.json") in err and "best_val_accuracy is 'x'" in err


def test_comparisons_carry_welch_intervals_and_read_ties_as_ties(tmp_path):
  """Each comparison row: both samples, the difference of means with its Welch interval
  (results.stats), and a reading that follows the interval; the QNG clip control appears
  once it has runs."""
  root = tmp_path / "runs"
  ginger = {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  qng = {"optimizer": "qng", "tau": 8, "alpha": 0.99, "block": "global"}
  samples = {
    "adam": ({}, [88.0, 87.6, 88.3]),
    "ginger": (ginger, [88.1, 88.4, 87.9]),
    "qng": (qng, [86.4, 86.5, 86.2]),
  }
  for name, (run, accs) in samples.items():
    for seed, acc in enumerate(accs):
      make_run(root, f"{name}{seed}", {**run, "seed": seed}, best_val_accuracy=acc)
  runs = tables.collect_runs([root])
  table = comparisons.build_comparisons(runs, "cifar100", ["resnet18"])
  rows = {r.label: r.cells for r in table.rows}
  assert set(rows) == {"Ginger τ=8 − Adam", "Ginger τ=8 − QNG τ=8", "QNG τ=8 − Adam"}
  tie = stats.welch(samples["ginger"][1], samples["adam"][1])
  assert rows["Ginger τ=8 − Adam"] == [
    "88.13 ± 0.25 (n=3)",
    "87.97 ± 0.35 (n=3)",
    tie.text(),
    "tie",
    "Ginger − Adam over τ (1)",
    f"{tie.p:.2g}",
    "tie",
    f"[{tie.low:+.2f}, {tie.high:+.2f}]",  # a family of one: its simultaneous interval is Welch's
  ]
  assert rows["Ginger τ=8 − QNG τ=8"][3] == "above"
  assert rows["QNG τ=8 − Adam"][3] == "below"
  clipped = {**qng, "rho": 1.0, "block": "per_tensor", "sweep": "qng_control"}
  for seed, acc in enumerate([87.0, 87.2]):
    make_run(root, f"control{seed}", {**clipped, "seed": seed}, best_val_accuracy=acc)
  runs = tables.collect_runs([root])
  rows = {
    r.label: r.cells for r in comparisons.build_comparisons(runs, "cifar100", ["resnet18"]).rows
  }
  assert rows["Ginger τ=8 − QNG τ=8 clipped"][1] == "87.10 ± 0.14 (n=2)"
  assert rows["QNG τ=8 clipped − QNG τ=8"][3] == "above"
  # Table 1's QNG cell stays the unclipped global variant: the control does not leak into it.
  table1 = paper_tables.build_table1(runs, "cifar100", ["resnet18"])
  qng_row = next(r for r in table1.rows if r.label == "QNG (τ=8)")
  assert qng_row.cells[0] == "3"


def test_final_comparisons_read_each_runs_last_evaluation(tmp_path):
  """The final-accuracy comparisons: the same pairs and families as the best accuracy's, on
  each run's last evaluation (the end of its training) instead of the best of them; a set
  whose runs logged no evaluations has no such table."""
  root = tmp_path / "runs"
  ginger = {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  samples = {  # (run, [(best, last)] per seed): Ginger's best is higher, its last lower
    "adam": ({}, [(88.0, 87.9), (87.6, 87.5), (88.3, 88.0)]),
    "ginger": (ginger, [(88.9, 87.0), (89.0, 87.2), (88.8, 86.9)]),
  }
  for name, (run, pairs) in samples.items():
    for seed, (best, last) in enumerate(pairs):
      events = [
        {"event": "eval", "step": 10, "val_accuracy": best},
        {"event": "eval", "step": 20, "val_accuracy": last},
      ]
      make_run(root, f"{name}{seed}", {**run, "seed": seed}, events=events, best_val_accuracy=best)
  runs = tables.collect_runs([root])
  best = {
    r.label: r.cells for r in comparisons.build_comparisons(runs, "cifar100", ["resnet18"]).rows
  }
  table = comparisons.build_final_comparisons(runs, "cifar100", ["resnet18"])
  assert table.name == "comparisons_final_cifar100"
  final = {r.label: r.cells for r in table.rows}
  assert set(final) == set(best) == {"Ginger τ=8 − Adam"}
  assert best["Ginger τ=8 − Adam"][3] == "above"
  lasts = {name: [last for _, last in pairs] for name, (_, pairs) in samples.items()}
  below = stats.welch(lasts["ginger"], lasts["adam"])
  assert final["Ginger τ=8 − Adam"][:4] == [
    "87.03 ± 0.15 (n=3)",
    "87.80 ± 0.26 (n=3)",
    below.text(),
    "below",
  ]
  assert final["Ginger τ=8 − Adam"][4] == "Ginger − Adam over τ (1)"
  without_evals = [r for r in runs if r is not None]
  for run in without_evals:
    (Path(run["path"]) / "metrics.jsonl").unlink()
  runs = tables.collect_runs([root])
  assert not comparisons.build_final_comparisons(runs, "cifar100", ["resnet18"]).rows


def test_comparisons_read_each_family_after_holms_correction(tmp_path):
  """Ginger against Adam at three taus is one family of m = 3: each row keeps its uncorrected
  Welch interval and reading beside the Holm-adjusted p-value and reading and the simultaneous
  interval (each at 1 - 0.05 / 3); a margin that clears 0.05 alone but not after the correction
  reads as a tie; the pairs of taus form a family of their own."""
  root = tmp_path / "runs"
  ginger = {"optimizer": "ginger", "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  adam = [88.0, 87.9, 88.1]
  samples = {
    "adam": ({}, adam),
    "g1": ({**ginger, "tau": 1}, [88.0, 88.1, 87.9]),
    "g2": ({**ginger, "tau": 2}, [88.3, 88.15, 88.4]),  # p 0.040: 0.081 after Holm
    "g4": ({**ginger, "tau": 4}, [89.0, 89.1, 88.9]),
  }
  rows = _comparison_rows(root, samples)
  diffs = [stats.welch(samples[k][1], adam) for k in ("g1", "g2", "g4")]
  adjusted = stats.holm([d.p for d in diffs])
  for k, (tau, d, p) in enumerate(zip((1, 2, 4), diffs, adjusted, strict=True)):
    cells = rows[f"Ginger τ={tau} − Adam"]
    assert cells[2:] == [
      d.text(),
      d.verdict,
      "Ginger − Adam over τ (3)",
      f"{p:.2g}",
      stats.holm_verdicts(diffs)[k],
      "[{0.low:+.2f}, {0.high:+.2f}]".format(
        stats.welch(samples[f"g{tau}"][1], adam, 1 - 0.05 / 3)
      ),
    ]
  assert rows["Ginger τ=2 − Adam"][3] == "above" and rows["Ginger τ=2 − Adam"][6] == "tie"
  assert rows["Ginger τ=4 − Adam"][6] == "above"
  assert rows["Ginger τ=4 − τ=1"][4] == "Ginger τ pairs (3)"


def _comparison_rows(root, samples) -> dict[str, list[str]]:
  """ResNet-18 runs of ``samples`` ({name: (run fields, best accuracy per seed)}) under
  ``root``: the comparisons table's cells by row label."""
  for name, (run, accs) in samples.items():
    for seed, acc in enumerate(accs):
      make_run(root, f"{name}{seed}", {**run, "seed": seed}, best_val_accuracy=acc)
  return {
    r.label: r.cells
    for r in comparisons.build_comparisons(
      tables.collect_runs([root]), "cifar100", ["resnet18"]
    ).rows
  }


def test_comparisons_cover_the_ablation_variants(tmp_path):
  """Each ablation variant of Ginger (clip rho, block) at one tau is compared with the
  authors' variant (clip, per-tensor; Table 1's runs of that configuration pool into it) and
  with Adam; the two unclipped variants with each other (the block without the clip)."""
  root = tmp_path / "runs"
  authors = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  samples = {
    "adam": ({}, [88.0, 87.6, 88.3]),
    "authors": (authors, [88.1, 88.4, 87.9]),
    "global": ({**authors, "block": "global", "sweep": "ablation"}, [85.2, 86.6]),
    "free": ({**authors, "rho": None, "lr": 1e-6, "sweep": "ablation"}, [86.9, 86.5]),
    "free_global": (
      {**authors, "rho": None, "block": "global", "lr": 1e-6, "sweep": "ablation"},
      [86.6],
    ),
  }
  rows = _comparison_rows(root, samples)
  welch = stats.welch
  expected = {
    "Ginger τ=4 ρ=1 global − ρ=1 per-tensor": welch(samples["global"][1], samples["authors"][1]),
    "Ginger τ=4 no clip per-tensor − ρ=1 per-tensor": welch(
      samples["free"][1], samples["authors"][1]
    ),
    "Ginger τ=4 ρ=1 global − Adam": welch(samples["global"][1], samples["adam"][1]),
    "Ginger τ=4 no clip per-tensor − Adam": welch(samples["free"][1], samples["adam"][1]),
  }
  for label, diff in expected.items():
    assert rows[label][2:4] == [diff.text(), diff.verdict], label
  assert rows["Ginger τ=4 ρ=1 global − ρ=1 per-tensor"][:2] == [
    "85.90 ± 0.99 (n=2)",
    "88.13 ± 0.25 (n=3)",
  ]
  # one seed: named, no interval
  assert rows["Ginger τ=4 no clip global − no clip per-tensor"][3] == "n < 2"
  assert rows["Ginger τ=4 no clip global − ρ=1 per-tensor"][3] == "n < 2"
  assert "Ginger τ=4 ρ=1 per-tensor − Adam" not in rows  # Table 1's row says it
  # Variants at another alpha: rows of their own, named by it.
  at_alpha = {
    f"{name}_a9_": ({**samples[name][0], "alpha": 0.9}, samples[name][1])
    for name in ("authors", "global")
  }
  rows = _comparison_rows(root, at_alpha)
  assert rows["Ginger τ=4 α=0.9 ρ=1 global − ρ=1 per-tensor"][:5] == [
    "85.90 ± 0.99 (n=2)",
    "88.13 ± 0.25 (n=3)",
    welch(samples["global"][1], samples["authors"][1]).text(),
    "tie",
    "ablation τ=4 α=0.9 (2)",  # a family of its own, apart from alpha 0.99's
  ]
  assert rows["Ginger τ=4 ρ=1 global − ρ=1 per-tensor"][:2] == [
    "85.90 ± 0.99 (n=2)",
    "88.13 ± 0.25 (n=3)",
  ]


def test_clip_fraction_table_averages_the_logged_share_by_stretch(tmp_path):
  root = tmp_path / "runs"
  ginger = {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  events = [
    {"event": "train", "step": s, "epoch": s / 10, "clip_fraction": f}
    for s, f in [(5, 0.4), (10, 0.2), (30, 0.1), (300, 0.3)]
  ]
  make_run(root, "clip", ginger, events=events, best_val_accuracy=88.0)
  make_run(root, "adam", {}, events=[{"event": "train", "step": 5, "epoch": 0.5}])
  table = studies.build_clip_fraction(tables.collect_runs([root]), "cifar100")
  assert [r.label for r in table.rows] == ["Ginger (τ=8), clip ρ=1, per_tensor (table1)"]
  # epochs 0-1: 0.4 and 0.2; 1-5: 0.1; 20-end: 0.3; whole run: 0.25
  assert table.rows[0].cells == [
    "0.001",
    "0",
    "30.0 %",
    "10.0 %",
    "",
    "",
    "30.0 %",
    "25.0 %",
    "88.00",
  ]


@pytest.mark.parametrize(
  "key, values, labels",
  [
    (
      "alpha",
      (0.9, 0.99),
      [
        "Ginger (τ=8), clip ρ=1, per_tensor (table1)",
        "Ginger (τ=8), clip ρ=1, α=0.9, per_tensor (table1)",
      ],
    ),
    # the curvature_every sweep runs K = 1 and K = 8 at one tau and seed
    (
      "curvature_every",
      (1, 8),
      [
        "Ginger (τ=8), clip ρ=1, K=8, per_tensor (table1)",
        "Ginger (τ=8), clip ρ=1, per_tensor (table1)",
      ],
    ),
  ],
)
def test_clip_fraction_table_names_a_setting_other_than_the_papers(tmp_path, key, values, labels):
  """An alpha other than the paper's, or a curvature update every K > 1 steps, is named in the
  run's label: two such runs at one tau and seed do not share one."""
  root = tmp_path / "runs"
  events = [{"event": "train", "step": 5, "epoch": 0.5, "clip_fraction": 0.2}]
  ginger = {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  for value in values:
    make_run(root, f"{key}{value}", {**ginger, key: value}, events=events, best_val_accuracy=88.0)
  table = studies.build_clip_fraction(tables.collect_runs([root]), "cifar100")
  assert sorted(r.label for r in table.rows) == labels


def test_an_ablation_variant_at_two_learning_rates_is_two_comparisons(tmp_path):
  """A variant (clip, block) that ran at two learning rates is two cells, each named by its lr,
  each compared with the authors' variant and Adam: neither lr's runs stand for the other's."""
  root = tmp_path / "runs"
  authors = {"optimizer": "ginger", "tau": 4, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  free = {**authors, "rho": None, "sweep": "ablation"}
  samples = {
    "adam": ({}, [88.0, 87.6, 88.3]),
    "authors": (authors, [88.1, 88.4, 87.9]),
    "slow": ({**free, "lr": 1e-6}, [86.9, 86.5]),
    "fast": ({**free, "lr": 1e-5}, [80.1, 81.0, 80.4]),
  }
  rows = _comparison_rows(root, samples)
  welch = stats.welch
  for name, lr in (("slow", "1e-06"), ("fast", "1e-05")):
    diff = welch(samples[name][1], samples["authors"][1])
    label = f"Ginger τ=4 no clip per-tensor lr={lr} − ρ=1 per-tensor"
    assert rows[label][2:4] == [diff.text(), diff.verdict], label
    assert f"Ginger τ=4 no clip per-tensor lr={lr} − Adam" in rows


def test_comparisons_hold_the_curvature_every_family(tmp_path: Path) -> None:
  """The curvature_every sweep's cells are compared too, one family: each K against Adam and
  each K > 1 against K = 1 (the diverged K=2 run has no cell, the one-seed K=8 no interval)."""
  runs = tables.collect_runs([curvature_every_runs(tmp_path)])
  rows = {
    r.label: r.cells
    for r in comparisons.build_comparisons(runs, "cifar10", ["resnet18"], "10ep").rows
  }
  assert set(rows) == {
    "Ginger τ=8 K=1 − Adam",
    "Ginger τ=8 K=4 − Adam",
    "Ginger τ=8 K=4 − K=1",
    "Ginger τ=8 K=8 − Adam",
    "Ginger τ=8 K=8 − K=1",
  }
  expected = stats.welch([88.0, 89.0], [86.0, 87.0])
  assert rows["Ginger τ=8 K=1 − Adam"][:5] == [
    "88.50 ± 0.71 (n=2)",
    "86.50 ± 0.71 (n=2)",
    expected.text(),
    expected.verdict,
    "curvature every K (3)",
  ]
  assert rows["Ginger τ=8 K=8 − K=1"][3] == "n < 2"


def dpass_runs(root: Path) -> Path:
  """Ginger tau 8 on CIFAR-10 (30 epochs): the paper's d-pass (eval forward) at K = 1 in the
  table1 sweep and at K = 8 in the curvature_every sweep; the shared forward at K = 1 and 8 and
  the eval forward on 32 examples at K = 1 in the table1 sweep, with more seeds and newer."""
  ginger = {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  ginger |= {"dataset": "cifar10", "model": "resnet18", "experiment": "cifar10_resnet18_30ep"}
  arms = [
    ("eval", None, 1, "table1", (88.0, 88.4)),
    ("shared", None, 1, "table1", (87.6, 87.9, 87.7)),
    ("eval", 32, 1, "table1", (88.1, 88.2, 88.3)),
    ("eval", None, 8, "curvature_every", (88.2, 88.0)),
    ("shared", None, 8, "table1", (88.3, 88.1, 88.2)),
  ]
  for i, (forward, batch, every, sweep, accs) in enumerate(arms):
    for seed, acc in enumerate(accs):
      run = {**ginger, "fisher_forward": forward, "curvature_every": every, "sweep": sweep}
      run |= {"seed": seed} | ({"fisher_batch": batch} if batch else {})
      name = f"{forward}{batch or ''}_k{every}_s{seed}"
      run_dir = make_run(root, name, run, config={"epochs": 30}, best_val_accuracy=acc)
      os.utime(run_dir / "summary.json", (1000 + i, 1000 + i))
  return root


def test_paper_cells_take_the_papers_d_pass(tmp_path: Path) -> None:
  """Table 1's Ginger cell holds the paper's d-pass (eval forward, whole batch) although the
  shared forward and the 32-example d-pass have more seeds and newer runs of the same arm."""
  runs = tables.collect_runs([dpass_runs(tmp_path)])
  sel = selection.table1_cell(runs, "ginger", 8, dataset="cifar10", length="30ep")
  assert [r["best_val_accuracy"] for r in sel.runs] == [88.0, 88.4] and sel.note is None
  table = ablation.build_ablation(runs, selection.image_protocol("cifar10", "30ep"))
  assert not table.rows  # the d-pass variants are not ablation variants of the clip or block


def test_the_d_pass_table_compares_each_d_pass_with_the_papers_at_its_k(tmp_path: Path) -> None:
  """dpass_cifar10_30ep: each other d-pass against the paper's at the same K, Welch and Holm
  over the three; the comparisons file holds the same family."""
  runs = tables.collect_runs([dpass_runs(tmp_path)])
  table = comparisons.build_dpass(runs, "cifar10", "30ep")
  rows = {r.label: r.cells for r in table.rows}
  assert set(rows) == {
    "Ginger τ=8 K=1, d-pass shared forward − the paper's d-pass",
    "Ginger τ=8 K=1, d-pass first 32 examples − the paper's d-pass",
    "Ginger τ=8 K=8, d-pass shared forward − the paper's d-pass",
  }
  expected = stats.welch([88.3, 88.1, 88.2], [88.2, 88.0])
  k8 = rows["Ginger τ=8 K=8, d-pass shared forward − the paper's d-pass"]
  assert k8[2:5] == [expected.text(), expected.verdict, "d-pass − the paper's d-pass (3)"]
  shared = rows["Ginger τ=8 K=1, d-pass shared forward − the paper's d-pass"]
  assert shared[:2] == ["87.73 ± 0.15 (n=3)", "88.20 ± 0.28 (n=2)"]
  listed = comparisons.build_comparisons(runs, "cifar10", ["resnet18"], "30ep")
  assert {r.label for r in listed.rows} >= set(rows)


def test_a_d_pass_cell_takes_the_newest_run_of_each_seed_from_either_sweep(
  tmp_path: Path,
) -> None:
  """A d-pass arm with runs in both sweeps (the table1 seeds 0-2, a cold race's seeds 0-4 in the
  curvature_every sweep, newer) pools them by the tables' rule: one run per seed, the newest."""
  root = dpass_runs(tmp_path)
  ginger = {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0, "block": "per_tensor"}
  ginger |= {"dataset": "cifar10", "model": "resnet18", "experiment": "cifar10_resnet18_30ep"}
  race = (87.5, 87.8, 87.6, 87.8, 88.0)
  for seed, acc in enumerate(race):
    run = {**ginger, "fisher_forward": "shared", "curvature_every": 1, "seed": seed}
    run_dir = make_run(
      root,
      f"race_shared_k1_s{seed}",
      {**run, "sweep": "curvature_every"},
      config={"epochs": 30},
      best_val_accuracy=acc,
    )
    os.utime(run_dir / "summary.json", (2000, 2000))
  runs = tables.collect_runs([root])
  rows = {r.label: r.cells for r in comparisons.build_dpass(runs, "cifar10", "30ep").rows}
  shared = rows["Ginger τ=8 K=1, d-pass shared forward − the paper's d-pass"]
  expected = stats.welch(list(race), [88.0, 88.4])
  mean, std = statistics.mean(race), statistics.stdev(race)
  assert shared[:3] == [f"{mean:.2f} ± {std:.2f} (n=5)", "88.20 ± 0.28 (n=2)", expected.text()]


def test_the_t5_standins_training_loss_is_compared_over_tau(tmp_path: Path) -> None:
  """Table 2's testable claim on the stand-in (larger tau, lower training loss in full
  fine-tuning): the minimum training loss of each Ginger tau against Adam and of each pair of
  taus, Welch intervals with Holm over each family; a setting with one seed a cell tests
  nothing and writes no file."""
  xsum = {"dataset": "xsum", "model": "t5-small-random", "setting": "full", "sweep": "table2"}
  arms = [
    (("adam", None), (5.0, 5.2, 5.1)),
    (("ginger", 1), (5.4, 5.3, 5.5)),
    (("ginger", 8), (5.2, 5.3, 5.25)),
    (("ginger", 32), (4.9, 5.0, 4.95)),
  ]
  for (optimizer, tau), losses in arms:
    for seed, loss in enumerate(losses):
      run = {**xsum, "optimizer": optimizer, "tau": tau, "seed": seed}
      run |= {"alpha": 0.99} if tau else {}
      make_run(
        tmp_path / "full",
        f"{optimizer}{tau}_{seed}",
        run,
        min_train_loss=loss,
        config={"epochs": 2, "max_steps": None},
      )
  lora = {**xsum, "setting": "lora", "optimizer": "adam"}
  make_run(
    tmp_path / "lora", "adam", lora, min_train_loss=6.0, config={"epochs": 2, "max_steps": None}
  )
  runs = tables.collect_runs([tmp_path])
  [(name, table)] = comparisons.loss_comparison_tables(runs)
  assert name == "comparisons_t5_small_random_2ep"
  rows = {r.label: r.cells for r in table.rows}
  expected = stats.welch([4.9, 5.0, 4.95], [5.4, 5.3, 5.5])
  pair = rows["Full: Ginger τ=32 − τ=1"]
  assert pair[2:5] == [expected.text(), expected.verdict, "Ginger τ pairs, Full (3)"]
  assert rows["Full: Ginger τ=8 − Adam"][4] == "Ginger − Adam over τ, Full (3)"
  assert not any(label.startswith("LoRA") for label in rows)
  assert "minimum training loss" in table.caption.lower()
  assert comparisons.loss_comparison_tables(tables.collect_runs([tmp_path / "lora"])) == []
