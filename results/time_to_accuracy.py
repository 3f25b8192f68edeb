"""Wall-clock seconds to a validation accuracy, from the run records of the table sweeps:
``time_to_accuracy_<experiment>.png`` and ``.md`` (``python -m results.plots`` writes them).

For each optimizer configuration (mean over seeds), the seconds from the run's start
(compilation and evaluations included) until the validation accuracy first reached each level,
runs alone on their device only (a shared run's wall-clock is not its own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from results.plot_runs import RunInfo, config_labels, device_shared, group_name
from results.plot_style import distinct_colors, plot_xy, plt, slug
from results.runs import is_done
from results.series import Series, accuracy_times, first_time_at, read_series
from results.studies import time_to_target_cell

TABLE_SWEEPS = ("table1", "table2", "table34", "ablation", "curvature_every")


def _configurations(
  infos: Sequence[RunInfo], levels: Sequence[float]
) -> dict[str, list[tuple[str, list[Series], dict[str, list[float]]]]]:
  """Per experiment of the table sweeps, its completed runs alone on their device grouped by
  configuration (labelled by the keys that vary among those runs): each configuration's label,
  its runs' series (each read once) and its per-seed best accuracy, seconds to it and to each
  level (NaN: never reached)."""
  groups: dict[str, list[RunInfo]] = {}
  for info in infos:
    if (
      info.meta.get("sweep") in TABLE_SWEEPS
      and info.summary
      and is_done(info.summary)
      and not device_shared(info)  # wall-clock seconds: a run alone on its device
    ):
      groups.setdefault(group_name(info), []).append(info)
  keys = ("best", "to_best", *(str(v) for v in levels))
  out = {}
  for name, members in sorted(groups.items()):
    configs: dict[str, tuple[list[Series], dict[str, list[float]]]] = {}
    for info, label in zip(members, config_labels([m.meta for m in members]), strict=True):
      series = read_series(info.path, spectrum=False)
      times = accuracy_times(series, levels)
      if times is None:
        continue
      seen, values = configs.setdefault(label, ([], {key: [] for key in keys}))
      seen.append(series)
      for key, per_seed in values.items():
        per_seed.append(times[key])
    if configs:
      out[name] = [(label, seen, values) for label, (seen, values) in configs.items()]
  return out


def time_to_accuracy(
  infos: Sequence[RunInfo], levels: Sequence[float] = (80.0, 85.0)
) -> dict[str, list[dict[str, Any]]]:
  """Per experiment of the table sweeps: one row per optimizer configuration (mean over the
  seeds that reached each level, and how many did)."""
  return {
    name: [{"config": label, **values} for label, _, values in configs]
    for name, configs in _configurations(infos, levels).items()
  }


def _mean_cell(values: Sequence[float], fmt: str) -> str:
  ok = [v for v in values if math.isfinite(v)]
  if not ok:
    return "never"
  text = format(sum(ok) / len(ok), fmt)
  return text if len(ok) == len(values) else f"{text} ({len(ok)}/{len(values)} seeds)"


def plot_time_to_accuracy(
  infos: Sequence[RunInfo], out: Path, levels: Sequence[float] = (80.0, 85.0)
) -> list[Path]:
  """time_to_accuracy_<experiment>.png (seconds to reach each accuracy level, one line per
  configuration) and .md (the same numbers at `levels`, and the time to each run's best)."""
  written = []
  for name, configs in _configurations(infos, levels).items():
    grid = np.arange(50.0, 100.0, 0.5)
    fig, ax = plt.subplots(figsize=(8, 5))
    palette = distinct_colors(len(configs))
    for color, (label, seen, _) in zip(palette, configs, strict=True):
      times = np.array([[first_time_at(s, g) for g in grid] for s in seen])
      # AlgoPerf's rule: a seed that never reached a level is infinitely slow to it.
      median = np.median(np.nan_to_num(times, nan=np.inf), axis=0)
      median = np.where(np.isfinite(median), median, np.nan)
      plot_xy(ax, grid, median, label=label, color=color)
    ax.set(
      xlabel="validation accuracy reached (%)",
      ylabel="wall-clock seconds from the run's start",
      title=f"{name}: time to accuracy (median over seeds, misses as never)",
    )
    if ax.get_lines():  # none where no configuration reached the grid's 50 %
      ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / f"time_to_accuracy_{slug(name)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    lines = [
      f"## {name}: wall-clock seconds to reach a validation accuracy",
      "",
      "Seconds from the run's start (compilation and evaluations included) to the first "
      "evaluation at or above the level: the median over seeds with a seed that never reached "
      "it counted as infinitely slow (AlgoPerf's rule), then (reached / seeds); best acc and s "
      "to best: mean over seeds. Regenerate with `python -m results.plots`.",
      "",
      "| config | best acc | s to best | " + " | ".join(f"s to {v:g}%" for v in levels) + " |",
      "|---|---:|---:|" + "---:|" * len(levels),
    ]
    for label, _, row in configs:
      cells = [_mean_cell(row["best"], ".2f"), _mean_cell(row["to_best"], ".0f")]
      cells += [time_to_target_cell(row[str(v)]) for v in levels]
      lines.append(f"| {label} | " + " | ".join(cells) + " |")
    md = out / f"time_to_accuracy_{slug(name)}.md"
    md.write_text("\n".join(lines) + "\n")
    written += [path, md]
  return written
