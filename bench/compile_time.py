"""Lowering and compilation time of an optimizer's update, and of train.py's training step, at
ResNet-18's parameter shapes: one fresh process per measurement.

    python -m bench.compile_time                                  # Adam and SOAP, the update
    python -m bench.compile_time --optimizers adam soap --train-step    # and the whole step
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m bench.compile_time --train-step

``update``: ``tx.update`` followed by ``optax.apply_updates``, jitted, lowered from
``jax.ShapeDtypeStruct`` leaves (the 62 tensors of ResNet-18 with a CIFAR-100 head, 11.2M
parameters; nothing is allocated) and compiled. Adam is ``optax.adam``, SOAP ``ginger.soap``
with its defaults, as train.py's ``optimizer=soap`` builds it. ``train step`` (with
``--train-step``): the training step train.py compiles before its first step, built as
``bench.startup`` builds it (ResNet-18, batch 128, CIFAR-10 shapes, random images), with
``optimizer=NAME``. The persistent compilation cache is off in the children, so every row is a
cold compilation (on a GPU: autotuning included). "CPU s" is the child's process time during
the compilation (all its threads): on a machine shared with other work the wall clock also
counts waiting for a core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time

from bench import startup

OPTIMIZERS = ("adam", "soap")


def build(name: str):
  """``optax.adam`` or ``ginger.soap`` (train.py's ``optimizer=soap``), at lr 3e-3."""
  import optax

  import ginger

  return optax.adam(3e-3) if name == "adam" else ginger.soap(3e-3)


def timed_compile(lowered) -> dict:
  wall, cpu = time.perf_counter(), time.process_time()
  lowered.compile()
  return {"compile_s": time.perf_counter() - wall, "compile_cpu_s": time.process_time() - cpu}


def measure_update(name: str) -> dict:
  """The update's lowering and compilation (see the module docstring)."""
  import jax
  import jax.numpy as jnp
  import optax

  from bench.optimizer_step import resnet18_shapes

  params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in resnet18_shapes()]
  tx = build(name)
  state = jax.eval_shape(tx.init, params)

  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  start = time.perf_counter()
  lowered = jax.jit(step).lower(params, state, params)
  out = {"lower_s": time.perf_counter() - start, "lowered": lowered}
  out["params"] = sum(math.prod(p.shape) for p in params)
  return out


def measure_train_step(name: str) -> dict:
  """train.py's training step, lowered and compiled as ``bench.startup`` does."""
  record = startup.child(
    {"overrides": [f"optimizer={name}"], "mode": "one-by-one", "data": None, "cache_dir": None}
  )
  step = record["programs"]["train step"]
  return {"lower_s": step["lower_s"], "compile_s": step["compile_s"], "params": None}


def child(spec: dict) -> dict:
  import jax

  jax.config.update("jax_compilation_cache_dir", None)
  if spec["what"] == "train step":
    return measure_train_step(spec["optimizer"]) | {"device": jax.devices()[0].device_kind}
  out = measure_update(spec["optimizer"])
  lowered = out.pop("lowered")
  out["ops"] = sum(1 for line in lowered.as_text().splitlines() if " = " in line)
  return out | timed_compile(lowered) | {"device": jax.devices()[0].device_kind}


def run(optimizer: str, what: str, timeout: float) -> dict:
  spec = {"optimizer": optimizer, "what": what}
  label = f"{optimizer} {what}"
  return startup.child_record("bench.compile_time", spec, label, timeout, cold=True) or {}


def table(results: dict) -> str:
  lines = [
    "| optimizer | what | params | StableHLO ops | lower s | compile s | compile CPU s |",
    "|---|---|---|---|---|---|---|",
  ]
  for (name, what), r in results.items():
    if not r:
      lines.append(f"| {name} | {what} | failed | | | | |")
      continue
    params = f"{r['params'] / 1e6:.1f}M" if r.get("params") else ""
    cpu = f"{r['compile_cpu_s']:.1f}" if "compile_cpu_s" in r else ""
    lines.append(
      f"| {name} | {what} | {params} | {r.get('ops', '')} | {r['lower_s']:.1f} "
      f"| {r['compile_s']:.1f} | {cpu} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--optimizers", nargs="*", choices=OPTIMIZERS, default=["adam", "soap"])
  parser.add_argument("--train-step", action="store_true", help="also train.py's whole step")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(child(json.loads(args.child))))
    return
  import jax

  whats = ["update", "train step"] if args.train_step else ["update"]
  results = {}
  for what in whats:
    for name in args.optimizers:
      results[name, what] = run(name, what, args.timeout)
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  devices = sorted({r["device"] for r in results.values() if r})
  print(
    f"{when}; jax {jax.__version__}; {', '.join(devices)}; host "
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
    f"{os.getloadavg()[0]:.1f}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n"
  )
  print(table(results))


if __name__ == "__main__":
  main()
