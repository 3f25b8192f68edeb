"""The lr_tune sweep's result: the best learning rate per experiment and optimizer.

    python -m sweeps.best_lr [roots...] [--experiments NAME ...] [--dry-run]

Reads the summary.json of every run with ``run.sweep == "lr_tune"`` under the roots (default
outputs and multirun; run dirs, plain or packed into archives by results/records.py) and
writes ``configs/best_lr/<experiment>.yaml`` for each experiment that has such runs: per
optimizer, the lr with the best mean score over seeds, where the score is

- image classification: ``best_val_accuracy`` on the held-out training images (higher is
  better); runs that validated on the test split (``data.holdout`` 0) are refused;
- seq2seq (XSUM): ``rougeL`` (higher is better) when every finished run of the optimizer has it,
  else ``val_loss`` (lower is better); ``--seq2seq-metric`` forces one.

An lr at which any run diverged (status "failed") is not eligible; runs still going are ignored
(the candidates are results/lr_tuning.py's, which ``python -m results.plots`` draws).
The table sweeps read these files through configs/sweep/exp/ (``best_lr``) and record where their
lr came from in ``lr_from``. An optimizer with no finished lr_tune run gets no entry, so the
sweeps use its config's default lr (configs/optimizer/<name>.yaml); this script prints that.
Entries of an existing file whose runs are no longer found are kept (and said so): the runs are
the source, but a result is never thrown away silently. No number here is ever made up.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from results.lr_tuning import SWEEP, Candidate, tunings
from results.records import ArchiveError
from results.runs import (
  DEFAULT_ROOTS,
  DamagedRecordError,
  Run,
  collect_runs,
  missing_roots,
  rfield,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
# The paper: "We tune the learning rate in the set of {1, 5} x 10^{-1, -2, -3, -4}"
# (configs/sweep/lr_tune.yaml sweeps these; tests/test_sweeps.py checks they agree).
LR_GRID = (0.5, 0.1, 0.05, 0.01, 0.005, 0.001, 0.0005, 0.0001)
HEADER = """\
# Written by `python -m sweeps.best_lr` from the lr_tune runs (sweep=lr_tune) it found: per
# optimizer, the lr with the best mean {what} over seeds, and every candidate's score.
# Do not edit by hand; rerun it after `make lr_tune`. Loaded as `best_lr` by the
# configs/sweep/exp/ file naming `best_lr@best_lr: {name}`; an optimizer missing here runs at
# its config's default lr.
"""


def entry(cands: Sequence[Candidate], best: Candidate, metric: str) -> dict[str, Any]:
  """What configs/best_lr/<experiment>.yaml holds for one optimizer."""
  seeds = max(len(c.scores) for c in cands)
  tried = (
    f"{len(cands)} of the {len(LR_GRID)} protocol lrs"
    if len(cands) < len(LR_GRID)
    else f"{len(cands)} lrs"
  )
  return {
    "lr": best.lr,
    "source": f"lr_tune: best mean {metric} {best.mean():.4g} over {tried}, up to {seeds} seed(s)",
    "metric": metric,
    "score": best.mean(),
    "candidates": [
      {"lr": c.lr, "score": c.mean(), "runs": len(c.scores) + c.failed, "diverged": c.failed}
      for c in cands
    ],
  }


def default_lr(optimizer: str, config_dir: Path) -> Any:
  path = config_dir / "optimizer" / f"{optimizer}.yaml"
  return OmegaConf.load(path).get("lr") if path.exists() else None


def optimizers(config_dir: Path) -> list[str]:
  return sorted(p.stem for p in (config_dir / "optimizer").glob("*.yaml"))


def referenced(experiment: str, config_dir: Path) -> bool:
  """Whether some configs/sweep/exp file loads configs/best_lr/<experiment>.yaml."""
  pattern = re.compile(rf"best_lr@best_lr: {re.escape(experiment)}\s*$", re.MULTILINE)
  return any(pattern.search(p.read_text()) for p in (config_dir / "sweep" / "exp").rglob("*.yaml"))


def best_lrs(
  runs: Iterable[Run], seq2seq_metric: str | None = None, notes: list[str] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
  """{experiment: {optimizer: entry}} from the lr_tune runs among `runs`; notes get appended
  for optimizers that have runs but no eligible lr."""
  notes = [] if notes is None else notes
  result: dict[str, dict[str, dict[str, Any]]] = {}
  for t in tunings(runs, seq2seq_metric, notes):
    result.setdefault(t.experiment, {})
    if t.best is None:
      diverged = sum(c.failed for c in t.candidates)
      notes.append(
        f"{t.experiment} {t.optimizer}: {len(t.runs)} lr_tune run(s) but no eligible "
        f"lr ({diverged} diverged, none scored {t.metric})"
      )
      continue
    result[t.experiment][t.optimizer] = entry(t.candidates, t.best, t.metric)
  return result


def render(experiment: str, entries: dict[str, dict[str, Any]]) -> str:
  metrics = sorted({e.get("metric", "?") for e in entries.values()})
  what = " / ".join(metrics) or "score"
  body = yaml.safe_dump(entries, sort_keys=True, default_flow_style=None, width=100)
  return HEADER.format(what=what, name=experiment) + body


def write(
  results: dict[str, dict[str, dict[str, Any]]],
  out: Path,
  config_dir: Path,
  experiments: Sequence[str] = (),
  dry_run: bool = False,
) -> list[str]:
  """Write one file per experiment with results; return the report lines."""
  lines: list[str] = []
  for experiment in sorted(set(results) | set(experiments)):
    tuned = dict(results.get(experiment, {}))
    path = out / f"{experiment}.yaml"
    kept: dict[str, Any] = {}
    if path.exists():
      old = yaml.safe_load(path.read_text()) or {}
      kept = {k: v for k, v in old.items() if k not in tuned}
    for optimizer in sorted(set(optimizers(config_dir)) | set(tuned) | set(kept)):
      if optimizer in tuned:
        e = tuned[optimizer]
        lines.append(f"{experiment} {optimizer}: lr {e['lr']} ({e['source']})")
      elif optimizer in kept:
        lines.append(
          f"{experiment} {optimizer}: lr {kept[optimizer].get('lr')} kept from "
          f"{path} (no lr_tune runs found for it now)"
        )
      else:
        lines.append(
          f"{experiment} {optimizer}: no finished lr_tune run -> the default "
          f"lr {default_lr(optimizer, config_dir)} of "
          f"configs/optimizer/{optimizer}.yaml is used"
        )
    if not tuned:
      continue
    if not referenced(experiment, config_dir):
      lines.append(
        f"note: no configs/sweep/exp file loads best_lr {experiment!r}; the "
        f"table sweeps will not use {path}"
      )
    if not dry_run:
      out.mkdir(parents=True, exist_ok=True)
      path.write_text(render(experiment, kept | tuned))
      lines.append(f"wrote {path}")
  return lines


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m sweeps.best_lr",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("roots", nargs="*", help="dirs to scan (default: outputs multirun)")
  parser.add_argument(
    "--out",
    type=Path,
    default=None,
    help="where to write <experiment>.yaml (default: configs/best_lr)",
  )
  parser.add_argument("--config-dir", type=Path, default=CONFIG_DIR, help=argparse.SUPPRESS)
  parser.add_argument(
    "--experiments",
    nargs="*",
    default=(),
    help="also report these experiment names (e.g. cifar100_resnet18) when "
    "they have no lr_tune runs",
  )
  parser.add_argument(
    "--seq2seq-metric",
    choices=("rougeL", "val_loss"),
    default=None,
    help="score seq2seq runs by this (default: rougeL where all have it)",
  )
  parser.add_argument("--dry-run", action="store_true", help="report, write nothing")
  args = parser.parse_args(argv)
  if error := missing_roots(args.roots):  # a typo would read as no lr_tune runs
    print(f"error: {error}", file=sys.stderr)
    return 2
  roots = args.roots or list(DEFAULT_ROOTS)
  notes: list[str] = []
  try:
    runs = collect_runs(roots)
  except (DamagedRecordError, ArchiveError) as e:  # a damaged value would read as a diverged lr
    print(f"error: {e}", file=sys.stderr)
    return 2
  results = best_lrs(runs, args.seq2seq_metric, notes)
  n = sum(1 for r in runs if rfield(r, "sweep") == SWEEP)
  print(f"{n} lr_tune run dirs with a summary.json under {', '.join(map(str, roots))}")
  if not results and not args.experiments:
    print(
      "no finished lr_tune runs: every sweep uses the optimizer configs' default lrs "
      "(configs/optimizer/*.yaml); run `make lr_tune` to tune them"
    )
  out = args.out or args.config_dir / "best_lr"
  for line in notes + write(results, out, args.config_dir, args.experiments, args.dry_run):
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
