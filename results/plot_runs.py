"""Run dirs as the plots see them: each with its run fields and summary, the label of its
optimizer configuration in a legend, and the experiment it is drawn with."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results.metrics import is_shared
from results.runs import find_run_dirs, load_summary

LABEL_KEYS = ("optimizer", "tau", "alpha", "rho", "block", "gamma", "lr", "curvature_every")
GROUP_KEYS = ("sweep", "experiment", "dataset", "model", "setting", "length")


@dataclass
class RunInfo:
  """A run dir with its run fields (empty without summary.json) and summary (or None)."""

  path: Path
  meta: dict[str, Any]
  summary: dict[str, Any] | None


def device_shared(info: RunInfo) -> bool:
  """Whether the run shared its device: its wall-clock seconds are not its own."""
  return bool(info.summary and is_shared(info.summary))


def load_runs(roots: Iterable[str | Path]) -> list[RunInfo]:
  """Every run dir under `roots`, with its summary where there is one."""
  infos = []
  for run_dir in find_run_dirs(roots):
    summary = load_summary(run_dir)
    meta = dict(summary["run"]) if summary else {}
    infos.append(RunInfo(run_dir, meta, summary))
  return infos


def config_labels(metas: Sequence[dict[str, Any]]) -> list[str]:
  """Legend labels: optimizer and tau, plus the keys that vary among that optimizer's runs."""
  by_optimizer: dict[Any, list[dict[str, Any]]] = {}
  for meta in metas:
    by_optimizer.setdefault(meta.get("optimizer"), []).append(meta)
  varying = {
    opt: [k for k in LABEL_KEYS[2:] if len({repr(m.get(k)) for m in group}) > 1]
    for opt, group in by_optimizer.items()
  }
  labels = []
  for meta in metas:
    text = str(meta.get("optimizer") or "?")
    if meta.get("tau") is not None:
      text += f" τ={meta['tau']}"
    labels += [text + "".join(f" {k}={meta.get(k)}" for k in varying[meta.get("optimizer")])]
  return labels


def group_name(info: RunInfo) -> str:
  """The experiment a run belongs to; runs without summary.json go by their parent dir."""
  parts = [str(info.meta[k]) for k in GROUP_KEYS if info.meta.get(k)]
  return "-".join(dict.fromkeys(parts)) if parts else f"no-summary-{info.path.parent.name}"
