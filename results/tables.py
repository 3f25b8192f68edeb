"""Our runs beside the Ginger paper's Tables 1-4, plus a Ginger ablation table.

Reads the `summary.json` of every run dir under the given roots (Hydra output dirs written by
train.py, plain or packed into archives by results/records.py) and writes `table1.md/.tex` ...
`table4.md/.tex` and `table_ablation.md/.tex` into --out (default results/local/, ignored by
git; `make tables` writes the committed campaign's into results/cifar10/)::

    python -m results.tables [roots...] [--out DIR] [--dataset cifar10] [--flops xla]
    python -m results.tables multirun --dataset digits --models resnet_tiny   # smoke sweeps

Each metric gets three columns: ours (mean ± sample std over seeds; no std for one seed), the
paper's number (verbatim from `results/paper/*.csv`) and the difference ours - paper. Tables of
other settings (NOT COMPARABLE) have no difference column: the paper's number stands beside
ours, labelled with the paper's setting. A table wider than MAX_COLUMNS is shown as several, one
per model (or setting), then per kind of column (accuracy and loss, cost). Cells with no
completed run are blank. See `results/README.md` for units and how runs are chosen.

Only runs of the paper's protocol (its dataset, model and run length: CIFAR-100 for 200 epochs;
pretrained t5-small on XSUM for 1 epoch) fill the paper's tables. Every other set of runs (a
stand-in dataset, a random-init model, a shorter schedule) gets its own tables, one set per
(dataset, run length), named after both (``table1_cifar10_30ep.md``) and titled NOT COMPARABLE.
Runs of different lengths never share a cell. Runs of the curvature_every sweep (Ginger with the
curvature updated every K steps, beyond the paper) enter only their own table,
``curvature_every_<dataset>_<length>.md``. Every set where an optimizer beyond the paper's four
has runs also gets the table of today's optimizers (``newcomers_<set>.md``, results/newcomers.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from results import records
from results.comparisons import comparison_tables
from results.newcomers import newcomer_tables
from results.paper_tables import build_all, build_table1, build_table3, build_table4, standin_tables
from results.render import to_latex, to_markdown, write_tables  # noqa: F401 (read through this module too)
from results.runs import (  # noqa: F401 (the run list, read through this module too)
  DEFAULT_ROOTS,
  DONE_STATUSES,
  NOT_SETTINGS,
  NUMBER_KEYS,
  DamagedRecordError,
  Run,
  check_numbers,
  collect_runs,
  find_run_dirs,
  is_done,
  is_number,
  length_text,
  load_summary,
  missing_roots,
  rfield,
  run_length,
  settings_of,
  skip_reason,
)
from results.selection import image_protocol, matches, models_in, tabulated
from results.studies import curvature_every_tables
from results.table_model import DEFAULT_OUT, Table, slug

FLOPS_SOURCES = ("analytic", "xla")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """Command-line options."""
  parser = argparse.ArgumentParser(
    prog="python -m results.tables",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("roots", nargs="*", help="dirs to scan (default: outputs multirun)")
  parser.add_argument(
    "--out", default=DEFAULT_OUT, help=f"where to write the tables (default: {DEFAULT_OUT})"
  )
  parser.add_argument(
    "--standin-only",
    action="store_true",
    help="write only the stand-in tables found (not the paper's, which would be blank)",
  )
  parser.add_argument(
    "--dataset",
    default=None,
    help="write only Tables 1, 3, 4 of this dataset (with --length, of that run length), "
    "named table<N>_<dataset>[_<length>]",
  )
  parser.add_argument("--length", default=None, help="with --dataset: e.g. 30ep or 450steps")
  parser.add_argument(
    "--models",
    nargs="+",
    default=None,
    help="with --dataset: models of Table 1's column groups; Tables 3/4 use the first "
    "(default: the models found)",
  )
  parser.add_argument(
    "--flops",
    choices=FLOPS_SOURCES,
    default="analytic",
    help="which FLOP count of summary.json to report",
  )
  return parser.parse_args(argv)


def run_report(roots: Sequence[str], runs: Sequence[Run]) -> str:
  """One line: how many run dirs were found, used and skipped (and why)."""
  dirs = find_run_dirs(roots)
  status: dict[str, int] = {}
  for run in runs:
    key = "completed" if is_done(run) else str(run.get("status"))
    status[key] = status.get(key, 0) + 1
  parts = [f"{n} {k}" for k, n in sorted(status.items())]
  parts.append(f"{len(dirs) - len(runs)} without a usable summary.json (skipped)")
  used = {str(run.get("path")) for run in runs}
  skipped = [f"\n  skipped {d}: {skip_reason(d)}" for d in dirs if str(d) not in used]
  return f"{len(dirs)} run dirs under {', '.join(roots)}: " + ", ".join(parts) + "".join(skipped)


def tables_to_write(args: argparse.Namespace, runs: Sequence[Run]) -> list[tuple[str, Table]]:
  """(file name, table) pairs that the command line asks for."""
  if args.dataset is not None:
    protocol = image_protocol(args.dataset, args.length)
    members = [r for r in tabulated(runs) if matches(r, protocol)]
    models = args.models or models_in(members) or ["resnet18", "resnet50"]
    suffix = "".join(f"_{slug(x)}" for x in (args.dataset, args.length) if x)
    return [
      ("table1" + suffix, build_table1(runs, args.dataset, models, args.flops, args.length)),
      ("table3" + suffix, build_table3(runs, args.dataset, models[0], args.length)),
      ("table4" + suffix, build_table4(runs, args.dataset, models[0], args.length)),
    ]
  paper = [] if args.standin_only else [(t.name, t) for t in build_all(runs, flops=args.flops)]
  tables = paper + standin_tables(runs, args.flops) + curvature_every_tables(runs)
  return tables + comparison_tables(runs) + newcomer_tables(runs)


def main(argv: Sequence[str] | None = None) -> int:
  """Scan the roots, build the tables and write <out>/<name>.md and .tex."""
  args = parse_args(argv)
  if error := missing_roots(args.roots):
    print(f"error: {error}", file=sys.stderr)
    return 2
  roots = args.roots or list(DEFAULT_ROOTS)
  try:
    runs = collect_runs(roots)
  except (DamagedRecordError, records.ArchiveError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(run_report(roots, runs), file=sys.stderr)
  write_tables(tables_to_write(args, runs), Path(args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
