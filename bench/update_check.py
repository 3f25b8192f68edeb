"""Ginger's whole update on the device, with Pallas and with jnp passes, against float64.

    python -m bench.update_check                     # GPU: ResNet-18 shapes, tau 8 and 32
    python -m bench.update_check --size tiny --taus 4 --steps 4    # any machine (slow on CPU)

``bench.kernels_check`` checks each pass alone; this checks what a training step gets from
them: ``--steps`` updates of ``ginger.scale_by_ginger`` (``b1=0.9``, ``per_tensor``,
``reorthonormalise_every=0`` as train.py builds it) on the same gradients and sampled-Fisher
vectors, three ways: a float32 state with ``passes="pallas"`` and with ``passes="jnp"`` on the
default device, and a float64 state with the jnp passes on the CPU, the reference (the same
algorithm, exact to float32's precision; its inputs are the float32 ones, widened). The
inputs have the structure that makes the curvature update work: every tensor's gradients and
Fisher vectors are random combinations of a few fixed directions (more than tau of them) plus
noise, so ``v`` lies partly in ``span U`` and the update's in-span and out-of-span parts both
matter.

It prints, per step, the relative error ``||u - u_64|| / ||u_64||`` of each float32 path's
update (all leaves as one vector). The two float32 paths evaluate the same formulas in other
summation orders, so their errors against the exact update are of the same size; a step
fails when the Pallas path's error exceeds ``RATIO`` times the jnp path's plus ``FLOOR`` unit
roundoffs of float32 (tiny errors are rounding of the output itself). Exit status 1 when a
step fails.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ginger
from bench.optimizer_step import SIZES

SHAPES = dict(SIZES, tiny=lambda: [(40, 24), (24,), (3, 3, 8, 16), (10,)])
DIRECTIONS = 12  # directions the inputs of every tensor combine (more than the taus checked)
NOISE = 0.1  # relative size of the inputs' unstructured part
RATIO = 4.0
FLOOR = 16


def inputs(shapes, steps: int, seed: int = 0):
  """Per step ``(grads, fisher)``: float32 arrays as numpy, a few fixed directions per tensor
  in random combinations, plus noise."""
  rng = np.random.default_rng(seed)
  bases = [rng.standard_normal((DIRECTIONS,) + tuple(s)) for s in shapes]
  out = []
  for _ in range(steps):
    pair = []
    for scale in (1e-2, 2e-2):
      pair.append(
        [
          (
            scale
            * (
              np.tensordot(rng.standard_normal(DIRECTIONS), b, 1)
              + NOISE * rng.standard_normal(b.shape[1:])
            )
          ).astype(np.float32)
          for b in bases
        ]
      )
    out.append(tuple(pair))
  return out


def run_updates(shapes, data, tau: int, passes: str, dtype, device) -> list[np.ndarray]:
  """Every step's update (as one float64 vector) of a ``dtype`` state on ``device``."""
  tx = ginger.scale_by_ginger(
    tau, state_dtype=dtype, passes=passes, b1=0.9, reorthonormalise_every=0
  )
  with jax.default_device(device):
    params = [jnp.zeros(s, dtype) for s in shapes]
    state = tx.init(params)
    update = jax.jit(lambda g, s, p, d: tx.update(g, s, p, fisher_grads=d), donate_argnums=(1,))
    put = lambda xs: [jax.device_put(np.asarray(x, dtype), device) for x in xs]  # noqa: E731
    out = []
    for grads, fisher in data:
      updates, state = update(put(grads), state, params, put(fisher))
      out.append(np.concatenate([np.asarray(u, np.float64).ravel() for u in updates]))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="resnet18", choices=list(SHAPES))
  parser.add_argument("--taus", nargs="+", type=int, default=[8, 32])
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args(argv)
  return check(args.size, args.taus, args.steps)


def check(size: str, taus, steps: int) -> int:
  """Prints the table; returns the number of failed steps."""
  device, cpu = jax.devices()[0], jax.devices("cpu")[0]
  shapes = SHAPES[size]()
  data = inputs(shapes, steps)
  print(
    f"# device={device.device_kind} jax={jax.__version__} size={size} "
    f"d={sum(int(np.prod(s)) for s in shapes)} steps={steps}"
  )
  print("| tau | step | pallas rel err | jnp rel err | pallas / jnp | ok |")
  print("|---|---|---|---|---|---|")
  unit = float(jnp.finfo(jnp.float32).eps) / 2
  failed = 0
  for tau in taus:
    with jax.enable_x64(True):  # 64-bit mode for the reference only
      exact = run_updates(shapes, data, tau, "jnp", "float64", cpu)
    paths = {p: run_updates(shapes, data, tau, p, "float32", device) for p in ("pallas", "jnp")}
    for step, ref in enumerate(exact):
      norm = np.linalg.norm(ref)
      err = {p: np.linalg.norm(u[step] - ref) / norm for p, u in paths.items()}
      ok = err["pallas"] <= RATIO * err["jnp"] + FLOOR * unit
      failed += not ok
      print(
        f"| {tau} | {step} | {err['pallas']:.3g} | {err['jnp']:.3g} | "
        f"{err['pallas'] / max(err['jnp'], unit):.2f} | {'pass' if ok else 'FAIL'} |",
        flush=True,
      )
  print(f"\n{'FAILED: ' + str(failed) + ' step(s)' if failed else 'all steps passed'}")
  return failed


if __name__ == "__main__":
  sys.exit(1 if main() else 0)
