"""Reading and saving an optimizer state that holds Ginger's.

:func:`curvature_spectrum` and :func:`kappa_eps` read the curvature eigenvalues ``sigma`` of
every block (for logs, and for the accuracy bound of docs/ginger-math.md, section 6);
:func:`checkpoint_state` and :func:`restore_checkpoint_state` save the bucket-stacked state in
a layout that depends only on the params, ``tau`` and ``block``, not on how the buckets were
planned. All of them take any optimizer state and find the Ginger states in it at any depth.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ginger._src.ginger_transform import ScaleByGingerState
from ginger._src.stacked import StackedBasis, StackedSigma, _Stacked


def curvature_spectrum(opt_state) -> dict[str, jax.Array]:
  """The curvature eigenvalues ``sigma`` (descending) of every Ginger block in ``opt_state``.

  ``opt_state`` is any optimizer state that contains :class:`ScaleByGingerState` s, at any
  depth (:func:`ginger`, ``optax.chain``, ``optax.inject_hyperparams``, ``optax.masked``...).
  Keys are parameter paths (``jax.tree_util.keystr``, e.g. ``"['conv1']['kernel']"``) for
  ``block="per_tensor"`` and ``"global"`` for ``block="global"`` (or params that are one
  array, where both are one block); with several Ginger states
  (e.g. under ``optax.multi_transform``) each key is prefixed by the state's index,
  ``"0:['w']"``. Empty when there is no Ginger state. Pure: usable under ``jax.jit``.
  """
  states = [
    s
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByGingerState))
    if isinstance(s, ScaleByGingerState)
  ]
  out = {}
  for n, state in enumerate(states):
    prefix = f"{n}:" if len(states) > 1 else ""
    sigmas = state.sigma.tree() if isinstance(state.sigma, StackedSigma) else state.sigma
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(sigmas)):
      out[prefix + "global"] = sigmas  # one block (also per-tensor over one array)
    else:
      for path, sigma in jax.tree_util.tree_leaves_with_path(sigmas):
        out[prefix + jax.tree_util.keystr(path)] = sigma
  return out


def kappa_eps(opt_state, gamma: float) -> dict[str, Any]:
  """``kappa eps = sigma_max * eps / gamma`` of every Ginger block in ``opt_state``: its
  curvature-to-damping ratio ``kappa`` times the machine epsilon ``eps`` of the state's dtype.

  Below 1, the direction computed from a state of that dtype is within its error bound
  (docs/ginger-math.md, section 6); above 1 the bound's term ``eps theta kappa`` (``theta``: the
  part of the gradient outside ``span U`` when the step starts) exceeds 1, and a gradient far
  from ``span U`` can get a direction of no accuracy. The remedies: a larger ``gamma`` (at least
  ``sigma_max * eps``) or a wider ``state_dtype``. Keys as :func:`curvature_spectrum`'s; a block
  with no curvature yet (``sigma = 0``) gives 0. ``gamma`` is the one the state was updated with
  (the state does not keep it). Pure: usable under ``jax.jit``, and on a state fetched to the
  host (numpy in, numpy out).
  """
  out = {}
  for key, sigma in curvature_spectrum(opt_state).items():
    if not np.size(sigma):
      continue
    eps = float(jnp.finfo(sigma.dtype).eps)
    out[key] = sigma.max() * (eps / gamma)
  return out


def _is_stacked(x) -> bool:
  return isinstance(x, StackedBasis | StackedSigma)


def checkpoint_state(opt_state):
  """``opt_state`` in a saving layout that does not depend on how Ginger buckets its bases.

  Ginger's bases live stacked in buckets (:class:`StackedBasis`) planned for speed from a
  tuning (``Tuning.bucket_overhead``, :mod:`ginger._src.tuning`); saved as they are, a
  checkpoint would fit only the plan it was written with. Here every basis becomes its per-leaf view
  ``u.tree()`` (a pytree like the params of ``(leaf.size, rank)`` arrays; for
  ``block="global"`` each leaf's rows of the one block), Ginger's momentum
  (:class:`StackedRows`) its ``(leaf.size,)`` vectors and the per-tensor ``sigma``
  (:class:`StackedSigma`) its ``(rank,)`` vectors, which depend only on the params' shapes,
  ``tau`` and ``block``. Everything else is returned as is, so this can be applied
  to any optimizer state (or a whole training state) before saving::

      save(checkpoint_state(state))
      state = restore_checkpoint_state(restore(like=checkpoint_state(like)), like)

  The per-leaf view of device arrays is a copy of ``U`` (made only when saving); of host
  (numpy) stacks it is made of views, which is how the training loop saves without a device
  copy (``training/checkpoints.py``).
  """
  return jax.tree.map(lambda x: x.tree() if _is_stacked(x) else x, opt_state, is_leaf=_is_stacked)


def restore_checkpoint_state(saved, like):
  """Inverse of :func:`checkpoint_state`: ``saved`` back in the stacked layout of ``like``
  (a freshly initialised state of the same optimizer, whatever its bucketing). Raises
  ``ValueError`` where a saved basis, momentum or ``sigma`` does not fit ``like`` (a state of
  other params, ``tau`` or ``block``), naming it."""

  def restack(path, template, value):
    if not _is_stacked(template):
      return value
    if type(value) is type(template) and value.layout == template.layout:
      return value  # stacked in the template's plan already: as it is, no copy
    if _is_stacked(value):  # stacked otherwise: only one plan fits the template's shapes
      value = value.tree()
    _check_fits(jax.tree_util.keystr(path), template, value)
    # One program: op by op, every leaf's padding, concatenation and stacking would compile
    # and dispatch programs of their own (hundreds for a ResNet: seconds at every resume).
    return jax.jit(type(template).from_tree, static_argnums=1)(value, template.layout)

  return jax.tree_util.tree_map_with_path(restack, like, saved, is_leaf=_is_stacked)


def _check_fits(name: str, template: _Stacked, tree) -> None:
  """``tree`` (per leaf, as :func:`checkpoint_state` saves it) has ``template``'s leaves."""
  layout = template.layout
  why = "a checkpoint of other params, tau or block"
  if jax.tree.structure(tree) != layout.treedef:
    raise ValueError(
      f"{name}: saved for params structured {jax.tree.structure(tree)}, this optimizer's "
      f"state for {layout.treedef} ({why})."
    )
  # The template's own per-leaf view, as shapes (its stacks may be abstract).
  view = jax.eval_shape(lambda stacks: type(template)(stacks, layout).tree(), template.stacks)
  for (where, leaf), like in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(view), strict=True
  ):
    expected = tuple(like.shape)
    if tuple(jnp.shape(leaf)) != expected:
      raise ValueError(
        f"{name}{jax.tree_util.keystr(where)}: saved {tuple(jnp.shape(leaf))}, this "
        f"optimizer's state has {expected} ({why})."
      )
