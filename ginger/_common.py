"""Argument checks and pytree plumbing shared by Ginger and QNG."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

BLOCKS = ("per_tensor", "global")


def _concrete(x) -> float | None:
  """The Python value of ``x``, or None while it is traced (e.g. under inject_hyperparams)."""
  if isinstance(x, jax.core.Tracer):
    return None
  return float(x)


def check_tau(tau) -> int:
  if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)):
    raise ValueError(
        f"tau must be a Python int >= 1 (the rank; it fixes array shapes, so under "
        f"optax.inject_hyperparams pass static_args=('tau',)), got {tau!r}.")
  tau = int(tau)
  if tau < 1:
    raise ValueError(f"tau must be >= 1 (the rank of the curvature model), got {tau}.")
  return tau


def check_alpha(alpha) -> None:
  value = _concrete(alpha)
  if value is not None and not 0.0 < value < 1.0:
    raise ValueError(f"alpha must lie in the open interval (0, 1) (the curvature EMA decay), "
                     f"got {value}.")


def check_gamma(gamma) -> None:
  value = _concrete(gamma)
  if value is not None and not (value > 0.0 and math.isfinite(value)):
    raise ValueError(f"gamma must be a finite number > 0 (the damping), got {value}.")


def check_block(block: str) -> str:
  if block not in BLOCKS:
    raise ValueError(f"block must be one of {BLOCKS}, got {block!r}.")
  return block


def check_dtype(name) -> jnp.dtype:
  """A floating dtype from its name (``"float32"``) or a dtype object."""
  try:
    dtype = jnp.dtype(name)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"state_dtype must name a floating dtype such as 'float32' or "
                     f"'float64', got {name!r}.")
  return dtype


def flat_vectors(tree, dtype) -> tuple[list[jax.Array], Any]:
  """Leaves of ``tree`` flattened to 1-D vectors in ``dtype`` (reshape is free under jit)."""
  leaves, treedef = jax.tree.flatten(tree)
  return [jnp.ravel(x).astype(dtype) for x in leaves], treedef


def unflatten_like(vectors, like_tree):
  """Inverse of :func:`flat_vectors`: reshape to ``like_tree``'s leaves and dtypes."""
  leaves, treedef = jax.tree.flatten(like_tree)
  out = [v.reshape(x.shape).astype(x.dtype) for v, x in zip(vectors, leaves, strict=True)]
  return jax.tree.unflatten(treedef, out)


def fisher_vectors(updates, fisher_grads, dtype) -> list[jax.Array]:
  """The curvature vector ``d_t`` as flat leaves; ``updates`` (empirical Fisher) if None."""
  if fisher_grads is None:
    return flat_vectors(updates, dtype)[0]
  want, got = jax.tree.structure(updates), jax.tree.structure(fisher_grads)
  if want != got:
    raise ValueError(
        "fisher_grads must have the same pytree structure as updates; got\n"
        f"  fisher_grads: {got}\n  updates:      {want}\n"
        "(under optax.masked, pass mask_compatible_extra_args=True so fisher_grads is masked "
        "like the updates).")
  mismatched = [
      (jax.tree_util.keystr(p), u.shape, f.shape)
      for (p, u), f in zip(jax.tree_util.tree_leaves_with_path(updates),
                           jax.tree.leaves(fisher_grads), strict=True)
      if u.shape != f.shape
  ]
  if mismatched:
    raise ValueError(f"fisher_grads leaf shapes differ from updates: {mismatched}")
  return flat_vectors(fisher_grads, dtype)[0]


def blocks_of(num_leaves: int, block: str) -> list[list[int]]:
  """Leaf indices of each block: one block per leaf, or one block holding all leaves."""
  if block == "global":
    return [list(range(num_leaves))] if num_leaves else []
  return [[i] for i in range(num_leaves)]


def default_fisher_to_gradient(
    tx: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
  """Feeds the raw gradient as ``fisher_grads`` when the caller gives none.

  Inside a chain, later stages see transformed updates (e.g. momentum), so the default
  must be captured here, at the entrance, to mean "the gradient" (empirical Fisher).
  """

  def update_fn(updates, state, params=None, *, fisher_grads=None, **extra_args):
    if fisher_grads is None:
      fisher_grads = updates
    return tx.update(updates, state, params, fisher_grads=fisher_grads, **extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)
