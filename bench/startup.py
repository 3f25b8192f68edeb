"""Where a run's start-up goes: building, lowering and compiling its programs, one fresh process
per measurement.

    python -m bench.startup                                   # CIFAR-10 shapes, fake images
    python -m bench.startup --data .data/cifar10-jpeg.tar.xz  # the real training set
    python -m bench.startup --only "ginger tau=8 K=8" --modes concurrent
    python -m bench.startup --only "ginger tau=8" --extra passes=pallas

For each configuration (ResNet-18, batch 128, CIFAR-10 shapes) a child process builds the run
as ``training.loop`` does (``run_setup.build``: data, model, optimizer state; then the arrays
placed on the device) and lowers and compiles every program the loop compiles before its first
step (``compilation.programs``: the training step, with ``curvature_every`` > 1 the step without
the curvature update, the evaluation step; not ``compilation.LATER``'s, which the loop compiles
while it trains), in one of two modes:

* ``one-by-one``: each program lowered and compiled in turn (the baseline: no overlap between
  programs);
* ``concurrent``: ``compilation.compile_all``, what the training loop does (the first of
  ``compilation.programs`` alone: with K > 1 the step without the curvature update, else the
  training step; then the others at once).

The table gives, per program, the lowering and compilation seconds (wall clock and this
process's CPU seconds: on a busy machine the wall clock includes waiting for a core) and the
size of the lowered program (StableHLO operations), and per run the time from the start of
``build`` to every program compiled. The persistent compilation cache is off in the children
(``--cache-dir`` turns it on: then the first run of a configuration fills it and a rerun reads
it back). ``--extra compilation_cache_dir=DIR`` turns on the run's own cache as train.py would:
JAX's compilation cache and the kept programs (``DIR/programs``, training/program_cache.py): the
first measurement of a configuration traces and keeps its programs, a rerun reads them back (the
table's "how" column). Without ``--data`` the images are random (the CIFAR-10 layout, 640
training and 500 test images): the programs have the real shapes except the dataset's length,
which does not change what is compiled beyond one dimension of the gather.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench import train_step

ROOT = Path(__file__).resolve().parents[1]
BASE = ["experiment=cifar10_resnet18", "batch_size=128", "logger=none", "eval_batch_size=500"]
RUNS = {
  "adam": ["optimizer=adam"],
  "ginger tau=8": ["optimizer=ginger", "tau=8"],
  "ginger tau=8 K=8": ["optimizer=ginger", "tau=8", "curvature_every=8"],
}
MODES = ("one-by-one", "concurrent")


def _stablehlo_ops(lowered) -> int:
  return sum(1 for line in lowered.as_text().splitlines() if " = " in line)


def _name(key) -> str:
  if key is True:
    return "train step"
  if key is False:
    return "step without curvature update"
  return f"eval step (batch {key[1]})"


def child(spec: dict) -> dict:
  """One measurement (runs in its own process): see the module docstring."""
  import jax

  jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
  import numpy as np
  from hydra import compose, initialize_config_dir
  from omegaconf import OmegaConf

  from training import compilation, run_setup, sharding

  data = spec["data"]
  if data is None:
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import cifar_pickle_folder

    # The same images (a fixed draw) at the same path in every child: its config, and its
    # programs' keys with the kept programs, are those of the previous child.
    root = Path(tempfile.gettempdir()) / "ginger-bench-startup-fake-cifar10"
    folder = root / "cifar-10-batches-py"
    data = str(folder if folder.exists() else cifar_pickle_folder(root, "cifar10", 640, 500))
  overrides = BASE + ["data.source=local", f"data.path={data}"] + spec["overrides"]
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    cfg = compose(config_name="config", overrides=overrides)

  start = time.perf_counter()
  setup = run_setup.build(cfg)
  jax.block_until_ready(setup.state)
  built = time.perf_counter()
  train_arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
  val_arrays = sharding.put(setup.task.val_arrays, setup.plan.replicated)
  indices = setup.plan.indices(np.arange(int(cfg.batch_size)))
  jax.block_until_ready((train_arrays, val_arrays))
  placed = time.perf_counter()
  resolved = OmegaConf.to_container(cfg, resolve=True)
  lower = compilation.programs(
    setup, setup.state, setup.frozen, train_arrays, val_arrays, indices, setup.rc, resolved
  )
  lower = {
    key: fn for key, fn in lower.items() if key not in compilation.LATER
  }  # compiled while training
  device = jax.devices()[0]
  out = {
    "device": f"{device.platform} {device.device_kind} x{jax.device_count()}",
    "build_s": built - start,
    "place_s": placed - built,
    "programs": {},
  }

  def timed(key, fn):
    """``fn`` (a lowering) timed, returning a Lowered whose compile() is timed too."""

    def lowering():
      t, c = time.perf_counter(), time.process_time()
      lowered = fn()
      record = out["programs"].setdefault(_name(key), {})
      record.update(
        lower_s=time.perf_counter() - t,
        lower_cpu_s=time.process_time() - c,
        # With compilation_cache_dir, how the program was lowered (training/program_cache.py)
        program=getattr(lowered, "how", "traced"),
        stablehlo_ops=_stablehlo_ops(getattr(lowered, "lowered", lowered)),
      )

      class Timed:
        def compile(self):
          t = time.perf_counter()
          compiled = lowered.compile()
          record["compile_s"] = time.perf_counter() - t
          return compiled

      return Timed()

    return lowering

  cpu = time.process_time()
  threads = 1 if spec["mode"] == "one-by-one" else None
  compilation.compile_all({key: timed(key, fn) for key, fn in lower.items()}, threads)
  done = time.perf_counter()
  out |= {
    "lower_and_compile_s": done - placed,
    "lower_and_compile_cpu_s": time.process_time() - cpu,
    "startup_s": done - start,
  }
  return out


def child_record(
  module: str, spec: dict, label: str, timeout: float, *, cold: bool = False
) -> dict | None:
  """Runs ``python -m MODULE --child SPEC`` (``spec`` as JSON) from the repository root, one
  fresh process per measurement, and reads the last line of its output as JSON: the child's
  record; None where it failed or ran out of time (``train_step.run_child`` says which on
  stderr). ``cold``: the persistent compilation cache off in the child (JAX's and the run's
  own), so that every compilation is a cold one; otherwise the child gets this environment."""
  env = None
  if cold:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["GINGER_COMPILATION_CACHE_DIR"] = "none"
  cmd = [sys.executable, "-m", module, "--child", json.dumps(spec)]
  done = train_step.run_child(cmd, label, timeout, cwd=ROOT, env=env)
  return None if done is None else json.loads(done.stdout.strip().splitlines()[-1])


def run(
  name: str,
  mode: str,
  data: str | None,
  cache_dir: str | None,
  timeout: float,
  extra: tuple[str, ...] = (),
) -> dict:
  spec = {"overrides": [*RUNS[name], *extra], "mode": mode, "data": data, "cache_dir": cache_dir}
  # The user's cache off unless --extra sets one.
  return child_record("bench.startup", spec, f"{name} ({mode})", timeout, cold=True) or {}


def table(results: dict) -> str:
  lines = [
    "| run | mode | build s | program | how | StableHLO ops | lower s | compile s (wall) "
    "| all programs: wall s (CPU s) | build to compiled s |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (name, mode), r in results.items():
    if not r:
      lines.append(f"| {name} | {mode} | failed | | | | | | | |")
      continue
    for i, (program, p) in enumerate(r["programs"].items()):
      first = i == 0
      lines.append(
        f"| {name if first else ''} | {mode if first else ''} "
        f"| {format(r['build_s'], '.1f') if first else ''} | {program} "
        f"| {p.get('program', 'traced')} | {p['stablehlo_ops']} | {p['lower_s']:.2f} "
        f"| {p.get('compile_s', float('nan')):.1f} "
        + (
          f"| {r['lower_and_compile_s']:.1f} ({r['lower_and_compile_cpu_s']:.1f}) "
          f"| {r['startup_s']:.1f} |"
          if first
          else "| | |"
        )
      )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--data", help="a CIFAR-10 path for data.source=local (default: fake)")
  parser.add_argument("--only", nargs="*", choices=list(RUNS), help="runs (default: all)")
  parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
  parser.add_argument("--cache-dir", help="a persistent compilation cache for the children")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
  parser.add_argument(
    "--extra", nargs="*", default=[], help="more overrides for every run, e.g. passes=pallas"
  )
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(child(json.loads(args.child))))
    return
  import jax

  results = {}
  for name in args.only or list(RUNS):
    for mode in args.modes:
      results[name, mode] = run(name, mode, args.data, args.cache_dir, args.timeout, args.extra)
      print(f"{name} ({mode}): {results[name, mode].get('startup_s')}", file=sys.stderr)
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  devices = sorted({r["device"] for r in results.values() if r})
  print(
    f"{when}; jax {jax.__version__}; {', '.join(devices)}; host "
    f"{platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')}; "
    f"load average {os.getloadavg()[0]:.1f}; data {args.data or 'fake (CIFAR-10 shapes)'}; "
    f"compilation cache {args.cache_dir or 'off'}; extra {args.extra}; "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n"
  )
  print(table(results))


if __name__ == "__main__":
  main()
