"""Time one optimizer update (Adam, Momentum, QNG, Ginger) on realistic parameter shapes.

    python -m bench.optimizer_step                      # everything (make bench)
    python -m bench.optimizer_step --sizes resnet18 --taus 8 --blocks per_tensor

Each update is timed as a jitted ``lax.scan`` over ``--scan`` steps (so the ~2 ms of host
dispatch per call on a GPU is amortised), after a warm-up, as the median of ``--repeats``
runs. On GPU the table also gives the bytes/s Ginger would need at its memory floor
(``U`` read and written once per step: ``2 d tau 4`` bytes) as a fraction of the card's peak
HBM bandwidth, and the time of that floor.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import ginger

# Peak HBM bandwidth (bytes/s) by device kind substring (vendor data sheets, SXM parts).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


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


def make_optimizer(name: str, tau: int | None, block: str | None):
  if name == "adam":
    return optax.adam(1e-3)
  if name == "momentum":
    return optax.sgd(1e-2, momentum=0.9)
  if name == "qng":
    return ginger.qng(1e-2, tau=tau, block=block)
  return ginger.ginger(1e-3, tau=tau, block=block)


def time_update(tx, shapes, scan_steps: int, repeats: int) -> float:
  """Median seconds per update."""
  keys = jax.random.split(jax.random.key(0), len(shapes))
  params = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]
  grads = [0.01 * p for p in params]
  fisher = [0.02 * p for p in params]

  @jax.jit
  def run(state):
    def body(state, _):
      updates, state = tx.update(grads, state, params, fisher_grads=fisher)
      return state, updates[0].ravel()[0]
    return jax.lax.scan(body, state, None, length=scan_steps)

  state = tx.init(params)
  state, _ = jax.block_until_ready(run(state))  # compile + warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, _ = jax.block_until_ready(run(state))
    times.append((time.perf_counter() - start) / scan_steps)
  return statistics.median(times)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  parser.add_argument("--taus", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
  parser.add_argument("--qng-taus", nargs="+", type=int, default=[8])
  parser.add_argument("--blocks", nargs="+", default=["per_tensor", "global"])
  parser.add_argument("--scan", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  peak = next((bw for kind, bw in PEAK_BANDWIDTH.items() if kind in device.device_kind), None)
  print(f"# {datetime.date.today()} device={device.device_kind} platform={device.platform} "
        f"jax={jax.__version__} optax={optax.__version__}")
  print("| size | d | optimizer | tau | block | ms/update | x Adam | floor ms | "
        "floor bytes/s / peak |")
  print("|---|---|---|---|---|---|---|---|---|")
  for size in args.sizes:
    shapes = SIZES[size]()
    d = sum(int(jnp.prod(jnp.array(s))) for s in shapes)
    configs = [("adam", None, None), ("momentum", None, None)]
    configs += [("qng", t, b) for t in args.qng_taus for b in args.blocks]
    configs += [("ginger", t, b) for t in args.taus for b in args.blocks]
    adam_s = None
    for name, tau, block in configs:
      seconds = time_update(make_optimizer(name, tau, block), shapes, args.scan, args.repeats)
      adam_s = adam_s or seconds
      floor = ""
      util = ""
      if name == "ginger" and peak:
        floor_s = 2 * d * tau * 4 / peak
        floor = f"{1e3 * floor_s:.3f}"
        util = f"{floor_s / seconds:.0%}"
      print(f"| {size} | {d / 1e6:.1f}M | {name} | {tau or ''} | {block or ''} | "
            f"{1e3 * seconds:.3f} | {seconds / adam_s:.1f} | {floor} | {util} |", flush=True)


if __name__ == "__main__":
  main()
