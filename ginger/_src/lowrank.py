"""Low-rank curvature algebra shared by Ginger and QNG.

Ginger's bases are stored *stacked*: an array ``u`` of shape ``(m, n, k)`` holds ``m`` blocks,
each an ``n x k`` matrix ``U`` with orthonormal columns (zero rows past a block's size are
padding and stay zero); vectors of those blocks are ``(m, n)`` and per-block small quantities
``(m, ...)``. The curvature model of a block is ``G = gamma I + U diag(sigma) U^T`` with
``sigma >= 0`` sorted descending; see docs/ginger-math.md.

One Brand eigen-update plus preconditioning is written as three passes over ``U``
(:func:`project_pair`, :func:`residual_sums`, :func:`rotate_from_residual`): two reads and one
read-and-write. Everything else works on ``(k+1) x (k+1)`` matrices. The passes here are the
reference (``passes="jnp"``, and the CPU path); :mod:`ginger._src.pallas_passes` writes each
as one fused Pallas kernel (``passes="pallas"``), and :mod:`ginger._src.kernels` checks the
operands and runs one or the other. The row-wise products are written as ``k`` multiply-adds
(:func:`rowdot`, :func:`rowmatmul`) instead of dots so that XLA can fuse them into the pass
that needs them, and so that no float32 product of ``U`` runs in TF32 on GPUs (a dot's default
precision there), which would break ``U^T U = I``.

Pass 3 is row-local: every row of ``U'`` and of its output depends only on the same row of
``U`` and the vectors. :func:`rotate_in_row_blocks` uses that to rotate a large ``U`` in place,
block of rows by block of rows (the jnp path on GPUs, :class:`ginger._src.tuning.Tuning`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ginger._src import secular
from ginger._src.tuning import DEFAULT, Tuning

Pieces = Sequence[jax.Array]
HIGHEST = jax.lax.Precision.HIGHEST


def dot(xs: Pieces, ys: Pieces) -> jax.Array:
  """``sum_i <x_i, y_i>`` over the pieces of a block."""
  return sum(jnp.vdot(x, y) for x, y in zip(xs, ys, strict=True))


def norm(xs: Pieces) -> jax.Array:
  """Overflow- and underflow-safe 2-norm of a block vector given as pieces.

  Gradients of 1e20 have squares of 1e40, which overflow float32; scaling by the largest
  entry first keeps the sum of squares in range. Pieces without entries (a leaf of size 0)
  add nothing; a block of none has norm 0.
  """
  dtype = xs[0].dtype
  xs = [x for x in xs if x.size]
  if not xs:
    return jnp.zeros([], dtype)
  largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in xs]))
  scale = jnp.maximum(largest, jnp.finfo(xs[0].dtype).tiny)
  return scale * jnp.sqrt(sum(jnp.sum(jnp.square(x / scale)) for x in xs))


# ---- row-wise products (elementwise, fusible) -------------------------------------------------


def rowdot(u: jax.Array, a: jax.Array) -> jax.Array:
  """``U a`` for stacked blocks: ``(..., n, k), (..., k) -> (..., n)``, as k multiply-adds."""
  out = jnp.zeros(u.shape[:-1], u.dtype)
  for j in range(u.shape[-1]):
    out = out + u[..., j] * a[..., None, j]
  return out


def rowmatmul(u: jax.Array, mat: jax.Array) -> jax.Array:
  """``U M`` for stacked blocks: ``(..., n, k), (..., k, l) -> (..., n, l)``, as multiply-adds."""
  out = jnp.zeros(u.shape[:-1] + mat.shape[-1:], u.dtype)
  for j in range(u.shape[-1]):
    out = out + u[..., j, None] * mat[..., None, j, :]
  return out


def small_matvec(mat: jax.Array, x: jax.Array, transpose: bool = False) -> jax.Array:
  """``M x`` (or ``M^T x``) batched over leading axes, in full float32/64 precision."""
  return jnp.einsum(
    "...ji,...j->...i" if transpose else "...ij,...j->...i", mat, x, precision=HIGHEST
  )


def row_sums(u: jax.Array, xs: Sequence[jax.Array]) -> jax.Array:
  """``U^T [x_1 ... x_j]`` per block: ``(..., n, k), j x (..., n) -> (..., k, j)``.

  A dot at full float32 precision (``HIGHEST``: a default float32 dot may run in TF32 on
  GPUs). On a GPU it runs about as fast as a fused two-stage reduction over the rows, and on
  CPUs several times faster.
  """
  return jnp.einsum("...nk,...nj->...kj", u, jnp.stack(xs, -1), precision=HIGHEST)


# ---- the same products as the backend runs them fastest ---------------------------------------
#
# Off GPUs a few products of the passes are written as dots where XLA:CPU's fusion of the plain
# formula is slow: the same values up to summation order.


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def backend_row_sums(u: jax.Array, xs: Sequence[jax.Array]) -> jax.Array:
  """:func:`row_sums` on GPUs; elsewhere one vector-matrix product ``x_i^T U`` each: XLA:CPU runs
  the ``(k, n) x (n, j)`` product at about half the speed of ``j`` such products, although each
  is one more read of ``U``."""
  if on_gpu():
    return row_sums(u, xs)
  return jnp.stack([jnp.einsum("...n,...nk->...k", x, u, precision=HIGHEST) for x in xs], -1)


def matvec(u: jax.Array, a: jax.Array) -> jax.Array:
  """``U a`` of a residual: ``k`` multiply-adds (:func:`rowdot`) on GPUs; elsewhere one
  matrix-vector product. XLA:CPU fuses the multiply-adds into every consumer of ``p1`` and
  computes it twice, once for the stored ``p1`` and the row sums and once for the operand of
  ``U^T p1`` (a reshape of it), each a read of ``U``; as a product ``U`` is read once and only
  ``(v - U a) inv_l1``, two vectors, is computed twice."""
  if on_gpu():
    return rowdot(u, a)
  return jnp.einsum("...nk,...k->...n", u, a, precision=HIGHEST)


def vdot_rows(x: jax.Array, y: jax.Array) -> jax.Array:
  """``x . y`` over the last axis: a reduction of the product on GPUs; elsewhere a dot, which
  runs near copy bandwidth where XLA:CPU turns the reduction into a far slower YNNPACK
  reduce."""
  if on_gpu():
    return jnp.sum(x * y, -1)
  return jnp.einsum("...n,...n->...", x, y, precision=HIGHEST)


# ---- the passes over U ------------------------------------------------------------------------


def first_residual(u: jax.Array, v: jax.Array, a: jax.Array, inv_l1: jax.Array) -> jax.Array:
  """``p1 = (v - U a) / l1``: the classical Gram-Schmidt residual, in units of ``l1``.

  Passes 2 and 3 both use this same expression (one value after XLA's CSE), so both see the
  same rounded ``p1``; that is what lets pass 2 measure, and pass 3 remove, ``p1``'s rounding
  error along ``U``.
  """
  return (v - matvec(u, a)) * inv_l1[..., None]


def second_residual(u: jax.Array, g: jax.Array, y: jax.Array) -> jax.Array:
  """``q1 = g - U y``: one expression for :func:`residual_sums` and :func:`residual`."""
  return g - matvec(u, y)


def project_pair(u: jax.Array, v: jax.Array, g: jax.Array):
  """Pass 1 (reads ``U``): ``U^T v``, ``U^T g`` and ``l1 = sum |v|`` per block.

  ``l1`` is the scale of the next pass: ``|v_i| <= l1``, so squares of ``v / l1`` neither
  overflow nor all underflow.
  """
  cy = backend_row_sums(u, [v, g])
  return cy[..., 0], cy[..., 1], jnp.sum(jnp.abs(v), axis=-1)


def residual_sums(u, v, g, a, inv_l1, ay, with_p1: bool = False):
  """Pass 2 (reads ``U``): with ``p1 = (v - U a) / l1`` and ``q1 = g - U ay``, returns
  ``(U^T p1, ||p1||^2, p1 . q1, ||v / l1||^2, U^T q1)`` (and ``p1, q1`` with ``with_p1``).

  ``U^T p1`` is the re-orthogonalisation coefficient of CGS2 (classical Gram-Schmidt with one
  re-orthogonalisation): ``p = p1 - U (U^T p1)`` is orthogonal to ``U`` to working precision
  even when ``v`` lies almost in ``span U``, and ``||p||^2 = ||p1||^2 - ||U^T p1||^2``;
  ``U^T q1`` is the same for ``g``.
  """
  p1 = first_residual(u, v, a, inv_l1)
  q1 = second_residual(u, g, ay)
  vs = v * inv_l1[..., None]
  sums = backend_row_sums(u, [p1, q1])
  sums = (sums[..., 0], vdot_rows(p1, p1), vdot_rows(p1, q1), vdot_rows(vs, vs), sums[..., 1])
  return sums + (p1, q1) if with_p1 else sums


def residual(u, g, y):
  """Pass 2 for ``g`` alone: :func:`residual_sums`' ``U^T q1`` and ``q1``."""
  q1 = second_residual(u, g, y)
  return backend_row_sums(u, [q1])[..., 0], q1


def rotate_from_residual(u, p1, q, a2, inv_r, rot, b, a, beta, gamma, *, out_rowdot=True):
  """Pass 3 (reads ``U``, writes ``U'``): ``p = (p1 - U a2) / r`` (zero when ``inv_r = 0``),
  the rotated basis ``U' = U rot + p b^T`` and ``(q - U a - p beta) / gamma``.

  ``out_rowdot``: ``U a`` as ``k`` multiply-adds (:func:`rowdot`, as :func:`correct`), else as
  a reduction over the rank axis, which XLA:CPU turns into a YNNPACK reduce many times slower
  than the multiply-adds (the reduction is what the row blocks of a GPU use).
  """
  p = (p1 - rowdot(u, a2)) * inv_r[..., None]
  u_new = rowmatmul(u, rot) + p[..., None] * b[..., None, :]
  u_a = rowdot(u, a) if out_rowdot else jnp.sum(u * a[..., None, :], axis=-1)
  return u_new, (q - u_a - p * beta[..., None]) / gamma[..., None]


def rotate_and_precondition(u, v, q, a1, inv_l1, a2, inv_r, rot, b, a, beta, gamma, **kw):
  """:func:`rotate_from_residual` with ``p1 = (v - U a1) / l1`` recomputed from ``v``."""
  p1 = first_residual(u, v, a1, inv_l1)
  return rotate_from_residual(u, p1, q, a2, inv_r, rot, b, a, beta, gamma, **kw)


def correct(u, q, a, gamma):
  """``(q - U a) / gamma`` per block (one read of ``U``)."""
  return (q - rowdot(u, a)) / gamma[..., None]


# ---- pass 3 in row blocks, written in place ---------------------------------------------------


def row_block(shape, rows_per_block: int | None = None, tuning: Tuning = DEFAULT) -> int:
  """Rows per block of the rotation of a ``U`` of ``shape`` (``(..., n, k)``) in row blocks:
  all ``n`` (one block) up to ``tuning.row_block_elements`` elements, else ``n`` split into at
  most ``tuning.max_row_blocks`` blocks of about that many. ``rows_per_block`` overrides it."""
  n = shape[-2]
  if rows_per_block is not None:
    if (
      isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or rows_per_block < 1
    ):
      raise ValueError(f"rows_per_block must be an int >= 1 or None, got {rows_per_block!r}.")
    return min(rows_per_block, max(n, 1))
  total = math.prod(shape)
  blocks = min(tuning.max_row_blocks, -(-total // tuning.row_block_elements))
  return max(1, -(-n // max(blocks, 1)))


def rotate_in_row_blocks(
  u, p1, g, a2, inv_r, rot, b, z, beta, gamma, *, rows_per_block=None, row_shards=1, tuning=DEFAULT
):
  """:func:`rotate_from_residual` over blocks of rows, each written back into ``U``.

  ``row_shards``: the rows are split over this many devices (``U`` sharded along its rows).
  Then the row axis is viewed as ``(row_shards, n / row_shards)`` and the blocks step along
  the second, so that every device rotates blocks of its own rows: a block sliced out of the
  split axis itself would make XLA's partitioner all-gather ``U``, ``p1`` and ``g``. Where a
  device's rows fit in one block, that block is all of them: the rotation runs unblocked
  (row-local, as on one device with a ``U`` of that size), never in blocks of the whole axis.

  Every row of ``U'`` and of the output depends only on the same row of ``U``, ``p1`` and
  ``g`` (and the small operands), so applying the formula block by block computes each entry
  with the same operations as on the whole array. The blocks run in a ``fori_loop`` whose carry
  is ``U`` itself: XLA updates a loop-carried buffer in place, so the rotation keeps a block
  of ``U'`` (and the block's slice of ``U``) alive besides ``U``, with ``U`` donated not even a
  copy of ``U``; the rows past the last whole block are one more block after the loop.
  """
  n = u.shape[-2]
  if row_shards > 1 and n % row_shards == 0:
    rows = row_block(u.shape[:-2] + (n // row_shards,) + u.shape[-1:], rows_per_block, tuning)
    if rows >= n // row_shards:
      # One block per device. Blocks of the whole axis (below) would cut across the split,
      # and XLA would all-gather U, p1, g and the output to form them, where each device's
      # share fits in one block.
      return rotate_from_residual(u, p1, g, a2, inv_r, rot, b, z, beta, gamma, out_rowdot=False)
    split = u.ndim - 2
    view = lambda x: x.reshape(
      x.shape[:split] + (row_shards, n // row_shards) + x.shape[split + 1 :]
    )
    small = [jnp.expand_dims(x, split) for x in (a2, inv_r, rot, b, z, beta, gamma)]
    u_new, out = rotate_in_row_blocks(view(u), view(p1), view(g), *small, rows_per_block=rows)
    return u_new.reshape(u.shape), out.reshape(g.shape)
  rows = row_block(u.shape, rows_per_block, tuning)
  if rows >= n:
    return rotate_from_residual(u, p1, g, a2, inv_r, rot, b, z, beta, gamma, out_rowdot=False)
  row_axis = u.ndim - 2
  small = (a2, inv_r, rot, b, z, beta, gamma)

  def rotate(start, size, u, out):
    def rows_of(x, axis):
      return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    u_new, o = rotate_from_residual(
      rows_of(u, row_axis), rows_of(p1, row_axis), rows_of(g, row_axis), *small, out_rowdot=False
    )
    return (
      jax.lax.dynamic_update_slice_in_dim(u, u_new, start, row_axis),
      jax.lax.dynamic_update_slice_in_dim(out, o, start, row_axis),
    )

  whole = n // rows
  u, out = jax.lax.fori_loop(
    0, whole, lambda i, c: rotate(i * rows, rows, *c), (u, jnp.zeros(g.shape, g.dtype))
  )
  if whole * rows < n:
    u, out = rotate(whole * rows, n - whole * rows, u, out)
  return u, out


# ---- the (k+1) x (k+1) eigenproblem ----------------------------------------------------------


def brand_diag_rank_one(c, r, sigma, v_norm, in_span, alpha):
  """Brand's ``(k+1) x (k+1)`` matrix as a diagonal plus a rank-one matrix, in units of ``s^2``.

  ``alpha U diag(sigma) U^T + (1-alpha) v v^T = [U p] C [U p]^T`` with ``c = U^T v``,
  ``r = ||v - U c||``, ``p = (v - U c) / r`` and::

      C = diag(alpha sigma, 0) + (1 - alpha) w w^T,   w = [c; r],

  i.e. ``[[alpha diag(sigma) + (1-alpha) c c^T, (1-alpha) r c], [(1-alpha) r c^T,
  (1-alpha) r^2]]``. When ``v`` is in ``span U`` (``in_span``: ``p = 0``, ``r = 0``) the last
  diagonal entry is set to -1: ``e_{k+1}`` is then an exact eigenvector that sorts last and is
  dropped, so the kept eigenvectors never mix the zero vector ``p`` into ``U'`` (which would
  otherwise happen among tied zero eigenvalues and break ``U^T U = I``).
  ``s = max(||v||, sqrt(max sigma))`` keeps ``w w^T`` from overflowing.

  Returns ``(diagonal / s^2, w / s, 1 - alpha, s)``.
  """
  dtype = sigma.dtype
  s = jnp.maximum(
    jnp.maximum(v_norm, jnp.sqrt(jnp.max(sigma, axis=-1, initial=0.0))),
    jnp.sqrt(jnp.finfo(dtype).tiny),
  )
  diagonal = jnp.concatenate(
    [alpha * (sigma / s[..., None] / s[..., None]), jnp.where(in_span, -1.0, 0.0)[..., None]], -1
  )
  w = jnp.concatenate([c / s[..., None], (r / s)[..., None]], -1)
  return diagonal.astype(dtype), w.astype(dtype), jnp.asarray(1.0 - alpha, dtype), s


def brand_core(c, r, sigma, v_norm, in_span, alpha):
  """Brand's matrix ``C / s^2`` (see :func:`brand_diag_rank_one`) as a dense array, and ``s``."""
  diagonal, w, beta, s = brand_diag_rank_one(c, r, sigma, v_norm, in_span, alpha)
  core = diagonal[..., None] * jnp.eye(diagonal.shape[-1], dtype=diagonal.dtype)
  return core + beta * w[..., :, None] * w[..., None, :], s


def brand_eigh(
  c, r, sigma, v_norm, in_span, alpha, solver: str = "secular", *, impl="jnp", interpret=False
):
  """Eigenpairs of Brand's matrix in units of ``s^2``, descending: ``(w, vectors, s)``.

  ``"secular"``: the diagonal-plus-rank-one solver (:mod:`ginger._src.secular`), O(k^2), exact
  zeros for deflated entries, its bisection run by ``impl`` (``"jnp"`` or ``"pallas"``, the
  same bits; ``interpret``: the kernel interpreted); ``"dense"``: ``eigh`` of the formed
  matrix (the reference).
  """
  if solver == "dense":
    core, s = brand_core(c, r, sigma, v_norm, in_span, alpha)
    return *sorted_eigh(core), s
  diagonal, w, beta, s = brand_diag_rank_one(c, r, sigma, v_norm, in_span, alpha)
  return *secular.eigh_diag_plus_rank_one(diagonal, w, beta, impl=impl, interpret=interpret), s


def sorted_eigh(core: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric eigendecomposition with eigenvalues sorted descending (batched over leading
  axes). ``eigh`` returns ascending order, so both outputs are flipped."""
  w, v = jnp.linalg.eigh(core, symmetrize_input=True)
  return w[..., ::-1], v[..., ::-1]


def rescale_sigma(w: jax.Array, s: jax.Array, rank: int, max_rank: jax.Array) -> jax.Array:
  """Top ``rank`` eigenvalues back in the original units, clipped to ``[0, finfo.max]``, and
  exactly zero past ``max_rank`` (see :func:`keep_rank`).

  Clipping at zero removes the tiny negative eigenvalues roundoff leaves on a PSD matrix;
  clipping at ``finfo.max`` keeps huge curvature finite (it then acts as "infinite").
  """
  big = jnp.finfo(w.dtype).max
  return keep_rank(jnp.clip(w[..., :rank] * s[..., None] * s[..., None], 0.0, big), max_rank)


def keep_rank(w: jax.Array, max_rank: jax.Array) -> jax.Array:
  """Descending eigenvalues ``w`` with all past the first ``max_rank`` set to exactly zero.

  ``alpha S + (1 - alpha) v v^T`` has rank at most ``rank(S) + 1``, so all its eigenvalues
  past that are zero in exact arithmetic; a float32 ``eigh`` returns them as noise of about
  ``eps ||C||``. Kept, that noise is curvature of ``1e-7 sigma_max``, which exceeds ``gamma``
  once ``sigma_max / gamma > 1e7`` and then wrongly shrinks those directions (mostly while a
  block has seen fewer than ``tau`` vectors). The bound is exact bookkeeping, not a threshold:
  ``rank(S)`` is the number of nonzero ``sigma``, themselves exact zeros past their own bound.
  """
  return jnp.where(jnp.arange(w.shape[-1]) < max_rank[..., None], w, jnp.zeros_like(w))


def rank_after_update(sigma: jax.Array) -> jax.Array:
  """Upper bound of the rank of ``alpha U diag(sigma) U^T + (1 - alpha) v v^T``."""
  return jnp.sum(sigma > 0, axis=-1) + 1


# ---- orthonormality --------------------------------------------------------------------------


def init_basis(members: int, rows: int, rank: int, dtype) -> jax.Array:
  """Orthonormal starting columns of stacked blocks: each block's first ``rank`` coordinate
  vectors. With ``sigma = 0`` they represent ``S = 0`` exactly; starting orthonormal (rather
  than from zeros) keeps ``U^T U = I`` true from step 0."""
  return jnp.broadcast_to(jnp.eye(rows, rank, dtype=dtype), (members, rows, rank))


def gram(u: jax.Array, dtype=None) -> jax.Array:
  """``U^T U`` per block (one read of ``U``), accumulated and returned in ``dtype`` (default
  ``U``'s)."""
  return jnp.einsum("...nk,...nl->...kl", u, u, precision=HIGHEST, preferred_element_type=dtype)


def reorthonormalising_factor(gram_u: jax.Array, sigma: jax.Array):
  """``(Q, sigma')`` with ``U Q`` orthonormal and ``(U Q) diag(sigma') (U Q)^T = S``.

  Cholesky-QR: ``U^T U = L L^T`` gives the orthonormal ``U L^{-T}``; ``S`` is unchanged when
  the small ``L^T diag(sigma) L`` is re-diagonalised (``= W diag(sigma') W^T``), so
  ``Q = L^{-T} W``. Valid while ``U`` is close to orthonormal, which is when this is used.
  """
  chol = jnp.linalg.cholesky(gram_u)
  eye = jnp.broadcast_to(jnp.eye(chol.shape[-1], dtype=chol.dtype), chol.shape)
  linv_t = jnp.swapaxes(jax.scipy.linalg.solve_triangular(chol, eye, lower=True), -1, -2)
  small = jnp.einsum("...ji,...j,...jl->...il", chol, sigma, chol, precision=HIGHEST)
  w, vecs = sorted_eigh(small)
  # L^T diag(sigma) L has the rank of sigma: its other eigenvalues are exact zeros.
  w = keep_rank(jnp.maximum(w, 0.0), jnp.sum(sigma > 0, axis=-1))
  return jnp.matmul(linv_t, vecs, precision=HIGHEST), w


def orthonormality_error(pieces: Pieces) -> jax.Array:
  """``max |U^T U - I|`` over blocks.

  ``pieces`` are ``(..., rows, k)`` arrays whose Grams add up to the blocks' ``U^T U``:
  the row-pieces of one block, or one stacked ``(m, n, k)`` array of ``m`` blocks.
  """
  g = sum(gram(u) for u in pieces)
  return jnp.max(jnp.abs(g - jnp.eye(g.shape[-1], dtype=g.dtype)), initial=0.0)
