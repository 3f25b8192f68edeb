"""The wall-clock race: how long each run took to reach a validation accuracy, from its records.

    python -m bench.race multirun/curvature_every [--target 85]
    python -m bench.race races/cold races/warm      # run dirs collected into folders by kind

Every folder below the given ones that holds a run's ``summary.json`` and ``metrics.jsonl`` is
one row, grouped by the given folder and the first folder below it (a sweep's experiment,
``curvature_every/cifar10_resnet18_30ep``, whose arms and seeds lie deeper; or ``races/cold``
and ``races/warm``: whether the compilation cache held the run's programs); a run directly
inside a given folder is grouped by that folder. Then optimizer, Ginger's K
(``curvature_every``) and d-pass forward, seed, the seconds its programs took to lower and
compile (or to read from the cache) and how they were lowered (read back from the programs an
earlier run kept, exported, traced), the epochs and the seconds to the first evaluation at
``--target`` % or more, the best accuracy and the seconds to it, and the median step time.
Seconds count from the training loop's start (``metrics.jsonl``'s ``wall_time_s``: compilation
and evaluations included, building the data and model not). Then the mean of each (group, run)
over its seeds, and each run's difference from Adam of its group in seconds to the target with
its Welch 95 % interval (:func:`results.stats.welch`, over the seeds that reached the target; a
tie where the interval contains 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from results.stats import welch
from training import run_record

HEADER = (
  "| group | run | seed | compile s | programs | epochs to {t} % | s to {t} % | best acc % "
  "| s to best | ms/step |"
)


class Race(NamedTuple):
  group: str
  run: str
  seed: int
  compile_s: float
  # How its programs were lowered (summary.json's startup_s.per_program: "read" back from the
  # programs an earlier run kept, "exported", "traced"; "" where the record lacks it)
  programs: str
  epochs_to_target: int | None
  s_to_target: float | None
  best: float
  s_to_best: float
  ms_per_step: float


def run_label(summary: dict) -> str:
  """``adam``, ``ginger tau=8 K=8`` (``, shared forward`` where not the default eval one), then
  the numerics where not float32: ``, bfloat16 state``, ``, bfloat16 compute``."""
  run = summary["run"]
  label = run["optimizer"]
  if run["optimizer"] == "ginger":
    label = f"ginger tau={run['tau']} K={run['curvature_every']}"
    label += ", shared forward" if run.get("fisher_forward") == "shared" else ""
  names = {"precision": "compute", "state_dtype": "state"}
  narrow = run_record.narrow_numerics(run)
  return label + "".join(f", {value} {names[key]}" for key, value in narrow.items())


def race(run_dir: Path, target: float, group: str) -> Race:
  summary = json.loads((run_dir / "summary.json").read_text())
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  evals = [e for e in map(json.loads, lines) if e["event"] == "eval"]
  if not evals:
    raise ValueError(f"{run_dir}: no evaluation in metrics.jsonl")
  per_epoch = summary["steps_per_epoch"]
  hit = next((e for e in evals if e["val_accuracy"] >= target), None)
  best = max(evals, key=lambda e: e["val_accuracy"])
  return Race(
    group,
    run_label(summary),
    summary["run"]["seed"],
    summary["startup_s"]["lower_and_compile"],
    programs_of(summary),
    None if hit is None else round(hit["step"] / per_epoch),
    None if hit is None else hit["wall_time_s"],
    best["val_accuracy"],
    best["wall_time_s"],
    1e3 * summary["step_time_s"],
  )


def programs_of(summary: dict) -> str:
  """The ways the run's programs were lowered, e.g. "read" or "exported" ("" if unrecorded)."""
  per_program = summary["startup_s"].get("per_program", {}).values()
  return "/".join(sorted({p["program"] for p in per_program if "program" in p}))


def group_of(run_dir: Path, folder: Path) -> str:
  """``folder``'s name and the first folder below it on the way to ``run_dir`` (``folder``'s
  name alone for a run directly inside it): the arms of a sweep's experiment share a group."""
  parts = run_dir.relative_to(folder).parts
  return "/".join([folder.resolve().name, *parts[:-1][:1]])


def collect(folders: list[Path], target: float) -> list[Race]:
  rows = []
  for folder in folders:
    for summary in sorted(folder.rglob("summary.json")):
      run_dir = summary.parent
      if (run_dir / "metrics.jsonl").is_file():
        rows.append(race(run_dir, target, group_of(run_dir, folder)))
  return sorted(rows, key=lambda r: (r.group, r.run, r.seed))


def _cell(x, fmt: str) -> str:
  return "" if x is None else format(x, fmt)


def table(rows: list[Race], target: float) -> str:
  header = HEADER.format(t=f"{target:g}")
  out = [header, "|---" * (header.count("|") - 1) + "|"]
  for r in rows:
    out.append(
      f"| {r.group} | {r.run} | {r.seed} | {r.compile_s:.1f} | {r.programs} "
      f"| {_cell(r.epochs_to_target, 'd')} "
      f"| {_cell(r.s_to_target, '.1f')} | {r.best:.2f} | {r.s_to_best:.1f} "
      f"| {r.ms_per_step:.2f} |"
    )
  return "\n".join(out)


def means(rows: list[Race]) -> str:
  """Mean over seeds of each (group, run); s to target over the seeds that got there."""
  cells = defaultdict(list)
  for r in rows:
    cells[(r.group, r.run)].append(r)
  out = ["| group | run | seeds | epochs to target | s to target | s to best |", "|---" * 6 + "|"]
  for (group, run), rs in sorted(cells.items()):
    hit = [r for r in rs if r.s_to_target is not None]
    mean = lambda xs: f"{statistics.fmean(xs):.1f}" if xs else ""  # noqa: E731
    out.append(
      f"| {group} | {run} | {len(rs)} ({len(hit)} reached) "
      f"| {mean([r.epochs_to_target for r in hit])} | {mean([r.s_to_target for r in hit])} "
      f"| {mean([r.s_to_best for r in rs])} |"
    )
  return "\n".join(out)


def differences(rows: list[Race], baseline: str = "adam") -> str:
  """Per group, each run's mean seconds to the target minus ``baseline``'s, with the Welch 95 %
  interval over the seeds that reached the target (``reached / seeds`` for the run)."""
  times = defaultdict(list)
  seeds = defaultdict(int)
  for r in rows:
    seeds[(r.group, r.run)] += 1
    if r.s_to_target is not None:
      times[(r.group, r.run)].append(r.s_to_target)
  out = [
    f"| group | run - {baseline} | reached / seeds | s to target [95 %] | verdict |",
    "|---" * 5 + "|",
  ]
  for group, run in sorted(seeds):
    base = times.get((group, baseline))
    if run == baseline or not base or not times.get((group, run)):
      continue
    diff = welch(times[(group, run)], base)
    reached = f"{len(times[(group, run)])} / {seeds[(group, run)]}"
    out.append(f"| {group} | {run} - {baseline} | {reached} | {diff.text(1)} | {diff.verdict} |")
  return "\n".join(out)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folders", nargs="+", type=Path, help="folders holding run dirs")
  parser.add_argument("--target", type=float, default=85.0, help="validation accuracy, %%")
  args = parser.parse_args(argv)
  rows = collect(args.folders, args.target)
  if not rows:
    raise SystemExit(f"error: no run (summary.json + metrics.jsonl) under {args.folders}")
  print(table(rows, args.target))
  print()
  print(means(rows))
  print()
  print(differences(rows))


if __name__ == "__main__":
  main()
