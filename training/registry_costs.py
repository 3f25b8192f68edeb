"""The update FLOPs and state bytes that several registry entries share: an element-wise
method's (:func:`elementwise_flops`, :func:`moments_state_bytes`) and the state the library's
own transformation allocates (:func:`traced_state_bytes`). JAX is imported when called only.
"""

from __future__ import annotations

import math
from typing import Any

from training.registry_schema import StateBytes, get, keeps_curvature, update_flops


def leaf_sizes(params: Any) -> list[int]:
  """The number of entries of each leaf of ``params`` (arrays or shapes), in tree order."""
  import jax

  return [math.prod(leaf.shape) for leaf in jax.tree.leaves(params)]


def elementwise_flops(params: Any, opt: Any = None, **_: Any) -> float:
  """An element-wise update's FLOPs (momentum, Adam's moments, weight decay, the update):
  ``models.flops.ELEMENTWISE_FLOPS_PER_PARAM`` per parameter."""
  from models import flops

  return flops.ELEMENTWISE_FLOPS_PER_PARAM * sum(leaf_sizes(params))


def step_flops(
  opt: Any,
  params: Any,
  *,
  forward_flops: float,
  batch_size: int,
  fisher_forward: str | None,
  fisher_batch: int | None,
) -> float:
  """One training step's FLOPs: the passes (``models.flops.train_step_flops``: the loss
  gradient's, and for a curvature method its d-pass, in the mode ``fisher_forward`` names, on
  the batch's first ``fisher_batch`` examples or the whole batch where None) over a batch whose
  forward costs ``forward_flops``, plus the entry's update of ``params`` (arrays or shapes).

  With ``curvature_every`` K > 1 the mean over K steps: one with the d-pass and the curvature
  update, K - 1 with neither (they only precondition).
  """
  from models import flops

  curvature = keeps_curvature(opt.name)
  fraction = min(fisher_batch or batch_size, batch_size) / batch_size

  def step(update: bool) -> float:
    passes = flops.train_step_flops(
      forward_flops,
      fisher_forward=fisher_forward if curvature and update else None,
      fisher_fraction=fraction,
    )
    return passes + update_flops(opt, params, curvature_update=update)

  every = opt.curvature_every
  return step(True) if every == 1 else (step(True) + (every - 1) * step(False)) / every


def traced_state_bytes(params: Any, opt: Any) -> int:
  """The bytes of the state the entry's own transformation allocates for ``params``: its
  ``init`` traced with ``jax.eval_shape`` (shapes only, nothing allocated), as the library
  lays the state out (Ginger's buckets of equal-rank blocks, Muon's two branches)."""
  import jax
  import numpy as np

  tx = get(opt.name).build(opt, _constant_schedule, None)  # a schedule, as runs have: its count
  state = jax.eval_shape(tx.init, params)
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def _constant_schedule(step: Any) -> float:
  """A learning-rate schedule (a run's always is one: optax keeps its step count)."""
  del step
  return 1e-3


def moments_state_bytes(copies: int, counts: int = 0) -> StateBytes:
  """The state of an element-wise method: ``copies`` arrays like the parameters (momentum: 1,
  Adam: 2, mu and nu) and ``counts`` int32 step counters (the learning-rate schedule's, which
  every run has, and Adam's for its bias correction: 2)."""

  def state_bytes(params: Any, opt: Any = None) -> int:
    import jax
    import numpy as np

    leaves = jax.tree.leaves(params)
    per_copy = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    return copies * per_copy + 4 * counts

  return state_bytes
