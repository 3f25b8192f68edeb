"""The collectives in a compiled data-parallel train step: what each step sends between devices.

    python -m bench.collectives --devices 4 -- optimizer=ginger tau=8
    python -m bench.collectives --devices 4 --cpu -- optimizer=adam   # simulated CPU devices
    python -m bench.collectives --devices 4 --cpu --row-blocks -- optimizer=ginger tau=8

Runs ``train.py`` for two steps (ResNet-18, CIFAR-10 from ``--data``, ``mesh.data=N``, batch
``N x --per-device-batch``) in a fresh process with XLA dumping every compiled module's optimized
HLO, then reads the train step's module(s) (``jit_step``, and ``jit_plain_step`` etc. with
``curvature_every > 1``) and prints one row per kind of collective and source: how many, and
how many bytes they carry per step. Sources: "BN forward" / "BN backward" are the per-layer
batch-statistic all-reduces that BatchNorm over the global batch needs; anything over 100 kB is
named by its op_name (the gradient all-reduce, the state all-gathers). This is the structure of
the step, not its timing: which collectives sit on the critical path is for a profile to show.
With ``--cpu`` the same SPMD partitioning runs on simulated CPU devices (XLA_FLAGS
``--xla_force_host_platform_device_count``), so the count can be read on a machine with no GPU;
GPU backends may combine small collectives differently. ``--row-blocks`` traces Ginger's jnp
rotation of ``U`` in row blocks as on GPUs and stacks its bases as on GPUs (Ginger given
``Tuning(jnp_row_blocks=True, solo_buckets=False)``; the CPU rotates ``U`` in one piece and gives
each large block a bucket of its own), so that the CPU run partitions the step a GPU runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVE = re.compile(
  r"= (.*?) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("
)
SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s32|u32|s8|u8|pred)\[([0-9,]*)\]")
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1}
SMALL_BYTES = 100_000


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in an HLO result type, e.g. ``(f32[64]{0}, f32[64]{0})``."""
  total = 0
  for dtype, dims in SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += DTYPE_BYTES.get(dtype, 1) * n
  return total


def source(op_name: str, nbytes: int) -> str:
  """A readable name for what a collective carries."""
  tail = op_name.split("/", 1)[-1]
  if nbytes < SMALL_BYTES and tail == "jvp()/reduce_sum":
    return "BN forward (batch statistics)"
  if nbytes < SMALL_BYTES and tail == "transpose(jvp())/reduce_sum":
    return "BN backward (statistics' gradients)"
  return ("small: " if nbytes < SMALL_BYTES else "") + (op_name[:70] or "(no op_name)")


def collectives(hlo: str) -> dict[tuple[str, str], list[int]]:
  """{(kind, source): [count, bytes]} of one optimized HLO module's text."""
  rows: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
  for line in hlo.splitlines():
    match = COLLECTIVE.search(line)
    if not match:
      continue
    nbytes = shape_bytes(match.group(1))
    op = re.search(r'op_name="([^"]*)"', line)
    row = rows[(match.group(2), source(op.group(1) if op else "", nbytes))]
    row[0] += 1
    row[1] += nbytes
  return dict(rows)


def step_modules(dump: Path) -> list[Path]:
  """The train steps' optimized HLO files in an XLA dump folder (not the eval step)."""
  files = sorted(dump.glob("*after_optimizations.txt"))
  return [f for f in files if re.search(r"\.jit_\w*step\.", f.name) and "eval" not in f.name]


def table(modules: Sequence[Path]) -> str:
  lines = ["| module | collective | source | count | MB per step |", "|---|---|---|---|---|"]
  for path in modules:
    name = path.name.split(".")[1]
    rows = collectives(path.read_text())
    for (kind, src), (count, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
      lines.append(f"| {name} | {kind} | {src} | {count} | {nbytes / 1e6:.3f} |")
    if not rows:
      lines.append(f"| {name} | none | | 0 | 0 |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", default=".data/cifar10-jpeg.tar.xz", help="local CIFAR-10 copy")
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--per-device-batch", type=int, default=128)
  parser.add_argument("--cpu", action="store_true", help="simulated CPU devices")
  parser.add_argument(
    "--row-blocks",
    action="store_true",
    help="Ginger's rotation in row blocks and its bases stacked, as on GPUs",
  )
  parser.add_argument("--dump", type=Path, help="keep the XLA dump here (default: a temp dir)")
  parser.add_argument("overrides", nargs="*", help="train.py overrides, after --")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    dump = args.dump or Path(tmp) / "xla"
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"]
    env = dict(os.environ)
    if args.cpu:
      flags.append(f"--xla_force_host_platform_device_count={args.devices}")
      env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    train = [sys.executable, "train.py"]
    if args.row_blocks:  # train.py as __main__ after setting the switches
      train = [
        sys.executable,
        "-c",
        "import functools, runpy, sys; import ginger; from ginger._src.tuning import Tuning; "
        "ginger.ginger = functools.partial(ginger.ginger, "
        "tuning=Tuning(jnp_row_blocks=True, solo_buckets=False)); "
        "sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')",
      ]
    command = [
      *train,
      "experiment=cifar10_resnet18",
      "data.source=local",
      f"data.path={args.data}",
      "max_steps=2",
      "eval_every=1000",
      "logger=none",
      f"mesh.data={args.devices}",
      f"batch_size={args.devices * args.per_device_batch}",
      f"hydra.run.dir={Path(tmp) / 'run'}",
      *args.overrides,
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
      print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
      return done.returncode
    modules = step_modules(dump)
    print(
      f"# {args.devices} {'simulated CPU' if args.cpu else ''} devices"
      f"{', row-blocked rotation' if args.row_blocks else ''}, overrides: "
      f"{' '.join(args.overrides) or '(none)'}"
    )
    print(table(modules))
  return 0


if __name__ == "__main__":
  sys.exit(main())
