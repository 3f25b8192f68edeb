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

The end of this module runs Ginger's passes over a split ``U`` per device where XLA cannot
partition them (the Pallas kernels): :func:`per_shard` and :func:`per_shard_sums` wrap a pass
in ``shard_map`` with the ``PartitionSpec`` s its :class:`PassLayout` names, and add the
passes' sums over the devices in one ``psum``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
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


# ---- passes over a bucket that run per device -------------------------------------------------
#
# XLA partitions the jnp passes over a split ``U`` itself; a Pallas kernel it cannot partition,
# so on a split bucket the kernels run under ``shard_map``, each device on its own rows. What
# follows says how each operand and result of a pass is split there: by the axes of its
# bucket's ``U``, ``(members, rows, rank)``, that it keeps.

U = "u"  # (members, rows, rank): U itself
ROWS = "rows"  # (members, rows): g, d, the residuals p1 and q1, the update
SMALL = "small"  # (members, rank): tau-vectors, e.g. U^T g
SQUARE = "square"  # (members, rank, rank): the rotation of U
BLOCK = "block"  # (members,): one number per block, e.g. a norm or gamma
# Results of these layouts are sums over the rows: under shard_map each device has its share.
SUMS = (SMALL, SQUARE, BLOCK)


class PassLayout(NamedTuple):
  """The layouts (:data:`U`, :data:`ROWS`, :data:`SMALL`, :data:`SQUARE`, :data:`BLOCK`) of
  a pass's operands and results, in the order of its signature and its return value; a single
  layout as ``results`` for a pass that returns one array. Build with :meth:`of`, which names
  every entry."""

  operands: tuple[str, ...]
  results: tuple[str, ...] | str

  @classmethod
  def of(cls, results: dict[str, str] | str, **operands: str) -> PassLayout:
    """``PassLayout.of(dict(result=LAYOUT, ...), operand=LAYOUT, ...)``."""
    return cls(
      tuple(operands.values()), results if isinstance(results, str) else tuple(results.values())
    )


# The passes of ginger._src.kernels, as Ginger's step calls them.
PROJECT_PAIR = PassLayout.of(dict(c=SMALL, y=SMALL, l1=BLOCK), u=U, v=ROWS, g=ROWS)
RESIDUAL_SUMS = PassLayout.of(
  dict(c2=SMALL, pp=BLOCK, pq=BLOCK, vv=BLOCK, c3=SMALL, p1=ROWS, q1=ROWS),
  u=U, v=ROWS, g=ROWS, a=SMALL, inv_l1=BLOCK, ay=SMALL,
)  # fmt: skip
ROTATE = PassLayout.of(
  dict(u_new=U, out=ROWS),
  u=U, p1=ROWS, q=ROWS, a2=SMALL, inv_r=BLOCK, rot=SQUARE, b=SMALL, a=SMALL, beta=BLOCK,
  gamma=BLOCK,
)  # fmt: skip
PROJECT = PassLayout.of(dict(y=SMALL), u=U, g=ROWS)
RESIDUAL = PassLayout.of(dict(c=SMALL, q1=ROWS), u=U, g=ROWS, y=SMALL)
CORRECT = PassLayout.of(ROWS, u=U, q=ROWS, a=SMALL)


def bucket_split(sharding: StateSharding | None, impl: str, u) -> tuple:
  """How bucket ``u`` is split where its passes run per device (the Pallas kernels on a state
  split over devices), as its ``PartitionSpec``'s entries; else ``()``: XLA partitions the jnp
  passes, and an unsplit state has nothing to split."""
  if impl != "pallas" or sharding is None:
    return ()
  return tuple(sharding.spec(u.shape))


def layout_specs(split: tuple, layouts: tuple[str, ...] | str):
  """The ``PartitionSpec`` of each of ``layouts`` (one, or a tuple of them) for a bucket whose
  ``U`` is split as ``split`` (:func:`bucket_split`) along its members and rows."""
  members, rows = split[0], split[1]
  specs = {
    U: PartitionSpec(members, rows, None),
    ROWS: PartitionSpec(members, rows),
    SMALL: PartitionSpec(members, None),
    SQUARE: PartitionSpec(members, None, None),
    BLOCK: PartitionSpec(members),
  }
  return specs[layouts] if isinstance(layouts, str) else tuple(specs[n] for n in layouts)


def per_shard(
  fn: Callable, sharding: StateSharding | None, impl: str, args: Sequence, layout: PassLayout
):
  """``fn(*args)`` for one bucket (``args[0]`` its ``U``), run on each device's rows of it
  under ``shard_map`` where its passes run per device (:func:`bucket_split`); else as it is.
  ``fn`` must be row-local (pass 3, the second half of preconditioning): a pass that sums over
  the rows runs in :func:`per_shard_sums`. ``layout``: its operands' and results' layouts."""
  split = bucket_split(sharding, impl, args[0])
  if not split:
    return fn(*args)
  return jax.shard_map(
    fn,
    mesh=sharding.mesh,
    in_specs=layout_specs(split, layout.operands),
    out_specs=layout_specs(split, layout.results),
    check_vma=False,
  )(*args)


def per_shard_sums(
  fn: Callable,
  sharding: StateSharding | None,
  impl: str,
  bucket_args: Sequence[Sequence],
  layout: PassLayout,
) -> list:
  """``[fn(*args) for args in bucket_args]`` for a pass whose results of layouts :data:`SUMS`
  are sums over the rows, as :func:`per_shard` runs it per bucket, but the buckets whose passes
  run per device all in one ``shard_map``, their sums added over the devices in one ``psum``
  (per mesh axis and dtype) instead of one per bucket and sum: XLA's combiner merges only some
  of those, and each all-reduce is a latency-bound collective. Under ``shard_map`` ``fn`` gives
  each device's partial sums over its own rows."""
  outs: list = [None] * len(bucket_args)
  split = []
  for b, args in enumerate(bucket_args):
    spec = bucket_split(sharding, impl, args[0])
    if spec:
      split.append((b, spec))
    else:
      outs[b] = fn(*args)
  if not split:
    return outs
  axes = [spec[1] for _, spec in split]

  def per_device(*per_bucket):
    return _summed_over_devices([fn(*args) for args in per_bucket], axes, layout.results)

  mapped = jax.shard_map(
    per_device,
    mesh=sharding.mesh,
    in_specs=tuple(layout_specs(spec, layout.operands) for _, spec in split),
    out_specs=[layout_specs(spec, layout.results) for _, spec in split],
    check_vma=False,
  )(*(tuple(bucket_args[b]) for b, _ in split))
  for (b, _), out in zip(split, mapped, strict=True):
    outs[b] = out
  return outs


def _summed_over_devices(results, axes, result_layouts) -> list[tuple]:
  """Inside ``shard_map``: each bucket's ``results`` with those of layouts :data:`SUMS` added
  over its rows' mesh axis (``axes``; None: its rows are all here), joined into one vector per
  (axis, dtype) for one ``psum``."""
  results = [list(r) for r in results]
  groups: dict = defaultdict(list)
  for b, axis in enumerate(axes):
    if axis is not None:
      for i, kind in enumerate(result_layouts):
        if kind in SUMS:
          groups[axis, results[b][i].dtype].append((b, i))
  for (axis, _), where in groups.items():
    parts = [results[b][i] for b, i in where]
    total = jax.lax.psum(jnp.concatenate([x.ravel() for x in parts]), axis)
    cuts = np.cumsum([x.size for x in parts])[:-1].tolist()
    for (b, i), x, y in zip(where, parts, jnp.split(total, cuts), strict=True):
      results[b][i] = y.reshape(x.shape)
  return [tuple(r) for r in results]
