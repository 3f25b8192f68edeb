"""Shardings for optimizer state: split the big arrays (Ginger's ``U``, QNG's factors) across a
device mesh, replicate the small ones (``sigma``, counts, Brand's ``(k+1) x (k+1)`` cores).

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    state = tx.init(params)
    state = jax.device_put(state, ginger.sharding.state_shardings(state, mesh, "data"))
    step = jax.jit(step, in_shardings=..., out_shardings=...)   # GSPMD adds the all-reduces

Inside the step the optimizer's own temporaries follow the same rule when it is told where the
state lives (``ginger.ginger(..., sharding=ginger.sharding.StateSharding(mesh, "data"))``): the
stacked ``g`` and ``d`` are pinned to the rows of ``U`` each device holds, and so is the update
as the passes make it; then it is gathered whole, stack by stack, before the leaves are sliced
out of it. Without the first, XLA's partitioner sees params-shaped vectors meet row-split bases
and re-lays them out with all-gathers and collective-permutes (more bytes a step than a
replicated state moves); without the second, slicing a leaf that ends
inside a device's rows out of the split update sends its edges between neighbours (a
collective-permute per slice, one after the other).

The rule is generic, so it holds whatever layout the state has (per-leaf ``(d, tau)`` bases,
stacked ``(members, rows, tau)`` buckets, params-shaped momenta): an array of at least
``min_size`` elements is split along its largest axis that the mesh axis size divides, never
the last axis of a matrix (a basis's rank); everything else is replicated. For Ginger's bases
that axis is the rows ``d``, so each device keeps ``d / n`` rows of ``U`` and the passes over
``U`` run on the local rows; the ``tau``-vectors ``U^T v`` they reduce to are summed across
devices by XLA, and the small core and its eigenpairs are computed redundantly on every device.
Ginger's momentum, stacked ``(members, rows)`` as ``U`` is (``ginger.StackedRows``), is
split as its bucket's ``U``: each device averages its own rows. Per-device optimizer memory
falls ~n-fold.

Results equal the unsharded ones up to float summation order. Note that Ginger amplifies any
rounding difference (sharded or not, CPU or GPU) by about ``sigma_max / gamma``: float32
eigensolvers resolve ``sigma`` only to about ``eps * sigma_max``, and directions with ``sigma`` near
``gamma`` are weighted by ``sigma / (gamma + sigma)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ginger._src.stacked import StackedBasis, StackedRows

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

  def spec(x):
    if isinstance(x, StackedRows):  # (members, rows): split as the bucket's U is
      return _per_bucket(x, lambda s, b: rows_spec(s, b, size, axis, min_size=min_size))
    return partition_spec(np.shape(x), size, axis, min_size=min_size)

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, StackedRows))


def _per_bucket(rows, of):
  """``rows`` (Ginger's momentum, a ``StackedRows``) with each bucket's ``(members, rows)``
  array replaced by ``of(its shape, the shape of the bucket's U (members, rows, rank))``."""
  return type(rows)(
    [
      of(np.shape(m), (*np.shape(m), b.rank))
      for m, b in zip(rows.stacks, rows.layout.buckets, strict=True)
    ],
    rows.layout,
  )


def rows_spec(
  shape: Sequence[int],
  basis_shape: Sequence[int],
  size: int,
  axis: Axis = "data",
  *,
  min_size: int = MIN_SIZE,
) -> PartitionSpec:
  """``PartitionSpec`` of an array of ``shape`` split as a basis of ``basis_shape`` is: the
  basis itself, or a stack of vectors along its leading axes (``g`` or Ginger's momentum as
  ``(members, rows)`` beside ``U`` as ``(members, rows, rank)``), so that each device holds
  the same rows of both. The vectors' own size does not matter: they go where ``U`` goes."""
  spec = tuple(partition_spec(basis_shape, size, axis, min_size=min_size))
  return PartitionSpec(*(spec + (None,) * len(basis_shape))[: len(shape)])


def state_shardings(state, mesh: Mesh, axis: Axis = "data", *, min_size: int = MIN_SIZE):
  """``NamedSharding``s for ``state`` on ``mesh`` (see :func:`state_partition_specs`), ready
  for ``jax.device_put`` and ``jax.jit(in_shardings=..., out_shardings=...)``."""
  specs = state_partition_specs(state, mesh, axis, min_size=min_size)
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
  )


@dataclasses.dataclass(frozen=True)
class StateSharding:
  """Where a sharded optimizer state's big arrays live: ``mesh``, the mesh ``axis`` (or tuple
  of axes) they are split over, and the ``min_size`` below which arrays stay whole; the same
  arguments as :func:`state_shardings`, which placed the state.

  Given to :func:`ginger.ginger` / :func:`ginger.scale_by_ginger` as ``sharding``, it pins the
  step's vectors in the stacked layout to the rows of ``U`` that each device holds
  (:meth:`constrain`), so that XLA gives each device its rows of ``g`` and ``d`` by a slice of
  the all-reduced gradient (or a reduce-scatter), runs the passes over ``U`` on local rows,
  sums only the ``tau``-vectors ``U^T v`` across devices, and all-gathers the update once.
  """

  mesh: Mesh
  axis: Axis = "data"
  min_size: int = MIN_SIZE

  def spec(self, basis_shape: Sequence[int]) -> PartitionSpec:
    """The ``PartitionSpec`` of a basis of ``basis_shape`` (as :func:`state_shardings`)."""
    return partition_spec(
      basis_shape, axis_size(self.mesh, self.axis), self.axis, min_size=self.min_size
    )

  def row_shards(self, basis_shape: Sequence[int]) -> int:
    """The number of devices the rows (``basis_shape[-2]``) of such a basis are split over."""
    spec = tuple(self.spec(basis_shape))
    split = len(basis_shape) >= 2 and len(spec) == len(basis_shape) and spec[-2] is not None
    return axis_size(self.mesh, self.axis) if split else 1

  def shardings(self, state):
    """``NamedSharding``s for an optimizer ``state``: those of :func:`state_shardings`, except
    in a state that holds Ginger's stacked bases, where only the bases and Ginger's momentum
    (split as the bases' rows, :func:`rows_spec`) are split.

    The rest of such a state is small (counts, ``sigma``) or params-shaped (the states of
    transformations chained with Ginger's): split by the params' own axes, such an array that
    meets the stacked vectors is re-laid out by the bases' rows every step (all-gathers),
    while whole on every device it is updated from the all-reduced gradient with no
    collective.
    """

    def is_basis(x):
      return isinstance(x, StackedBasis)

    if not any(map(is_basis, jax.tree.leaves(state, is_leaf=is_basis))):
      return state_shardings(state, self.mesh, self.axis, min_size=self.min_size)
    whole = NamedSharding(self.mesh, PartitionSpec())

    def place(x):
      if isinstance(x, StackedRows):  # (members, rows): split as the bucket's U is
        return _per_bucket(x, self.row_sharding)
      if is_basis(x):
        return jax.tree.map(lambda u: NamedSharding(self.mesh, self.spec(np.shape(u))), x)
      return whole

    return jax.tree.map(place, state, is_leaf=is_basis)

  def replicate(self, tree):
    """``tree``'s arrays pinned whole on every device (data parallelism's gradients)."""
    return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, PartitionSpec()))

  def row_sharding(self, shape: Sequence[int], basis_shape: Sequence[int]) -> NamedSharding:
    """The sharding of an array of ``shape`` split as a basis of ``basis_shape`` is
    (:func:`rows_spec`: the basis, or ``g``, ``d`` or the momentum as ``(members, rows)``
    beside ``U`` as ``(members, rows, rank)``)."""
    size = axis_size(self.mesh, self.axis)
    spec = rows_spec(shape, basis_shape, size, self.axis, min_size=self.min_size)
    return NamedSharding(self.mesh, spec)

  def constrain(self, x: jax.Array, basis_shape: Sequence[int]) -> jax.Array:
    """``x`` pinned as :meth:`row_sharding` says."""
    return jax.lax.with_sharding_constraint(x, self.row_sharding(x.shape, basis_shape))
