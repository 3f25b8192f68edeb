"""Low-rank curvature algebra shared by Ginger and QNG.

A *block* is the unit that carries one curvature model. It is stored as a list of
*pieces*: 2-D arrays ``U_i`` of shape ``(n_i, k)`` whose row-concatenation is the block's
``U`` (``d x k``, ``d = sum n_i``). A per-tensor block has one piece (the flattened leaf);
the global block has one piece per leaf, so the full ``d``-vector is never concatenated.
Every function here takes the pieces of one block and matching lists of ``(n_i,)`` vectors.

The curvature model is ``G = gamma I + U diag(sigma) U^T`` with ``U^T U = I`` and
``sigma >= 0`` sorted descending; see ``docs``: ginger-math.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Pieces = Sequence[jax.Array]


def dot(xs: Pieces, ys: Pieces) -> jax.Array:
  """``sum_i <x_i, y_i>`` over the pieces of a block."""
  return sum(jnp.vdot(x, y) for x, y in zip(xs, ys, strict=True))


def project(us: Pieces, xs: Pieces) -> jax.Array:
  """``U^T x`` (a ``k``-vector) from pieces."""
  return sum(x @ u for u, x in zip(us, xs, strict=True))


def norm(xs: Pieces) -> jax.Array:
  """Overflow- and underflow-safe 2-norm of a block vector.

  Gradients of 1e20 have squares of 1e40, which overflow float32; scaling by the largest
  entry first keeps the sum of squares in range.
  """
  largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in xs]))
  scale = jnp.maximum(largest, jnp.finfo(xs[0].dtype).tiny)
  return scale * jnp.sqrt(sum(jnp.sum(jnp.square(x / scale)) for x in xs))


def init_basis(sizes: Sequence[int], rank: int, dtype) -> list[jax.Array]:
  """Orthonormal starting columns: the first ``rank`` coordinate vectors of the block.

  With ``sigma = 0`` they represent ``S = 0`` exactly; starting orthonormal (rather than
  from zeros) keeps ``U^T U = I`` true from step 0.
  """
  pieces, offset = [], 0
  for n in sizes:
    pieces.append(jnp.eye(n, rank, k=offset, dtype=dtype))
    offset += n
  return pieces


def brand_core(
    us: Pieces, sigma: jax.Array, vs: Pieces, alpha
) -> tuple[jax.Array, list[jax.Array], jax.Array]:
  """Builds the ``(k+1) x (k+1)`` matrix of Brand's rank-one eigen-update.

  ``alpha U diag(sigma) U^T + (1 - alpha) v v^T = [U p] C [U p]^T`` with
  ``c = U^T v``, ``p = (v - U c) / r``, ``r = ||v - U c||`` and::

      C = [[alpha diag(sigma) + (1-alpha) c c^T,  (1-alpha) r c],
           [(1-alpha) r c^T,                      (1-alpha) r^2]]

  ``p`` is orthogonalised twice (classical Gram-Schmidt with one re-orthogonalisation) so
  that it stays orthogonal to ``U`` in float32 even when ``v`` is almost in ``span U``. When
  ``r <= eps ||v||`` (``v`` already in the span, or zero) ``p = 0`` and the last diagonal
  entry of ``C`` is set to -1: ``e_{k+1}`` is then an exact eigenvector that sorts last and
  is dropped, so the kept eigenvectors never mix the zero vector ``p`` into ``U'`` (which
  would otherwise happen among tied zero eigenvalues and break ``U^T U = I``).

  Everything is computed in units of ``s^2`` with ``s = max(||v||, sqrt(max sigma))`` so
  that neither ``c c^T`` nor ``r^2`` overflows for huge vectors. Returns ``(C / s^2, p, s)``.

  Returns:
    ``(core, ps, s)``: the scaled core, the unit-norm pieces of ``p`` and the scale ``s``.
  """
  dtype = sigma.dtype
  c = project(us, vs)
  ps = [v - u @ c for u, v in zip(us, vs, strict=True)]
  c2 = project(us, ps)
  ps = [p - u @ c2 for u, p in zip(us, ps, strict=True)]
  c = c + c2
  r = norm(ps)
  v_norm = norm(vs)
  in_span = r <= 32 * jnp.finfo(dtype).eps * v_norm
  r = jnp.where(in_span, 0.0, r).astype(dtype)
  safe_r = jnp.where(in_span, 1.0, r)
  ps = [jnp.where(in_span, 0.0, p / safe_r) for p in ps]

  tiny = jnp.finfo(dtype).tiny
  s = jnp.maximum(jnp.maximum(v_norm, jnp.sqrt(jnp.max(sigma, initial=0.0))), jnp.sqrt(tiny))
  cs, rs = c / s, r / s
  beta = 1.0 - alpha
  top = alpha * jnp.diag(sigma / s / s) + beta * jnp.outer(cs, cs)
  col = beta * rs * cs
  corner = jnp.where(in_span, -1.0, beta * rs * rs)
  core = jnp.block([[top, col[:, None]], [col[None, :], corner[None, None]]])
  return core.astype(dtype), ps, s


def sorted_eigh(core: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric eigendecomposition with eigenvalues sorted descending (batched over leading
  axes). ``eigh`` returns ascending order, so both outputs are flipped."""
  w, v = jnp.linalg.eigh(core, symmetrize_input=True)
  return w[..., ::-1], v[..., ::-1]


def rotate(us: Pieces, ps: Pieces, vecs: jax.Array) -> list[jax.Array]:
  """``U' = [U p] V[:, :k]`` without concatenating ``[U p]``."""
  k = us[0].shape[-1]
  top, bottom = vecs[:k, :k], vecs[k, :k]
  return [u @ top + p[:, None] * bottom[None, :] for u, p in zip(us, ps, strict=True)]


def rescale_sigma(w: jax.Array, s: jax.Array, rank: int) -> jax.Array:
  """Top ``rank`` eigenvalues back in the original units, clipped to ``[0, finfo.max]``.

  Clipping at zero removes the tiny negative eigenvalues roundoff leaves on a PSD matrix;
  clipping at ``finfo.max`` keeps huge curvature finite (it then acts as "infinite").
  """
  big = jnp.finfo(w.dtype).max
  return jnp.clip(w[:rank] * s * s, 0.0, big)


def precondition(us: Pieces, sigma: jax.Array, gs: Pieces, gamma) -> list[jax.Array]:
  """``(gamma I + U diag(sigma) U^T)^{-1} g`` by the stable split of Woodbury.

  ``G^{-1} g = (g - U U^T g) / gamma + U diag(1/(gamma+sigma)) U^T g
            = (g - U diag(sigma/(gamma+sigma)) U^T g) / gamma``;
  the weights ``sigma/(gamma+sigma)`` lie in ``[0, 1]``, so nothing is formed that can
  cancel catastrophically for large ``sigma/gamma`` (unlike the inverse-space form).
  """
  y = project(us, gs)
  weight = sigma / (gamma + sigma)
  return [(g - u @ (weight * y)) / gamma for u, g in zip(us, gs, strict=True)]


def reorthonormalise(us: Pieces, sigma: jax.Array) -> tuple[list[jax.Array], jax.Array]:
  """Restores ``U^T U = I`` while keeping ``S = U diag(sigma) U^T`` unchanged.

  Cholesky-QR over the pieces (``U = Q R``, ``R = L^T`` from ``U^T U = L L^T``), then the
  small ``R diag(sigma) R^T`` is re-diagonalised so that ``sigma`` stays sorted.
  Valid while ``U`` is close to orthonormal, which is when this is called.
  """
  gram = sum(u.T @ u for u in us)
  chol = jnp.linalg.cholesky(gram)
  rinv_t = jax.scipy.linalg.solve_triangular(chol, jnp.eye(chol.shape[0], dtype=chol.dtype),
                                             lower=True).T
  qs = [u @ rinv_t for u in us]
  small = chol.T @ (sigma[:, None] * chol)
  w, vecs = sorted_eigh(small)
  return [q @ vecs for q in qs], jnp.maximum(w, 0.0)


def orthonormality_error(us: Pieces) -> jax.Array:
  """``max |U^T U - I|``: how far the stored basis has drifted."""
  gram = sum(u.T @ u for u in us)
  return jnp.max(jnp.abs(gram - jnp.eye(gram.shape[0], dtype=gram.dtype)))
