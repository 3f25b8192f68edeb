"""Where a traced window of training steps spends each device's time.

    python train.py ... profile_steps=10 profile_start=40     # writes <run dir>/profile
    python -m bench.profile_summary <run dir> [--top 15]

Reads the newest ``*.xplane.pb`` under the run dir (or the file given) with
``jax.profiler.ProfileData`` and, for every GPU of the trace, splits the window's wall-clock
time per step into: kernels other than collectives, collectives (NCCL kernels), the part of
the collectives that ran while another kernel did (hidden behind compute) and the part that
did not (exposed), and idle time (no kernel on any of the device's streams: launch gaps,
host waits). ``span`` is the first kernel's start to the last one's end, divided by the
steps. Then the kernel time by family (:data:`CATEGORIES`, from the kernels' names:
convolutions and matmuls, Ginger's Pallas kernels, collectives, copies, fusions with a
transpose, other fusions) and the slowest kernels, summed over the devices. The trace's own
overhead slows the traced steps: compare shares within a trace, and take step times from the run's
summary.json (its median leaves out the traced window's interval only if it is not the
median: bench.train_step's 60 steps with ``profile_start=40 profile_steps=10`` are).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import yaml

DEVICE_PLANE = re.compile(r"^/device:(GPU|TPU):(\d+)$")
COLLECTIVE = re.compile(
  r"nccl|all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|allreduce", re.I
)
# Kernel families by name (first match wins): the GPU libraries' convolutions and matrix
# products, Ginger's Pallas kernels, NCCL, copies, and XLA's fusions (layout changes apart).
CATEGORIES = (
  ("convolutions and matmuls", re.compile(r"xmma|cudnn|cutlass|gemm|wgrad|dgrad|fprop|conv", re.I)),
  ("Ginger's Pallas kernels", re.compile(r"^ginger_")),
  ("collectives", COLLECTIVE),
  ("copies", re.compile(r"memcpy|memset", re.I)),
  ("fusions with a transpose", re.compile(r"transpose")),
  ("other fusions", re.compile(r"")),
)
HEADER = (
  "| device | span ms/step | busy | other kernels | collectives | collectives hidden "
  "| collectives exposed | idle | kernels/step |"
)


class DeviceTime(NamedTuple):
  """One device's time in the window, in ms per step (see the module docstring)."""

  device: str
  span: float
  busy: float
  kernels: float
  collectives: float
  hidden: float
  exposed: float
  idle: float
  launches: float


def union_ns(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of ``[start, end)`` intervals."""
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def kernel_events(plane) -> list[tuple[str, float, float]]:
  """``(name, start_ns, end_ns)`` of the kernels and copies on a device plane's streams (the
  lines named ``Stream ...``; derived lines such as ``XLA Ops`` repeat them)."""
  return [
    (e.name, e.start_ns, e.start_ns + e.duration_ns)
    for line in plane.lines
    if line.name.startswith("Stream")
    for e in line.events
  ]


def device_time(name: str, events, steps: int) -> DeviceTime:
  coll = [(a, b) for n, a, b in events if COLLECTIVE.search(n)]
  other = [(a, b) for n, a, b in events if not COLLECTIVE.search(n)]
  busy, c, o = union_ns(coll + other), union_ns(coll), union_ns(other)
  span = max(b for _, _, b in events) - min(a for _, a, _ in events)
  ms = 1e-6 / steps
  return DeviceTime(
    name,
    span * ms,
    busy * ms,
    o * ms,
    c * ms,
    (c + o - busy) * ms,
    (busy - o) * ms,
    (span - busy) * ms,
    len(events) / steps,
  )


def by_category(kernels: list[tuple]) -> list[tuple]:
  """``(category, us/step, launches/step)`` of :data:`CATEGORIES`, from :func:`summarize`'s
  full kernel list, largest first."""
  totals = defaultdict(lambda: [0.0, 0.0])
  for name, us, launches in kernels:
    label = next(label for label, pattern in CATEGORIES if pattern.search(name))
    totals[label][0] += us
    totals[label][1] += launches
  return sorted(((k, t, n) for k, (t, n) in totals.items()), key=lambda r: -r[1])


def summarize(data, steps: int, top: int | None = 15) -> tuple[list[DeviceTime], list[tuple]]:
  """Per-device times and the ``top`` kernels (name, us/step summed over devices, launches
  per step; ``top=None``: all) of a ``jax.profiler.ProfileData`` holding ``steps`` steps."""
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  devices, per_kernel = [], defaultdict(lambda: [0.0, 0])
  planes = sorted(
    (p for p in data.planes if DEVICE_PLANE.match(p.name)),
    key=lambda p: int(DEVICE_PLANE.match(p.name).group(2)),
  )
  for plane in planes:
    events = kernel_events(plane)
    if not events:
      continue
    devices.append(device_time(plane.name.removeprefix("/device:"), events, steps))
    for n, a, b in events:
      per_kernel[n][0] += b - a
      per_kernel[n][1] += 1
  kernels = sorted(
    ((n, t * 1e-3 / steps, k / steps) for n, (t, k) in per_kernel.items()), key=lambda r: -r[1]
  )
  return devices, kernels if top is None else kernels[:top]


def find_trace(path: Path) -> Path:
  """``path`` if it is a trace file, else the newest ``*.xplane.pb`` below it."""
  if path.is_file():
    return path
  traces = sorted(path.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
  if not traces:
    raise FileNotFoundError(
      f"no *.xplane.pb under {path}: run train.py with profile_steps=N (> 0) to write one"
    )
  return traces[-1]


def steps_of(path: Path) -> int | None:
  """profile_steps of the run dir holding ``path`` (its .hydra/config.yaml), if any."""
  for folder in [path, *path.parents]:
    config = folder / ".hydra" / "config.yaml"
    if config.is_file():
      return yaml.safe_load(config.read_text()).get("profile_steps") or None
  return None


def format_table(devices: list[DeviceTime], kernels: list[tuple], categories=()) -> str:
  lines = [HEADER, "|---" * (HEADER.count("|") - 1) + "|"]
  for d in devices:
    cells = " | ".join(f"{x:.2f}" for x in d[1:-1])
    lines.append(f"| {d.device} | {cells} | {d.launches:.0f} |")
  lines.append("")
  if categories:
    lines.append("| kernels by family | us/step (all devices) | launches/step |")
    lines.append("|---|---|---|")
    lines += [f"| {c} | {t:.1f} | {k:.1f} |" for c, t, k in categories]
    lines.append("")
  lines.append("| kernel | us/step (all devices) | launches/step |")
  lines.append("|---|---|---|")
  lines += [f"| {n[:90]} | {t:.1f} | {k:.1f} |" for n, t, k in kernels]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path", type=Path, help="a run dir (or its profile folder, or a trace)")
  parser.add_argument("--steps", type=int, help="steps in the trace (default: the run's)")
  parser.add_argument("--top", type=int, default=15, help="slowest kernels to list")
  args = parser.parse_args(argv)
  from jax.profiler import ProfileData

  try:
    trace = find_trace(args.path)
  except FileNotFoundError as e:
    sys.exit(f"error: {e}")
  steps = args.steps or steps_of(trace)
  if not steps:
    sys.exit(f"error: no profile_steps in a .hydra/config.yaml above {trace}: pass --steps N")
  devices, kernels = summarize(ProfileData.from_file(str(trace)), steps, top=None)
  print(f"# {trace} ({steps} steps)")
  if not devices:
    print("(no GPU or TPU kernels in the trace: a CPU run traces host threads only)")
    return
  print(format_table(devices, kernels[: args.top], by_category(kernels)))


if __name__ == "__main__":
  main()
