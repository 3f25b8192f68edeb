"""Low-rank curvature algebra shared by Ginger and QNG.

Ginger's bases are stored *stacked*: an array ``u`` of shape ``(m, n, k)`` holds ``m`` blocks,
each an ``n x k`` matrix ``U`` with orthonormal columns (zero rows past a block's size are
padding and stay zero); vectors of those blocks are ``(m, n)`` and per-block small quantities
``(m, ...)``. The curvature model of a block is ``G = gamma I + U diag(sigma) U^T`` with
``sigma >= 0`` sorted descending; see docs/ginger-math.md.

One Brand eigen-update plus preconditioning is written as three passes over ``U``
(:func:`project_pair`, :func:`residual_sums`, :func:`rotate_and_precondition`): two reads and
one read-and-write. Everything else works on ``(k+1) x (k+1)`` matrices. The row-wise
products are written as ``k`` multiply-adds (:func:`rowdot`, :func:`rowmatmul`) instead of
dots so that XLA can fuse them into the pass that needs them, and so that no float32 product
of ``U`` runs in TF32 on GPUs (a dot's default precision there), which would break
``U^T U = I``. XLA does not fuse all of it on a GPU, so Ginger's step runs these passes
through :mod:`ginger._src.kernels`, which holds the same formulas (``passes="jnp"``) next to fused
Pallas kernels (``passes="pallas"``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ginger._src import secular

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


# ---- the three passes over U ------------------------------------------------------------------


def row_sums(u: jax.Array, xs: Sequence[jax.Array]) -> jax.Array:
  """``U^T [x_1 ... x_j]`` per block: ``(..., n, k), j x (..., n) -> (..., k, j)``.

  A dot at full float32 precision (``HIGHEST``: a default float32 dot may run in TF32 on
  GPUs). On a GPU it runs about as fast as a fused two-stage reduction over the rows, and on
  CPUs several times faster.
  """
  return jnp.einsum("...nk,...nj->...kj", u, jnp.stack(xs, -1), precision=HIGHEST)


def project_pair(u: jax.Array, v: jax.Array, g: jax.Array):
  """Pass 1 (reads ``U``): ``U^T v``, ``U^T g`` and ``l1 = sum |v|`` per block.

  ``l1`` is the scale of the next pass: ``|v_i| <= l1``, so squares of ``v / l1`` neither
  overflow nor all underflow.
  """
  cy = row_sums(u, [v, g])
  return cy[..., 0], cy[..., 1], jnp.sum(jnp.abs(v), axis=-1)


def first_residual(u: jax.Array, v: jax.Array, a: jax.Array, inv_l1: jax.Array) -> jax.Array:
  """``p1 = (v - U a) / l1``: the classical Gram-Schmidt residual, in units of ``l1``.

  Passes 2 and 3 both use this same expression (one value after XLA's CSE), so both see the
  same rounded ``p1``; that is what lets pass 2 measure, and pass 3 remove, ``p1``'s rounding
  error along ``U``.
  """
  return (v - rowdot(u, a)) * inv_l1[..., None]


def residual_sums(u, v, g, a, inv_l1):
  """Pass 2 (reads ``U``): ``U^T p1``, ``||p1||^2``, ``p1 . g`` and ``||v / l1||^2``.

  ``U^T p1`` is the re-orthogonalisation coefficient of CGS2 (classical Gram-Schmidt with one
  re-orthogonalisation): ``p = p1 - U (U^T p1)`` is orthogonal to ``U`` to working precision
  even when ``v`` lies almost in ``span U``, and ``||p||^2 = ||p1||^2 - ||U^T p1||^2``.
  """
  p1 = first_residual(u, v, a, inv_l1)
  vs = v * inv_l1[..., None]
  return (
    row_sums(u, [p1])[..., 0],
    jnp.sum(p1 * p1, -1),
    jnp.sum(p1 * g, -1),
    jnp.sum(vs * vs, -1),
  )


def rotate_and_precondition(u, v, g, a1, inv_l1, a2, inv_r, rot, b, z, gamma):
  """Pass 3 (reads ``U``, writes ``U'``): the rotated basis and ``G'^{-1} g``.

  ``p = (p1 - U a2) / r`` (zero when ``inv_r = 0``), ``U' = U rot + p b^T`` and
  ``G'^{-1} g = (g - U' z) / gamma`` with ``z = diag(sigma'/(gamma+sigma')) U'^T g``, which
  the caller forms from pass 1's ``U^T g`` without reading ``U'`` again.
  """
  p = (first_residual(u, v, a1, inv_l1) - rowdot(u, a2)) * inv_r[..., None]
  u_new = rowmatmul(u, rot) + p[..., None] * b[..., None, :]
  out = (g - jnp.sum(u_new * z[..., None, :], axis=-1)) / gamma
  return u_new, out


def precondition(u, sigma, g, gamma):
  """``G^{-1} g = (g - U diag(sigma / (gamma + sigma)) U^T g) / gamma`` with ``U`` as it is
  (a step without a curvature update): two reads of ``U``."""
  z = sigma / (gamma + sigma) * row_sums(u, [g])[..., 0]
  return (g - rowdot(u, z)) / gamma


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
