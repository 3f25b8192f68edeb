"""The wall-clock race: how long each run took to reach a validation accuracy, from its records.

    python -m bench.race multirun/curvature_every [--target 85]
    python -m bench.race races/cold races/warm      # run dirs collected into folders by kind
    python -m bench.race results/cifar10/runs/race_cold   # committed runs, as packed

Every folder below the given ones that holds a run's ``summary.json`` and ``metrics.jsonl``, and
every run packed into an archive there (results.records: read as the run dir it was), is
one row, grouped by the given folder and the first folder below it (a sweep's experiment,
``curvature_every/cifar10_resnet18_30ep``, whose arms and seeds lie deeper; or ``races/cold``
and ``races/warm``: whether the compilation cache held the run's programs); a run directly
inside a given folder is grouped by that folder. Then optimizer, Ginger's K
(``curvature_every``) and d-pass forward, seed, the seconds its programs took to lower and
compile (or to read from the cache) and how they were lowered (read back from the programs an
earlier run kept, exported, traced), the epochs and the seconds to the first evaluation at
``--target`` % or more, the best accuracy and the seconds to it, and the median step time.
Seconds count from the training loop's start (``metrics.jsonl``'s ``wall_time_s``: compilation
and evaluations included, building the data and model not). Then per (group, run) over its
seeds, as AlgoPerf scores time to a target: a run that never reached the target counts as not
reached (infinite time), not as a dropped seed; ``reached / seeds``, the median epochs and
seconds to the target with the misses at infinity (``not reached`` when half or more missed),
the mean seconds to the best. Last, each run against ``adam`` of its group (the baseline keeps
its row, whether or not it reached the target): the Hodges-Lehmann difference in seconds to
the target with its 95 % interval from the exact rank test inverted, misses included
(:func:`results.stats.race_difference`), and the reading (faster / slower / tie) after Holm's
correction over the group's comparisons with the baseline, the family.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from results import records, stats
from training import run_record

HEADER = (
  "| group | run | seed | compile s | programs | epochs to {t} % | s to {t} % | best acc % "
  "| s to best | ms/step |"
)


class Race(NamedTuple):
  group: str
  run: str
  seed: int
  compile_s: float | None  # None for records older than summary.json's startup_s
  # How its programs were lowered (summary.json's startup_s.per_program: "read" back from the
  # programs an earlier run kept, "exported", "traced"; "" where the record lacks it)
  programs: str
  epochs_to_target: int | None
  s_to_target: float | None
  best: float
  s_to_best: float
  ms_per_step: float


def run_label(summary: dict) -> str:
  """``adam``, ``ginger tau=8 K=8`` (``, shared forward`` where not the paper sweeps' eval), then
  the numerics where not float32: ``, bfloat16 state``, ``, bfloat16 compute``."""
  run = summary["run"]
  label = run["optimizer"]
  if run["optimizer"] == "ginger":
    label = f"ginger tau={run['tau']} K={run['curvature_every']}"
    label += ", shared forward" if run.get("fisher_forward") == "shared" else ""
  names = {"precision": "compute", "state_dtype": "state"}
  narrow = run_record.narrow_numerics(run)
  return label + "".join(f", {value} {names[key]}" for key, value in narrow.items())


def race(run_dir: Path, summary: dict, events: list[dict], target: float, group: str) -> Race:
  """One run's row from its summary.json and its metrics.jsonl ``events``."""
  evals = [e for e in events if e.get("event") == "eval"]
  if not evals:
    raise ValueError(f"{run_dir}: no evaluation in metrics.jsonl")
  per_epoch = summary["steps_per_epoch"]
  s_to_target = stats.time_to_target([(e["wall_time_s"], e["val_accuracy"]) for e in evals], target)
  hit = next((e for e in evals if e["wall_time_s"] == s_to_target), None)
  best = max(evals, key=lambda e: e["val_accuracy"])
  return Race(
    group,
    run_label(summary),
    summary["run"]["seed"],
    summary.get("startup_s", {}).get("lower_and_compile"),
    programs_of(summary),
    None if hit is None else round(hit["step"] / per_epoch),
    None if hit is None else s_to_target,
    best["val_accuracy"],
    best["wall_time_s"],
    1e3 * summary["step_time_s"],
  )


def programs_of(summary: dict) -> str:
  """The ways the run's programs were lowered, e.g. "read" or "exported" ("" if unrecorded)."""
  per_program = summary.get("startup_s", {}).get("per_program", {}).values()
  return "/".join(sorted({p["program"] for p in per_program if "program" in p}))


def group_of(run_dir: Path, folder: Path) -> str:
  """``folder``'s name and the first folder below it on the way to ``run_dir`` (``folder``'s
  name alone for a run directly inside it): the arms of a sweep's experiment share a group."""
  parts = run_dir.relative_to(folder).parts
  return "/".join([folder.resolve().name, *parts[:-1][:1]])


def collect(folders: list[Path], target: float) -> list[Race]:
  """A row per run dir below ``folders`` with a summary.json and a metrics.jsonl: plain run
  dirs and those packed into archives there (results.records), read alike."""
  rows = []
  for folder in folders:
    for run_dir in records.find_run_dirs([folder]):
      summary, events = records.read_summary(run_dir), list(records.read_events(run_dir))
      if summary is not None and events:
        rows.append(race(run_dir, summary, events, target, group_of(run_dir, folder)))
  return sorted(rows, key=lambda r: (r.group, r.run, r.seed))


def _cell(x, fmt: str) -> str:
  return "" if x is None else format(x, fmt)


def table(rows: list[Race], target: float) -> str:
  header = HEADER.format(t=f"{target:g}")
  out = [header, "|---" * (header.count("|") - 1) + "|"]
  for r in rows:
    out.append(
      f"| {r.group} | {r.run} | {r.seed} | {_cell(r.compile_s, '.1f')} | {r.programs} "
      f"| {_cell(r.epochs_to_target, 'd')} "
      f"| {_cell(r.s_to_target, '.1f')} | {r.best:.2f} | {r.s_to_best:.1f} "
      f"| {r.ms_per_step:.2f} |"
    )
  return "\n".join(out)


def _cells(rows: list[Race]) -> dict[tuple[str, str], list[Race]]:
  cells = defaultdict(list)
  for r in rows:
    cells[(r.group, r.run)].append(r)
  return dict(sorted(cells.items()))


def _missed(x: float | None) -> float:
  return math.inf if x is None else float(x)


def _median_text(values: list[float | None], fmt: str = ".1f") -> str:
  """The median with misses at infinity: "not reached" when half or more missed."""
  median = stats.median_time([_missed(x) for x in values])
  return format(median, fmt) if math.isfinite(median) else "not reached"


def _reached(values: list[float | None]) -> str:
  return f"{sum(x is not None and math.isfinite(x) for x in values)} / {len(values)}"


def means(rows: list[Race], baseline: str = "adam") -> str:
  """Per (group, run): reached / seeds, the median epochs and seconds to the target with the
  misses at infinity (AlgoPerf's rule), the mean seconds to each run's best, the best accuracy
  (mean ± sample std over seeds), the mean step time and its ratio to ``baseline``'s in the
  group (blank where the group has no ``baseline``)."""
  cells = _cells(rows)
  step = {key: statistics.fmean(r.ms_per_step for r in rs) for key, rs in cells.items()}
  out = [
    "| group | run | reached / seeds | epochs to target, median | s to target, median "
    f"| s to best, mean | best acc % | ms/step, mean | x {baseline} |",
    "|---" * 9 + "|",
  ]
  for (group, run), rs in cells.items():
    best = [r.best for r in rs]
    spread = f" ± {statistics.stdev(best):.2f}" if len(best) > 1 else ""
    base = step.get((group, baseline))
    ratio = "" if base is None else f"{step[(group, run)] / base:.2f}"
    out.append(
      f"| {group} | {run} | {_reached([r.s_to_target for r in rs])} "
      f"| {_median_text([r.epochs_to_target for r in rs])} "
      f"| {_median_text([r.s_to_target for r in rs])} "
      f"| {statistics.fmean(r.s_to_best for r in rs):.1f} "
      f"| {statistics.fmean(best):.2f}{spread} | {step[(group, run)]:.2f} | {ratio} |"
    )
  return "\n".join(out)


def differences(rows: list[Race], baseline: str = "adam") -> str:
  """Per group, each run's seconds to the target against ``baseline``'s, misses counted
  (:func:`results.stats.race_difference`): the Hodges-Lehmann shift with its 95 % interval,
  the rank test's p-value adjusted by Holm over the group's runs (the family) and its reading.
  The baseline's row gives its reached / seeds and median; a group without it is left out."""
  times = {key: [_missed(r.s_to_target) for r in rs] for key, rs in _cells(rows).items()}
  out = [
    f"| group | run - {baseline} | reached / seeds | s to target, median | shift s [95 %] "
    "| p (Holm) | reading (Holm) |",
    "|---" * 7 + "|",
  ]
  for group in sorted({g for g, _ in times}):
    base = times.get((group, baseline))
    if base is None:
      continue
    arms = [(run, t) for (g, run), t in times.items() if g == group and run != baseline]
    diffs = [stats.race_difference(t, base) for _, t in arms]
    adjusted = stats.holm([d.p for d in diffs])
    out.append(
      f"| {group} | {baseline} (baseline) | {_reached(base)} | {_median_text(base)} | | | |"
    )
    for (run, t), d, p in zip(arms, diffs, adjusted, strict=True):
      out.append(
        f"| {group} | {run} - {baseline} | {_reached(t)} | {_median_text(t)} | {d.text(1)} "
        f"| {p:.3f} | {stats.race_verdict(d, p)} |"
      )
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
