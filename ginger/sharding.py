"""Shardings for optimizer state: split the big arrays (Ginger's ``U``, QNG's factors) across a
device mesh, replicate the small ones (``sigma``, counts, Brand's ``(k+1) x (k+1)`` cores).

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    state = tx.init(params)
    state = jax.device_put(state, ginger.sharding.state_shardings(state, mesh, "data"))
    step = jax.jit(step, in_shardings=..., out_shardings=...)   # GSPMD adds the all-reduces

The rule is generic, so it holds whatever layout the state has (per-leaf ``(d, tau)`` bases,
stacked ``(members, rows, tau)`` buckets, params-shaped momenta): an array of at least
``min_size`` elements is split along its largest axis that the mesh axis size divides, never
the last axis of a matrix (a basis's rank); everything else is replicated. For Ginger's bases
that axis is the rows ``d``, so each device keeps ``d / n`` rows of ``U`` and the passes over
``U`` run on the local rows; the ``tau``-vectors ``U^T v`` they reduce to are summed across
devices by XLA, and the small core and its eigenpairs are computed redundantly on every device.
Per-device optimizer memory falls ~n-fold.

Results equal the unsharded ones up to float summation order. Note that Ginger amplifies any
rounding difference (sharded or not, CPU or GPU) by about ``sigma_max / gamma``: float32
eigensolvers resolve ``sigma`` only to about ``eps * sigma_max``, and directions with ``sigma`` near
``gamma`` are weighted by ``sigma / (gamma + sigma)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Elements (4 MiB of float32). Smaller arrays stay replicated: they hold little memory, and
# split ones cost a latency-bound collective each (ResNet-18's 41 BatchNorm-sized bases, split,
# added ~100 small all-gathers per step); Ginger's big bases are far above it.
MIN_SIZE = 1 << 20

Axis = str | Sequence[str]


def _names(axis: Axis) -> tuple[str, ...]:
  return (axis,) if isinstance(axis, str) else tuple(axis)


def axis_size(mesh: Mesh, axis: Axis) -> int:
  """Number of devices along ``axis`` (a mesh axis name or a tuple of names)."""
  return math.prod(mesh.shape[name] for name in _names(axis))


def partition_spec(
  shape: Sequence[int], size: int, axis: Axis = "data", *, min_size: int = MIN_SIZE
) -> PartitionSpec:
  """``PartitionSpec`` of one array: its largest axis divisible by ``size`` split over
  ``axis``, or replicated (``P()``) when the array is small, scalar or nothing divides.
  The last axis of an array of two or more axes (a basis's rank) is never split."""
  shape = tuple(int(n) for n in shape)
  if size <= 1 or not shape or math.prod(shape) < min_size:
    return PartitionSpec()
  rows = shape[:-1] if len(shape) > 1 else shape
  divisible = [i for i, n in enumerate(rows) if n >= size and n % size == 0]
  if not divisible:
    return PartitionSpec()
  split = max(divisible, key=lambda i: shape[i])  # the first of equally large axes
  names = _names(axis)
  spec = [None] * len(shape)
  spec[split] = names[0] if len(names) == 1 else names
  return PartitionSpec(*spec)


def state_partition_specs(
  state,
  mesh: Mesh | None = None,
  axis: Axis = "data",
  *,
  min_size: int = MIN_SIZE,
  size: int | None = None,
):
  """A pytree like ``state`` (arrays or ``ShapeDtypeStruct``s) of ``PartitionSpec``s.

  Args:
    state: an optimizer state (any pytree of arrays), e.g. ``tx.init(params)`` or its
      ``jax.eval_shape``.
    mesh: the device mesh; gives the number of devices along ``axis``. Or pass ``size``.
    axis: the mesh axis (or tuple of axes, split jointly) the big arrays are split over.
    min_size: arrays with fewer elements are replicated.
    size: the number of devices along ``axis``, instead of ``mesh``.
  """
  if size is None:
    if mesh is None:
      raise ValueError("state_partition_specs needs a mesh or the axis size.")
    size = axis_size(mesh, axis)
  return jax.tree.map(lambda x: partition_spec(np.shape(x), size, axis, min_size=min_size), state)


def state_shardings(state, mesh: Mesh, axis: Axis = "data", *, min_size: int = MIN_SIZE):
  """``NamedSharding``s for ``state`` on ``mesh`` (see :func:`state_partition_specs`), ready
  for ``jax.device_put`` and ``jax.jit(in_shardings=..., out_shardings=...)``."""
  specs = state_partition_specs(state, mesh, axis, min_size=min_size)
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
  )
