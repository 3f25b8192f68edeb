"""Eigendecomposition of a diagonal plus a rank-one matrix, ``D + rho z z^T``, without ``eigh``.

Brand's core is of this form (see :func:`ginger._src.lowrank.brand_core`): in the basis ``[U p]``,
``alpha U diag(sigma) U^T + (1 - alpha) v v^T`` is ``diag(alpha sigma, 0) + (1 - alpha) w w^T``
with ``w = [U^T v; r]``. Its eigenproblem needs O(n^2) work, not a dense O(n^3) ``eigh``
(which on GPUs also falls off the batched small-matrix path at n = 33, the core of tau = 32).

The method (Golub 1973; Bunch, Nielsen and Sorensen 1978; Gu and Eisenstat 1994; LAPACK's
``dlaed2``/``dlaed3``/``dlaed4``), vectorised over a batch, with fixed iteration counts:

1. *Deflation.* Entries of ``d`` below ``max(sqrt(tiny) max(|d|_max, rho), 8 tiny / eps)``
   are set to zero: far below the matrix's rounding level, but where floats are dense
   enough for two poles to be closer than two normal numbers, so that a root between them
   would be a subnormal away from one (XLA flushes subnormals to zero: a division by zero in
   the eigenvectors). Sort ``d`` ascending. Entries of equal ``d`` are merged by one Householder
   reflection per group, which leaves ``D`` unchanged and moves the group's part of ``z``
   onto its last member; the others get ``z = 0``. Every entry with
   ``rho |z_j| <= sqrt(tiny) max(|d|_max, rho)`` then gets ``z_j = 0`` (far below the
   matrix's rounding level; LAPACK deflates up to ``8 eps ||M||``, which the bisection below
   does not need and which costs the eigenvectors of eigenvalues near such a ``d_j``
   accuracy). An entry with ``z_j = 0`` is an exact eigenpair
   ``(d_j, e_j)``: eigenvalues that are zero in exact arithmetic stay exactly zero.
2. *Secular equation.* The other eigenvalues are the roots of
   ``f(lambda) = 1/rho + sum_j z_j^2 / (d_j - lambda)``, one in each gap between consecutive
   active poles and one in ``(d_top, d_top + rho ||z||^2]``. Each is written as
   ``lambda = d_K + s * t`` from the nearer pole ``K`` (``s = +-1``), so that the differences
   ``d_j - lambda = (d_j - d_K) - s t`` are accurate however close the poles are, and ``t``
   is found by bisection on the bit pattern of the float ``t``: each step halves the number
   of floats left in the bracket, so 31 steps (63 in float64) end at adjacent floats for any
   scale of ``t``, from subnormal to ``finfo.max``. The sum over the poles is a pairwise
   tree of fixed order (:func:`_pole_sum`), so that the two implementations below agree.
3. *Eigenvectors.* With the computed roots, ``z`` is recomputed by Lowner's formula
   (Gu-Eisenstat), ``zhat_j^2 = prod_i (lambda_i - d_j) / (rho prod_{i != j} (d_i - d_j))``,
   which makes the eigenvectors ``(zhat_j / (d_j - lambda_i))_j`` (normalised) numerically
   orthogonal, the exact eigenvectors of a matrix within rounding of the given one.

The bisection runs as ``impl`` says (:func:`eigh_diag_plus_rank_one`): ``"jnp"``, a
``fori_loop`` of jnp expressions (the reference, and the CPU path), or ``"pallas"``, one
Pallas kernel (:func:`bisect_pallas`; Triton on GPUs, interpreted elsewhere). On a GPU the
loop is three small XLA kernels a step, 93 launches a solve, whose time is mostly launch
latency; the kernel runs all 31 steps for all roots of a batch entry in
registers, one program per entry. Both evaluate ``f`` with the same operations in the same
order (on GPUs also the same float32 division, PTX ``div.full`` in XLA and in Triton), and
so end at the same bits of every root (tests/test_secular.py): the eigenvectors depend on
those bits. Deflation, the choice of origin and the eigenvectors are shared jnp code.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ginger._src import pallas_passes

HIGHEST = jax.lax.Precision.HIGHEST
IMPLS = ("jnp", "pallas")


def eigh_diag_plus_rank_one(
  d: jax.Array, z: jax.Array, rho, *, impl: str = "jnp", interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
  """Eigenpairs of ``diag(d) + rho z z^T`` (``rho > 0``), batched over leading axes.

  The steps of the module docstring: ``z`` normalised and poles near zero snapped to it
  (:func:`_normalised`), ``d`` sorted, deflation (:func:`_deflate`), the roots of the secular
  equation by bisection (:func:`_roots`), Lowner's eigenvectors (:func:`_eigenvectors`).

  Args:
    d: ``(..., n)`` diagonal, any order.
    z: ``(..., n)`` rank-one vector (any scale; ``rho ||z||^2`` must be finite).
    rho: positive scalar or ``(...)`` array.
    impl: how the bisection (step 2) runs: ``"jnp"``, a ``fori_loop`` of jnp expressions
      (the reference, and the CPU path), or ``"pallas"``, one Pallas kernel
      (:func:`bisect_pallas`). Both give the same bits; the rest is shared.
    interpret: run the ``"pallas"`` kernel in Pallas' interpreter (off GPUs).

  Returns:
    ``(w, v)``: eigenvalues ``(..., n)`` sorted descending and the matching orthonormal
    eigenvectors as the columns of ``v`` ``(..., n, n)``, like ``eigh`` flipped.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
  d, z, rho, scale = _normalised(d, z, rho)
  # Ascending order; ``perm[j]`` is the input index of sorted entry j.
  perm = jnp.argsort(d, axis=-1, stable=True)
  d = jnp.take_along_axis(d, perm, -1)
  z = jnp.take_along_axis(z, perm, -1)
  house, z, active = _deflate(d, z, rho, scale)
  index = jnp.arange(d.shape[-1])
  roots = _roots(d, z, active, rho, index, impl, interpret)
  vecs = _eigenvectors(d, z, active, rho, index, roots, house)
  # Back to the input's coordinates (rows), eigenvalues descending (columns).
  rows = jnp.argsort(perm, axis=-1)
  vecs = jnp.take_along_axis(vecs, rows[..., :, None], -2)
  order = jnp.argsort(-roots.w, axis=-1, stable=True)
  w = jnp.take_along_axis(roots.w, order, -1)
  vecs = jnp.take_along_axis(vecs, order[..., None, :], -1)
  return w, vecs


def _normalised(d, z, rho):
  """``(d, z / ||z||, rho ||z||^2, scale)`` with ``scale = max(|d|_max, rho ||z||^2)``, the
  matrix's, and the poles ``|d_j| < max(sqrt(tiny) scale, 8 tiny / eps)`` set to zero (see the
  module docstring, step 1): beyond it two distinct floats are at least four normal numbers
  apart, so every gap's middle is normal. ``z^2`` never overflows."""
  dtype = d.dtype
  z_norm = jnp.sqrt(jnp.sum(jnp.square(z / _safe_max_abs(z)[..., None]), -1)) * _safe_max_abs(z)
  rho = jnp.asarray(rho, dtype) * jnp.square(z_norm)
  z = z / jnp.where(z_norm > 0, z_norm, 1.0)[..., None]
  finfo = jnp.finfo(dtype)
  scale = jnp.maximum(jnp.max(jnp.abs(d), -1), rho)
  snap = jnp.maximum(jnp.sqrt(finfo.tiny) * scale, 8 * finfo.tiny / finfo.eps)
  d = jnp.where(jnp.abs(d) < snap[..., None], 0.0, d).astype(dtype)
  return d, z, rho, scale


def _deflate(d, z, rho, scale):
  """Step 1 on sorted ``d``: one Householder reflection ``H`` per group of equal ``d`` (which
  leaves ``D`` unchanged and moves the group's part of ``z`` onto its last member), then every
  ``rho |z_j| <= sqrt(tiny) scale`` to zero. Returns ``(H, z, active)``, ``active``: the
  entries with ``z_j != 0``; the others are exact eigenpairs ``(d_j, e_j)``."""
  dtype, n = d.dtype, d.shape[-1]
  same = d[..., :, None] == d[..., None, :]  # ties are contiguous after sorting
  last = jnp.concatenate([d[..., 1:] != d[..., :-1], jnp.ones_like(d[..., :1], bool)], -1)
  group_norm = jnp.sqrt(
    jnp.einsum("...ij,...j->...i", same.astype(dtype), z * z, precision=HIGHEST)
  )
  z_last = jnp.einsum(
    "...ij,...j->...i", (same & last[..., None, :]).astype(dtype), z, precision=HIGHEST
  )
  sign_last = jnp.where(z_last < 0, -1.0, 1.0).astype(dtype)
  members = jnp.sum(same, -1)
  reflect = (members > 1) & (group_norm > 0)
  u = z + jnp.where(last, sign_last * group_norm, 0.0)
  utu = 2.0 * group_norm * (group_norm + jnp.abs(z_last))
  coef = jnp.where(reflect, 2.0 / jnp.where(reflect, utu, 1.0), 0.0)
  house = jnp.eye(n, dtype=dtype) - same * (coef[..., :, None] * u[..., :, None] * u[..., None, :])
  z = jnp.where(reflect, jnp.where(last, -sign_last * group_norm, 0.0), z)
  # Only couplings below sqrt(tiny) of the matrix's scale are dropped (their squares would
  # underflow); the bisection needs no wider deflation, and LAPACK's 8 eps ||M|| tolerance
  # would cost the smallest kept eigenvectors accuracy (eps ||M|| / gap).
  tol = jnp.sqrt(jnp.finfo(dtype).tiny) * scale
  active = rho[..., None] * jnp.abs(z) > tol[..., None]
  z = jnp.where(active, z, 0.0)
  return house, z, active


class _Roots(NamedTuple):
  """The eigenvalues ``w = d_K + s t`` of the active entries (``d_j`` elsewhere), each from
  its nearer pole ``origin_d = d_K`` by ``shift = s t``; ``d_next`` and ``has_next``: the next
  active pole above each (the top active root has none)."""

  w: jax.Array
  origin_d: jax.Array
  shift: jax.Array
  d_next: jax.Array
  has_next: jax.Array


def _roots(d, z, active, rho, index, impl, interpret) -> _Roots:
  """Step 2: the roots of ``f(lambda) = 1/rho + sum_j z_j^2 / (d_j - lambda)``, one in each
  gap between consecutive active poles and one in ``(d_top, d_top + rho ||z||^2]``, each by
  bisection on the bits of ``t`` from the pole nearer to it (``bisect_jnp`` or
  ``bisect_pallas``, as ``impl`` says)."""
  dtype = d.dtype
  above = active[..., None, :] & (index[None, :] > index[:, None])
  has_next = jnp.any(above, -1)
  next_ = jnp.argmax(above, -1)
  d_next = jnp.take_along_axis(d, next_, -1)
  z2 = jnp.where(active, z * z, 0.0)
  half = jnp.where(has_next, 0.5 * (d_next - d), rho[..., None] * jnp.sum(z2, -1, keepdims=True))
  inv_rho = 1.0 / rho[..., None]
  # The nearer pole is the origin: the left one if f at the gap's middle is positive.
  f_half = _secular(d[..., :, None], z2[..., :, None], active[..., :, None], inv_rho, d, half)
  left = ~has_next | (f_half > 0)
  origin = jnp.where(left, index, next_)
  origin_d = jnp.take_along_axis(d, origin, -1)
  sign = jnp.where(left, 1.0, -1.0).astype(dtype)
  floor = _floor_bits(dtype)
  lo = jnp.zeros(half.shape, floor.dtype)
  hi = jnp.maximum(
    jax.lax.bitcast_convert_type(jnp.maximum(half, 0.0).astype(dtype), floor.dtype), floor
  )
  bisect = bisect_jnp if impl == "jnp" else functools.partial(bisect_pallas, interpret=interpret)
  hi = bisect(d, z2, active, origin_d, sign, inv_rho, lo, hi)
  t = jax.lax.bitcast_convert_type(jnp.maximum(hi, floor), dtype)
  shift = sign * t
  w = jnp.where(active, origin_d + shift, d)
  return _Roots(w, origin_d, shift, d_next, has_next)


def _eigenvectors(d, z, active, rho, index, roots: _Roots, house):
  """Step 3: the eigenvectors ``H (zhat_j / (d_j - lambda_i))_j`` (normalised) of the active
  part, ``zhat`` by Lowner's formula ``zhat_j^2 = prod_i (lambda_i - d_j) / (rho prod_{i != j}
  (d_i - d_j))`` from the computed roots (Gu-Eisenstat: numerically orthogonal), ``e_j`` for
  the deflated entries; in the sorted coordinates."""
  dtype, n = d.dtype, d.shape[-1]
  pair = active[..., :, None] & active[..., None, :]  # (j, i)
  delta = (d[..., :, None] - roots.origin_d[..., None, :]) - roots.shift[..., None, :]
  lower = index[None, :] < index[:, None]  # i < j
  denominator = jnp.where(
    lower, d[..., None, :] - d[..., :, None], roots.d_next[..., None, :] - d[..., :, None]
  )
  is_top = active & ~roots.has_next
  ratio = jnp.where(
    pair & ~(is_top[..., None, :] & ~lower), -delta / jnp.where(pair, denominator, 1.0), 1.0
  )
  # lambda_top - d_j from the accurate differences (lambda_top itself may round onto d_j).
  top_gap = jnp.sum(jnp.where(is_top[..., None, :], -delta, 0.0), -1)
  zhat2 = jnp.abs(top_gap) / rho[..., None] * jnp.prod(ratio, -1)
  zhat = jnp.where(z < 0, -1.0, 1.0) * jnp.sqrt(jnp.where(active, zhat2, 0.0))
  vecs = jnp.where(pair, zhat[..., :, None] / jnp.where(pair, delta, 1.0), 0.0)
  vecs = vecs / _column_norm(vecs)[..., None, :]
  vecs = jnp.where(active[..., None, :], vecs, jnp.eye(n, dtype=dtype))
  return jnp.matmul(house, vecs, precision=HIGHEST)


# ---- step 2: the bisection, as jnp (reference) and as one Pallas kernel -----------------------
#
# Both evaluate f with the same operations in the same order (the shared helpers below), so that
# they give the same bits: the eigenvectors are functions of the roots' bits.


def _terms(d_j, z2_j, active_j, origin_d, shift):
  """``z_j^2 / (d_j - lambda_i)`` with ``d_j - lambda_i = (d_j - d_K) - s t`` (pole ``j`` on
  the pole axis of the inputs, root ``i`` on the last axis), zero for inactive poles."""
  delta = (d_j - origin_d) - shift
  return jnp.where(active_j, z2_j / jnp.where(active_j, delta, 1.0), 0.0)


def _pole_sum(terms, padded: int):
  """Sum over the pole axis (-2) of ``terms`` as a pairwise tree: halves ``x[:h] + x[h:]`` of
  the axis padded with zeros to ``padded`` (a power of two), down to one row.

  A fixed order, unlike ``jnp.sum``'s (XLA's, or Triton's in a kernel): the kernel sums its
  zero-padded block with this tree (``lax.split`` in halves, which Triton lowers), the
  reference its unpadded rows with the same tree, where additions of padding are left out.
  Adding a zero returns the other operand as a real number (a zero result's sign aside, which
  no later addition of a nonzero number sees), so both give the same bits."""
  rows = terms.shape[-2]
  while padded > 1:
    h = padded // 2
    if rows == padded:  # no padding left: halve the block (the kernel's case)
      top, bottom = jax.lax.split(terms, (h, h), axis=terms.ndim - 2)
      terms = top + bottom
    elif rows > h:  # rows h..rows-1 meet rows 0..rows-h-1; the others meet padding
      pairs = terms[..., : rows - h, :] + terms[..., h:rows, :]
      terms = jnp.concatenate([pairs, terms[..., rows - h : h, :]], -2)
    rows, padded = min(rows, h), h
  return jnp.squeeze(terms, -2)  # a reshape, as Triton lowers it (no slicing of registers)


def _secular(d_j, z2_j, active_j, inv_rho, origin_d, shift):
  """``f(d_K + s t) = 1/rho + sum_j z_j^2 / (d_j - lambda)`` for every root: the poles'
  operands ``(..., poles, 1)``, the roots' ``origin_d = d_K`` and ``shift = s t`` ``(..., n)``."""
  terms = _terms(d_j, z2_j, active_j, origin_d[..., None, :], shift[..., None, :])
  return inv_rho + _pole_sum(terms, _padded(d_j.shape[-2]))


def _bisect_step(lo, hi, floor, sign, f_of_t, dtype):
  """One step of the bisection on the bits of ``t``: ``f(d_K + s t)`` increases along
  ``s t``, so the root is above ``t`` where ``s f < 0``. ``hi >= lo >= 0``: the halving is a
  shift."""
  mid = jnp.maximum(lo + ((hi - lo) >> 1), floor)
  t = jax.lax.bitcast_convert_type(mid, dtype)
  below = sign * f_of_t(sign * t) < 0
  return jnp.where(below, mid, lo), jnp.where(below, hi, mid)


def _steps(dtype) -> int:
  """Bisection steps: each halves the floats of the bracket, 31 (63 in float64) reach
  adjacent floats from ``[0, finfo.max]``."""
  return jnp.finfo(dtype).bits - 1


def _padded(n: int) -> int:
  """Roots and poles of the kernel's block: a power of two >= 16 (Triton's block sizes)."""
  return max(16, 1 << max(0, n - 1).bit_length())


def _bits_dtype(dtype):
  return jnp.int32 if jnp.dtype(dtype) == jnp.float32 else jnp.int64


def _floor_bits(dtype) -> np.integer:
  """The bits of the smallest normal number (a constant of the bits' dtype). Shifts stay at
  or above it: XLA flushes subnormals to zero, and a zero shift would put the root on its pole
  (a division by zero in the eigenvectors). The eigenvalue error this allows is at most that
  number."""
  return np.asarray(jnp.finfo(dtype).tiny, dtype).view(_bits_dtype(dtype))[()]


def bisect_jnp(d, z2, active, origin_d, sign, inv_rho, lo, hi):
  """The bisection as a ``fori_loop`` of jnp expressions (the reference): the final ``hi``
  bits of ``t`` for every root.

  ``d, z2, active``: ``(..., n)`` poles (ascending), ``z_j^2`` (zero where inactive) and
  which are active; ``origin_d, sign``: ``(..., n)`` each root's origin ``d_K`` and ``s``;
  ``inv_rho``: ``(..., 1)``; ``lo, hi``: ``(..., n)`` brackets of the bits of ``t``.
  """
  dtype = d.dtype
  floor = _floor_bits(dtype)
  poles = (d[..., :, None], z2[..., :, None], active[..., :, None])

  def bisect(_, bracket):
    f = lambda shift: _secular(*poles, inv_rho, origin_d, shift)
    return _bisect_step(*bracket, floor, sign, f, dtype)

  # A loop, not unrolled: 31 (63) copies of the evaluation would multiply compile time.
  return jax.lax.fori_loop(0, _steps(dtype), bisect, (lo, hi))[1]


def _bisect_kernel(n: int, padded: int, dtype):
  """One program per batch entry: all roots (lanes of the block's last axis) and all poles
  (its first axis) of the ``(padded, padded)`` block of ``d_j - lambda_i``, every bisection
  step in registers. Padded poles are inactive (zero terms); padded roots are not stored."""
  floor = _floor_bits(dtype)

  def kernel(d_ref, z2_ref, active_ref, origin_ref, sign_ref, inv_rho_ref, lo_ref, hi_ref, out):
    lanes = jnp.arange(padded)
    real = lanes < n

    def load(ref, other):
      return plgpu.load(ref.at[pl.ds(0, padded)], mask=real, other=other)

    d, z2, active = load(d_ref, 0.0), load(z2_ref, 0.0), load(active_ref, 0) != 0
    origin_d, sign = load(origin_ref, 0.0), load(sign_ref, 1.0)
    inv_rho = inv_rho_ref[...]
    poles = (d[:, None], z2[:, None], active[:, None])

    def bisect(_, bracket):
      f = lambda shift: _secular(*poles, inv_rho, origin_d, shift)
      return _bisect_step(*bracket, floor, sign, f, dtype)

    bracket = (load(lo_ref, 0), load(hi_ref, floor))
    _, hi = jax.lax.fori_loop(0, _steps(dtype), bisect, bracket)
    plgpu.store(out.at[pl.ds(0, padded)], hi, mask=real)

  return kernel


def bisect_pallas(d, z2, active, origin_d, sign, inv_rho, lo, hi, *, interpret=False):
  """:func:`bisect_jnp` as one Pallas kernel (Triton on GPUs), the same bits.

  On a GPU the ``fori_loop`` of :func:`bisect_jnp` is three kernels a step, 93 launches a
  solve; here one program per batch entry runs all steps in registers, its ``(padded,
  padded)`` block of poles by roots (:func:`_padded`) summed with :func:`_pole_sum`'s tree.
  ``float32`` bits are ``int32``; ``float64`` (``int64`` bits) runs in interpret mode only.
  """
  dtype, n = d.dtype, d.shape[-1]
  lead = d.shape[:-1]
  padded = _padded(n)
  ibits = lo.dtype
  flat = lambda x: x.reshape((-1, n))
  rows = pl.BlockSpec((None, padded), lambda b: (b, 0))
  scalar = pl.BlockSpec((None,), lambda b: (b,))
  batch = int(np.prod(lead, dtype=np.int64))
  hi = pallas_passes.call(
    _bisect_kernel(n, padded, dtype),
    (batch,),
    [rows] * 5 + [scalar] + [rows] * 2,
    rows,
    jax.ShapeDtypeStruct((batch, n), ibits),
    interpret,
    "ginger_secular_bisect",
  )(
    flat(d),
    flat(z2),
    flat(active.astype(jnp.int32)),
    flat(origin_d),
    flat(sign),
    inv_rho.reshape((batch,)),
    flat(lo),
    flat(hi),
  )
  return hi.reshape(lead + (n,))


def _safe_max_abs(x: jax.Array) -> jax.Array:
  return jnp.maximum(jnp.max(jnp.abs(x), -1), jnp.finfo(x.dtype).tiny)


def _column_norm(v: jax.Array) -> jax.Array:
  """2-norms of the columns, scaled first so that squares neither overflow nor underflow."""
  scale = jnp.maximum(jnp.max(jnp.abs(v), -2), jnp.finfo(v.dtype).tiny)
  return scale * jnp.sqrt(jnp.sum(jnp.square(v / scale[..., None, :]), -2))
