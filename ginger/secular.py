"""Eigendecomposition of a diagonal plus a rank-one matrix, ``D + rho z z^T``, without ``eigh``.

Brand's core is of this form (see :func:`ginger.lowrank.brand_core`): in the basis ``[U p]``,
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
   scale of ``t``, from subnormal to ``finfo.max``.
3. *Eigenvectors.* With the computed roots, ``z`` is recomputed by Lowner's formula
   (Gu-Eisenstat), ``zhat_j^2 = prod_i (lambda_i - d_j) / (rho prod_{i != j} (d_i - d_j))``,
   which makes the eigenvectors ``(zhat_j / (d_j - lambda_i))_j`` (normalised) numerically
   orthogonal, the exact eigenvectors of a matrix within rounding of the given one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def eigh_diag_plus_rank_one(d: jax.Array, z: jax.Array, rho) -> tuple[jax.Array, jax.Array]:
  """Eigenpairs of ``diag(d) + rho z z^T`` (``rho > 0``), batched over leading axes.

  Args:
    d: ``(..., n)`` diagonal, any order.
    z: ``(..., n)`` rank-one vector (any scale; ``rho ||z||^2`` must be finite).
    rho: positive scalar or ``(...)`` array.

  Returns:
    ``(w, v)``: eigenvalues ``(..., n)`` sorted descending and the matching orthonormal
    eigenvectors as the columns of ``v`` ``(..., n, n)``, like ``eigh`` flipped.
  """
  dtype = d.dtype
  n = d.shape[-1]
  # Normalise z: rho ||z||^2 becomes rho, and z^2 never overflows.
  z_norm = jnp.sqrt(jnp.sum(jnp.square(z / _safe_max_abs(z)[..., None]), -1)) * _safe_max_abs(z)
  rho = jnp.asarray(rho, dtype) * jnp.square(z_norm)
  z = z / jnp.where(z_norm > 0, z_norm, 1.0)[..., None]
  # Poles nearer zero than this are zero (see the module docstring, step 1): beyond it two
  # distinct floats are at least four normal numbers apart, so every gap's middle is normal.
  finfo = jnp.finfo(dtype)
  scale = jnp.maximum(jnp.max(jnp.abs(d), -1), rho)
  snap = jnp.maximum(jnp.sqrt(finfo.tiny) * scale, 8 * finfo.tiny / finfo.eps)
  d = jnp.where(jnp.abs(d) < snap[..., None], 0.0, d).astype(dtype)

  # Ascending order; ``perm[j]`` is the input index of sorted entry j.
  perm = jnp.argsort(d, axis=-1, stable=True)
  d = jnp.take_along_axis(d, perm, -1)
  z = jnp.take_along_axis(z, perm, -1)

  # 1. Deflation: one Householder reflection per group of equal d, then tiny z to zero.
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
  tol = jnp.sqrt(finfo.tiny) * scale
  active = rho[..., None] * jnp.abs(z) > tol[..., None]
  z = jnp.where(active, z, 0.0)

  # 2. Roots. next_[i]: the next active pole above i; the top active root has none.
  index = jnp.arange(n)
  above = active[..., None, :] & (index[None, :] > index[:, None])
  has_next = jnp.any(above, -1)
  next_ = jnp.argmax(above, -1)
  d_next = jnp.take_along_axis(d, next_, -1)
  z2 = jnp.where(active, z * z, 0.0)
  half = jnp.where(has_next, 0.5 * (d_next - d), rho[..., None] * jnp.sum(z2, -1, keepdims=True))
  inv_rho = 1.0 / rho[..., None]

  def secular(origin_d, shift):
    """``f(origin_d + shift)`` for every root (column i), from accurate differences."""
    delta = (d[..., :, None] - origin_d[..., None, :]) - shift[..., None, :]
    terms = jnp.where(
      active[..., :, None], z2[..., :, None] / jnp.where(active[..., :, None], delta, 1.0), 0.0
    )
    return inv_rho + jnp.sum(terms, -2)

  # The nearer pole is the origin: the left one if f at the gap's middle is positive.
  left = ~has_next | (secular(d, half) > 0)
  origin = jnp.where(left, index, next_)
  origin_d = jnp.take_along_axis(d, origin, -1)
  sign = jnp.where(left, 1.0, -1.0).astype(dtype)
  ibits = jnp.int32 if dtype == jnp.float32 else jnp.int64
  # Shifts stay at or above the smallest normal number: XLA flushes subnormals to zero, and a
  # zero shift would put the root on its pole (a division by zero in the eigenvectors). The
  # eigenvalue error this allows is at most that number.
  floor = jax.lax.bitcast_convert_type(jnp.asarray(jnp.finfo(dtype).tiny, dtype), ibits)
  lo = jnp.zeros(half.shape, ibits)
  hi = jnp.maximum(jax.lax.bitcast_convert_type(jnp.maximum(half, 0.0).astype(dtype), ibits), floor)

  def bisect(_, bracket):
    lo, hi = bracket
    mid = jnp.maximum(lo + (hi - lo) // 2, floor)
    t = jax.lax.bitcast_convert_type(mid, dtype)
    below = sign * secular(origin_d, sign * t) < 0  # f increases along s t
    return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

  # A loop, not unrolled: 31 (63) copies of the evaluation would multiply compile time.
  lo, hi = jax.lax.fori_loop(0, jnp.finfo(dtype).bits - 1, bisect, (lo, hi))
  t = jax.lax.bitcast_convert_type(jnp.maximum(hi, floor), dtype)
  shift = sign * t
  w = jnp.where(active, origin_d + shift, d)

  # 3. Eigenvectors of the active part from Lowner's zhat.
  pair = active[..., :, None] & active[..., None, :]  # (j, i)
  delta = (d[..., :, None] - origin_d[..., None, :]) - shift[..., None, :]  # d_j - lambda_i
  lower = index[None, :] < index[:, None]  # i < j
  denominator = jnp.where(
    lower, d[..., None, :] - d[..., :, None], d_next[..., None, :] - d[..., :, None]
  )
  is_top = active & ~has_next
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
  vecs = jnp.matmul(house, vecs, precision=HIGHEST)

  # Back to the input's coordinates (rows), eigenvalues descending (columns).
  rows = jnp.argsort(perm, axis=-1)
  vecs = jnp.take_along_axis(vecs, rows[..., :, None], -2)
  order = jnp.argsort(-w, axis=-1, stable=True)
  w = jnp.take_along_axis(w, order, -1)
  vecs = jnp.take_along_axis(vecs, order[..., None, :], -1)
  return w, vecs


def _safe_max_abs(x: jax.Array) -> jax.Array:
  return jnp.maximum(jnp.max(jnp.abs(x), -1), jnp.finfo(x.dtype).tiny)


def _column_norm(v: jax.Array) -> jax.Array:
  """2-norms of the columns, scaled first so that squares neither overflow nor underflow."""
  scale = jnp.maximum(jnp.max(jnp.abs(v), -2), jnp.finfo(v.dtype).tiny)
  return scale * jnp.sqrt(jnp.sum(jnp.square(v / scale[..., None, :]), -2))
