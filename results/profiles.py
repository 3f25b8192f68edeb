"""AlgoPerf's performance profiles over the stand-in workloads: which optimizer reaches a target
first, and by how much, across ResNet-18, ResNet-50 and the T5 stand-in's validation loss.

For optimizer ``s`` and workload ``w``, ``t[s, w]`` is the time to the target: the median over
seeds of each seed's time, a seed that never reaches the target counting as infinitely slow
(:func:`results.stats.median_time`, AlgoPerf's rule). AlgoPerf (Dahl et al. 2023,
"Benchmarking Neural Network Training Algorithms", section 4.2) then scores

    r[s, w] = t[s, w] / min_s' t[s', w]          (infinite where r > r_max, r_max = 4)
    P_s(x) = |{w : r[s, w] <= x}| / |W|          (the performance profile, x in [1, r_max])
    B_s = integral_1^r_max P_s(x) dx / (r_max - 1)

so ``B_s = 1`` for an optimizer fastest on every workload and 0 for one that never comes within
``r_max`` of the fastest. AlgoPerf writes the profile ``rho_s(tau)``; here ``tau`` is Ginger's
rank and ``rho`` its clip bound, so the profile is ``P_s`` and its threshold ``x``.

A seed's time is its steps to its first evaluation at the target (an accuracy at or above it,
a loss at or below it) times the configuration's current step time on a device of its own
(:func:`alone_step_time`: the median ``step_time_s`` of the runs with its step,
``device_shared`` false, from any sweep and length, at the newest commit among them and on the
newest run's device; ``make steptime`` runs 600 steps of each alone): the runs of the tables
shared GPUs, so their wall clocks are not their own, and code and the GPU change the step.
Compilation and evaluations are left out (AlgoPerf leaves out evaluations).
A profile compares the optimizers timed on its first workload (ResNet-18) over the workloads
on which every one of them is timed; a workload where one has no time (no runs, or none alone on
its GPU) is left out of it whole, and the notes name what is missing: a profile over different
workloads per optimizer would not compare. Where that leaves a workload out, a second profile
per level compares the optimizers timed on every workload over all of them (:func:`everywhere`).
A workload whose optimizers' runs were evaluated at different spacings is left out of both (a
time is the step of the first evaluation at the target, so its resolution is the spacing), and
so is one whose optimizers' step times were measured on different devices. The
runs are the Table 1 cells' and, for T5, Table 2's full fine-tuning
(``results.selection.select_runs``: the configured lr, one run per seed, the newest).
Each workload has a target per level: the image workloads' validation accuracy (``TARGETS``,
on the sets of ``IMAGE_TARGETS`` only: a set without targets has no profile), T5's validation
loss (``TEXT_WORKLOADS``). ``make tables`` writes
``profile_<dataset>_<length>.md`` and its plot::

    python -m results.profiles results/cifar10/runs --out results/cifar10
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from results import selection, stats, table_model
from results.metrics import is_shared
from results.runs import Run, collect_runs, is_done, is_number, missing_roots
from results.series import read_series
from training import registry

LEGEND_INCHES = 1.6  # the profile plot's legend, beside its panels
R_MAX = 4.0  # AlgoPerf's largest ratio to the fastest that still scores
TARGETS = (85.0, 88.0)  # the image workloads' validation accuracy (%): the race's and a harder one
# The image sets whose workloads have targets (TARGETS), as AlgoPerf fixes a workload's target
# from its baselines' runs: the CIFAR-10 30-epoch stand-in's. Another set (the paper's CIFAR-100
# at 200 epochs, a toy set) has no profile, and its table of today's optimizers no times.
IMAGE_TARGETS = {("cifar10", "30ep"): TARGETS}
MODELS = ("resnet18", "resnet50")
PAPER_ARMS = (("adam", None), ("momentum", None), ("ginger", 8), ("qng", 8))
# The T5 workload beside an image set: Table 2's full fine-tuning at that scale, scored on its
# validation loss, one target per level of TARGETS. The stand-in's were fixed from the paper's
# arms' committed runs before any newer optimizer ran on T5, as AlgoPerf sets a target from its
# baselines' runs: 6.0, which every paper arm reaches in its two epochs (Ginger tau 8 ends at
# 5.70-5.77, QNG tau 8 at 5.87), and 4.5, which the best of them, Adam, reaches in every seed
# (4.37-4.38 at its last evaluation).
TEXT_WORKLOADS = {("cifar10", "30ep"): ("t5-small-random", "2ep", (6.0, 4.5))}


class Workload(NamedTuple):
  """One workload of the profiles: the criteria and sweep of its runs (an optimizer's cell on
  top), the validation metric its targets are on, and its target at each level of TARGETS."""

  name: str
  family: str  # model.family
  criteria: dict[str, Any]
  sweep: str
  metric: str
  targets: tuple[float, ...]
  lower_is_better: bool = False

  def reached(self, values: np.ndarray, target: float) -> np.ndarray:
    """Which evaluations are at the target or past it (NaN never is)."""
    if self.lower_is_better:
      return np.nan_to_num(values, nan=np.inf) <= target
    return np.nan_to_num(values, nan=-np.inf) >= target

  def target_text(self, target: float) -> str:
    return f"validation loss {target:g}" if self.lower_is_better else f"{target:g} %"


def workloads(dataset: str, length: str | None) -> list[Workload]:
  """The image set's ResNets at its targets, then its T5 workload where TEXT_WORKLOADS has one;
  none for a set without targets (IMAGE_TARGETS)."""
  if (dataset, length) not in IMAGE_TARGETS:
    return []
  out = [image_workload(dataset, model, length) for model in MODELS]
  if (dataset, length) in TEXT_WORKLOADS:
    model, text_length, _ = TEXT_WORKLOADS[dataset, length]
    out.append(text_workload(model, text_length)._replace(name="T5 stand-in"))
  return out


def image_workload(dataset: str, model: str, length: str | None) -> Workload:
  """An image model's workload: Table 1's cells on their validation accuracy, with the targets
  IMAGE_TARGETS gives the set (none otherwise)."""
  criteria = {**selection.image_protocol(dataset, length), "model": model}
  name = table_model.MODEL_NAMES.get(model, model)
  targets = IMAGE_TARGETS.get((dataset, length), ())
  return Workload(name, "resnet", criteria, "table1", "val_accuracy", targets)


def text_workload(model: str, length: str | None, setting: str = "full") -> Workload:
  """An XSUM model's workload in ``setting``: Table 2's cells on their validation loss, with the
  targets TEXT_WORKLOADS gives that model and length in full fine-tuning (none otherwise)."""
  targets = next(
    (t for m, n, t in TEXT_WORKLOADS.values() if (m, n, setting) == (model, length, "full")), ()
  )
  criteria = {**selection.text_protocol(model, length), "setting": setting}
  return Workload(model, "t5", criteria, "table2", "val_loss", targets, True)


def performance_ratios(
  times: Mapping[str, Mapping[str, float]], r_max: float = R_MAX
) -> dict[str, dict[str, float]]:
  """``{workload: {optimizer: t}}`` -> ``{optimizer: {workload: r}}`` with ``r = t / min t``
  over the workload's optimizers; ``inf`` where ``t`` is infinite, where ``r > r_max``, and for
  every optimizer of a workload that none reaches."""
  ratios: dict[str, dict[str, float]] = {}
  for workload, by_optimizer in times.items():
    fastest = min(by_optimizer.values(), default=math.inf)
    for optimizer, t in by_optimizer.items():
      r = t / fastest if math.isfinite(t) else math.inf
      ratios.setdefault(optimizer, {})[workload] = r if r <= r_max else math.inf
  return ratios


def profile(ratios: Mapping[str, float], xs: np.ndarray) -> np.ndarray:
  """``P(x)``: the fraction of the workloads whose ratio is at most ``x``, at each ``x``."""
  r = np.array(list(ratios.values()), dtype=float)
  return (r[None, :] <= np.asarray(xs, dtype=float)[:, None]).mean(axis=1)


def score(ratios: Mapping[str, float], r_max: float = R_MAX) -> float:
  """AlgoPerf's ``B``: the profile's integral over ``[1, r_max]`` over ``r_max - 1``, exactly (the
  profile is a step function: a workload at ratio ``r <= r_max`` adds ``(r_max - r) / (r_max -
  1)`` over the number of workloads)."""
  r = [x for x in ratios.values() if x <= r_max]
  return sum((r_max - max(x, 1.0)) / (r_max - 1.0) for x in r) / len(ratios)


def current_alone_runs(runs: Sequence[Run], pool: Sequence[Run] = ()) -> list[Run]:
  """The runs that time the configuration of ``runs`` as its code stands: those that had their
  device alone, among ``runs`` and the runs of ``pool`` with the same step
  (:func:`results.selection.step_key`; any sweep and length: a cold race's runs and the
  steptime sweep's short runs time the same program), at the newest commit among them and on
  the newest run's device (code and the GPU change the step); [] without a run alone."""
  keys, mine = {selection.step_key(r) for r in runs}, {id(r) for r in runs}
  others = (r for r in pool if id(r) not in mine and is_done(r))
  same = [*runs, *(r for r in others if selection.step_key(r) in keys)]
  alone = [r for r in same if is_number(r.get("step_time_s")) and not is_shared(r)]
  if not alone:
    return []
  newest = max(alone, key=lambda r: r.get("mtime") or 0)
  commit, device = newest.get("git_commit"), table_model.device_name(newest)
  return [
    r for r in alone if r.get("git_commit") == commit and table_model.device_name(r) == device
  ]


def alone_step_time(runs: Sequence[Run], pool: Sequence[Run] = ()) -> float | None:
  """The median ``step_time_s`` of :func:`current_alone_runs` (None without one)."""
  return median_step(current_alone_runs(runs, pool))


def median_step(alone: Sequence[Run]) -> float | None:
  """The median ``step_time_s`` of runs already found alone (None for none)."""
  return statistics.median(r["step_time_s"] for r in alone) if alone else None


IMAGE = Workload("image", "resnet", {}, "table1", "val_accuracy", TARGETS)


def eval_series(run: Run, workload: Workload = IMAGE) -> dict[str, np.ndarray]:
  """The run's evaluations of ``workload``'s metric: their ``step`` and ``value`` arrays."""
  return read_series(run["path"], spectrum=False, eval_metric=workload.metric).eval


def steps_to(run: Run, target: float, workload: Workload = IMAGE) -> float:
  """Training steps to the run's first evaluation at ``target`` or past it (inf if never)."""
  return first_step(eval_series(run, workload), target, workload)


def first_step(evals: dict[str, np.ndarray], target: float, workload: Workload = IMAGE) -> float:
  """The step of the first of ``evals`` (:func:`eval_series`) at ``target`` (inf if none)."""
  if "value" not in evals or not evals["value"].size:
    return math.inf
  hit = np.flatnonzero(workload.reached(evals["value"], target))
  return float(evals["step"][hit[0]]) if hit.size else math.inf


def seed_times(
  runs: Sequence[Run],
  target: float,
  step_s: float | None,
  workload: Workload = IMAGE,
  evals: Callable[[Run], dict[str, np.ndarray]] | None = None,
) -> list[float] | None:
  """Each seed's seconds to ``target``: its steps times ``step_s``, the configuration's step
  time alone (:func:`alone_step_time`); inf where never reached; None without a step time.
  ``evals`` gives a run's evaluations already read (default: :func:`eval_series`)."""
  if step_s is None:
    return None
  evals = evals or (lambda run: eval_series(run, workload))
  return [first_step(evals(r), target, workload) * step_s for r in runs]


def optimizers() -> list[tuple[str, Any]]:
  """The profile's rows: the paper's four (Ginger and QNG at tau 8) and every registered
  optimizer beyond them (those with comparison arms)."""
  return list(PAPER_ARMS) + [(n, None) for n in registry.table_order() if registry.get(n).arms]


def label(optimizer: str, tau: Any) -> str:
  return (
    registry.display_name(optimizer) if tau is None else table_model.optimizer_label(optimizer, tau)
  )


def runs_family(optimizer: str, workload: Workload) -> bool:
  """Whether ``optimizer`` can run ``workload``'s model family (its registry entry's
  ``families``)."""
  families = registry.get(optimizer).families
  return families is None or workload.family in families


def cell_runs(runs: Sequence[Run], workload: Workload, optimizer: str, tau: Any) -> list[Run]:
  """The runs that time ``optimizer`` (at ``tau``) on ``workload``: its table cell's."""
  criteria = selection.cell_criteria(optimizer, tau, **workload.criteria)
  return selection.select_runs(runs, criteria, (workload.sweep,)).runs


class Timing(NamedTuple):
  """The times at each level of targets: ``times[level]`` ``{workload: {optimizer label:
  median seconds}}``; ``missing`` why an optimizer has no time on a workload (``{workload:
  ["<label> (no runs)", ...]}``); ``spacings`` each timed optimizer's steps between evaluations
  there (``{workload: {label: (45,)}}``), the resolution of its times; ``devices`` the device
  its step time was measured on (``{workload: {label: "NVIDIA H200"}}``) and ``commits`` the
  code commit of those runs (``{workload: {label: "64d18e614a"}}``)."""

  times: list[dict[str, dict[str, float]]]
  missing: dict[str, list[str]]
  spacings: dict[str, dict[str, tuple[int, ...]]]
  devices: dict[str, dict[str, str]]
  commits: dict[str, dict[str, str]]


def workload_times(runs: Sequence[Run], dataset: str, length: str | None) -> Timing:
  """Each optimizer's time on each workload at each of its targets (one level per TARGETS),
  each run's evaluations read once. An optimizer that cannot run a workload's model family (its
  registry entry's ``families``) never reaches its targets there. A workload whose optimizers
  were evaluated at different spacings, or whose step times were measured on different devices,
  gets no times (:func:`comparable`)."""
  timing = Timing([{} for _ in TARGETS], {}, {}, {}, {})
  for workload in workloads(dataset, length):
    levels = [by_workload.setdefault(workload.name, {}) for by_workload in timing.times]
    spacings = timing.spacings[workload.name] = {}
    devices = timing.devices[workload.name] = {}
    commits = timing.commits[workload.name] = {}
    for optimizer, tau in optimizers():
      name = label(optimizer, tau)
      if not runs_family(optimizer, workload):
        for times in levels:
          times[name] = math.inf
        continue
      runs_of = cell_runs(runs, workload, optimizer, tau)
      alone = current_alone_runs(runs_of, runs) if runs_of else []
      if not alone:
        why = "no runs" if not runs_of else "no run alone on its GPU"
        timing.missing.setdefault(workload.name, []).append(f"{name} ({why})")
        continue
      step_s = median_step(alone)
      evals = [eval_series(r, workload) for r in runs_of]
      for times, target in zip(levels, workload.targets, strict=True):
        times[name] = stats.median_time([first_step(e, target, workload) * step_s for e in evals])
      spacings[name] = evaluation_spacings(evals)
      devices[name] = table_model.device_name(alone[0])
      commits[name] = table_model.commit_name(alone[0])
    if not comparable(spacings, devices):
      for times in levels:
        times.clear()
  return timing


def evaluation_spacings(evals: Sequence[dict[str, np.ndarray]]) -> tuple[int, ...]:
  """The distinct numbers of steps between consecutive evaluations of runs' ``evals``
  (:func:`eval_series`): the resolution of their times, a seed's time being the step of its
  first evaluation at the target."""
  found = set()
  for e in evals:
    steps = e["step"]
    found.update(int(d) for d in np.diff(steps[np.isfinite(steps)]) if d > 0)
  return tuple(sorted(found))


def same_resolution(spacings: Mapping[str, tuple[int, ...]]) -> bool:
  """Whether every optimizer was evaluated at the same spacings: a time is the step of the first
  evaluation at the target, so one evaluated every 225 steps is timed up to 225 steps late
  where one evaluated every 45 is up to 45 late, and their times do not compare."""
  return len(set(spacings.values())) <= 1


def same_device(devices: Mapping[str, str]) -> bool:
  """Whether every optimizer's step time was measured on one kind of device: a time is steps
  times the step time, and an H100's step is not an H200's."""
  return len(set(devices.values())) <= 1


def comparable(spacings: Mapping[str, tuple[int, ...]], devices: Mapping[str, str]) -> bool:
  """Whether a workload's times compare: one evaluation spacing and one device."""
  return same_resolution(spacings) and same_device(devices)


def by_value(mapping: Mapping[str, Any]) -> list[tuple[Any, list[str]]]:
  """The keys of ``mapping`` grouped by their value, the values sorted."""
  groups: dict[Any, list[str]] = {}
  for name, value in mapping.items():
    groups.setdefault(value, []).append(name)
  return sorted(groups.items())


def grouped_text(values: Mapping[str, str]) -> str:
  """ "NVIDIA H100: Ginger (τ=8); NVIDIA H200: Adam, Muon": the optimizers grouped by a value of
  theirs (``{label: value}``: their step times' device or commit)."""
  return "; ".join(f"{value}: {', '.join(names)}" for value, names in by_value(values))


def every_text(spacing: tuple[int, ...], unit: str = " steps") -> str:
  """ "every 45/225 steps": one optimizer's spacings between evaluations."""
  return f"every {'/'.join(map(str, spacing))}{unit}"


def spacing_text(spacings: Mapping[str, tuple[int, ...]]) -> str:
  """ "every 45 steps: Muon, SOAP; every 225: Adam": the optimizers grouped by their spacings."""
  return "; ".join(
    f"{every_text(s, ' steps' if i == 0 else '')}: {', '.join(names)}"
    for i, (s, names) in enumerate(by_value(spacings))
  )


def complete(times: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
  """The optimizers timed on the first workload, over the workloads where each of them is timed
  (a profile over different workloads per optimizer would not compare); {} if none is."""
  first = next(iter(times.values()), {})
  if not first:
    return {}
  return {w: {o: ts[o] for o in first} for w, ts in times.items() if set(first) <= set(ts)}


def everywhere(times: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
  """The optimizers timed on every workload that has times, over all of those workloads (as
  AlgoPerf compares its submissions over the full set, the fastest among them setting each
  ratio); {} unless two optimizers are. Where :func:`complete` leaves a workload out (one that
  only some optimizers ran, such as ResNet-50 for the two best newer optimizers), this profile
  keeps it and leaves out the optimizers without a time there instead."""
  timed = {w: ts for w, ts in times.items() if ts}
  first = next(iter(timed.values()), {})
  common = [o for o in first if all(o in ts for ts in timed.values())]
  if len(common) < 2:
    return {}
  return {w: {o: ts[o] for o in common} for w, ts in timed.items()}


def level_text(dataset: str, length: str | None, level: int, names: Sequence[str]) -> str:
  """ "85 % (ResNet-18, ResNet-50), validation loss 6 (T5 stand-in)": a level's targets on the
  workloads ``names``."""
  by_text: dict[str, list[str]] = {}
  for w in workloads(dataset, length):
    if w.name in names:
      by_text.setdefault(w.target_text(w.targets[level]), []).append(w.name)
  return ", ".join(f"{text} ({', '.join(ws)})" for text, ws in by_text.items())


def seconds_text(t: float) -> str:
  """ "27", "1.3" (under 10 s: the T5 stand-in's targets are a few seconds away), "not
  reached"."""
  if not math.isfinite(t):
    return "not reached"
  return f"{t:.1f}" if t < 10 else f"{t:.0f}"


def _ratio(r: float) -> str:
  return f"{r:.2f}" if math.isfinite(r) else "∞"


def target_table(times: dict[str, dict[str, float]], title: str) -> list[str]:
  """One markdown table: each optimizer's seconds and ratio per workload, and its score."""
  names = list(times)
  ratios = performance_ratios(times)
  order = sorted(ratios, key=lambda o: -score(ratios[o]))
  head = " | ".join(f"{w} s | {w} ratio" for w in names)
  lines = [f"### Targets: {title}", "", f"| optimizer | {head} | score B |"]
  lines.append("|---|" + "---:|---:|" * len(names) + "---:|")
  for name in order:
    cells = " | ".join(f"{seconds_text(times[w][name])} | {_ratio(ratios[name][w])}" for w in names)
    lines.append(f"| {name} | {cells} | {score(ratios[name]):.2f} |")
  return lines + [""]


def draw(profiles: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
  """The profiles as AlgoPerf draws them: P(x) against the ratio x, one panel per level of targets
  (``{its title: times}``)."""
  from results.plot_style import distinct_colors, plt

  cols = min(2, len(profiles))
  rows = math.ceil(len(profiles) / cols)
  fig, axes = plt.subplots(
    rows, cols, figsize=(5.5 * cols + LEGEND_INCHES, 4 * rows), squeeze=False
  )
  xs = np.linspace(1.0, R_MAX, 601)
  for ax in axes.flat[len(profiles) :]:
    ax.set_axis_off()
  names = sorted({name for times in profiles.values() for ts in times.values() for name in ts})
  colors = dict(zip(names, distinct_colors(len(names)), strict=True))  # one per optimizer
  for ax, (title, times) in zip(axes.flat, profiles.items(), strict=False):
    ratios = performance_ratios(times)
    for name in sorted(ratios):
      ax.step(xs, profile(ratios[name], xs), where="post", color=colors[name], label=name)
    ax.set(xlabel="ratio to the fastest, x", ylabel="fraction of workloads within x, P(x)")
    ax.set(title=textwrap.fill(f"targets: {title}", 60), xlim=(1.0, R_MAX), ylim=(-0.02, 1.02))
  # One legend beside the panels (one color per optimizer in every panel), off the lines.
  handles = {}
  for ax in axes.flat:
    handles.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
  legend_width = LEGEND_INCHES / fig.get_figwidth()
  fig.tight_layout(rect=(0.0, 0.0, 1.0 - legend_width, 1.0))
  anchor = (1.0 - legend_width, 0.5)
  fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=anchor, fontsize=8)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_profiles(runs: Sequence[Run], dataset: str, length: str | None, out: Path) -> list[Path]:
  """profile_<dataset>_<length>.md and plots/performance_<...>.png; [] without times."""
  profiles, wide, notes = {}, {}, []
  timing = workload_times(runs, dataset, length)
  for level, times in enumerate(timing.times):  # which optimizers have times: every level alike
    used, every = complete(times), everywhere(times)
    profiles[level_text(dataset, length, level, list(used))] = used
    if set(every) - set(used):
      wide[f"{level_text(dataset, length, level, list(every))}, {len(every)} workloads"] = every
  if not any(profiles.values()):
    return []
  first = next(iter(used))
  for name, why in timing.missing.items():
    notes.append(f"- {name}, no time for: " + "; ".join(why) + ".")
  mixed = [w for w in timing.spacings if not comparable(timing.spacings[w], timing.devices[w])]
  profiled = {w for times in (used, *wide.values()) for w in times}
  for w in workloads(dataset, length):
    for optimizer, tau in optimizers():
      if not runs_family(optimizer, w):
        notes.append(
          f"- {label(optimizer, tau)} cannot run {w.name} (model.family={w.family}): never "
          "reaches its targets there."
        )
    spacings = timing.spacings[w.name]
    if w.name in profiled and spacings:
      every = every_text(next(iter(spacings.values())))
      notes.append(f"- {w.name}: evaluated {every}, the resolution of its times.")
      if len(set(timing.commits[w.name].values())) > 1:
        notes.append(
          f"- {w.name}: step times alone from runs at different commits, each optimizer's "
          f"newest ({grouped_text(timing.commits[w.name])}): their ratios hold the differences "
          "between those runs' machines and code as well as between the optimizers."
        )
    if w.name in mixed:
      devices, why = timing.devices[w.name], []
      if not same_resolution(spacings):
        why.append(f"evaluated at different spacings ({spacing_text(spacings)})")
      if not same_device(devices):
        why.append(f"timed on different devices ({grouped_text(devices)})")
      notes.append(
        f"- Left out of the profiles: {w.name}, its optimizers {' and '.join(why)}, so their "
        "times do not compare."
      )
  left_out = [w for w in timing.times[0] if w not in used and w not in mixed]
  if left_out:
    where = "the first profiles" if wide else "the profiles"
    notes.append(
      f"- Left out of {where} (not every optimizer timed on {first} is timed there): "
      + ", ".join(left_out)
      + "."
    )
  if wide:
    every = next(iter(wide.values()))
    notes.append(
      f"- Over {len(every)} workloads ({', '.join(every)}): the optimizers timed on each of "
      f"them, {', '.join(next(iter(every.values())))}; each ratio to the fastest among them."
    )
  name = table_model.set_name("profile", dataset, length)
  lines = [
    f"## Performance profiles: {table_model.set_text(dataset, length)}",
    "",
    "Time to a target as AlgoPerf scores it (results/profiles.py): per "
    "workload, the median over seeds of each seed's steps to its first evaluation at the "
    "target times the configuration's step time alone on its GPU (its runs alone at the newest "
    "commit among them, any sweep; a seed that misses counts as infinitely "
    f"slow); ratio: to the fastest on that workload (∞ past {R_MAX:g}); score B: the "
    f"profile's area over [1, {R_MAX:g}] / {R_MAX - 1:g} (1: fastest everywhere). The "
    f"optimizers timed on {first}, over the workloads where each of them is timed.",
    "",
  ]
  for title, times in {**profiles, **wide}.items():
    lines += target_table(times, title) if times else []
  lines += notes
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{name}.md"
  path.write_text("\n".join(lines).rstrip() + "\n")
  plot = out / "plots" / f"performance_{name}.png"
  plot.parent.mkdir(parents=True, exist_ok=True)
  draw({t: ts for t, ts in {**profiles, **wide}.items() if ts}, plot)
  return [path, plot]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("roots", nargs="*", default=["results/cifar10/runs"])
  parser.add_argument("--out", type=Path, default=Path("results/cifar10"))
  parser.add_argument("--dataset", default="cifar10")
  parser.add_argument("--length", default="30ep")
  args = parser.parse_args(argv)
  if error := missing_roots(args.roots):
    print(error, file=sys.stderr)
    return 2
  written = write_profiles(collect_runs(args.roots), args.dataset, args.length, args.out)
  for path in written:
    print(f"wrote {path}")
  if not written and (args.dataset, args.length) not in IMAGE_TARGETS:
    sets = ", ".join(f"{d} {n}" for d, n in IMAGE_TARGETS)
    print(f"{args.dataset} {args.length} has no targets (sets with targets: {sets}): no profile")
  elif not written:
    print("no workload has runs timed alone on their GPU: no profile written")
  return 0


if __name__ == "__main__":
  sys.exit(main())
