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
all-reduce; at 1 device the same as ``sync``).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from bench import train_step

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
  args = parser.parse_args(argv)
  if 1 not in args.devices:
    parser.error("--devices must include 1 (the efficiency baseline)")

  print(
    f"# {datetime.date.today()} ResNet-18, batch {args.per_device_batch} per device, "
    f"steps={args.steps}, batchnorm={args.batchnorm}"
  )
  print(HEADER)
  print("|---" * (HEADER.count("|") - 1) + "|", flush=True)
  single: dict[str, float] = {}
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
        summary = train_step.run("resnet18", name, args.data, args.steps, out, args.timeout, extra)
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


if __name__ == "__main__":
  main()
