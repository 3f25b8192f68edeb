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
``curvature_every=16``, the race's Ginger).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from bench import profile_summary, train_step

RUNS = ("adam", "ginger tau=8 (d-pass: shared forward)")
HEADER = (
  "| optimizer | devices | optimizer state | ms/step | images/s | efficiency "
  f"| {train_step.MEMORY_HEADER} |"
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
  args = parser.parse_args(argv)
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
  single: dict[str, float] = {}
  traced: list[tuple[str, Path]] = []
  summary = {}
  for name in args.runs:
    for n in sorted(args.devices):
      for shard in (True, False) if n > 1 else (True,):
        extra = [
          f"mesh.data={n}",
          f"batch_size={n * args.per_device_batch}",
          f"mesh.shard_optimizer_state={str(shard).lower()}",
        ]
        out = args.out / f"d{n}_{'sharded' if shard else 'replicated'}"
        if args.batchnorm != "sync":
          extra.append(f"batchnorm={args.batchnorm}")
          out = out.with_name(f"{out.name}_bn_{args.batchnorm}")
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
          print(
            f"| {name} | {n} | {layout} | failed |" + " |" * (HEADER.count("|") - 5), flush=True
          )
          continue
        rate = summary["examples_per_s"]
        if n == 1:
          single[name] = rate
        eff = f"{rate / (n * single[name]):.1%}" if name in single else ""
        print(
          f"| {name} | {n} | {layout} | {1e3 * summary['step_time_s']:.2f} | {rate:.0f} "
          f"| {eff} | {train_step.memory_cells(summary)} |",
          flush=True,
        )
  print(f"device={summary.get('device')} versions={summary.get('versions')}")
  for label, run_dir in traced:
    print(f"\n## Profile: {label}")
    try:
      profile_summary.main([str(run_dir), "--steps", str(args.profile)])
    except SystemExit as e:  # a run that failed has no trace: say so, go on
      print(e)


if __name__ == "__main__":
  main()
