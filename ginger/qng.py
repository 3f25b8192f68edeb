"""QNG (He et al., 2022) in the product form the Ginger paper describes (its Section 2.2).

``G_t = A_{t+1} A_{t+1}^T`` with ``A_{t+1} = A_t K_t``, ``A_1 = I`` and::

    K_t = sqrt(alpha) I + beta_t q_t q_t^T,   q_t = A_t^{-1} d_t,
    beta_t = (sqrt(alpha + (1 - alpha)||q_t||^2) - sqrt(alpha)) / ||q_t||^2,

so that ``A_{t+1} A_{t+1}^T = alpha G_{t-1} + (1 - alpha) d_t d_t^T`` exactly (``G_0 = I``).
Only the last ``tau`` factors are kept (older ones are dropped, i.e. replaced by ``I``), so
the result is exact while ``tau >= t``. ``G^{-1} g = A^{-T} A^{-1} g`` applies each
``K^{-1}`` by Sherman-Morrison in O(d), O(d tau) in all.

Each factor is stored as a unit vector ``qhat = q / ||q||`` and ``kappa = 1 - sqrt(alpha)/a``
with ``a = sqrt(alpha + (1 - alpha)||q||^2)``, because then
``K^{-1} x = (x - kappa qhat qhat^T x) / sqrt(alpha)``: no ``||q||^2`` is ever formed, so
huge or tiny ``d_t`` neither overflow nor divide by zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from ginger import _common, lowrank


class ScaleByQNGState(NamedTuple):
  """State of :func:`scale_by_qng`.

  Attributes:
    count: number of factors taken so far (int32); slot ``count % tau`` is written next.
    qhat: pytree like the params; each leaf ``(leaf.size, tau)``: unit factor directions.
    kappa: ``(num_blocks, tau)`` Sherman-Morrison weights (0 for an empty slot).
    scale: ``(num_blocks, tau)``: ``1/sqrt(alpha)`` for a filled slot, 1 for an empty one.
  """

  count: chex.Array
  qhat: Any
  kappa: chex.Array
  scale: chex.Array


def scale_by_qng(
  tau: int,
  alpha: float = 0.99,
  block: str = "global",
  *,
  state_dtype: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  """Preconditions updates by QNG's product-form curvature ``G = A A^T``.

  Same interface as :func:`ginger.scale_by_ginger`: ``fisher_grads`` (``d_t``) is folded
  in first, then ``G_t^{-1} updates`` is returned; ``fisher_grads=None`` uses the updates
  (empirical Fisher). No damping: ``G_0 = I`` plays that role.

  Args:
    tau: number of rank-one factors kept (Python int >= 1).
    alpha: EMA decay in (0, 1).
    block: ``"global"`` (default; as in He et al. and the authors' code) or
      ``"per_tensor"`` (one product per leaf).
    state_dtype: dtype of the stored factors.
  """
  tau = _common.check_tau(tau)
  _common.check_alpha(alpha)
  _common.check_block(block)
  state_dtype = _common.check_dtype(state_dtype)

  def init_fn(params):
    vectors, treedef = _common.flat_vectors(params, state_dtype)
    qhat = jax.tree.unflatten(treedef, [jnp.zeros((v.size, tau), state_dtype) for v in vectors])
    n_blocks = len(_common.blocks_of(len(vectors), block))
    return ScaleByQNGState(
      count=jnp.zeros([], jnp.int32),
      qhat=qhat,
      kappa=jnp.zeros((n_blocks, tau), state_dtype),
      scale=jnp.ones((n_blocks, tau), state_dtype),
    )

  def update_fn(updates, state, params=None, *, fisher_grads=None, **extra_args):
    del params, extra_args
    gs, _ = _common.flat_vectors(updates, state_dtype)
    vs = _common.fisher_vectors(updates, fisher_grads, state_dtype)
    qs, q_def = jax.tree.flatten(state.qhat)
    blocks = _common.blocks_of(len(gs), block)
    # Chronological slot order, oldest first: empty slots (identity) come first.
    order = (state.count + jnp.arange(tau)) % tau
    slot = state.count % tau

    q_blocks = [[qs[i] for i in idx] for idx in blocks]
    new_q, new_kappa, new_scale = [], [], []
    for b, (idx, q_pieces) in enumerate(zip(blocks, q_blocks, strict=True)):
      # q_t = A_t^{-1} d_t: apply K_j^{-1} oldest first.
      q = _apply_inverse([vs[i] for i in idx], q_pieces, state.kappa[b], state.scale[b], order)
      n = lowrank.norm(q)
      safe_n = jnp.where(n > 0, n, 1.0)
      sqrt_a = jnp.sqrt(jnp.asarray(alpha, state_dtype))
      a = jnp.hypot(sqrt_a, jnp.sqrt(1.0 - jnp.asarray(alpha, state_dtype)) * n)
      # kappa = 1 - sqrt(alpha)/a, written without cancellation for small ||q||.
      kappa = ((1.0 - alpha) * n / a) * (n / (a + sqrt_a))
      qhat = [jnp.where(n > 0, p / safe_n, 0.0) for p in q]
      new_q.append([piece.at[:, slot].set(h) for piece, h in zip(q_pieces, qhat, strict=True)])
      new_kappa.append(state.kappa[b].at[slot].set(kappa.astype(state_dtype)))
      new_scale.append(state.scale[b].at[slot].set(1.0 / sqrt_a))
    kappa = jnp.stack(new_kappa) if new_kappa else state.kappa
    scale = jnp.stack(new_scale) if new_scale else state.scale
    count = optax.safe_increment(state.count)
    order = (count + jnp.arange(tau)) % tau

    out = [None] * len(gs)
    q_flat = [None] * len(gs)
    for b, (idx, q_pieces) in enumerate(zip(blocks, new_q, strict=True)):
      # G^{-1} g = A^{-T} (A^{-1} g): oldest-first inverse, then newest-first inverse.
      x = _apply_inverse([gs[i] for i in idx], q_pieces, kappa[b], scale[b], order)
      x = _apply_inverse(x, q_pieces, kappa[b], scale[b], order[::-1])
      for i, piece, y in zip(idx, q_pieces, x, strict=True):
        q_flat[i], out[i] = piece, y
    new_state = ScaleByQNGState(
      count=count, qhat=jax.tree.unflatten(q_def, q_flat), kappa=kappa, scale=scale
    )
    return _common.unflatten_like(out, updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _apply_inverse(xs, q_pieces, kappa, scale, order):
  """Applies ``K_j^{-1} x = scale_j (x - kappa_j qhat_j qhat_j^T x)`` for j in ``order``."""

  def body(j, xs):
    slot = order[j]
    cols = [q[:, slot] for q in q_pieces]
    coef = kappa[slot] * lowrank.dot(cols, xs)
    return [scale[slot] * (x - coef * c) for x, c in zip(xs, cols, strict=True)]

  return jax.lax.fori_loop(0, order.shape[0], body, list(xs))


def qng(
  learning_rate: optax.ScalarOrSchedule,
  tau: int = 8,
  alpha: float = 0.99,
  b1: float = 0.9,
  block: str = "global",
  *,
  state_dtype: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  """QNG composed like :func:`ginger.ginger` (bias-corrected momentum -> curvature update ->
  precondition -> ``-lr``), so the two differ only in the curvature model."""
  return _common.default_fisher_to_gradient(
    optax.chain(
      optax.ema(b1, debias=True),
      scale_by_qng(tau, alpha, block, state_dtype=state_dtype),
      optax.scale_by_learning_rate(learning_rate),
    )
  )
