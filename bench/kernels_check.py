"""Each Pallas kernel of ginger._src.pallas_passes compiled for the GPU against the jnp reference.

    python -m bench.kernels_check                       # GPU: ResNet-18 shapes, tau 8 and 32
    python -m bench.kernels_check --taus 8 --blocks global
    python -m bench.kernels_check --interpret --tiny    # any machine: interpreted, tiny shapes

For every bucket of Ginger's stacked bases (``block=per_tensor``: ResNet-18's buckets as
``ginger._src.common.plan_layout`` makes them; ``global``: one ``(1, d, k)`` block) it runs each
pass (:data:`PASSES`) with ``impl="pallas", interpret=False`` and ``impl="jnp"`` on the same
random operands (:func:`random_inputs`, the ranges a step produces) and checks, per output
entry, the bounds of tests/test_kernels.py (Higham's ``gamma_N A``, valid for every
summation order, fused multiply-adds included):

* ``vs jnp``: ``|pallas - jnp| <= 2 gamma_N A`` with ``N`` counting all rows of a row sum (the
  tests' bound; ``n/a`` where ``N u >= 1/2`` makes it vacuous, e.g. the global block);
* ``vs exact``: ``|pallas - exact| <= gamma_N A`` with the reference evaluated in float64 on the
  CPU (exact to float32's precision) and ``N`` the kernel's own depth of a row sum
  (:func:`kernel_rows_depth`: tiles a program streams + rows of a tile + programs of a block).

It prints the largest ``|error| / bound`` (pass when <= 1) and the largest absolute and
relative errors per pass and shape, then the compiled Ginger step's temporary memory with the
state donated (``memory_analysis``, ``block=global``, jnp and pallas passes) against
:func:`memory_bound`: the rotation writes ``U'`` over ``U``, so no second ``U`` may appear
(pallas: only vectors; jnp: two row blocks). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ginger
from ginger._src import common, kernels
from ginger._src.tuning import DEFAULT, Tuning

PASSES = (
  "project",
  "project_pair",
  "residual_sums",
  "residual",
  "rotate_and_precondition",
  "rotate_from_residual",
  "precondition",
)


def gamma_n(n: int, dtype) -> float:
  """Higham's ``gamma_N = N u / (1 - N u)``, ``u`` the unit roundoff of ``dtype``."""
  u = float(jnp.finfo(dtype).eps) / 2
  assert n * u < 0.5, "bound vacuous at this size: use smaller test shapes"
  return n * u / (1 - n * u)


def random_inputs(seed: int, m: int, n: int, k: int, dtype=jnp.float32) -> dict:
  """Operands of every pass, in the ranges a step produces (``inv_l1 = 1 / sum |v|``,
  ``sigma >= 0`` with trailing zeros, ``gamma > 0``)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  v = normal(m, n) * 10.0 ** rng.uniform(-3, 3, (m, 1))
  sigma = np.abs(normal(m, k)) * (np.arange(k) < rng.integers(0, k + 1, (m, 1)))
  arrays = {
    "u": normal(m, n, k),
    "v": v,
    "g": normal(m, n),
    "a1": normal(m, k),
    "inv_l1": 1.0 / np.sum(np.abs(v), -1),
    "a2": normal(m, k),
    "inv_r": np.exp(normal(m)),
    "rot": normal(m, k, k),
    "b": normal(m, k),
    "z": normal(m, k),
    "ay": normal(m, k),
    "beta": normal(m),
    "gamma": 10.0 ** rng.uniform(-3, 0, m),
    "sigma": sigma,
    "p1": normal(m, n),
  }
  return {key: jnp.asarray(x, dtype) for key, x in arrays.items()}


# Operands of rotate_from_residual in order (``g`` stands for pass 2's ``q1``, ``z`` for ``a``).
ROTATE_KEYS = ("u", "p1", "g", "a2", "inv_r", "rot", "b", "z", "beta", "gamma")


def call(name: str, x: dict, **kw):
  fn = getattr(kernels, name)
  if name == "project":
    return fn(x["u"], x["g"], **kw)
  if name == "project_pair":
    return fn(x["u"], x["v"], x["g"], **kw)
  if name == "residual_sums":  # with p1 and q1, the sixth and seventh outputs
    return fn(x["u"], x["v"], x["g"], x["a1"], x["inv_l1"], x["ay"], with_p1=True, **kw)
  if name == "residual":  # pass 2 for g alone: (U^T q1, q1) with q1 = g - U ay
    return fn(x["u"], x["g"], x["ay"], **kw)
  if name == "rotate_and_precondition":
    keys = ROTATE_KEYS[:1] + ("v",) + ROTATE_KEYS[2:3] + ("a1", "inv_l1") + ROTATE_KEYS[3:]
    return fn(*(x[key] for key in keys), **kw)
  if name == "rotate_from_residual":
    return fn(*(x[key] for key in ROTATE_KEYS), **kw)
  return fn(x["u"], x["sigma"], x["g"], x["gamma"], **kw)


def bounds(name: str, x: dict, rows: int | None = None) -> list[tuple[np.ndarray, int]]:
  """``(A, N)`` of every output of pass ``name``: ``A = sum_t |x_t|`` of its products, computed
  in float64, and ``N`` the most rounded operations any term passes through (tests/
  test_kernels.py's docstring). ``rows``: the depth of a sum over the rows (default all ``n``
  of them, which holds for any order; a kernel's own order is shallower, see
  :func:`kernel_rows_depth`)."""
  f = {key: np.abs(np.asarray(val, np.float64)) for key, val in x.items()}
  u, v, g = f["u"], f["v"], f["g"]
  k = u.shape[-1]
  n = u.shape[-2] if rows is None else rows
  ut = lambda w: np.einsum("...nk,...n->...k", u, w)  # noqa: E731  |U|^T w
  ua = lambda a: np.einsum("...nk,...k->...n", u, a)  # noqa: E731  |U| a
  if name == "project":
    return [(ut(g), n)]
  if name == "project_pair":
    return [(ut(v), n), (ut(g), n), (v.sum(-1), n)]
  if name == "residual":  # residual_sums' last two sums, q1's terms as there
    q1 = g + ua(f["ay"])
    return [(ut(q1), n + k + 3), (q1, k + 3)]
  if name == "rotate_from_residual":
    p1, depth = f["p1"], 0  # an input
  else:
    p1, depth = (v + ua(f["a1"])) * f["inv_l1"][..., None], k + 2  # a sum of k products, -, *
  if name == "residual_sums":
    vs = v * f["inv_l1"][..., None]
    q1 = g + ua(f["ay"])  # a sum of k products and a subtraction: depth k + 2
    return [
      (ut(p1), n + k + 3),
      ((p1 * p1).sum(-1), n + 2 * k + 5),
      ((p1 * q1).sum(-1), n + 2 * k + 5),
      ((vs * vs).sum(-1), n + 3),
      (ut(q1), n + k + 3),
      (p1, k + 3),
      (q1, k + 3),
    ]
  gamma = f["gamma"][..., None]
  if name.startswith("rotate"):
    p = (p1 + ua(f["a2"])) * f["inv_r"][..., None]  # depth + k + 2
    u_new = np.matmul(u, f["rot"]) + p[..., None] * f["b"][..., None, :]
    out = (g + ua(f["z"]) + p * f["beta"][..., None]) / gamma
    return [(u_new, depth + k + 4), (out, depth + 2 * k + 8)]
  # precondition: y = U^T g, q1 = g - U y, c = U^T q1, a = c - gamma / (gamma + sigma) (y + c),
  # (q1 - U a) / gamma: |a| <= 2 |c| + |y|, each term rounded at most 2n + 2k + 12 times.
  y = ut(g)
  q1 = g + ua(y)
  c = ut(q1)
  return [((q1 + ua(2 * c + y)) / gamma, 2 * n + 2 * k + 12)]


def kernel_rows_depth(rows: int, rank: int) -> int:
  """Rounded additions a row sum of a Pallas kernel chains at most: the ``steps`` tiles of a
  program into one accumulator, the ``tile`` rows of that accumulator, the programs of a block
  (``ginger._src.kernels.tiling``)."""
  tile, chunk, _ = kernels.tiling(rows, rank)
  return chunk // tile + tile + -(-rows // chunk)


def bucket_shapes(size: str, tau: int, block: str) -> list[tuple[int, int, int]]:
  """``(members, rows, rank)`` of Ginger's stacked bases for a model's parameter shapes."""
  from bench.optimizer_step import SIZES

  sizes = [math.prod(s) for s in SIZES[size]()]
  layout = common.plan_layout(sizes, tau, block, None)
  return [(len(b.members), b.rows, b.rank) for b in layout.buckets]


TINY = {"per_tensor": [(3, 70, 5), (1, 300, 8)], "global": [(1, 1500, 8)]}


def check_shape(m, n, k, interpret: bool, seed: int = 0) -> list[dict]:
  """One row per pass: largest errors and ``|error| / bound`` of the kernels at ``(m, n, k)``."""
  x = random_inputs(seed, m, n, k)

  @jax.jit
  def run(x):
    ref = {name: call(name, x, impl="jnp") for name in PASSES}
    got = {name: call(name, x, impl="pallas", interpret=interpret) for name in PASSES}
    return ref, got

  ref, got = jax.device_get(run(x))
  cpu = jax.devices("cpu")[0]
  with jax.enable_x64(True):
    x64 = {key: jax.device_put(np.asarray(val, np.float64), cpu) for key, val in x.items()}
    exact = jax.device_get(
      jax.jit(lambda x: {name: call(name, x, impl="jnp") for name in PASSES})(x64)
    )
  rows = []
  eps = float(jnp.finfo(jnp.float32).eps) / 2
  depth = kernel_rows_depth(n, k)
  host = jax.device_get(x)
  for name in PASSES:
    tests = bounds(name, host)
    own = bounds(name, host, rows=depth)
    row = {"pass": name, "shape": (m, n, k), "abs": 0.0, "rel": 0.0, "vs_jnp": 0.0, "vs_exact": 0.0}
    for (a, big_n), (a_own, own_n), y, r, e in zip(
      tests,
      own,
      jax.tree.leaves(got[name]),
      jax.tree.leaves(ref[name]),
      jax.tree.leaves(exact[name]),
      strict=True,
    ):
      y, r, e = (np.asarray(t, np.float64) for t in (y, r, e))
      diff = np.abs(y - r)
      row["abs"] = max(row["abs"], float(diff.max(initial=0.0)))
      row["rel"] = max(
        row["rel"], float(diff.max(initial=0.0) / max(np.abs(r).max(initial=0), 1e-300))
      )
      finite = bool(np.all(np.isfinite(y)))
      if big_n * eps >= 0.5 or row["vs_jnp"] is None:
        row["vs_jnp"] = None  # the tests' bound is vacuous at this many rows
      else:
        ratio = np.max(diff / np.maximum(2 * gamma_n(big_n, jnp.float32) * a, 1e-300), initial=0.0)
        row["vs_jnp"] = max(row["vs_jnp"], float(ratio) if finite else math.inf)
      ratio = np.max(
        np.abs(y - e) / np.maximum(gamma_n(own_n, jnp.float32) * a_own, 1e-300), initial=0.0
      )
      row["vs_exact"] = max(row["vs_exact"], float(ratio) if finite else math.inf)
    row["ok"] = row["vs_exact"] <= 1 and (row["vs_jnp"] is None or row["vs_jnp"] <= 1)
    rows.append(row)
  return rows


def step_memory(rows: int, tau: int, passes: str) -> tuple[float, float]:
  """``(temporary bytes, bytes of U)`` of the compiled Ginger update with the state donated.
  The jnp rotation is traced with its row blocks (``Tuning(jnp_row_blocks=True)``), as on a
  GPU, also where it runs: the CPU rotates ``U`` in one piece, which is faster there but holds a
  second ``U`` by design, so only the GPU's form has the bound below."""
  tuning = Tuning(jnp_row_blocks=True)
  tx = ginger.scale_by_ginger(tau, block="global", passes=passes, tuning=tuning)
  params = {"w": jax.ShapeDtypeStruct((rows,), jnp.float32)}
  state = jax.eval_shape(tx.init, params)

  def step(state, g, d):
    return tx.update(g, state, fisher_grads=d)

  compiled = jax.jit(step, donate_argnums=(0,)).lower(state, params, params).compile()
  return float(compiled.memory_analysis().temp_size_in_bytes), rows * min(tau, rows) * 4.0


def memory_bound(rows: int, u_bytes: float, passes: str) -> float:
  """Most temporary bytes the step may hold: a few ``(d,)`` float32 vectors (``g``, ``d``,
  ``p1``, the output), plus, for jnp, two row blocks of the rotation (a block of ``U'`` and its
  slice of ``U``; one block, a copy of ``U``, while ``U`` has at most ``row_block_elements``).
  The pallas kernel writes ``U'`` over ``U``: nothing of ``U``'s size."""
  vectors = 4 * rows * 4.0
  if passes == "pallas":
    return vectors
  block = DEFAULT.row_block_elements * 4.0
  return vectors + (u_bytes if u_bytes <= block else 2 * block)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="resnet18", help="bench.optimizer_step size")
  parser.add_argument("--taus", nargs="+", type=int, default=[8, 32])
  parser.add_argument("--blocks", nargs="+", default=list(common.BLOCKS), choices=common.BLOCKS)
  parser.add_argument(
    "--interpret", action="store_true", help="interpret the kernels (any machine; slow)"
  )
  parser.add_argument("--tiny", action="store_true", help="tiny shapes instead of --size's")
  parser.add_argument(
    "--memory-rows", type=int, default=1 << 22, help="d of the step-memory check (0: skip)"
  )
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  if not args.interpret and device.platform != "gpu":
    parser.error(f"compiled kernels need a GPU (found {device.platform}); pass --interpret")
  print(
    f"# device={device.device_kind} jax={jax.__version__} interpret={args.interpret} "
    f"size={'tiny' if args.tiny else args.size}"
  )
  print(
    "| tau | block | shape | pass | max abs err | max rel err | err/bound vs jnp "
    "| err/bound vs exact | ok |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  failed = 0
  seen = set()
  for tau in args.taus:
    for block in args.blocks:
      shapes = TINY[block] if args.tiny else bucket_shapes(args.size, tau, block)
      for m, n, k in shapes:
        k = min(k, tau)
        if (m, n, k) in seen:
          continue
        seen.add((m, n, k))
        for row in check_shape(m, n, k, args.interpret):
          failed += not row["ok"]
          vs_jnp = "n/a" if row["vs_jnp"] is None else f"{row['vs_jnp']:.3g}"
          print(
            f"| {tau} | {block} | {m}x{n}x{k} | {row['pass']} | {row['abs']:.3g} | "
            f"{row['rel']:.3g} | {vs_jnp} | {row['vs_exact']:.3g} | "
            f"{'pass' if row['ok'] else 'FAIL'} |",
            flush=True,
          )
  if args.memory_rows:
    print("\n| d | tau | passes | temp MB | bound MB | U MB | temp / U | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for tau in args.taus:
      for passes in ("jnp", "pallas"):
        if passes == "pallas" and args.interpret:
          continue  # the interpreter copies its operands: its memory says nothing of the GPU's
        temp, u_bytes = step_memory(args.memory_rows, tau, passes)
        ok = temp <= memory_bound(args.memory_rows, u_bytes, passes)
        failed += not ok
        print(
          f"| {args.memory_rows} | {tau} | {passes} | {temp / 1e6:.1f} | "
          f"{memory_bound(args.memory_rows, u_bytes, passes) / 1e6:.1f} | {u_bytes / 1e6:.1f} | "
          f"{temp / u_bytes:.2f} | {'pass' if ok else 'FAIL'} |",
          flush=True,
        )
  print(f"\n{'FAILED: ' + str(failed) + ' check(s)' if failed else 'all checks passed'}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
