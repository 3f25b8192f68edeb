"""Per-block state stacked by bucket (``common.Layout``): Ginger's bases ``U``, its
momentum's rows and its eigenvalues ``sigma``, as pytrees whose leaves are one array per
bucket. Below both :mod:`ginger._src.ginger_transform` and :mod:`ginger._src.sharding`, which
place them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ginger._src import common


class _Stacked:
  """Per-block state stacked by bucket (``common.Layout``): the pytree leaves are ``stacks``,
  one array per bucket; ``x[key]`` (or ``x.tree()[...]``) is a leaf's part (:meth:`leaf`)."""

  def __init__(self, stacks, layout: common.Layout):
    self.stacks = tuple(stacks)
    self.layout = layout

  def tree_flatten_with_keys(self):
    keys = [jax.tree_util.SequenceKey(b) for b in range(len(self.stacks))]
    return list(zip(keys, self.stacks, strict=True)), self.layout

  @classmethod
  def tree_unflatten(cls, layout, stacks):
    return cls(stacks, layout)

  def leaf(self, i: int) -> jax.Array:
    raise NotImplementedError

  def tree(self):
    """A pytree like the params whose leaves are :meth:`leaf`."""
    return jax.tree.unflatten(
      self.layout.treedef, [self.leaf(i) for i in range(len(self.layout.sizes))]
    )

  def __getitem__(self, key):
    return self.tree()[key]

  def __repr__(self):
    shapes = ", ".join(str(getattr(x, "shape", "?")) for x in self.stacks)
    return f"{type(self).__name__}([{shapes}])"


@jax.tree_util.register_pytree_with_keys_class
class StackedBasis(_Stacked):
  """The bases ``U`` of all blocks, stacked by bucket (see ``common.Layout``).

  Its pytree leaves are ``stacks``: one ``(members, rows, rank)`` array per bucket, blocks of
  one rank padded with zero rows to a common size, so that a step runs a few kernels per
  bucket rather than per parameter tensor and never copies ``U`` to stack it. Indexing gives a
  leaf's part: ``u[key]`` (or ``u.tree()[...]``) is that leaf's rows of ``U``, shape
  ``(leaf.size, rank)``.
  """

  def leaf(self, i: int) -> jax.Array:
    """Rows of ``U`` belonging to leaf ``i`` (in ``jax.tree.leaves(params)`` order)."""
    b, j, row = self.layout.where(i)
    return self.stacks[b][j, row : row + self.layout.sizes[i]]

  @classmethod
  def from_tree(cls, tree, layout: common.Layout) -> StackedBasis:
    """Inverse of :meth:`tree`: per-leaf rows ``(leaf.size, rank)`` stacked by ``layout``."""
    return cls(common.gather(layout, jax.tree.leaves(tree)), layout)


@jax.tree_util.register_pytree_with_keys_class
class StackedRows(StackedBasis):
  """Per-entry state of all blocks (Ginger's momentum), stacked by bucket as ``U`` is: one
  ``(members, rows)`` array per bucket, zero in the padding rows; ``m[key]`` is a leaf's
  ``(leaf.size,)`` vector. Saved per leaf like the bases (:func:`checkpoint_state`), and
  split over devices by the rows of ``U`` (:meth:`ginger.sharding.StateSharding.shardings`)."""


@jax.tree_util.register_pytree_with_keys_class
class StackedSigma(_Stacked):
  """The eigenvalues ``sigma`` of all per-tensor blocks, stacked by bucket as ``U`` is: one
  ``(members, rank)`` array per bucket, so that a step reads and writes them as a few arrays
  (kept per leaf, each tensor's new ``sigma`` would be cut out of the batched solve's result,
  one small copy kernel per tensor on a GPU). Indexing reads like a pytree like the params of
  ``(rank,)`` vectors: ``sigma[key]``, ``sigma.tree()``.
  Saved per leaf (:func:`checkpoint_state`); whole on every device when the state is split
  (small). Not a :class:`StackedBasis`: nothing of it is placed by rows.
  """

  def leaf(self, i: int) -> jax.Array:
    """``sigma`` of leaf ``i``'s block (in ``jax.tree.leaves(params)`` order)."""
    b, j, _ = self.layout.where(i)
    return self.stacks[b][j]

  @classmethod
  def from_tree(cls, tree, layout: common.Layout) -> StackedSigma:
    """Inverse of :meth:`tree`."""
    leaves = jax.tree.leaves(tree)
    return cls(
      [jnp.stack([leaves[piece[0][0]] for piece in b.members]) for b in layout.buckets], layout
    )
