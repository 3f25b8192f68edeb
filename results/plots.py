"""Plots from run dirs: training curves, final metric against tau, Ginger's sigma spectrum.

    python -m results.plots [roots...] [--out DIR] [--spectrum-run DIR] [--param PATH]

DIR defaults to results/local/plots/ (ignored by git).

Writes PNGs (matplotlib, Agg backend):
- `curves_<experiment>.png`: validation accuracy (or ROUGE-L) and training loss against steps and
  (where a run ran alone on its device) against wall-clock seconds, one colour per optimizer
  configuration (seeds share the colour);
- `tau_<dataset>[_<length>].png`: final metric against tau, Ginger vs QNG (mean ± std over
  seeds), one panel per model (or XSUM setting), Adam/Momentum as horizontal lines; the paper's
  numbers dashed only for runs of the paper's protocol, every other set (a stand-in dataset or
  schedule: the run length in the file name) titled NOT COMPARABLE;
- `time_to_accuracy_<experiment>.png` and `.md`: for each optimizer configuration of a table
  sweep or the curvature_every sweep (mean over seeds), the wall-clock seconds from the run's
  start (compilation and evaluations included) until the validation accuracy first reached
  each level (results/time_to_accuracy.py);
- `lr_<experiment>.png`: the lr_tune sweep's score against lr, one line per optimizer, the tuned
  lr circled (results/lr_tuning.py);
- `spectrum_<run>.png`: Ginger's curvature eigenvalues sigma (one line per index, log y) against
  step for a few parameter blocks of a run, from its "spectrum" events (spectrum.jsonl.gz, or
  metrics.jsonl in records written before that file).
Missing files, keys or events only leave a panel (or a figure) out.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from results import records
from results.lr_tuning import plot_lr_tuning
from results.metrics import aggregate
from results.plot_runs import (
  RunInfo,
  config_labels,
  device_shared,
  group_name,
  load_runs,
)
from results.plot_style import distinct_colors, plot_xy, plt, slug
from results.runs import (
  DEFAULT_ROOTS,
  Run,
  is_number,
  length_text,
  missing_roots,
  rfield,
)
from results.selection import (
  PAPER_IMAGE,
  PAPER_TEXT,
  TAUS,
  cell_criteria,
  comparable,
  config_key,
  load_paper,
  matches,
  paper_row,
  select_runs,
  sort_key,
  tabulated,
  tuple_key,
)
from results.series import (
  Series,
  as_float,
  read_series,
)
from results.time_to_accuracy import TABLE_SWEEPS, plot_time_to_accuracy
from training import registry

DEFAULT_OUT = "results/local/plots"  # ignored by git, like tables.DEFAULT_OUT
METRIC_NAMES = {"val_accuracy": "val. accuracy (%)", "rougeL": "ROUGE-L (%)"}
LEGEND_ROWS = 30  # entries in one legend column of a curves plot
# a legend column's width, to widen the figure by: its marker and gaps, then each character of
# its longest label at the "small" font
LEGEND_MARGIN_INCHES, LEGEND_CHAR_INCHES = 0.7, 0.065


# ----------------------------------------------------------------------------- curves


def _draw_run(
  axes: np.ndarray, series: Series, color: Any, label: str | None, shared: bool = False
) -> str | None:
  """Draw one run's four curves (two, against steps only, for a run that shared its device:
  its wall-clock is not its own); returns the eval metric's name."""
  style = {"color": color, "lw": 1.0, "alpha": 0.85}
  for col, xkey in enumerate(("step",) if shared else ("step", "wall")):
    if series.eval:
      plot_xy(
        axes[0, col],
        series.eval[xkey],
        series.eval["value"],
        marker=".",
        label=label if col == 0 else None,
        **style,
      )
    if series.train:
      plot_xy(axes[1, col], series.train[xkey], series.train["loss"], **style)
  return series.eval_metric


def _finish_curves(fig: Any, axes: np.ndarray, title: str, metric: str | None) -> None:
  """Axis labels, log loss axis, a legend of as many columns as its entries need (at most
  LEGEND_ROWS a column) right of the panels, the figure widened to hold it."""
  for col, xlabel in enumerate(("step", "wall-clock (s)")[: axes.shape[1]]):
    axes[0, col].set_ylabel(METRIC_NAMES.get(metric or "", "validation metric"))
    axes[1, col].set_ylabel("training loss")
    axes[1, col].set_xlabel(xlabel)
    lines = axes[1, col].get_lines()
    if lines and all((line.get_ydata() > 0).all() for line in lines):
      axes[1, col].set_yscale("log")
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.suptitle(title)
  if handles:
    ncol = math.ceil(len(handles) / LEGEND_ROWS)
    column = LEGEND_MARGIN_INCHES + LEGEND_CHAR_INCHES * max(map(len, labels))
    fig.set_figwidth(fig.get_figwidth() + ncol * column)
    fig.legend(handles, labels, loc="outside right center", fontsize="small", ncol=ncol)
  fig.set_layout_engine("constrained")  # places the legend beside the panels, never over them


def plot_curves(infos: Sequence[RunInfo], out: Path) -> list[Path]:
  """One curves_<experiment>.png per experiment; returns the files written."""
  groups: dict[str, list[RunInfo]] = {}
  for info in infos:
    groups.setdefault(group_name(info), []).append(info)
  written = []
  for name, members in sorted(groups.items()):
    path = _plot_group(name, members, out)
    if path:
      written.append(path)
  return written


def _plot_group(name: str, members: Sequence[RunInfo], out: Path) -> Path | None:
  """Curves of one experiment: a colour per configuration, seeds share it."""
  labels = config_labels([m.meta for m in members])
  if all(not m.meta for m in members):
    labels = [m.path.name for m in members]
  unique = list(dict.fromkeys(labels))
  colors = dict(zip(unique, distinct_colors(len(unique)), strict=True))
  timed = not all(device_shared(m) for m in members)  # a wall-clock column only with a run alone
  fig, axes = plt.subplots(2, 1 + timed, figsize=(6.5 * (1 + timed), 8), squeeze=False)
  drawn, metric, seen = False, None, set()
  for info, label in zip(members, labels, strict=True):
    series = read_series(info.path, spectrum=False)
    if not (series.train["step"].size or series.eval["step"].size):
      continue
    first = None if label in seen else label
    metric = _draw_run(axes, series, colors[label], first, device_shared(info)) or metric
    seen.add(label)
    drawn = True
  if not drawn:
    plt.close(fig)
    return None
  _finish_curves(fig, axes, name, metric)
  path = out / f"curves_{slug(name)}.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------- final vs tau


def _final_metric(dataset: str) -> tuple[str, str, str]:
  """(summary key, paper column, axis label) of a dataset's headline metric."""
  if dataset == "xsum":
    return "rougeL", "rougeL", "ROUGE-L (%)"
  return "best_val_accuracy", "acc", "best val. accuracy (%)"


def _panels(runs: Sequence[Run], protocol: dict[str, Any]) -> list[tuple[str, dict]]:
  """(title, criteria) per panel: one per model, or per setting for XSUM."""
  mine = [r for r in runs if matches(r, protocol)]
  key = "setting" if protocol["dataset"] == "xsum" else "model"
  values = sorted({rfield(r, key) for r in mine}, key=sort_key)
  return [(f"{key} {v}", {**protocol, key: v}) for v in values]


def _paper_points(dataset: str, crit: dict[str, Any], optimizer: str) -> dict[int, float]:
  """The paper's numbers by tau for this panel (empty unless its runs follow the paper's
  protocol: dataset, model and run length)."""
  if comparable(crit, PAPER_IMAGE):
    rows, keys = load_paper("table1_cifar100"), {"model": crit.get("model")}
  elif comparable(crit, PAPER_TEXT):
    rows, keys = load_paper("table2_xsum"), {"setting": crit.get("setting")}
  else:
    return {}
  col = _final_metric(dataset)[1]
  points = {}
  for tau in TAUS:
    row = paper_row(rows, optimizer=optimizer, tau=tau, **keys)
    if row and row.get(col):
      points[tau] = float(row[col])
  return points


def _draw_tau_panel(ax: Any, runs: Sequence[Run], dataset: str, crit: dict) -> bool:
  """The optimizers with a rank (Ginger, QNG) against tau, the others (Adam, Momentum) as
  lines; paper dashed. False if empty."""
  key = _final_metric(dataset)[0]
  drawn, taus = False, set()
  ranked = [o for o in registry.names() if registry.reads(o, "tau")]
  for i, optimizer in enumerate(ranked):
    pts = []
    for tau in sorted(
      {
        rfield(r, "tau")
        for r in runs
        if rfield(r, "optimizer") == optimizer and is_number(rfield(r, "tau"))
      }
    ):
      sel = select_runs(runs, cell_criteria(optimizer, tau, **crit))
      stat = aggregate(r.get(key) for r in sel.runs)
      if stat.mean is not None:
        pts.append((tau, stat.mean, stat.std or 0.0))
    if pts:
      x, y, e = np.array(pts).T
      ax.errorbar(x, y, yerr=e, marker="o", capsize=3, color=f"C{i}", label=optimizer)
      drawn, taus = True, taus | set(x)
    paper = _paper_points(dataset, crit, optimizer)
    if paper:
      ax.plot(
        list(paper),
        list(paper.values()),
        ls="--",
        color=f"C{i}",
        alpha=0.5,
        label=f"{optimizer} (paper)",
      )
      taus |= set(paper)
  flat = [o for o in registry.names() if not registry.reads(o, "tau")]
  for i, optimizer in enumerate(flat, start=len(ranked)):
    stat = aggregate(r.get(key) for r in select_runs(runs, dict(crit, optimizer=optimizer)).runs)
    if stat.mean is not None:
      ax.axhline(stat.mean, color=f"C{i}", ls=":", label=optimizer)
      drawn = True
  if taus:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(taus), [f"{t:g}" for t in sorted(taus)])
  return drawn


def _protocols(runs: Sequence[Run]) -> list[dict[str, Any]]:
  """The sets of tabulated runs: (dataset, run length), and the model for XSUM."""
  found = set()
  for r in tabulated(runs):
    dataset = rfield(r, "dataset")
    model = rfield(r, "model") if dataset == "xsum" else None
    found.add((dataset, model, rfield(r, "length")))
  return [
    {"dataset": d, "length": n} | ({"model": m} if m is not None else {})
    for d, m, n in sorted(found, key=tuple_key)
  ]


def plot_final_vs_tau(runs: Sequence[Run], out: Path) -> list[Path]:
  """One tau_<dataset>[_<length>].png per set of runs; returns the files written."""
  written = []
  for protocol in _protocols(runs):
    dataset = str(protocol["dataset"])
    panels = _panels(runs, protocol)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    drawn = [
      _draw_tau_panel(ax, runs, dataset, crit)
      for ax, (_, crit) in zip(axes[0], panels, strict=True)
    ]
    if not any(drawn):
      plt.close(fig)
      continue
    for ax, (title, _) in zip(axes[0], panels, strict=True):
      ax.set(title=title, xlabel="τ", ylabel=_final_metric(dataset)[2])
      ax.legend(fontsize="small")
    paper = comparable(protocol, PAPER_IMAGE) or comparable(protocol, PAPER_TEXT)
    what = ", ".join(
      str(x) for x in (dataset, protocol.get("model"), length_text(protocol["length"])) if x
    )
    fig.suptitle(
      f"{what}: final metric against τ" + ("" if paper else " - NOT COMPARABLE with the paper")
    )
    fig.tight_layout()
    name = slug(dataset) if paper else "_".join(slug(str(v)) for v in protocol.values() if v)
    path = out / f"tau_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


# ----------------------------------------------------------------------------- spectrum


def spectrum_matrix(series: Series, param: str) -> np.ndarray:
  """(events x rank) eigenvalues of one parameter block, NaN-padded."""
  rows = [list(map(as_float, s.get(param) or [])) for s in series.spectrum]
  width = max((len(r) for r in rows), default=0)
  return np.array([r + [math.nan] * (width - len(r)) for r in rows], dtype=float)


def pick_params(series: Series, params: Sequence[str] | None, limit: int = 4) -> list[str]:
  """The requested blocks that occur, else the `limit` with the largest final top sigma."""
  names = sorted({p for s in series.spectrum for p in s})
  if params:
    return [p for p in params if p in names]
  last = series.spectrum[-1] if series.spectrum else {}

  def top(p: str) -> float:
    values = [as_float(v) for v in last.get(p) or []]
    finite = [v for v in values if math.isfinite(v)]
    return max(finite, default=-math.inf)

  return sorted(names, key=lambda p: (-top(p), p))[:limit]


def plot_spectrum(
  run_dir: str | Path, out: Path, params: Sequence[str] | None = None, limit: int = 4
) -> Path | None:
  """spectrum_<run>.png: each eigenvalue index as a line against step (log y), per block."""
  series = read_series(run_dir)
  chosen = pick_params(series, params, limit)
  if not chosen:
    return None
  fig, axes = plt.subplots(1, len(chosen), figsize=(5 * len(chosen), 4), squeeze=False)
  steps = np.array(series.spectrum_steps, dtype=float)
  for ax, param in zip(axes[0], chosen, strict=True):
    sigma = spectrum_matrix(series, param)
    sigma[~(sigma > 0)] = np.nan  # log axis: drop zeros, negatives, NaN
    colors = plt.cm.viridis(np.linspace(0, 1, max(sigma.shape[1], 1)))
    for i in range(sigma.shape[1]):
      plot_xy(
        ax,
        steps,
        sigma[:, i],
        color=colors[i],
        lw=1,
        label=f"σ{i + 1}" if sigma.shape[1] <= 8 else None,
      )
    if np.isfinite(sigma).any():
      ax.set_yscale("log")
    ax.set(title=param, xlabel="step", ylabel="σ (curvature eigenvalue)")
    if sigma.shape[1] <= 8 and ax.get_lines():
      ax.legend(fontsize="x-small")
  # <sweep>/<exp>/<arm>/<seed>: the sweep too, as one arm and seed can run in several sweeps
  name = slug("-".join(Path(run_dir).resolve().parts[-4:]))
  fig.suptitle(f"Ginger spectrum: {run_dir}")
  fig.tight_layout()
  path = out / f"spectrum_{name}.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def default_spectrum_runs(infos: Sequence[RunInfo], limit: int) -> list[Path]:
  """The first `limit` Ginger runs with spectrum events: the table sweeps'
  runs first, in TABLE_SWEEPS' order (Table 1 first), then the rest by path; one seed per
  configuration (everything but the seed), so that the few plots show different ones."""

  def rank(info: RunInfo) -> int:
    sweep = info.meta.get("sweep")
    return TABLE_SWEEPS.index(sweep) if sweep in TABLE_SWEEPS else len(TABLE_SWEEPS)

  chosen: list[Path] = []
  configurations: set[Any] = set()
  for info in sorted(infos, key=rank):
    if len(chosen) >= limit:
      break
    configuration = config_key(info.summary) if info.summary else info.path
    if configuration in configurations or info.meta.get("optimizer") not in ("ginger", None):
      continue
    if read_series(info.path).spectrum:
      chosen.append(info.path)
      configurations.add(configuration)
  return chosen


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """Command-line options."""
  parser = argparse.ArgumentParser(
    prog="python -m results.plots",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("roots", nargs="*", help="dirs to scan (default: outputs multirun)")
  parser.add_argument(
    "--out", default=DEFAULT_OUT, help=f"where to write the PNGs (default: {DEFAULT_OUT})"
  )
  parser.add_argument(
    "--spectrum-run",
    action="append",
    default=[],
    help="run dir whose sigma spectrum to plot (repeatable; default: the "
    "first --max-spectrum Ginger runs with spectrum events)",
  )
  parser.add_argument(
    "--param",
    action="append",
    default=[],
    help="parameter block(s) for the spectrum (default: the 4 with the "
    "largest final top eigenvalue)",
  )
  parser.add_argument(
    "--max-spectrum",
    type=int,
    default=3,
    help="how many runs get a spectrum plot when --spectrum-run is not given",
  )
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  """Scan the roots and write every plot to --out."""
  args = parse_args(argv)
  if error := missing_roots(args.roots):
    print(f"error: {error}", file=sys.stderr)
    return 2
  roots = args.roots or list(DEFAULT_ROOTS)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  try:
    infos = load_runs(roots)
  except records.ArchiveError as e:  # a damaged archive
    print(f"error: {e}", file=sys.stderr)
    return 2
  written = plot_curves(infos, out)
  written += plot_final_vs_tau([i.summary for i in infos if i.summary], out)
  written += plot_time_to_accuracy(infos, out)
  written += plot_lr_tuning([i.summary for i in infos if i.summary], out)
  spectrum_runs = args.spectrum_run or default_spectrum_runs(infos, args.max_spectrum)
  for run_dir in spectrum_runs:
    path = plot_spectrum(run_dir, out, args.param or None)
    if path:
      written.append(path)
  print(f"{len(infos)} run dirs; wrote {len(written)} plots to {out}", file=sys.stderr)
  for path in written:
    print(f"  {path}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
