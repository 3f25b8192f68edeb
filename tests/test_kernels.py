"""The Pallas kernels of ginger._src.kernels (interpreted on the CPU) against the jnp reference.

Tolerances: both implementations evaluate the same sums of products in float, in different
orders. For a quantity that expands into a sum of elementary products ``sum_t x_t`` in which
every term passes through at most ``N`` rounded operations, any evaluation order satisfies
``|fl - exact| <= gamma_N sum_t |x_t|`` with ``gamma_N = N u / (1 - N u)`` and ``u = eps / 2``
the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., sections
3.1-3.5; the bound holds for every summation order, FMAs included). Two implementations
therefore differ by at most ``2 gamma_N A`` with ``A = sum_t |x_t|``, which the tests compute in
float64 from the inputs: e.g. ``A_j = (|U|^T |v|)_j`` and ``N = rows`` for ``U^T v``. The bound
is worst-case (the typical error is ~``sqrt(N) u A``) but per entry and exact: a missed mask, a
lost tile or a wrong operand gives errors of order ``A`` itself. The operands and bounds live in
bench/kernels_check.py, which checks the compiled kernels on a GPU against the same bounds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from abstract_gpu import abstract_h200
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.kernels_check import PASSES, ROTATE_KEYS, bounds, call, gamma_n, random_inputs
from ginger._src import kernels, lowrank
from ginger._src.tuning import DEFAULT, Tuning


def assert_close(name: str, x: dict, got, want, dtype=jnp.float32, extra: int = 0):
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  for i, ((a, n), y, r) in enumerate(zip(bounds(name, x), got, want, strict=True)):
    assert y.shape == r.shape and y.dtype == r.dtype, (name, i, y.shape, r.shape, y.dtype)
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    assert np.all(np.isfinite(y)), (name, i)
    tol = 2 * gamma_n(n + extra, dtype) * a
    excess = np.abs(y - r) - tol
    assert np.all(excess <= 0), (
      f"{name} output {i}: |pallas - jnp| exceeds 2 gamma_{n + extra} A by up to "
      f"{excess.max():.3g} (largest A {a.max():.3g})"
    )


def both(x: dict, tile: int, steps: int, tuning: Tuning = DEFAULT):
  """Every pass, jnp and interpreted Pallas (under ``tuning``), in one jitted function (one
  compilation)."""

  def run(x):
    ref = {name: call(name, x, impl="jnp") for name in PASSES}
    kw = dict(impl="pallas", interpret=True, tile=tile, steps=steps, tuning=tuning)
    return ref, {name: call(name, x, **kw) for name in PASSES}

  return jax.jit(run)(x)


# Rows not a multiple of the tile (16), several tiles a program (steps) and several programs a
# block (rows > tile * steps), rank 1..33 (padded to 16, 32 or 64 lanes), 1-3 blocks.
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  m=st.integers(1, 3),
  n=st.integers(1, 70),
  k=st.integers(1, 33),
  steps=st.integers(1, 3),
  seed=st.integers(0, 2**16),
)
@example(m=1, n=1, k=1, steps=1, seed=0)
@example(m=2, n=67, k=33, steps=2, seed=1)
def test_passes_match_reference(m, n, k, steps, seed):
  x = random_inputs(seed, m, n, k)
  ref, got = both(x, tile=16, steps=steps)
  for name in PASSES:
    assert_close(name, x, got[name], ref[name])


@pytest.mark.parametrize("k", [3, 8])
def test_eight_lane_padding_matches_reference(k):
  """min_padded_rank=8: passes 1 and 2 at ranks up to 8 in 8 lanes (3: masked lanes; 8: all of
  them), as pass 3 by default; rank 9 still pads to 16 (the dot)."""
  tuning = Tuning(min_padded_rank=8)
  assert kernels.tiling(rows=100, rank=k, tile=16, tuning=tuning)[2] == 8
  assert kernels.tiling(rows=100, rank=9, tile=16, tuning=tuning)[2] == 16
  x = random_inputs(k, 2, 45, k)
  ref, got = both(x, tile=16, steps=2, tuning=tuning)
  for name in PASSES:
    assert_close(name, x, got[name], ref[name])
  for name in ("min_padded_rank", "rotate_min_padded_rank"):
    with pytest.raises(ValueError, match=f"{name} must be a power of two >= 4, got 12"):
      Tuning(**{name: 12})


def _pass_three_jaxpr(k: int, tuning: Tuning = DEFAULT) -> str:
  x = random_inputs(0, 1, 40, k)
  args = [x[n] for n in ROTATE_KEYS]
  kw = dict(impl="pallas", interpret=True, tile=16, tuning=tuning)
  return str(jax.make_jaxpr(lambda *a: kernels.rotate_from_residual(*a, **kw))(*args))


@pytest.mark.parametrize("k", [3, 8])
def test_pass_three_rotates_column_by_column_at_low_rank(k):
  """Ranks up to 8: pass 3 in 8 lanes (``rotate_min_padded_rank``), ``U rot`` as k column-times-row
  multiply-adds, no dot (a Triton dot made the rotation of the largest ResNet-18 bucket twice as
  slow on an H200); rank 9 pads to 16 lanes and keeps the dot. Their values: the property test
  above (ranks 1..33)."""
  assert kernels.tiling(rows=5000, rank=k, rotate=True) == (256, 256, 8)
  assert kernels.tiling(rows=5000, rank=9, rotate=True) == (512, 512, 16)
  assert kernels.tiling(rows=5000, rank=32, rotate=True) == (64, 64, 32)
  assert "dot_general" not in _pass_three_jaxpr(k)
  assert "dot_general" in _pass_three_jaxpr(9)


def test_pass_three_in_sixteen_lanes_matches_reference():
  """rotate_min_padded_rank=16: rank 8 in 16 lanes, the rotation one dot."""
  tuning = Tuning(rotate_min_padded_rank=16)
  assert "dot_general" in _pass_three_jaxpr(8, tuning)
  x = random_inputs(5, 2, 45, 8)
  ref, got = both(x, tile=16, steps=2, tuning=tuning)
  for name in PASSES:
    assert_close(name, x, got[name], ref[name])


def test_correct_matches_reference():
  """``correct``, precondition's last pass, on its own: ``(q - U a) / gamma``, each entry a sum
  of ``k`` products, a subtraction and a division (``N = k + 3``), over rows not a multiple of
  the tile and several tiles a program."""
  m, n, k = 2, 45, 5
  x = random_inputs(4, m, n, k)
  args = lambda x: (x["u"], x["g"], x["z"], x["gamma"])  # noqa: E731
  pallas = dict(impl="pallas", interpret=True, tile=16, steps=2)
  ref, got = jax.jit(
    lambda x: (kernels.correct(*args(x), impl="jnp"), kernels.correct(*args(x), **pallas))
  )(x)
  f = {key: np.abs(np.asarray(x[key], np.float64)) for key in ("u", "g", "z", "gamma")}
  a = (f["g"] + np.einsum("mnk,mk->mn", f["u"], f["z"])) / f["gamma"][:, None]
  assert got.shape == ref.shape == (m, n) and got.dtype == ref.dtype
  assert np.all(
    np.abs(np.asarray(got, np.float64) - np.asarray(ref)) <= 2 * gamma_n(k + 3, jnp.float32) * a
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_precondition_from_its_first_half(impl, dtype):
  """``precondition(..., uT_g=project(u, g))`` (how a split state adds ``U^T g`` of all
  buckets over the devices at once) is ``precondition`` itself: the same operations, split in
  two; bit for bit with the kernels, to float32 rounding with the jnp passes (XLA may fuse the
  halves otherwise: the tests' bound)."""
  x = random_inputs(7, 2, 45, 5, dtype)
  kw = dict(impl=impl, interpret=True, tile=16, steps=2)
  args = (x["u"], x["sigma"], x["g"], x["gamma"])

  def both(x):
    whole = kernels.precondition(*args, **kw)
    return whole, kernels.precondition(*args, uT_g=kernels.project(x["u"], x["g"], **kw), **kw)

  whole, halves = jax.jit(both)(x)
  if impl == "pallas":
    np.testing.assert_array_equal(np.asarray(halves, np.float32), np.asarray(whole, np.float32))
  assert_close("precondition", x, halves, whole, dtype, extra=int(dtype == jnp.bfloat16))
  with pytest.raises(ValueError, match=r"uT_g must have shape \(2, 5\)"):
    kernels.precondition(*args, uT_g=x["g"], **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_residual_is_the_q1_half_of_residual_sums(impl, dtype):
  """``residual`` (pass 2 for ``g`` alone, a step without a curvature update) returns what
  ``residual_sums(u, g, g, y, 1, y)`` returns for ``g``: ``U^T q1`` and ``q1``, the same
  arithmetic without ``p1``; ``q1`` bit for bit (one expression), ``U^T q1`` within the
  kernels' bound (interpreted, XLA:CPU may contract the two kernels' multiply-adds into fused
  multiply-adds differently)."""
  x = random_inputs(9, 3, 53, 6, dtype)
  kw = dict(impl=impl, interpret=True, tile=16, steps=2)

  @jax.jit
  def run(x):
    ones = jnp.ones(x["u"].shape[:-2], dtype)
    sums = kernels.residual_sums(x["u"], x["g"], x["g"], x["ay"], ones, x["ay"], with_p1=True, **kw)
    return kernels.residual(x["u"], x["g"], x["ay"], **kw), (sums[4], sums[6])

  (c, q1), (c_all, q1_all) = run(x)
  assert c.dtype == kernels.compute_dtype(dtype) and q1.dtype == dtype
  np.testing.assert_array_equal(np.asarray(q1, np.float32), np.asarray(q1_all, np.float32))
  extra = int(dtype == jnp.bfloat16)
  assert_close("residual", x, (c, q1), (c_all.astype(c.dtype), q1_all), dtype, extra=extra)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_residual_against_float64(impl):
  """``residual``'s ``U^T q1`` and ``q1`` against the dense float64 math: within ``gamma_N A``
  of the exact values (the bound every order of evaluation obeys), at shapes where no other
  bound hides a lost tile or row (several programs a block, a partial last tile)."""
  x = random_inputs(13, 2, 70, 7)
  c, q1 = jax.jit(lambda x: kernels.residual(x["u"], x["g"], x["ay"], impl=impl, tile=16))(x)
  u, g, y = (np.asarray(x[key], np.float64) for key in ("u", "g", "ay"))
  q1_exact = g - np.einsum("mnk,mk->mn", u, y)
  c_exact = np.einsum("mnk,mn->mk", u, q1_exact)
  for got, want, (a, n) in zip((c, q1), (c_exact, q1_exact), bounds("residual", x), strict=True):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= gamma_n(n, jnp.float32) * a), (err.max(), a.max())


def test_bfloat16_state():
  """bf16 ``U`` (state_dtype="bfloat16"): the kernels compute in float32 and round once; the
  reference rounds every operation to bf16. Both obey the bound with bf16's unit roundoff
  (one more rounding for the final cast), so rows and rank stay small enough for it to bind."""
  x = random_inputs(3, 2, 21, 3, jnp.bfloat16)
  ref, got = both(x, tile=16, steps=1)
  for name in PASSES:
    assert_close(name, x, got[name], ref[name], jnp.bfloat16, extra=1)


def test_jit_vmap_and_leading_axes():
  """Under ``vmap`` (Pallas adds a grid axis) and with extra leading axes (flattened into the
  blocks axis) the kernels match the reference on every slice."""
  xs = [random_inputs(seed, 2, 35, 6) for seed in (4, 5)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
  names = ("project_pair", "rotate_and_precondition")
  kw = dict(impl="pallas", interpret=True, tile=16, steps=2)

  @jax.jit
  def run(stacked):
    mapped = {n: jax.vmap(lambda x, n=n: call(n, x, **kw))(stacked) for n in names}
    leading = {n: call(n, stacked, **kw) for n in names}
    return mapped, leading

  mapped, leading = run(stacked)
  for i, x in enumerate(xs):
    for name in names:
      want = call(name, x, impl="jnp")
      assert_close(name, x, jax.tree.map(lambda a, i=i: a[i], mapped[name]), want)
      assert_close(name, x, jax.tree.map(lambda a, i=i: a[i], leading[name]), want)


def test_passes_two_and_three_agree_on_p1():
  """CGS2 through the kernels: pass 2 measures ``c2 = U^T p1`` and pass 3 subtracts ``U c2``
  from ``p1``; ``p = p1 - U c2`` is orthogonal to ``U`` to working precision only if both
  passes use the same rounded ``p1``. Here ``v`` lies within ``1e-4`` of ``span U``, so ``p1``
  is ~``1e-4 |v| / l1`` while its rounding is ~``eps |v| / l1``: a pass 3 that rounded ``p1``
  differently (e.g. the jnp ``rowdot`` after the Pallas pass 2, checked by hand) leaves
  ``|U^T p| ~ 1e-2``, far above the bound below. Both routes: pass 3 recomputing ``p1`` from
  ``v`` in its kernel, and pass 3 reading pass 2's ``p1`` (``with_p1``). ``p`` is read back as
  column 0 of ``U'`` (``rot = 0``, ``b = e_1``)."""
  rng = np.random.default_rng(7)
  m, n, k = 2, 45, 5
  u64 = np.linalg.qr(rng.standard_normal((m, n, k)))[0]
  w = rng.standard_normal((m, n))
  w -= np.einsum("mnk,mk->mn", u64, np.einsum("mnk,mn->mk", u64, w))
  w /= np.linalg.norm(w, axis=-1, keepdims=True)
  c0 = rng.standard_normal((m, k))
  v64 = np.einsum("mnk,mk->mn", u64, c0) + 1e-4 * np.linalg.norm(c0, axis=-1)[:, None] * w
  u, v = jnp.asarray(u64, jnp.float32), jnp.asarray(v64, jnp.float32)
  g = jnp.zeros_like(v)
  kw = dict(impl="pallas", interpret=True, tile=16, steps=2)

  @jax.jit
  def cgs2(u, v):
    c, _, l1 = kernels.project_pair(u, v, g, **kw)
    inv_l1 = 1.0 / l1
    c2, pp, _, _, _, p1, _ = kernels.residual_sums(u, v, g, c, inv_l1, c, with_p1=True, **kw)
    inv_r = 1.0 / jnp.sqrt(pp - jnp.sum(c2 * c2, -1))
    e1 = jnp.zeros_like(c).at[:, 0].set(1.0)
    zero = jnp.zeros_like(c)
    rest = (c2, inv_r, jnp.zeros(u.shape[:1] + (k, k), u.dtype), e1, zero, 0.0, 1.0)
    recomputed, _ = kernels.rotate_and_precondition(u, v, g, c, inv_l1, *rest, **kw)
    stored, _ = kernels.rotate_from_residual(u, p1, g, *rest, **kw)
    return recomputed[..., 0], stored[..., 0], c, inv_l1, c2, inv_r

  *ps, c, inv_l1, c2, inv_r = (np.asarray(a, np.float64) for a in cgs2(u, v))
  # With one rounded p1 in both passes, c2 = U^T p1 + f and p = (p1 - U c2 + e) inv_r give
  # U^T p = (-f + U^T e - (U^T U - I) c2) inv_r, with |f| <= gamma_n |U|^T |p1|,
  # |e| <= gamma_{k+3} (|p1| + |U| |c2|) and U^T U - I from the float32 QR factor. |p1| is
  # bounded by the exact (v - U c) inv_l1 plus its rounding gamma_{k+2} (|v| + |U| |c|) inv_l1.
  u64, v64 = np.asarray(u, np.float64), np.asarray(v, np.float64)
  ua = np.abs(u64)
  p1 = np.abs(v64 - np.einsum("mnk,mk->mn", u64, c)) * inv_l1[:, None]
  p1 += (
    gamma_n(k + 2, jnp.float32)
    * (np.abs(v64) + np.einsum("mnk,mk->mn", ua, np.abs(c)))
    * (inv_l1[:, None])
  )
  term = p1 + np.einsum("mnk,mk->mn", ua, np.abs(c2))
  ortho = np.abs(np.einsum("mnk,mnl->mkl", u64, u64) - np.eye(k))
  tol = (
    gamma_n(n + k + 3, jnp.float32) * np.einsum("mnk,mn->mk", ua, term)
    + np.einsum("mkl,ml->mk", ortho, np.abs(c2))
  ) * inv_r[:, None]
  for route, p in zip(("recomputed", "stored"), ps):
    assert np.allclose(np.linalg.norm(p, axis=-1), 1.0, atol=1e-3), route
    got = np.abs(np.einsum("mnk,mn->mk", u64, p))
    assert np.all(got <= tol), (route, got.max(), tol.min())


@pytest.mark.parametrize(("m", "n", "k", "rows"), [(1, 50, 3, 7), (3, 64, 8, 16), (2, 33, 33, 40)])
def test_jnp_rotation_in_row_blocks(m, n, k, rows):
  """The jnp rotation over row blocks written back into ``U`` (a loop; the in-place path of a
  large ``U``) against the formula on the whole array: each row's entries are the same sums of
  products, rounded alike up to fused multiply-adds, so the bound above holds (rows a multiple
  of the block or not, one block larger than the rows)."""
  x = random_inputs(11, m, n, k)
  keys = ROTATE_KEYS

  @jax.jit
  def run(x):
    blocked = kernels.rotate_from_residual(*(x[q] for q in keys), impl="jnp", rows_per_block=rows)
    return blocked, lowrank.rotate_from_residual(*(x[q] for q in keys))

  blocked, whole = run(x)
  assert_close("rotate_from_residual", x, blocked, whole)
  assert kernels.row_block((m, n, k), rows) == min(rows, n)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_rotation_reads_joined_small_operands_at_first(impl):
  """Pass 3 of a bucket whose small operands are the rows ``first ..`` of arrays joined with
  other buckets' (one batched solve) equals it on the bucket's own rows: the kernel offsets its
  block index maps, the jnp path slices; other rows are never read (NaN there). The jnp path
  bit for bit; the kernel within the kernels' bound: its two interpreted programs may contract
  the rotation's multiply-adds (rank 8: column by column) into fused multiply-adds differently
  (XLA:CPU with `make test`'s flags does)."""
  m, before, after = 2, 3, 1
  x = random_inputs(5, m, 40, 8)
  smalls = ROTATE_KEYS[3:]

  def joined(a):
    pad = lambda rows: jnp.full((rows,) + a.shape[1:], jnp.nan, a.dtype)
    return jnp.concatenate([pad(before), a, pad(after)])

  kw = dict(impl=impl, interpret=True)

  @jax.jit
  def run(x):
    args = [x[q] for q in ("u", "p1", "g")]
    own = kernels.rotate_from_residual(*args, *(x[q] for q in smalls), **kw)
    at_first = kernels.rotate_from_residual(
      *args, *(joined(x[q]) for q in smalls), first=before, **kw
    )
    return own, at_first

  own, at_first = run(x)
  assert not any(np.isnan(np.asarray(a)).any() for a in jax.tree.leaves(at_first))
  if impl == "jnp":
    for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(at_first), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  else:
    assert_close("rotate_from_residual", x, at_first, own)


def test_row_block_sizes():
  """Up to ``row_block_elements`` one block; beyond, blocks of about that size, at most
  ``max_row_blocks`` of them."""
  big = DEFAULT.row_block_elements
  assert kernels.row_block((1, big // 8, 8)) == big // 8
  assert kernels.row_block((2, big // 8, 8)) == big // 16
  assert kernels.row_block((1, 1000 * big, 1)) == -(-1000 * big // DEFAULT.max_row_blocks)
  small = Tuning(row_block_elements=64, max_row_blocks=3)
  assert kernels.row_block((1, 16, 8), tuning=small) == 8
  assert kernels.row_block((1, 1000, 8), tuning=small) == 334


def test_bad_arguments():
  x = random_inputs(0, 1, 5, 2)
  with pytest.raises(ValueError, match="impl must be one of"):
    kernels.project_pair(x["u"], x["v"], x["g"], impl="triton")
  with pytest.raises(ValueError, match="g must have shape"):
    kernels.project_pair(x["u"], x["v"], x["g"][:, :3])
  with pytest.raises(ValueError, match="rot must have shape"):
    call("rotate_and_precondition", {**x, "rot": x["rot"][..., :1]})
  with pytest.raises(ValueError, match="inv_l1 must be a scalar or have shape"):
    call("residual_sums", {**x, "inv_l1": jnp.ones((3,))})
  with pytest.raises(ValueError, match="v must have u's dtype"):
    kernels.project_pair(x["u"], x["v"].astype(jnp.bfloat16), x["g"])
  with pytest.raises(ValueError, match="tile must be a power of two"):
    kernels.project_pair(x["u"], x["v"], x["g"], impl="pallas", tile=24)
  with pytest.raises(ValueError, match="rows_per_block must be an int >= 1"):
    call("rotate_from_residual", x, rows_per_block=0)
  with pytest.raises(ValueError, match="first must be an int >= 0"):
    call("rotate_from_residual", x, first=-1)
  with pytest.raises(ValueError, match="1 blocks from first=1 run past the 1 joined blocks"):
    call("rotate_from_residual", x, first=1)


def test_defaults_off_gpu():
  assert kernels.resolve_impl("auto", None) == ("jnp", True)
  assert kernels.resolve_impl("pallas", None) == ("pallas", True)
  assert kernels.tiling(rows=5000, rank=8) == (512, 512, 16)
  assert kernels.tiling(rows=5000, rank=32) == (64, 64, 32)
  assert kernels.tiling(rows=20, rank=33) == (32, 32, 64)
  assert kernels.tiling(rows=5000, rank=8, tile=64, steps=4) == (64, 256, 16)


def test_cpu_pass_two_products_are_dots():
  """Off GPUs the jnp pass 2's vector products (``p1.p1``, ``p1.q1``, ``vs.vs``) are dots, not
  sums of products: XLA:CPU turns such a sum over the row axis into a YNNPACK reduce at ~0.6
  GB/s (33 ms for ``p1.g`` of one of ResNet-18's 2359296-row tensors, three of them a third of
  the whole tau=8 step)."""
  m, n, k = 2, 64, 4
  args = (jnp.ones((m, n, k)), jnp.ones((m, n)), jnp.ones((m, n)), jnp.ones((m, k)), jnp.ones(m))
  args += (jnp.ones((m, k)),)
  jaxpr = jax.make_jaxpr(lambda *x: kernels.residual_sums(*x, impl="jnp"))(*args)
  row_reductions = [
    e
    for e in jaxpr.eqns
    if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape[-1:] == (n,)
  ]
  assert not row_reductions, row_reductions
  # U a, U ay, U^T [p1 q1] (two products off GPUs), the three vector sums
  assert sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) >= 7


def _triton_lowering():
  """Triton's MLIR bindings from jaxlib, and a hook that verifies every Triton module Pallas
  builds (element counts must be powers of two, ``tt.dot`` operand shapes...)."""
  try:
    from jax._src.pallas.triton import lowering
  except ImportError as e:  # pragma: no cover
    pytest.skip(f"no Pallas Triton lowering in this jaxlib: {e}")
  original = lowering.lower_jaxpr_to_triton_module

  def verified(*args, **kwargs):
    result = original(*args, **kwargs)
    assert result.module.operation.verify()
    return result

  return lowering, verified


@pytest.mark.parametrize(
  ("m", "n", "k", "dtype", "lanes"),
  [(3, 1000, 8, "float32", 16), (1, 70, 33, "bfloat16", 16), (3, 1000, 8, "float32", 8)],
)
def test_lowers_to_triton(monkeypatch, m, n, k, dtype, lanes):
  """Each pass lowers for CUDA to one verified Triton module (no GPU needed: Pallas builds the
  Triton IR in Python for the GPU an abstract device names, an H200; only its compilation to PTX
  needs the card), and the rotation's kernel aliases ``U'`` to ``U``; also with ranks padded to
  8 lanes (no dot in the rotation)."""
  lowering, verified = _triton_lowering()
  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", verified)
  x = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(dtype)), random_inputs(0, m, n, k)
  )
  for name in PASSES:
    kw = dict(impl="pallas", interpret=False, tuning=Tuning(min_padded_rank=lanes))
    fn = jax.jit(functools.partial(call, name, **kw))
    with abstract_h200():
      text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    calls = text.count("__gpu$xla.gpu.triton")
    assert calls == (3 if name == "precondition" else 1), (name, calls)
    if name.startswith("rotate"):
      assert "output_operand_aliases" in text
