"""Argument checks and pytree plumbing shared by Ginger and QNG."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ginger._src.tuning import DEFAULT, Tuning

BLOCKS = ("per_tensor", "global")
EIGENSOLVERS = ("secular", "dense")
# How the passes over U run (ginger._src.kernels): "auto" is "pallas" on GPUs, "jnp" elsewhere.
PASSES = ("jnp", "pallas", "auto")


def _concrete(x) -> float | None:
  """The Python value of ``x``, or None while it is traced (e.g. under inject_hyperparams)."""
  if isinstance(x, jax.core.Tracer):
    return None
  return float(x)


def check_tau(tau) -> int:
  if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)):
    raise ValueError(
      f"tau must be a Python int >= 1 (the rank; it fixes array shapes, so under "
      f"optax.inject_hyperparams pass static_args=('tau',)), got {tau!r}."
    )
  tau = int(tau)
  if tau < 1:
    raise ValueError(f"tau must be >= 1 (the rank of the curvature model), got {tau}.")
  return tau


def check_alpha(alpha) -> None:
  value = _concrete(alpha)
  if value is not None and not 0.0 < value < 1.0:
    raise ValueError(
      f"alpha must lie in the open interval (0, 1) (the curvature EMA decay), got {value}."
    )


def check_b1(b1) -> None:
  """The momentum's decay: ``b1 = 1`` never moves the average and its bias correction
  ``1 - b1^t`` is 0 (a NaN update); None (no momentum) passes."""
  value = None if b1 is None else _concrete(b1)
  if value is not None and not 0.0 <= value < 1.0:
    raise ValueError(f"b1 must lie in [0, 1) (the momentum), got {value}.")


def check_rho(rho) -> None:
  """The element-wise clip's bound: ``> 0``, or None for no clip."""
  value = None if rho is None else _concrete(rho)
  if value is not None and not value > 0.0:
    raise ValueError(f"rho must be > 0 or None (no clip), got {value}.")


def check_gamma(gamma) -> None:
  value = _concrete(gamma)
  if value is not None and not (value > 0.0 and math.isfinite(value)):
    raise ValueError(f"gamma must be a finite number > 0 (the damping), got {value}.")


def check_tuning(tuning) -> None:
  """The passes' and the bucket plan's knobs: a :class:`ginger._src.tuning.Tuning` (whose own
  fields are checked when it is made)."""
  if not isinstance(tuning, Tuning):
    raise ValueError(f"tuning must be a ginger.Tuning, got {tuning!r}.")


def check_block(block: str) -> str:
  if block not in BLOCKS:
    raise ValueError(f"block must be one of {BLOCKS}, got {block!r}.")
  return block


def check_every(name: str, value) -> int:
  """A step period that decides what is traced: a Python int >= 1, or None for 1 (None so
  that ``optax.inject_hyperparams`` leaves the default static)."""
  if value is None:
    return 1
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(
      f"{name} must be a Python int >= 1 or None (it fixes what a step computes, so under "
      f"optax.inject_hyperparams pass it in static_args), got {value!r}."
    )
  return int(value)


def check_eigensolver(name) -> str:
  if name not in EIGENSOLVERS:
    raise ValueError(f"eigensolver must be one of {EIGENSOLVERS}, got {name!r}.")
  return name


def check_passes(name) -> str:
  if not isinstance(name, str) or name not in PASSES:
    raise ValueError(
      f"passes must be one of {PASSES} (how the passes over U run: jnp = XLA's fusions, "
      f"pallas = fused Pallas kernels, auto = pallas on GPUs, jnp elsewhere), got {name!r}."
    )
  return name


def check_dtype(name) -> jnp.dtype:
  """A floating dtype from its name (``"float32"``) or a dtype object."""
  try:
    dtype = jnp.dtype(name)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"state_dtype must name a floating dtype such as 'float32' or 'float64', got {name!r}."
    )
  if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
    # JAX would make every array of the state float32 (warning only): a silent float32 state.
    raise ValueError(
      f"state_dtype={str(dtype)!r} needs JAX's 64-bit mode: set JAX_ENABLE_X64=1 (or "
      "jax.config.update('jax_enable_x64', True)) before making the optimizer, or use "
      "'float32'."
    )
  return dtype


@functools.cache
def params_placeholder_type() -> type:
  """The type of what ``optax.tree.map_params`` initialises a transformation with to find the
  params-shaped trees of its state, asked of optax through its public API (optax keeps the
  class itself private): the argument ``map_params`` passes an ``init`` it is given."""
  seen = []
  optax.tree.map_params(lambda placeholder: seen.append(type(placeholder)) or {}, lambda x: x, {})
  return seen[0]


def check_float_params(params) -> None:
  """Every leaf of ``params`` is a floating array: the curvature of an integer (or boolean)
  parameter means nothing, and its update could not come back in its dtype."""
  bad = [
    f"{jax.tree_util.keystr(path)} ({jnp.result_type(x)})"
    for path, x in jax.tree_util.tree_leaves_with_path(params)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating)
  ]
  if bad:
    raise ValueError(
      f"params must be floating-point arrays; not so: {', '.join(bad)}. Keep integer leaves "
      "out of the optimizer (optax.masked, or a partition of the params)."
    )


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
      "like the updates)."
    )
  mismatched = [
    (jax.tree_util.keystr(p), u.shape, f.shape)
    for (p, u), f in zip(
      jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(fisher_grads), strict=True
    )
    if u.shape != f.shape
  ]
  if mismatched:
    raise ValueError(f"fisher_grads leaf shapes differ from updates: {mismatched}")
  return flat_vectors(fisher_grads, dtype)[0]


def all_finite(arrays: Sequence[jax.Array]) -> jax.Array:
  """Whether every entry of ``arrays`` is finite: a scalar bool (true for no arrays)."""
  flags = [jnp.all(jnp.isfinite(x)) for x in arrays]
  return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def zero_unless(finite: jax.Array, arrays: Sequence[jax.Array]) -> list[jax.Array]:
  """``arrays``, or zeros of their shapes where ``finite`` is false: a skipped ``d_t`` enters
  the step as zero, so that no NaN reaches its small algebra (whose result is then dropped)."""
  return [jnp.where(finite, x, jnp.zeros((), x.dtype)) for x in arrays]


def keep_unless(finite: jax.Array, new, old):
  """``new`` where ``finite`` is true, else ``old``, leaf by leaf (same structures)."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


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


def updates_in_their_dtype(
  tx: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
  """``tx`` with its updates cast back to the dtype of the updates it was given (bf16
  gradients give bf16 updates, whatever dtype ``tx`` computes and keeps its state in)."""

  def update_fn(updates, state, params=None, **extra_args):
    out, state = tx.update(updates, state, params, **extra_args)
    return jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates), state

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


# ---- stacked block layout ------------------------------------------------------------------
#
# Ginger keeps one basis U (rows x rank) per block. Running the per-step passes once per block
# costs a few kernel launches each, and a model has 60-130 leaves, so blocks of one rank are
# stacked into *buckets*: arrays of shape (members, rows, rank), padded with zero rows to the
# largest member. Zero rows are exact: they add nothing to U^T U or U^T x, their p and update
# rows stay zero, so padding changes no result. How blocks are grouped is a speed knob of
# ginger._src.tuning.Tuning (bucket_overhead, solo_buckets, solo_rows).


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Blocks of one rank stacked as ``(len(members), rows, rank)``.

  ``members[j]`` lists block ``j``'s pieces as ``(leaf index, first row)``; a per-tensor block
  has one piece, the global block one per leaf. Rows past the pieces are zero padding.
  """

  rows: int
  rank: int
  members: tuple[tuple[tuple[int, int], ...], ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf's rows of ``U`` live: static (hashable) pytree metadata."""

  treedef: Any
  sizes: tuple[int, ...]
  buckets: tuple[Bucket, ...]

  def where(self, leaf: int) -> tuple[int, int, int]:
    """``(bucket, member, first row)`` of a leaf."""
    for b, bucket in enumerate(self.buckets):
      for j, pieces in enumerate(bucket.members):
        for i, row in pieces:
          if i == leaf:
            return b, j, row
    raise KeyError(leaf)


def plan_layout(
  sizes: Sequence[int], tau: int, block: str, treedef, tuning: Tuning = DEFAULT
) -> Layout:
  """Buckets for the blocks of ``block`` mode over leaves of the given sizes.

  ``"global"``: one bucket holding one block, all leaves stacked row after row.
  ``"per_tensor"``: blocks of equal rank ``min(tau, size)`` are split into runs of similar
  size (see :func:`_size_runs`, ``tuning.bucket_overhead``), each run one bucket padded to its
  largest member; off GPUs (``tuning.solo_buckets``) blocks of at least ``tuning.solo_rows``
  rows are one bucket each instead, after the others, in leaf order.
  """
  check_tuning(tuning)
  sizes = tuple(int(n) for n in sizes)
  if block == "global":
    if not sizes:
      return Layout(treedef, sizes, ())
    offsets = np.cumsum((0,) + sizes[:-1]).tolist()
    member = tuple(zip(range(len(sizes)), offsets, strict=True))
    total = sum(sizes)
    return Layout(treedef, sizes, (Bucket(total, min(tau, total), (member,)),))
  solo = _solo_buckets(tuning)
  by_rank: dict[int, list[int]] = {}
  for i, n in enumerate(sizes):
    if not (solo and n >= tuning.solo_rows):
      by_rank.setdefault(min(tau, n), []).append(i)
  buckets = []
  for rank, leaves in sorted(by_rank.items()):
    counts = collections.Counter(sizes[i] for i in leaves)
    distinct = sorted(counts)
    for run in _size_runs(distinct, [counts[n] for n in distinct], rank, tuning.bucket_overhead):
      members = tuple(((i, 0),) for i in leaves if sizes[i] in run)
      buckets.append(Bucket(max(run), rank, members))
  if solo:
    solos = [(i, n) for i, n in enumerate(sizes) if n >= tuning.solo_rows]
    buckets += [Bucket(n, min(tau, n), (((i, 0),),)) for i, n in solos]
  return Layout(treedef, sizes, tuple(buckets))


def _solo_buckets(tuning: Tuning) -> bool:
  """Whether large per-tensor blocks get a bucket each (``tuning.solo_buckets``; None: off
  GPUs)."""
  if tuning.solo_buckets is None:
    return jax.default_backend() != "gpu"
  return tuning.solo_buckets


def _size_runs(distinct: list[int], counts: list[int], rank: int, overhead: int) -> list[set[int]]:
  """Splits ascending distinct sizes into runs minimising the modelled per-step cost
  ``sum over runs of (overhead + members * largest size * (rank + 2))`` (exact DP)."""
  best = [0.0] + [math.inf] * len(distinct)
  start = [0] * (len(distinct) + 1)
  for end in range(1, len(distinct) + 1):
    for first in range(end):
      padded = sum(counts[first:end]) * distinct[end - 1] * (rank + 2)
      cost = best[first] + overhead + padded
      if cost < best[end]:
        best[end], start[end] = cost, first
  runs, end = [], len(distinct)
  while end:
    runs.append(set(distinct[start[end] : end]))
    end = start[end]
  return runs[::-1]


def gather(layout: Layout, vectors: Sequence[jax.Array]) -> list[jax.Array]:
  """Leaf vectors ``(size, ...)`` -> one ``(members, rows, ...)`` array per bucket (zero
  padded)."""
  stacks = []
  for bucket in layout.buckets:
    rows = []
    for pieces in bucket.members:
      parts = [vectors[i] for i, _ in pieces]
      used = sum(p.shape[0] for p in parts)
      if used < bucket.rows:
        parts.append(jnp.zeros((bucket.rows - used,) + parts[0].shape[1:], parts[0].dtype))
      rows.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    stacks.append(jnp.stack(rows))
  return stacks


def scatter(layout: Layout, stacks: Sequence[jax.Array]) -> list[jax.Array]:
  """Inverse of :func:`gather`: one vector per leaf (padding dropped)."""
  out: list[jax.Array] = [None] * len(layout.sizes)  # type: ignore[list-item]
  for bucket, stack in zip(layout.buckets, stacks, strict=True):
    for j, pieces in enumerate(bucket.members):
      for i, row in pieces:
        out[i] = stack[j, row : row + layout.sizes[i]]
  return out
