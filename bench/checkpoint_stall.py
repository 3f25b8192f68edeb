"""What a checkpoint costs the training loop: the time a save holds training, in-process.

    python -m bench.checkpoint_stall                                   # fake CIFAR-10 images
    python -m bench.checkpoint_stall --data .data/cifar10-jpeg.tar.xz --intervals 5

For each run (ResNet-18, batch 128; Adam and Ginger tau 8 with ``curvature_every=16``, the
race's runs) a child process builds the run as ``training.loop`` does, compiles its programs
and times intervals of ``--steps`` training steps, each ended by a device sync as the loop's
logging ends one: alternately without a checkpoint and with ``Checkpointer.save`` at the
interval's start (the loop saves right after a logged step). The stall is the median interval
with a save minus the median without; the table also gives the seconds ``save`` itself took to
return and ``wait`` (the write finishing in the background, after the interval). A save's
cost to a run is the stall, whatever part of it ``save`` itself blocks: work it leaves running
beside training (a thread, orbax's writes) shows up in the interval.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import startup

RUNS = {
  "adam": ["optimizer=adam"],
  "ginger tau=8 K=16": ["optimizer=ginger", "tau=8", "curvature_every=16"],
}


def child(spec: dict) -> dict:
  """One run's measurement (in its own process): see the module docstring."""
  import jax
  import numpy as np
  from hydra import compose, initialize_config_dir
  from omegaconf import OmegaConf

  from training import compilation, run_setup, sharding
  from training.checkpoints import Checkpointer

  data = spec["data"]
  if data is None:
    sys.path.insert(0, str(startup.ROOT / "tests"))
    from fakes import cifar_pickle_folder

    data = str(cifar_pickle_folder(Path(tempfile.mkdtemp()), "cifar10", 640, 500))
  overrides = startup.BASE + ["data.source=local", f"data.path={data}"] + spec["overrides"]
  with initialize_config_dir(config_dir=str(startup.ROOT / "configs"), version_base=None):
    cfg = compose(config_name="config", overrides=overrides)
  setup = run_setup.build(cfg)
  train_arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
  val_arrays = sharding.put(setup.task.val_arrays, setup.plan.replicated)
  indices = setup.plan.indices(np.arange(int(cfg.batch_size)))
  resolved = OmegaConf.to_container(cfg, resolve=True)
  lower = compilation.programs(
    setup, setup.state, setup.frozen, train_arrays, val_arrays, indices, setup.rc, resolved
  )
  compiled = compilation.compile_all({k: v for k, v in lower.items() if isinstance(k, bool)})
  state, step = setup.state, 0

  def steps(n: int):
    nonlocal state, step
    for _ in range(n):
      state = compiled[setup.updates_curvature(step)](state, setup.frozen, train_arrays, indices)
      step += 1
    jax.device_get(state.stats)  # the loop's logged step: a sync

  steps(2 * spec["steps"])  # warm up
  checkpointer = Checkpointer(tempfile.mkdtemp())
  plain, saving, save_s, wait_s = [], [], [], []
  for _ in range(spec["intervals"]):
    t = time.perf_counter()
    steps(spec["steps"])
    plain.append(time.perf_counter() - t)
    t = time.perf_counter()
    checkpointer.save(step, state)
    save_s.append(time.perf_counter() - t)
    steps(spec["steps"])
    saving.append(time.perf_counter() - t)
    t = time.perf_counter()
    checkpointer.wait()
    wait_s.append(time.perf_counter() - t)
  device = jax.devices()[0]
  return {
    "device": f"{device.platform} {device.device_kind}",
    "plain_s": statistics.median(plain),
    "saving_s": statistics.median(saving),
    "stall_s": statistics.median(saving) - statistics.median(plain),
    "save_s": statistics.median(save_s),
    "wait_s": statistics.median(wait_s),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--data", help="a CIFAR-10 path for data.source=local (default: fake)")
  parser.add_argument("--only", nargs="*", choices=list(RUNS), help="runs (default: all)")
  parser.add_argument("--steps", type=int, default=50, help="steps per interval")
  parser.add_argument("--intervals", type=int, default=5, help="intervals of each kind")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(child(json.loads(args.child))))
    return
  import jax

  rows = []
  for name in args.only or list(RUNS):
    spec = {
      "overrides": RUNS[name],
      "data": args.data,
      "steps": args.steps,
      "intervals": args.intervals,
    }
    rows.append((name, startup.child_record("bench.checkpoint_stall", spec, name, args.timeout)))
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  devices = sorted({r["device"] for _, r in rows if r})
  print(
    f"{when}; jax {jax.__version__}; {', '.join(devices)}; data {args.data or 'fake'}; "
    f"{args.intervals} intervals of {args.steps} steps\n"
  )
  print(f"| run | {args.steps} steps s | with a save s | stall s | save() s | wait() s |")
  print("|---|---|---|---|---|---|")
  for name, r in rows:
    if r is None:
      print(f"| {name} | failed | | | | |")
      continue
    print(
      f"| {name} | {r['plain_s']:.3f} | {r['saving_s']:.3f} "
      f"| **{r['stall_s']:.3f}** | {r['save_s']:.3f} | {r['wait_s']:.3f} |"
    )


if __name__ == "__main__":
  main()
