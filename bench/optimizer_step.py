"""Time one optimizer update (Adam, Momentum, QNG, Ginger) on realistic parameter shapes.

    python -m bench.optimizer_step                      # everything (make bench)
    python -m bench.optimizer_step --sizes resnet18 --taus 8 --blocks per_tensor
    python -m bench.optimizer_step --sizes resnet18 --optimizers ginger qng --taus 8 32 \
        --blocks per_tensor global --passes jnp pallas       # Ginger's passes both ways
    python -m bench.optimizer_step --sizes resnet18 --optimizers ginger --taus 8 \
        --blocks per_tensor --passes pallas --solo-rows 0 2097152   # other bucket plans
    python -m bench.optimizer_step --sizes resnet18 --optimizers ginger --taus 8 \
        --blocks per_tensor --passes pallas --bucket-overhead 0 16777216   # fewer buckets

Each step is ``tx.update`` followed by ``optax.apply_updates``, so every update entry is
consumed (a benchmark that returned one entry would let XLA drop the rest of the output).
Steps are timed as a jitted ``lax.scan`` over ``--scan`` steps (so the ~2 ms of host dispatch
per call on a GPU is amortised), after a warm-up, as the median of ``--repeats`` runs, with the
state and params donated as train.py's step donates them (updated in place, not first copied).
Params, gradients and Fisher vectors are arguments of the jitted function, not constants baked
into it.
Ginger's update is the library's default unless ``--reorthonormalise-every 0``: that is the
update train.py runs, without the in-update re-orthonormalisation (an XLA conditional, which on
a GPU stops the host every step; train.py runs it as a program of its own).

On GPU the table also gives Ginger's memory floor, ``U`` read and written once per step
(``2 d tau`` elements of ``state_dtype``: ``2 d tau 4`` bytes in float32), as a time at the
card's measured copy bandwidth (``floor ms``) and the measured time over that floor
(``x floor``); the header line gives the measured copy bandwidth and the data-sheet peak. The
floor ignores the O(d) vectors (gradient, momentum, output), so it
is a lower bound of a lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import ginger
from ginger._src import common
from ginger._src.tuning import DEFAULT, Tuning

# Data-sheet peak HBM bandwidth (bytes/s) by device-kind substring (SXM parts).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
OPTIMIZERS = ("adam", "momentum", "qng", "ginger")


def resnet18_shapes() -> list[tuple[int, ...]]:
  from flax import nnx

  from models.resnet import build_resnet

  model = nnx.eval_shape(lambda: build_resnet("resnet18", 100, rngs=nnx.Rngs(0)))
  return [p.shape for p in jax.tree.leaves(nnx.state(model, nnx.Param))]


def t5_small_shapes() -> list[tuple[int, ...]]:
  """t5-small's trainable tensors (60.5M; tied embeddings), by layer."""
  d, ff, heads_kv, vocab = 512, 2048, 512, 32128
  shapes = [(vocab, d)]
  attn = [(d, heads_kv)] * 3 + [(heads_kv, d)]
  for _ in range(6):  # encoder: self-attn, ff, 2 norms
    shapes += attn + [(d, ff), (ff, d), (d,), (d,)]
  for _ in range(6):  # decoder: self-attn, cross-attn, ff, 3 norms
    shapes += attn + attn + [(d, ff), (ff, d), (d,), (d,), (d,)]
  shapes += [(32, 8), (32, 8), (d,), (d,)]  # relative position biases, final norms
  return shapes


SIZES = {
  "1M": lambda: [(1024, 1024)],
  "resnet18": resnet18_shapes,
  "t5-small": t5_small_shapes,
}


def make_optimizer(
  name: str,
  tau: int | None,
  block: str | None,
  passes: str = "jnp",
  state_dtype="float32",
  reorthonormalise_every: int | None = None,
  curvature_every: int = 1,
  tuning: Tuning = DEFAULT,
):
  """``name`` is an optimizer, or ``ginger/<eigensolver>`` for a non-default Ginger solver;
  ``passes``, ``state_dtype`` (of ``U``, sigma and the momentum), ``reorthonormalise_every``
  (None: the library's default, in the update), ``curvature_every`` and ``tuning`` (its
  bucket plan) are Ginger's."""
  if name == "adam":
    return optax.adam(1e-3)
  if name == "momentum":
    return optax.sgd(1e-2, momentum=0.9)
  if name == "qng":
    return ginger.qng(1e-2, tau=tau, block=block)
  name, _, solver = name.partition("/")
  return ginger.ginger(
    1e-3,
    tau=tau,
    block=block,
    eigensolver=solver or "secular",
    passes=passes,
    state_dtype=state_dtype,
    reorthonormalise_every=reorthonormalise_every,
    curvature_every=curvature_every,
    tuning=tuning,
  )


def bucket_plan(solo_rows: int, overhead: int) -> Tuning:
  """Ginger's bucket plan: with ``solo_rows`` > 0, per-tensor blocks of >= ``solo_rows`` rows
  planned as buckets of their own (``Tuning.solo_buckets``, ``solo_rows``); with ``overhead``
  > 0, ``Tuning.bucket_overhead = overhead`` (the modelled cost of a bucket: a larger one
  merges more block sizes into fewer, more padded buckets). 0: the library's."""
  tuning = DEFAULT
  if solo_rows:
    tuning = dataclasses.replace(tuning, solo_buckets=True, solo_rows=solo_rows)
  if overhead:
    tuning = dataclasses.replace(tuning, bucket_overhead=overhead)
  return tuning


def time_update(
  tx, shapes, scan_steps: int, repeats: int, kernels: int = 0, curvature: bool = True
) -> tuple[float, float, str]:
  """(median seconds per update, seconds to compile, per-kernel report or ""). ``curvature``
  False: updates without ``fisher_grads`` (with ``curvature_every > 1``: no curvature
  update)."""
  keys = jax.random.split(jax.random.key(0), len(shapes))
  params = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]
  grads = [0.01 * p for p in params]
  fisher = [0.02 * p for p in params] if curvature else None

  # The state and params donated, as train.py's step donates them: the loop then updates them
  # in place instead of first copying them into its carry (U: 358 MB at ResNet-18 tau 8).
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def run(state, params, grads, fisher):
    def body(carry, _):
      state, params = carry
      updates, state = tx.update(grads, state, params, fisher_grads=fisher)
      return (state, optax.apply_updates(params, updates)), None

    return jax.lax.scan(body, (state, params), None, length=scan_steps)[0]

  carry = (tx.init(params), params)
  start = time.perf_counter()
  compiled = run.lower(*carry, grads, fisher).compile()
  compile_s = time.perf_counter() - start
  carry = jax.block_until_ready(compiled(*carry, grads, fisher))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    carry = jax.block_until_ready(compiled(*carry, grads, fisher))
    times.append((time.perf_counter() - start) / scan_steps)
  report = ""
  if kernels:

    def again():
      nonlocal carry
      carry = compiled(*carry, grads, fisher)
      return carry

    report = kernel_report(again, scan_steps, kernels)
  return statistics.median(times), compile_s, report


def kernel_report(fn, steps: int, top: int) -> str:
  """Device time per kernel of ``fn()`` (``steps`` updates), via CUPTI (torch.profiler sees
  every kernel of the process, XLA's included). Kernel names are the HLO fusion names."""
  try:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      jax.block_until_ready(fn())
  except Exception as e:  # noqa: BLE001 (no torch, no CUDA, no CUPTI: say so, don't fail)
    return f"  (no kernel profile: {e!r})"
  rows = sorted(
    (
      (getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0), ev.count, ev.key)
      for ev in prof.key_averages()
    ),
    reverse=True,
  )
  rows = [r for r in rows if r[0]]
  lines = [
    f"  kernel time {sum(r[0] for r in rows) / steps:.1f} us/update in "
    f"{sum(r[1] for r in rows) / steps:.1f} kernels/update; top {top}:"
  ]
  lines += [
    f"  {t / steps:9.1f} us/update {n / steps:5.1f}x  {name[:90]}" for t, n, name in rows[:top]
  ]
  return "\n".join(lines)


def copy_bandwidth(nbytes: int = 1 << 30, steps: int = 20) -> float:
  """Bytes/s of an on-device ``x + 1`` over ``nbytes`` (read + write counted)."""
  x = jnp.zeros(nbytes // 4, jnp.float32)
  run = jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda _, x: x + 1.0, x))
  x = jax.block_until_ready(run(x))
  start = time.perf_counter()
  jax.block_until_ready(run(x))
  return 2 * nbytes * steps / (time.perf_counter() - start)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
  parser.add_argument("--taus", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
  parser.add_argument("--qng-taus", nargs="+", type=int, default=[8])
  parser.add_argument("--blocks", nargs="+", default=["per_tensor", "global"])
  parser.add_argument(
    "--eigensolvers",
    nargs="+",
    default=["secular"],
    choices=["secular", "dense"],
    help="Ginger's Brand-core solvers to time (rows 'ginger/dense' for the dense eigh)",
  )
  parser.add_argument(
    "--passes",
    nargs="+",
    default=["jnp"],
    choices=list(common.PASSES),
    help="how Ginger's passes over U run (column 'passes'): jnp (XLA's fusions), pallas "
    "(fused Pallas kernels; interpreted, so slow, off GPUs), auto",
  )
  parser.add_argument(
    "--state-dtypes",
    nargs="+",
    default=["float32"],
    choices=["float32", "bfloat16"],
    help="Ginger's state_dtype (column 'state'; the floor counts U in it)",
  )
  parser.add_argument(
    "--reorthonormalise-every",
    type=int,
    default=None,
    metavar="N",
    help="Ginger's reorthonormalise_every (default: the library's, a conditional in every "
    "update; 0: none in the update, as train.py builds it and runs it as a program of its own)",
  )
  parser.add_argument(
    "--solo-rows",
    nargs="+",
    type=int,
    default=[0],
    metavar="N",
    help="Ginger's bucket plan (column 'block'): 0, the library's; N, every per-tensor block "
    "of >= N rows a bucket of its own (Tuning.solo_buckets, solo_rows = N): its g and d are "
    "read where they are instead of copied into a stack",
  )
  parser.add_argument(
    "--bucket-overhead",
    nargs="+",
    type=int,
    default=[0],
    metavar="N",
    help="Ginger's bucket plan (column 'block', with the number of buckets): 0, the library's "
    "(Tuning.bucket_overhead); N, that modelled cost of a bucket in padded row-entries: a "
    "larger N, fewer and more padded buckets (fewer kernels to launch and compile)",
  )
  parser.add_argument(
    "--curvature-every",
    type=int,
    default=1,
    metavar="K",
    help="Ginger's curvature_every; K > 1 times its steps without a curvature update (no "
    "fisher_grads: preconditioning with U as it is)",
  )
  parser.add_argument("--scan", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--kernels",
    type=int,
    default=0,
    metavar="N",
    help="after the table, the N slowest kernels of each Ginger config "
    "(GPU; needs torch for CUPTI)",
  )
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  peak = next((bw for kind, bw in PEAK_BANDWIDTH.items() if kind in device.device_kind), None)
  bandwidth = copy_bandwidth() if device.platform == "gpu" else None
  print(
    f"# {datetime.date.today()} device={device.device_kind} platform={device.platform} "
    f"jax={jax.__version__} optax={optax.__version__}"
    + (f" copy_bandwidth={bandwidth / 1e12:.2f}TB/s" if bandwidth else "")
    + (f" datasheet_peak={peak / 1e12:.2f}TB/s" if peak else "")
    + f" reorthonormalise_every={args.reorthonormalise_every}"
    + f" curvature_every={args.curvature_every}"
  )
  print(
    "| size | d | optimizer | tau | block | passes | state | ms/update | x Adam | floor ms "
    "| x floor | compile s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  reports: list[str] = []
  for size in args.sizes:
    shapes = SIZES[size]()
    sizes = [math.prod(s) for s in shapes]
    d = sum(sizes)
    # Adam always runs first: it is the reference of the "x Adam" column.
    configs = [("adam", None, None, None, None, 0, 0)]
    if "momentum" in args.optimizers:
      configs.append(("momentum", None, None, None, None, 0, 0))
    if "qng" in args.optimizers:
      configs += [("qng", t, b, None, None, 0, 0) for t in args.qng_taus for b in args.blocks]
    if "ginger" in args.optimizers:
      configs += [
        ("ginger" if e == "secular" else f"ginger/{e}", t, b, p, dt, n, o)
        for t in args.taus
        for b in args.blocks
        for e in args.eigensolvers
        for p in args.passes
        for dt in args.state_dtypes
        for n in args.solo_rows
        for o in args.bucket_overhead
      ]
    adam_s = None
    for name, tau, block, passes, state, solo, overhead in configs:
      tuning = bucket_plan(solo, overhead)
      if name.startswith("ginger"):
        buckets = len(common.plan_layout(sizes, tau, block, None, tuning).buckets)
      optimizer = make_optimizer(
        name,
        tau,
        block,
        passes or "jnp",
        state or "float32",
        args.reorthonormalise_every,
        args.curvature_every,
        tuning,
      )
      seconds, compile_s, report = time_update(
        optimizer,
        shapes,
        args.scan,
        args.repeats,
        args.kernels if name.startswith("ginger") else 0,
        curvature=args.curvature_every == 1 or not name.startswith("ginger"),
      )
      if name.startswith("ginger") and block == "per_tensor":
        plan = (f" solo>={solo}" if solo else "") + (f" overhead={overhead}" if overhead else "")
        block = f"{block}{plan} ({buckets} buckets)"
      if report:
        reports.append(f"{size} {name} tau={tau} {block} passes={passes} {state}:\n{report}")
      adam_s = adam_s or seconds
      floor = ratio = ""
      if name.startswith("ginger") and bandwidth:
        floor_s = 2 * d * tau * jnp.dtype(state).itemsize / bandwidth
        floor, ratio = f"{1e3 * floor_s:.3f}", f"{seconds / floor_s:.1f}"
      print(
        f"| {size} | {d / 1e6:.1f}M | {name} | {tau or ''} | {block or ''} | {passes or ''} | "
        f"{state or ''} | "
        f"{1e3 * seconds:.3f} | {seconds / adam_s:.1f} | {floor} | {ratio} | "
        f"{compile_s:.1f} |",
        flush=True,
      )
  if reports:
    print("\n" + "\n".join(reports))


if __name__ == "__main__":
  main()
