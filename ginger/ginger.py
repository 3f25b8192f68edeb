"""Ginger: a damped low-rank Gauss-Newton preconditioner as optax transformations.

The curvature model of each block is ``G = gamma I + U diag(sigma) U^T`` (``U`` is
``d x tau`` with orthonormal columns, ``sigma >= 0`` sorted descending). Every step first
folds the sampled-Fisher vector ``d_t`` into the curvature::

    S_t = top_tau( alpha S_{t-1} + (1 - alpha) d_t d_t^T ),     S_0 = 0

(Brand's rank-one eigen-update, O(d tau^2 + tau^3)), then returns ``G_t^{-1} g`` by the
stable split of the Woodbury identity (O(d tau)). See ginger-math.md for why this
sigma-space form, and not the paper's inverse-space algorithm, is the one implemented.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from ginger import _common, lowrank


class ScaleByGingerState(NamedTuple):
  """State of :func:`scale_by_ginger`.

  Attributes:
    count: number of curvature updates taken (int32).
    u: a pytree like the params; each leaf is that leaf's rows of ``U``,
      shape ``(leaf.size, k)`` with ``k = min(tau, block size)``.
    sigma: the eigenvalues ``sigma`` of each block: a pytree like the params of
      ``(k,)`` arrays for ``block="per_tensor"``, a single ``(k,)`` array for ``"global"``.
  """
  count: chex.Array
  u: Any
  sigma: Any


def scale_by_ginger(
    tau: int,
    alpha: float = 0.99,
    gamma: float = 1e-5,
    block: str = "per_tensor",
    *,
    state_dtype: str = "float32",
    reorthonormalise_every: int = 1000,
) -> optax.GradientTransformationExtraArgs:
  r"""Preconditions updates by Ginger's damped low-rank curvature model.

  ``update(updates, state, params=None, *, fisher_grads=None)`` first folds
  ``fisher_grads`` (the sampled-Fisher vector ``d_t``, a pytree like ``updates``; see
  :mod:`ginger.fisher`) into the curvature, then returns ``G_t^{-1} updates`` computed with
  the *updated* ``G_t``, as in the paper's Algorithm 1. With ``fisher_grads=None`` the
  updates themselves are used as ``d_t``: the *empirical* Fisher, a different method.

  Args:
    tau: rank of the curvature model (a Python int >= 1).
    alpha: EMA decay of the curvature, in (0, 1).
    gamma: damping (> 0); ``G^{-1}`` has largest eigenvalue ``1/gamma``.
    block: ``"per_tensor"`` keeps one ``(U, sigma)`` per leaf (the authors' code; leaves
      with ``size <= tau`` are modelled exactly with rank ``size``); ``"global"`` treats all
      leaves as one vector (the paper's text) without materialising a flat copy.
    state_dtype: dtype name of ``U`` and ``sigma`` (float32 by default, also for bf16
      params; a string so that ``optax.inject_hyperparams`` leaves it static).
      Updates are returned in the dtype of the incoming updates.
    reorthonormalise_every: every this many steps ``U`` is re-orthonormalised (Cholesky-QR,
      ``S`` unchanged) to remove float32 drift of ``U^T U`` over long runs.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.
  """
  tau = _common.check_tau(tau)
  _common.check_alpha(alpha)
  _common.check_gamma(gamma)
  _common.check_block(block)
  state_dtype = _common.check_dtype(state_dtype)
  if _common._concrete(reorthonormalise_every) is not None and reorthonormalise_every < 1:
    raise ValueError(f"reorthonormalise_every must be >= 1, got {reorthonormalise_every}.")

  def init_fn(params):
    vectors, treedef = _common.flat_vectors(params, state_dtype)
    sizes = [v.size for v in vectors]
    u_leaves: list[jax.Array] = [None] * len(vectors)  # type: ignore[list-item]
    sigmas = []
    for idx in _common.blocks_of(len(vectors), block):
      rank = min(tau, sum(sizes[i] for i in idx))
      for i, piece in zip(idx, lowrank.init_basis([sizes[i] for i in idx], rank, state_dtype),
                          strict=True):
        u_leaves[i] = piece
      sigmas.append(jnp.zeros((rank,), state_dtype))
    u = jax.tree.unflatten(treedef, u_leaves)
    sigma = jax.tree.unflatten(treedef, sigmas) if block == "per_tensor" else (
        sigmas[0] if sigmas else jnp.zeros((0,), state_dtype))
    return ScaleByGingerState(count=jnp.zeros([], jnp.int32), u=u, sigma=sigma)

  def update_fn(updates, state, params=None, *, fisher_grads=None, **extra_args):
    del params, extra_args
    gs, _ = _common.flat_vectors(updates, state_dtype)
    vs = _common.fisher_vectors(updates, fisher_grads, state_dtype)
    us, u_def = jax.tree.flatten(state.u)
    sigmas = _sigma_list(state.sigma, block)
    blocks = _common.blocks_of(len(gs), block)

    new_us, new_sigmas = curvature_update(
        [[us[i] for i in idx] for idx in blocks], sigmas,
        [[vs[i] for i in idx] for idx in blocks], alpha)
    count = optax.safe_increment(state.count)
    new_us, new_sigmas = jax.lax.cond(
        count % reorthonormalise_every == 0,
        lambda a: _reorthonormalise_all(*a),
        lambda a: a,
        (new_us, new_sigmas))

    out = [None] * len(gs)
    u_flat = [None] * len(gs)
    for idx, pieces, sigma in zip(blocks, new_us, new_sigmas, strict=True):
      pre = lowrank.precondition(pieces, sigma, [gs[i] for i in idx], gamma)
      for i, piece, g in zip(idx, pieces, pre, strict=True):
        u_flat[i], out[i] = piece, g
    new_state = ScaleByGingerState(
        count=count, u=jax.tree.unflatten(u_def, u_flat),
        sigma=_sigma_tree(new_sigmas, state.sigma, block))
    return _common.unflatten_like(out, updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def curvature_update(us_blocks, sigmas, vs_blocks, alpha):
  """Brand's eigen-update for every block, with one batched ``eigh`` per core size.

  Batching the ``(k+1) x (k+1)`` eigendecompositions turns one small-solver launch per
  parameter tensor into one per distinct rank (usually one), which matters on GPUs.
  """
  cores = [lowrank.brand_core(us, sigma, vs, alpha)
           for us, sigma, vs in zip(us_blocks, sigmas, vs_blocks, strict=True)]
  by_size = defaultdict(list)
  for b, (core, _, _) in enumerate(cores):
    by_size[core.shape[0]].append(b)
  eig: dict[int, tuple[jax.Array, jax.Array]] = {}
  for members in by_size.values():
    w, vecs = lowrank.sorted_eigh(jnp.stack([cores[b][0] for b in members]))
    for j, b in enumerate(members):
      eig[b] = (w[j], vecs[j])
  new_us, new_sigmas = [], []
  for b, (us, sigma) in enumerate(zip(us_blocks, sigmas, strict=True)):
    _, ps, s = cores[b]
    w, vecs = eig[b]
    new_us.append(lowrank.rotate(us, ps, vecs))
    new_sigmas.append(lowrank.rescale_sigma(w, s, sigma.shape[0]))
  return new_us, new_sigmas


def _reorthonormalise_all(us_blocks, sigmas):
  pairs = [lowrank.reorthonormalise(us, s) for us, s in zip(us_blocks, sigmas, strict=True)]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def _sigma_list(sigma, block) -> list[jax.Array]:
  if block == "per_tensor":
    return jax.tree.leaves(sigma)
  return [sigma] if sigma.shape[0] else []


def _sigma_tree(sigmas, like, block):
  if block == "per_tensor":
    return jax.tree.unflatten(jax.tree.structure(like), sigmas)
  return sigmas[0] if sigmas else like


def ginger(
    learning_rate: optax.ScalarOrSchedule,
    tau: int = 4,
    alpha: float = 0.99,
    gamma: float = 1e-5,
    b1: float = 0.9,
    rho: float | None = None,
    block: str = "per_tensor",
    *,
    state_dtype: str = "float32",
    reorthonormalise_every: int = 1000,
) -> optax.GradientTransformationExtraArgs:
  r"""The Ginger optimizer as the authors compose it.

  ``m_t = EMA_{b1}(g)`` with bias correction -> fold ``d_t`` into ``G_t`` ->
  ``u = G_t^{-1} m_t`` -> optional element-wise clip to ``[-rho, rho]`` -> ``-lr * u``.

  ``update(grads, state, params, *, fisher_grads=d_t)``: pass the sampled-Fisher vector
  (:func:`ginger.fisher.value_grad_and_fisher`); without it the raw gradient is used
  (empirical Fisher). Defaults: ``tau=4, gamma=1e-5, b1=0.9, alpha=0.99`` are the authors'
  and the paper's; the authors also clip with ``rho=1`` (off here by default: with
  ``rho=1`` most entries are clipped and the method approaches sign-momentum).

  Args:
    learning_rate: a scalar or an optax schedule.
    tau, alpha, gamma, block, state_dtype, reorthonormalise_every: see
      :func:`scale_by_ginger`.
    b1: momentum (EMA) decay of the gradient, bias-corrected.
    rho: if set, clip every update entry to ``[-rho, rho]`` before the learning rate.
  """
  if rho is not None and _common._concrete(rho) is not None and not float(rho) > 0:
    raise ValueError(f"rho must be > 0 or None (no clip), got {rho}.")
  return _common.default_fisher_to_gradient(optax.chain(
      optax.ema(b1, debias=True),
      scale_by_ginger(tau, alpha, gamma, block, state_dtype=state_dtype,
                      reorthonormalise_every=reorthonormalise_every),
      optax.clip(rho) if rho is not None else optax.identity(),
      optax.scale_by_learning_rate(learning_rate),
  ))
