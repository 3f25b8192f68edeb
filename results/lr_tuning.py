"""The lr_tune sweep's runs as candidates: per (experiment, optimizer) the score of each lr, and
the figure of score against lr.

Scores (higher is better except ``val_loss``):

- image classification: ``best_val_accuracy`` on the held-out training images; runs that
  validated on the test split (``data.holdout`` 0) are left out;
- seq2seq (XSUM): ``rougeL`` when every finished run of the optimizer has it, else ``val_loss``.

A candidate's score is the mean over its seeds; an lr at which any run diverged (status
"failed") has none and is never picked; runs still going are ignored; a rerun replaces the
earlier run of the same setting and seed. ``python -m sweeps.best_lr`` writes the picks into
configs/best_lr/; ``python -m results.plots`` draws ``lr_<experiment>.png``: each optimizer's
mean score against lr (log axis), the picked lr circled, the diverged lrs marked x at the
bottom, so how sharply an optimizer depends on its lr reads off one figure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from results.plot_style import distinct_colors, plt, slug
from results.runs import Run, is_done, is_number, rfield
from results.selection import CONFIG_KEYS
from training.run_record import lr_key, narrow_numerics

SWEEP = "lr_tune"
# metric -> True when higher is better
METRICS = {"best_val_accuracy": True, "rougeL": True, "val_loss": False}
METRIC_TEXT = {
  "best_val_accuracy": "best held-out accuracy (%)",
  "rougeL": "ROUGE-L (%)",
  "val_loss": "validation loss (lower is better)",
}
# What makes two runs the same setting and seed: a rerun (the newer summary) replaces the older.
SETTING_KEYS = ("seed", *CONFIG_KEYS)


@dataclass
class Candidate:
  """One learning rate of one (experiment, optimizer): its finished and diverged runs."""

  lr: float
  scores: list[float] = field(default_factory=list)
  failed: int = 0

  def mean(self) -> float | None:
    """The mean score, or None if a run diverged or none finished with a score."""
    if self.failed or not self.scores:
      return None
    return statistics.fmean(self.scores)


class Tuning(NamedTuple):
  """One (experiment, optimizer)'s lr tuning: its runs, score, candidates and pick (None when
  no lr is eligible)."""

  experiment: str
  optimizer: str  # the configs/best_lr entry (training.run_record.lr_key)
  runs: list[Run]
  metric: str
  candidates: list[Candidate]
  best: Candidate | None


def run_family(run: Run) -> str | None:
  """ "resnet" or "t5" (from the run's config), None when unknown."""
  model = (run.get("config") or {}).get("model") or {}
  return model.get("family")


def holdout(run: Run) -> int:
  data = (run.get("config") or {}).get("data") or {}
  return int(data.get("holdout") or 0)


def tuning_runs(runs: Iterable[Run], notes: list[str]) -> list[Run]:
  """The lr_tune runs that may be used: finished or diverged, validated off the test split,
  float32; each run left out gets a note."""
  out = []
  for run in runs:
    if rfield(run, "sweep") != SWEEP:
      continue
    if not is_done(run) and run.get("status") != "failed":
      continue  # still running (or an unknown status): not a result yet
    if run_family(run) == "resnet" and holdout(run) <= 0:
      notes.append(
        f"skipped {run['path']}: an lr_tune run that validated on the test "
        f"split (data.holdout=0); use `+sweep=lr_tune`, which holds out images"
      )
      continue
    narrow = narrow_numerics(run["run"])
    if narrow:
      notes.append(
        f"skipped {run['path']}: an lr_tune run with "
        + ", ".join(f"{k}={v}" for k, v in narrow.items())
        + " (the tuned lr is the float32 runs')"
      )
      continue
    out.append(run)
  return out


def newest_per_setting(runs: Iterable[Run]) -> list[Run]:
  """One run per (seed and every hyper-parameter): a rerun replaces the earlier summary."""
  best: dict[tuple, Run] = {}
  for run in runs:
    key = tuple(repr(rfield(run, k)) for k in SETTING_KEYS)
    if key not in best or run.get("mtime", 0) > best[key].get("mtime", 0):
      best[key] = run
  return list(best.values())


def choose_metric(runs: Sequence[Run], seq2seq_metric: str | None) -> str:
  """The score of an (experiment, optimizer) group's runs."""
  if all(run_family(r) == "resnet" for r in runs):
    return "best_val_accuracy"
  if seq2seq_metric:
    return seq2seq_metric
  finished = [r for r in runs if is_done(r)]
  if finished and all(is_number(r.get("rougeL")) for r in finished):
    return "rougeL"
  return "val_loss"


def candidates(runs: Iterable[Run], metric: str) -> list[Candidate]:
  """One Candidate per lr, sorted by lr (descending, like the protocol's grid)."""
  by_lr: dict[float, Candidate] = {}
  for run in runs:
    lr = float(rfield(run, "lr"))
    cand = by_lr.setdefault(lr, Candidate(lr))
    value = run.get(metric)
    if run.get("status") == "failed":
      cand.failed += 1
    elif is_number(value) and math.isfinite(value):
      cand.scores.append(float(value))
  return sorted(by_lr.values(), key=lambda c: -c.lr)


def pick(cands: Sequence[Candidate], metric: str) -> Candidate | None:
  """The eligible candidate with the best mean score (ties: the smaller lr)."""
  eligible = [c for c in cands if c.mean() is not None]
  if not eligible:
    return None
  sign = -1.0 if METRICS[metric] else 1.0
  return min(eligible, key=lambda c: (sign * c.mean(), c.lr))


def tunings(
  runs: Iterable[Run], seq2seq_metric: str | None = None, notes: list[str] | None = None
) -> list[Tuning]:
  """Every (experiment, optimizer)'s tuning among ``runs``, sorted by both names; ``notes``
  gets the runs left out."""
  notes = [] if notes is None else notes
  groups: dict[tuple[str, str], list[Run]] = {}
  for run in newest_per_setting(tuning_runs(runs, notes)):
    key = (str(rfield(run, "experiment")), lr_key(rfield(run, "optimizer"), rfield(run, "rho")))
    groups.setdefault(key, []).append(run)
  out = []
  for (experiment, optimizer), group in sorted(groups.items()):
    metric = choose_metric(group, seq2seq_metric)
    cands = candidates(group, metric)
    out.append(Tuning(experiment, optimizer, group, metric, cands, pick(cands, metric)))
  return out


def label(tuning: Tuning) -> str:
  """The legend's name: the configs/best_lr entry, with the tau it was tuned at."""
  taus = sorted({rfield(r, "tau") for r in tuning.runs if rfield(r, "tau") is not None})
  return tuning.optimizer + "".join(f" τ={t}" for t in taus)


def figure(experiment: str, group: Sequence[Tuning]) -> Any:
  """Score against lr for one experiment's optimizers (see the module); the caller closes it."""
  fig, ax = plt.subplots(figsize=(8, 5))
  for tuning, color in zip(group, distinct_colors(len(group)), strict=True):
    scored = [c for c in tuning.candidates if c.mean() is not None]
    ax.plot(
      [c.lr for c in scored],
      [c.mean() for c in scored],
      marker="o",
      ms=4,
      color=color,
      label=label(tuning),
    )
    for c in tuning.candidates:
      if len(c.scores) > 1:  # each seed, faint, beside its mean
        ax.plot([c.lr] * len(c.scores), c.scores, ".", color=color, alpha=0.35)
      if c.failed:
        ax.plot(c.lr, 0.02, "x", color=color, ms=8, transform=ax.get_xaxis_transform())
    if tuning.best is not None:
      ax.plot(tuning.best.lr, tuning.best.mean(), "o", ms=12, mfc="none", color=color)
  metrics = sorted({t.metric for t in group})
  lengths = sorted({str(rfield(r, "length")) for t in group for r in t.runs})
  ax.set_xscale("log")
  ax.set_xlabel("learning rate")
  ax.set_ylabel(" / ".join(METRIC_TEXT.get(m, m) for m in metrics))
  ax.set_title(
    f"{experiment}: lr tuning ({', '.join(lengths)}); circled: the tuned lr, x: diverged",
    fontsize="medium",
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small", loc="best")
  fig.tight_layout()
  return fig


def plot_lr_tuning(runs: Iterable[Run], out: Path) -> list[Path]:
  """One lr_<experiment>.png per experiment with lr_tune runs; returns the files written."""
  by_experiment: dict[str, list[Tuning]] = {}
  for tuning in tunings(runs):
    by_experiment.setdefault(tuning.experiment, []).append(tuning)
  written = []
  for experiment, group in by_experiment.items():
    path = out / f"lr_{slug(experiment)}.png"
    fig = figure(experiment, group)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written
