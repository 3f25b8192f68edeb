"""Data-parallel scaling of whole training steps: 1, 2, 4... devices at a fixed batch per device.

    python -m bench.scaling --data .data/cifar10-jpeg.tar.xz --devices 1 2 4

For every device count N and optimizer, ``train.py`` runs in a fresh process (as in
:mod:`bench.train_step`) on the first N devices (``mesh.data=N``) with batch ``N x
--per-device-batch``, with the optimizer state sharded over the mesh (arrays of at least
``mesh.min_shard_size`` elements) and replicated. Columns: median step time, images/s,
scaling efficiency (images/s over N times the same optimizer's 1-device images/s), and one
device's memory (:data:`bench.train_step.MEMORY_HEADER`: the step's own, the process's
high-water mark, the optimizer state). ``--batchnorm per_device`` runs with
``batchnorm=per_device`` (BatchNorm statistics over each device's batch, no per-layer
all-reduce; at 1 device the same as ``sync``). ``--profile N`` traces N steps of every run
and prints where each device's time goes (:mod:`bench.profile_summary`: kernels, collectives
hidden behind them or exposed, idle gaps). ``--extra`` passes more overrides to every run (e.g.
``curvature_every=8``, the race's Ginger). ``--repeat R`` runs the whole set R times, round
after round (so that a host's drift over time reaches every configuration alike: multi-GPU
step times drift from one command to the next on one host, docs/benchmarks.md), prints each
run's row as it finishes (efficiency against the same round's 1-device run) and then a table
of the medians over the rounds, with every round's step time.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

from bench import profile_summary, train_step

RUNS = ("adam", "ginger tau=8 (d-pass: shared forward)")
HEADER = (
  "| optimizer | devices | optimizer state | ms/step | images/s | efficiency "
  f"| {train_step.MEMORY_HEADER} |"
)
MEDIAN_HEADER = (
  "| optimizer | devices | optimizer state | ms/step | images/s | efficiency | ms/step each round |"
)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", required=True, help="local CIFAR-10 copy (data.path)")
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--per-device-batch", type=int, default=128)
  parser.add_argument(
    "--runs", nargs="+", default=list(RUNS), choices=list(train_step.SUITES["resnet18"]["runs"])
  )
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--out", type=Path, default=Path("outputs/bench_scaling"))
  parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
  parser.add_argument(
    "--batchnorm",
    choices=["sync", "per_device"],
    default="sync",
    help="BatchNorm statistics: over the global batch (sync) or each device's (per_device)",
  )
  parser.add_argument(
    "--extra",
    nargs="*",
    default=[],
    help="more overrides for every run, e.g. curvature_every=16 (the run dirs are not renamed: "
    "give each such invocation its own --out)",
  )
  parser.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="N",
    help="trace N steps of every run (ending 10 steps before the last) and print, after the "
    "table, where each device's time goes (bench.profile_summary)",
  )
  parser.add_argument(
    "--repeat",
    type=int,
    default=1,
    metavar="R",
    help="run every configuration R times, round after round, then print the medians",
  )
  args = parser.parse_args(argv)
  if args.repeat < 1:
    parser.error(f"--repeat {args.repeat}: must be >= 1")
  if 1 not in args.devices:
    parser.error("--devices must include 1 (the efficiency baseline)")
  if args.profile < 0 or (args.profile and args.steps < args.profile + 20):
    parser.error(
      f"--profile {args.profile}: must be >= 0 and leave 20 steps (--steps {args.steps})"
    )

  print(
    f"# {datetime.date.today()} ResNet-18, batch {args.per_device_batch} per device, "
    f"steps={args.steps}, batchnorm={args.batchnorm}, extra={args.extra}"
  )
  print(HEADER)
  print("|---" * (HEADER.count("|") - 1) + "|", flush=True)
  configs = [
    (name, n, shard)
    for name in args.runs
    for n in sorted(args.devices)
    for shard in ((True, False) if n > 1 else (True,))
  ]
  runs: dict[tuple, list[tuple[float, float]]] = {config: [] for config in configs}
  traced: list[tuple[str, Path]] = []
  last = {}  # the last run that finished: its device and versions close the table
  for round_ in range(args.repeat):
    single: dict[str, float] = {}  # this round's 1-device images/s of each optimizer
    for name, n, shard in configs:
      extra = [
        f"mesh.data={n}",
        f"batch_size={n * args.per_device_batch}",
        f"mesh.shard_optimizer_state={str(shard).lower()}",
      ]
      out = args.out / f"d{n}_{'sharded' if shard else 'replicated'}"
      if args.batchnorm != "sync":
        extra.append(f"batchnorm={args.batchnorm}")
        out = out.with_name(f"{out.name}_bn_{args.batchnorm}")
      if args.repeat > 1:
        out = out.with_name(f"{out.name}_round{round_}")
      if args.profile:
        start = args.steps - args.profile - 10
        extra += [f"profile_steps={args.profile}", f"profile_start={start}"]
        traced.append(
          (f"{name}, {n} devices, {out.name}", out / "resnet18" / train_step.run_dir_name(name))
        )
      summary = train_step.run(
        "resnet18", name, args.data, args.steps, out, args.timeout, extra + args.extra
      )
      layout = "sharded" if shard and n > 1 else "replicated"
      if not summary:
        print(f"| {name} | {n} | {layout} | failed |" + " |" * (HEADER.count("|") - 5), flush=True)
        continue
      last, rate = summary, summary["examples_per_s"]
      runs[(name, n, shard)].append((rate, summary["step_time_s"]))
      if n == 1:
        single[name] = rate
      eff = f"{rate / (n * single[name]):.1%}" if name in single else ""
      print(
        f"| {name} | {n} | {layout} | {1e3 * summary['step_time_s']:.2f} | {rate:.0f} "
        f"| {eff} | {train_step.memory_cells(summary)} |",
        flush=True,
      )
  if args.repeat > 1:
    print_medians(configs, runs, args.repeat)
  print(f"device={last.get('device')} versions={last.get('versions')}")
  for label, run_dir in traced:
    print(f"\n## Profile: {label}")
    try:
      profile_summary.main([str(run_dir), "--steps", str(args.profile)])
    except SystemExit as e:  # a run that failed has no trace: say so, go on
      print(e)


def print_medians(configs, runs: dict, rounds: int) -> None:
  """The table of medians over the rounds (``runs``: each configuration's (images/s, step s)
  per round): efficiency against the median 1-device images/s of the same optimizer, and
  every round's step time."""
  print(f"\n## Medians over {rounds} rounds")
  print(MEDIAN_HEADER)
  print("|---" * (MEDIAN_HEADER.count("|") - 1) + "|")
  single = {
    name: statistics.median(rate for rate, _ in got)
    for (name, n, _), got in runs.items()
    if n == 1 and got
  }
  for name, n, shard in configs:
    got = runs[(name, n, shard)]
    layout = "sharded" if shard and n > 1 else "replicated"
    if not got:
      print(f"| {name} | {n} | {layout} | failed | | | |")
      continue
    rate = statistics.median(r for r, _ in got)
    ms = 1e3 * statistics.median(t for _, t in got)
    eff = f"{rate / (n * single[name]):.1%}" if name in single else ""
    each = ", ".join(f"{1e3 * t:.2f}" for _, t in got)
    print(f"| {name} | {n} | {layout} | {ms:.2f} | {rate:.0f} | {eff} | {each} |", flush=True)


if __name__ == "__main__":
  main()
