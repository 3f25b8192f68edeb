"""QNG (He et al., 2022) in the product form the Ginger paper describes (its Section 2.2).

``G_t = A_{t+1} A_{t+1}^T`` with ``A_{t+1} = A_t K_t``, ``A_1 = I`` and::

    K_t = sqrt(alpha) I + beta_t q_t q_t^T,   q_t = A_t^{-1} d_t,
    beta_t = (sqrt(alpha + (1 - alpha)||q_t||^2) - sqrt(alpha)) / ||q_t||^2,

so that ``A_{t+1} A_{t+1}^T = alpha G_{t-1} + (1 - alpha) d_t d_t^T`` exactly (``G_0 = I``).
Only the last ``tau`` factors are kept (older ones are dropped, i.e. replaced by ``I``), so
the result is exact while ``tau >= t``.

The ``tau`` inverse factors are applied at once, in the compact WY form (Schreiber and Van
Loan 1989) rather than as a chain of ``tau`` rank-one updates: with ``H_j = I - kappa_j qhat_j
qhat_j^T`` (below), ``A^{-1} = c H_newest ... H_oldest = c (I - Q T Q^T)`` with ``c`` the
product of the factors' ``1/sqrt(alpha)`` and ``T`` a small triangular matrix from
``Q^T Q``, so ``G^{-1} g = A^{-T} A^{-1} g = c^2 (g - Q (T + T^T - T^T Q^T Q T) Q^T g)``. A
step reads ``Q`` for ``Q^T Q`` and ``Q^T [d g]``, forms and writes ``q_t``, and reads ``Q``
once more for ``Q (M Q^T g)``: tall-skinny products plus ``tau x tau`` algebra; the new
factor's row of ``Q^T Q`` comes from the first sums, with no further pass.

Each factor is stored as a unit vector ``qhat = q / ||q||`` and ``kappa = 1 - sqrt(alpha)/a``
with ``a = sqrt(alpha + (1 - alpha)||q||^2)``, because then
``K^{-1} x = (x - kappa qhat qhat^T x) / sqrt(alpha)``: no ``||q||^2`` is ever formed, so
huge or tiny ``d_t`` neither overflow nor divide by zero.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from ginger._src import common, lowrank

HIGHEST = jax.lax.Precision.HIGHEST


class ScaleByQNGState(NamedTuple):
  """State of :func:`scale_by_qng`.

  Attributes:
    count: number of factors taken so far (int32); slot ``count % tau`` is written next.
    qhat: pytree like the params; each leaf ``(leaf.size, tau)``: unit factor directions.
    kappa: ``(num_blocks, tau)`` Sherman-Morrison weights (0 for an empty slot).
    scale: ``(num_blocks, tau)``: ``1/sqrt(alpha)`` for a filled slot, 1 for an empty one.
    skipped: factors not taken because ``d_t`` had a NaN or Inf entry (int32): such a step
      keeps ``count``, ``qhat``, ``kappa`` and ``scale`` as they were.
  """

  count: chex.Array
  qhat: Any
  kappa: chex.Array
  scale: chex.Array
  skipped: Any = None


def scale_by_qng(
  tau: int,
  alpha: float = 0.99,
  block: str = "global",
  *,
  state_dtype: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  r"""Preconditions updates by QNG's product-form curvature ``G = A A^T``.

  Same interface as :func:`ginger.scale_by_ginger`: ``update(updates, state, params=None, *,
  fisher_grads=d_t)`` folds ``d_t`` in first, then returns ``G_t^{-1} updates``; with
  ``fisher_grads=None`` the updates themselves are folded in (the empirical Fisher). Each
  block keeps the last ``tau`` factors of ``A_{t+1} = A_t K_t``, ``A_1 = I``::

    K_t = sqrt(alpha) I + beta_t q_t q_t^T,   q_t = A_t^{-1} d_t
    A_{t+1} A_{t+1}^T = alpha G_{t-1} + (1 - alpha) d_t d_t^T,   G_0 = I

  exact while ``tau`` factors hold every step taken (older factors are replaced by ``I``).
  ``G^{-1} g = A^{-T} A^{-1} g`` is applied in the compact WY form, ``O(d tau)`` a step. No
  damping: ``G_0 = I`` plays that role.

  Args:
    tau: number of rank-one factors kept, a Python int >= 1.
    alpha: EMA decay of the curvature, in (0, 1).
    block: ``"global"`` (one product, as He et al. and the authors) or ``"per_tensor"``.
    state_dtype: dtype name of the stored factors.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Examples:
    One step with ``d_t = g``: ``G = alpha I + (1 - alpha) g g^T``, so
    ``G^{-1} g = g / (alpha + (1 - alpha) ||g||^2)``, here ``1 / (0.5 + 0.5 * 4) = 0.4``.

    >>> import jax, jax.numpy as jnp
    >>> import ginger
    >>> tx = ginger.scale_by_qng(tau=2, alpha=0.5)
    >>> g = {"w": jnp.ones(4)}
    >>> updates, _ = jax.jit(tx.update)(g, tx.init(g), fisher_grads=g)
    >>> print(f"{float(updates['w'][0]):.4f}")
    0.4000

  References:
    He et al., `QNG: A Quasi-Natural Gradient Method for Large-Scale Statistical Learning`,
    SIAM Journal on Optimization, 2022

    Yongchang Hao, Yanshuai Cao and Lili Mou, `Ginger: An Efficient Curvature Approximation
    with Linear Complexity for General Neural Networks <https://arxiv.org/abs/2402.03295>`_,
    2024 (Section 2.2)
  """
  tau = common.check_tau(tau)
  common.check_alpha(alpha)
  common.check_block(block)
  state_dtype = common.check_dtype(state_dtype)
  init_fn = functools.partial(init_qng_state, tau=tau, block=block, state_dtype=state_dtype)

  def update_fn(updates, state, params=None, *, fisher_grads=None, **extra_args):
    del params, extra_args
    return update_qng_state(updates, state, fisher_grads, tau, alpha, block, state_dtype)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def init_qng_state(params, *, tau: int, block: str, state_dtype) -> ScaleByQNGState:
  """``A_1 = I``: every slot empty (``qhat = 0``, ``kappa = 0``, ``scale = 1``), count 0."""
  common.check_float_params(params)
  vectors, treedef = common.flat_vectors(params, state_dtype)
  qhat = jax.tree.unflatten(treedef, [jnp.zeros((v.size, tau), state_dtype) for v in vectors])
  n_blocks = len(common.blocks_of(len(vectors), block))
  return ScaleByQNGState(
    count=jnp.zeros([], jnp.int32),
    qhat=qhat,
    kappa=jnp.zeros((n_blocks, tau), state_dtype),
    scale=jnp.ones((n_blocks, tau), state_dtype),
    skipped=jnp.zeros([], jnp.int32),
  )


def update_qng_state(updates, state, fisher_grads, tau, alpha, block, state_dtype):
  """One step of :func:`scale_by_qng`: per block, the new factor ``K_t`` from ``d_t``
  (:func:`_new_factor`), then ``G_t^{-1} g`` (:func:`_precondition`); ``(G_t^{-1} g, new
  state)``. The factor goes into slot ``count % tau``, over the oldest one."""
  gs, _ = common.flat_vectors(updates, state_dtype)
  vs = common.fisher_vectors(updates, fisher_grads, state_dtype)
  # A NaN or Inf in d_t alone (optax.apply_if_finite checks only g) would enter the factors
  # for good: such a d_t enters as zero (a factor sqrt(alpha) I) and the state is kept.
  finite = common.all_finite(vs)
  vs = common.zero_unless(finite, vs)
  qs, q_def = jax.tree.flatten(state.qhat)
  slot = state.count % tau
  count = optax.safe_increment(state.count)
  sqrt_a = jnp.sqrt(jnp.asarray(alpha, state_dtype))
  out, q_flat = [None] * len(gs), [None] * len(gs)
  new_kappa, new_scale = [], []
  for b, idx in enumerate(common.blocks_of(len(gs), block)):
    pieces, g, v = [qs[i] for i in idx], [gs[i] for i in idx], [vs[i] for i in idx]
    factors = _Factors(pieces, state.kappa[b], state.scale[b])
    # Pass 1 (reads Q): Q^T Q, Q^T d, Q^T g.
    gram, q_d, q_g = _project(pieces, v, g)
    factors, gram, q_g = _new_factor(
      factors, gram, q_d, q_g, v, g, state.count, slot, alpha, sqrt_a, state_dtype
    )
    for i, p, x in zip(idx, factors.qhat, _precondition(factors, gram, q_g, g, count), strict=True):
      q_flat[i], out[i] = p, x
    new_kappa.append(factors.kappa)
    new_scale.append(factors.scale)
  new_state = ScaleByQNGState(
    count=count,
    qhat=jax.tree.unflatten(q_def, q_flat),
    kappa=jnp.stack(new_kappa) if new_kappa else state.kappa,
    scale=jnp.stack(new_scale) if new_scale else state.scale,
  )
  kept = common.keep_unless(finite, new_state[:4], state[:4])
  new_state = ScaleByQNGState(*kept, skipped=state.skipped + (~finite).astype(jnp.int32))
  return common.unflatten_like(out, updates), new_state


class _Factors(NamedTuple):
  """One block's ``tau`` factors ``H_j = I - kappa_j qhat_j qhat_j^T``: ``qhat`` as the
  block's row pieces ``(leaf.size, tau)``, ``kappa`` and ``scale`` (``1/sqrt(alpha)`` per
  filled slot) ``(tau,)``."""

  qhat: list
  kappa: jax.Array
  scale: jax.Array


def _new_factor(factors, gram, q_d, q_g, v, g, old_count, slot, alpha, sqrt_a, state_dtype):
  """``K_t`` from ``d_t = v`` written into ``slot``: ``q_t = A_t^{-1} d_t = c (d - Q T Q^T d)``
  (pass 2, with the factors before it: ``old_count`` of them), ``qhat = q_t / ||q_t||`` and
  ``kappa = 1 - sqrt(alpha) / a``, ``a = sqrt(alpha + (1 - alpha) ||q_t||^2``. Returns the
  new factors and ``Q^T Q``, ``Q^T g`` with the new factor's row and entry, both from pass 1's
  sums: ``Q^T q_t = c (Q^T d - (Q^T Q) T Q^T d)``, no extra pass over ``Q``."""
  pieces, kappa, scale = factors
  tau = kappa.shape[0]
  t_old = _wy_factor(gram, kappa, _newest_first(old_count, tau))
  coef = lowrank.small_matvec(t_old, q_d)
  c_old = jnp.prod(scale)
  q = [c_old * (x - _cols(p, coef)) for x, p in zip(v, pieces, strict=True)]
  n = lowrank.norm(q)
  safe_n = jnp.where(n > 0, n, 1.0)
  a = jnp.hypot(sqrt_a, jnp.sqrt(1.0 - jnp.asarray(alpha, state_dtype)) * n)
  # kappa = 1 - sqrt(alpha)/a, written without cancellation for small ||q||.
  kappa_t = (((1.0 - alpha) * n / a) * (n / (a + sqrt_a))).astype(state_dtype)
  qhat = [jnp.where(n > 0, x / safe_n, 0.0) for x in q]
  pieces = [p.at[:, slot].set(h) for p, h in zip(pieces, qhat, strict=True)]
  q_q = jnp.where(n > 0, c_old * (q_d - lowrank.small_matvec(gram, coef)) / safe_n, 0.0)
  q_q = q_q.at[slot].set(jnp.where(n > 0, 1.0, 0.0))
  gram = gram.at[slot, :].set(q_q).at[:, slot].set(q_q)
  q_g = q_g.at[slot].set(lowrank.dot(qhat, g))
  kappa = kappa.at[slot].set(kappa_t)
  scale = scale.at[slot].set(1.0 / sqrt_a)
  return _Factors(pieces, kappa, scale), gram, q_g


def _precondition(factors, gram, q_g, g, count) -> list:
  """``G^{-1} g = A^{-T} A^{-1} g = c^2 (g - Q (T + T^T - T^T Q^T Q T) Q^T g)`` (pass 3) with
  the ``count`` factors taken, ``T`` their compact WY factor (:func:`_wy_factor`) and ``c``
  the product of their scales; per row piece of the block."""
  pieces, kappa, scale = factors
  t_new = _wy_factor(gram, kappa, _newest_first(count, kappa.shape[0]))
  inner = t_new + t_new.T - _mm(t_new.T, _mm(gram, t_new))
  coef = lowrank.small_matvec(inner, q_g)
  c_new = jnp.prod(scale)
  return [c_new * c_new * (x - _cols(p, coef)) for p, x in zip(pieces, g, strict=True)]


def _project(pieces, v, g):
  """``Q^T Q``, ``Q^T v`` and ``Q^T g`` of a block given as row pieces (two dots reading
  ``Q``; one dot over ``[Q v g]`` would first copy ``Q`` to concatenate it)."""
  gram = sum(lowrank.gram(p) for p in pieces)
  sums = sum(lowrank.row_sums(p, [x, y]) for p, x, y in zip(pieces, v, g, strict=True))
  return gram, sums[:, 0], sums[:, 1]


def _cols(q: jax.Array, coef: jax.Array) -> jax.Array:
  """``Q coef``, a matrix-vector dot at full float32 precision (one op per piece: ``k``
  multiply-adds per piece, as Ginger writes them for fusion, multiply compile time)."""
  return jnp.einsum("nk,k->n", q, coef, precision=HIGHEST)


def _mm(a, b):
  return jnp.matmul(a, b, precision=HIGHEST)


def _newest_first(count, tau: int) -> jax.Array:
  """Slots from the newest factor to the oldest when ``count`` factors have been taken."""
  return (count - 1 - jnp.arange(tau)) % tau


def _wy_factor(gram, kappa, order):
  """``T`` (in slot coordinates) with ``H_1 H_2 ... H_m = I - Q T Q^T`` for the factors
  ``H_j = I - kappa_j qhat_j qhat_j^T`` taken in ``order`` (newest first).

  The compact WY representation (Schreiber and Van Loan 1989): in the order of the product,
  ``T^{-1} = diag(1/kappa) + triu(Q^T Q, 1)``, upper triangular. An empty slot (``kappa = 0``,
  ``qhat = 0``) gets ``1/kappa := 1``: its column of ``Q`` is zero, so its ``T`` entries
  multiply nothing.
  """
  perm = (order[:, None] == jnp.arange(order.shape[0])[None, :]).astype(gram.dtype)
  gram_o, kappa_o = _mm(perm, _mm(gram, perm.T)), _mm(perm, kappa[:, None])[:, 0]
  inv_k = jnp.where(kappa_o > 0, 1.0 / jnp.where(kappa_o > 0, kappa_o, 1.0), 1.0)
  t_inv = jnp.diag(inv_k) + jnp.triu(gram_o, 1)
  eye = jnp.eye(order.shape[0], dtype=gram.dtype)
  t = jax.scipy.linalg.solve_triangular(t_inv, eye, lower=False)
  return _mm(perm.T, _mm(t, perm))


def qng(
  learning_rate: optax.ScalarOrSchedule,
  tau: int = 8,
  alpha: float = 0.99,
  b1: float = 0.9,
  block: str = "global",
  rho: float | None = None,
  *,
  state_dtype: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  r"""The QNG optimizer, composed as :func:`ginger.ginger` composes Ginger.

  The two differ only in the curvature model::

    m_t = b1 m_{t-1} + (1 - b1) g_t
    u_t = G_t^{-1} m_t / (1 - b1^t), clipped element-wise to [-rho, rho] if rho is set
    params <- params - lr_t u_t

  ``G_t`` is :func:`scale_by_qng`'s, updated first with ``fisher_grads`` (``d_t``); without
  it the raw gradient is used (the empirical Fisher).

  Args:
    learning_rate: a scalar or an optax schedule.
    tau: number of rank-one factors kept (:func:`scale_by_qng`).
    alpha: EMA decay of the curvature, in (0, 1).
    b1: decay of the bias-corrected momentum (``optax.ema``), in [0, 1).
    block: ``"global"`` or ``"per_tensor"`` (:func:`scale_by_qng`).
    rho: if set, the bound of the element-wise clip of ``u_t`` (He et al. do not clip; ``rho=1``
      with ``block="per_tensor"`` is the variant Ginger's authors run Ginger in).
    state_dtype: dtype name of the stored factors.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; its ``update`` takes ``fisher_grads``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import ginger
    >>> params = {"w": jnp.zeros(3)}
    >>> grads = {"w": jnp.array([0.5, 2.0, -3.0])}
    >>> for rho in (None, 1.0):  # rho = 1 bounds every entry by lr = 0.1
    ...   tx = ginger.qng(learning_rate=0.1, tau=2, rho=rho)
    ...   updates, _ = tx.update(grads, tx.init(params), params, fisher_grads=grads)
    ...   print(" ".join(f"{float(u):+.4f}" for u in updates["w"]))
    -0.0445 -0.1782 +0.2673
    -0.0445 -0.1000 +0.1000

  References:
    As :func:`scale_by_qng`.
  """
  common.check_b1(b1)
  common.check_rho(rho)
  return common.default_fisher_to_gradient(
    common.updates_in_their_dtype(
      optax.chain(
        # The momentum in the state's dtype, as Ginger's (for bf16 params too); the updates
        # come back in the params' dtype (below).
        optax.ema(b1, debias=True, accumulator_dtype=state_dtype),
        scale_by_qng(tau, alpha, block, state_dtype=state_dtype),
        optax.clip(rho) if rho is not None else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
      )
    )
  )
