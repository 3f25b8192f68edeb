"""Print the runs under a folder side by side (what `make train` shows at the end).

python -m results.compare multirun/demo
python -m results.compare results/cifar10/runs/table1/cifar10_resnet50_30ep   # archives too

python -m results.compare          # every run under outputs/ and multirun/, with its run dir

A run's ``status`` (completed, failed, interrupted; "running or stopped" for a run dir with
metrics but no summary.json yet) gets a column once any run has one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from results import records
from results.runs import DEFAULT_ROOTS
from training import run_record

COLUMNS = [
  ("optimizer", "optimizer"),
  ("tau", "tau"),
  ("alpha", "alpha"),
  ("lr", "lr"),
  ("precision", "compute"),
  ("state_dtype", "state"),
  ("best_val_accuracy", "best val acc %"),
  ("val_loss_at_best", "val loss @best"),
  ("rougeL", "ROUGE-L"),
  ("min_train_loss", "min train loss"),
  ("steps", "steps"),
  ("step_time_s", "s/step"),
  ("flops_per_iter", "FLOPs/iter (analytic)"),
  ("step_memory_bytes", "step GB"),
  ("peak_memory_bytes", "peak GB"),
  ("device_shared", "shared GPU"),
  ("status", "status"),
]


def _fmt(value) -> str:
  if value is None:
    return ""
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _value(run: dict, key: str):
  """``run[key]``, as the column shows it: bytes in GB (1e9), FLOPs by the analytic count."""
  value = run.get(key)
  if isinstance(value, dict):
    value = value.get("analytic")
  if key.endswith("_bytes") and isinstance(value, (int, float)):
    value = round(value / 1e9, 2)
  return value


def _shown(key: str, run: dict) -> bool:
  """Whether ``run`` earns column ``key`` a place: any value, but the numerics only where not
  float32 (most runs are: no column for them)."""
  if key in run_record.NUMERICS:
    return key in run_record.narrow_numerics(run)
  return _value(run, key) is not None


def rows(*roots: Path) -> list[dict]:
  """One row per run dir under ``roots`` (archived runs too: results/records.py): its summary,
  or, for a run dir with metrics but no summary.json yet, its status alone."""
  out = []
  for run_dir in records.find_run_dirs(roots):
    summary = records.read_summary(run_dir)
    if summary is not None:  # a torn or foreign file is skipped, not a crash
      out.append(summary.get("run", {}) | summary | {"dir": str(run_dir)})
    elif not (run_dir / run_record.SUMMARY).exists() and (run_dir / run_record.METRICS).exists():
      out.append({"status": "running or stopped", "dir": str(run_dir)})
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("root", type=Path, nargs="?", help="default: outputs/ and multirun/")
  args = parser.parse_args(argv)
  roots = [args.root] if args.root else [Path(r) for r in DEFAULT_ROOTS if Path(r).is_dir()]
  found = rows(*roots)
  if not found:
    raise SystemExit(f"no run under {', '.join(map(str, roots)) or ' or '.join(DEFAULT_ROOTS)}")
  listed = COLUMNS + ([] if args.root else [("dir", "run dir")])
  columns = [(k, title) for k, title in listed if any(_shown(k, r) for r in found)]
  print("| " + " | ".join(title for _, title in columns) + " |")
  print("|" + "---|" * len(columns))
  for r in found:
    print("| " + " | ".join(_fmt(_value(r, k)) for k, _ in columns) + " |")


if __name__ == "__main__":
  main()
