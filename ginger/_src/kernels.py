"""The passes over the stacked bases ``U`` as fused Pallas kernels, with a jnp reference.

A Ginger step reads the stacked bases ``u`` (``(blocks, rows, k)`` per bucket, see
:mod:`ginger._src.lowrank`) three times; everything else is ``O(k^2)`` per block. Each pass is
memory-bound (about ``2k`` flops per element of ``U`` read), so it should cost one read of
``U`` (and one write for the rotation) and nothing more. This module writes each pass twice:

* ``impl="jnp"``: the formulas of :mod:`ginger._src.lowrank` as they are (the reference, and the
  CPU path): XLA decides what it fuses. Off GPUs a few products are written as dots where
  XLA:CPU's fusion of the plain formula is slow (:func:`_row_sums`, :func:`_matvec`,
  :func:`_vdot`): the same values up to summation order.
* ``impl="pallas"``: one ``pl.pallas_call`` per pass (Triton lowering on GPUs, interpreted
  elsewhere), each program owning a chunk of rows of one block: it streams ``tile x k`` tiles
  of ``U`` (rows past the block masked, ``k`` padded to a power of two, at least
  :data:`MIN_PADDED_RANK` lanes, :data:`ROTATE_MIN_PADDED_RANK` in pass 3, as Triton requires)
  and keeps the small ``(k,)`` / ``(k, k)`` operands of its block in registers.
  Row reductions (``U^T x``) leave one partial sum per program, added up by a small jnp sum
  over the chunks (no atomics: the result does not depend on the launch order).

The passes (``a``, ``rot``, ``b``, ``z`` are per-block small operands, ``(blocks, k)`` or
``(blocks, k, k)``; ``inv_l1``, ``inv_r``, ``gamma`` per-block scalars)::

    project_pair:             U^T v, U^T g, sum |v|                       (reads U)
    residual_sums:            p1 = (v - U a) inv_l1,  q1 = g - U ay;
                              U^T p1, ||p1||^2, p1 . q1, ||v inv_l1||^2,
                              U^T q1                                        (reads U)
                              [and p1, q1 themselves, with_p1=True]
    rotate_and_precondition:  p = (p1 - U a2) inv_r;  U' = U rot + p b^T;
                              (q - U a - p beta) / gamma                    (reads U, writes U')
    rotate_from_residual:     the same from a stored p1 instead of v
    precondition:             G^{-1} g with U as it is: project, residual
                              (q1 = g - U y, U^T q1: pass 2 for q1 alone),
                              correct                                      (reads U 3 times)
    correct:                  (q - U a) / gamma                             (reads U)

Pass 3 is row-local: its ``pallas`` kernel writes ``U'`` over ``U`` (``input_output_aliases``),
so with the state donated to the jitted step no second ``U`` is allocated. The ``jnp``
:func:`rotate_from_residual` gets the same from XLA on GPUs (:data:`JNP_ROW_BLOCKS`; on the
CPU it rotates the whole ``U`` at once, which is faster there): on a ``U`` of more than
:data:`ROW_BLOCK_ELEMENTS` elements it applies the reference formula to row blocks in a
``fori_loop`` that writes each block back into the loop-carried ``U``
(``dynamic_update_slice``, which XLA does in place), so besides ``U`` only a block of ``U'``
(and, as XLA's CPU backend compiles it, the block's slice of ``U``) is alive. Rows are
independent, so every entry is computed by the same operations as on the whole array (equal
up to fused multiply-adds, which XLA forms per fusion).

Passes 2 and 3 must see the same rounded ``p1`` (and ``q1``): pass 2 measures its rounding along
``U`` (``c2 = U^T p1``) and pass 3 removes it (``p1 - U c2``; CGS2). ``rotate_and_precondition``
recomputes ``p1`` with the expression pass 2 used (the reference relies on XLA's CSE for this, the
kernels on Triton compiling one expression alike in two kernels); ``residual_sums(...,
with_p1=True)`` followed by ``rotate_from_residual`` guarantees it by construction, for one more
``(rows,)`` vector written. Never mix implementations between the two passes.

Results of the two implementations differ by float summation order only; bounds are in
tests/test_kernels.py. Inputs may have extra leading axes (flattened into ``blocks``); all
arrays of one call share ``u``'s dtype: float32, bfloat16 (computed in float32 inside the
kernels, ``p1`` rounded to bfloat16 like the reference's), or float64 (interpret mode).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

IMPLS = ("auto", "jnp", "pallas")
HIGHEST = jax.lax.Precision.HIGHEST
# Rows of one tile of U by padded rank (other ranks: TILE_ELEMENTS / padded rank rows, at most
# MAX_TILE_ROWS), and the tiles a program streams through (its rows are STEPS * tile), as
# bench.kernel_tiling picks them for ResNet-18's shapes on an H200: one tile a program, 512 rows
# at rank <= 16, 64 at rank 32, where larger tiles spill registers.
TILE_ROWS = {16: 512, 32: 64}
# Pass 3's rows per tile where they differ from TILE_ROWS (a knob of bench.kernel_tiling). Empty:
# at rank 32, 128-row tiles speed up pass 3's dot alone but not the whole update.
ROTATE_TILE_ROWS: dict[int, int] = {}
TILE_ELEMENTS = 2048
MAX_TILE_ROWS = 512
STEPS = 1
# Ranks are padded to a power of two of at least this many lanes (a power of two >= 4) in passes
# 1 and 2: rank 8 in 8 lanes makes the update slower.
MIN_PADDED_RANK = 16
# Pass 3's padding (a power of two >= 4). Where the padded rank is below 16 the rotation U rot is
# formed column by column: column j of the tile (a row sum of the tile masked to lane j: exact)
# times row j of rot, k multiply-adds per entry in the reference's order. At 16 lanes and more
# it is one Triton dot (``tl.dot`` needs >= 16). At rank 8 the dot halves pass 3's speed (its
# operands change layout through shared memory, and padding to 16 lanes quadruples the
# multiply-adds), so rank 8 rotates column by column, close to an elementwise pass over the same
# bytes; at rank 32 the dot is several times faster than the columns.
ROTATE_MIN_PADDED_RANK = 8
# Triton's warps per program and software-pipelining stages of its loops (None: Triton's own).
NUM_WARPS = 4
NUM_STAGES: int | None = None
# The jnp rotation of a U with more elements than this runs in row blocks of about this many
# elements, written in place (two such blocks are what it keeps alive besides U), in at most
# MAX_ROW_BLOCKS blocks (each one a loop iteration: a few kernel launches on a GPU).
ROW_BLOCK_ELEMENTS = 1 << 24
MAX_ROW_BLOCKS = 16
# Whether the jnp rotation (rows_per_block=None) runs in row blocks, read when the step is
# traced: None on GPUs only, True always (the tests of the blocked path on the CPU), False
# never. Not on the CPU by default: there the in-place rotation is bought with a second U's
# memory instead, because XLA:CPU copies each block's slice of U out and back
# (dynamic-slice / dynamic-update-slice) and, inside the loop, no longer fuses the output's k
# multiply-adds (below): both make the step slower.
JNP_ROW_BLOCKS: bool | None = None


# ---- arguments -------------------------------------------------------------------------------


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve_impl(impl: str, interpret: bool | None) -> tuple[str, bool]:
  """``(impl, interpret)`` with the defaults filled in.

  ``"auto"`` is ``"pallas"`` on GPUs and ``"jnp"`` elsewhere (the interpreter is a test
  harness, not a fast path); ``interpret=None`` interprets the kernels off-GPU.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
  if impl == "auto":
    impl = "pallas" if _on_gpu() else "jnp"
  if interpret is None:
    interpret = not _on_gpu()
  return impl, bool(interpret)


def _check(u, vectors: dict, smalls: dict | None = None, squares: dict | None = None, blocks=None):
  """Shapes of one pass's operands against ``u`` (``(..., n, k)``), before anything is traced
  into a kernel. ``blocks``: the leading shape of the small and square operands (default
  ``u``'s, see :func:`_joined_blocks`)."""
  if u.ndim < 3:
    raise ValueError(f"u must have shape (blocks, rows, rank), got {u.shape}.")
  lead, k = u.shape[:-2], u.shape[-1]
  small_lead = lead if blocks is None else blocks
  want = {"vector": u.shape[:-1], "small": small_lead + (k,), "square": small_lead + (k, k)}
  for kind, arrays in (("vector", vectors), ("small", smalls or {}), ("square", squares or {})):
    for name, x in arrays.items():
      if x.shape != want[kind]:
        raise ValueError(f"{name} must have shape {want[kind]} (u is {u.shape}), got {x.shape}.")
  for name, x in {**vectors, **(smalls or {}), **(squares or {})}.items():
    if x.dtype != u.dtype:
      raise ValueError(f"{name} must have u's dtype {u.dtype}, got {x.dtype}.")


def _scalar(name: str, x, u, blocks=None) -> jax.Array:
  """A per-block scalar (``(...)`` like ``u``'s leading axes, or one for all) as ``(...)``;
  ``blocks``: the leading shape instead of ``u``'s (see :func:`_joined_blocks`)."""
  x = jnp.asarray(x, u.dtype)
  lead = u.shape[:-2] if blocks is None else blocks
  if x.shape not in ((), lead):
    raise ValueError(f"{name} must be a scalar or have shape {lead}, got {x.shape}.")
  return jnp.broadcast_to(x, lead)


def _joined_blocks(u, first: int, a) -> tuple[int, ...] | None:
  """The leading shape of pass 3's small operands when they are joined (``first`` given, or
  more blocks than ``u`` has), else None (``u``'s own); checks that ``u``'s blocks
  ``first .. first + blocks`` lie inside them."""
  if isinstance(first, bool) or not isinstance(first, int) or first < 0:
    raise ValueError(f"first must be an int >= 0, got {first!r}.")
  if u.ndim < 3:
    raise ValueError(f"u must have shape (blocks, rows, rank), got {u.shape}.")
  if first == 0 and a.shape[:-1] == u.shape[:-2]:
    return None
  if u.ndim != 3 or a.ndim != 2:
    raise ValueError(
      f"joined small operands need u of shape (blocks, rows, rank) and a2 of shape "
      f"(joined blocks, rank), got u {u.shape} and a2 {a.shape}."
    )
  if first + u.shape[0] > a.shape[0]:
    raise ValueError(
      f"u's {u.shape[0]} blocks from first={first} run past the {a.shape[0]} joined blocks."
    )
  return a.shape[:1]


# ---- the jnp reference: the formulas of ginger._src.lowrank -----------------------------------


def _rowdot(u, a):
  """``U a`` as ``k`` multiply-adds (lowrank.rowdot)."""
  out = jnp.zeros(u.shape[:-1], u.dtype)
  for j in range(u.shape[-1]):
    out = out + u[..., j] * a[..., None, j]
  return out


def _rowmatmul(u, mat):
  """``U M`` as multiply-adds (lowrank.rowmatmul)."""
  out = jnp.zeros(u.shape[:-1] + mat.shape[-1:], u.dtype)
  for j in range(u.shape[-1]):
    out = out + u[..., j, None] * mat[..., None, j, :]
  return out


def _row_sums(u, xs):
  """``U^T [x_1 ... x_j]`` (lowrank.row_sums): one product with the stacked ``x``s on GPUs;
  elsewhere one vector-matrix product ``x_i^T U`` each: XLA:CPU runs the ``(k, n) x (n, j)``
  product at about half the speed of ``j`` such products, although each is one more read of
  ``U``."""
  if _on_gpu():
    return jnp.einsum("...nk,...nj->...kj", u, jnp.stack(xs, -1), precision=HIGHEST)
  return jnp.stack([jnp.einsum("...n,...nk->...k", x, u, precision=HIGHEST) for x in xs], -1)


def _matvec(u, a):
  """``U a`` of the first residual: ``k`` multiply-adds (:func:`_rowdot`) on GPUs; elsewhere
  one matrix-vector product. XLA:CPU fuses the multiply-adds into every consumer of ``p1`` and
  computes it twice, once for the stored ``p1`` and the row sums and once for the operand of
  ``U^T p1`` (a reshape of it), each a read of ``U``; as a product ``U`` is read once and only
  ``(v - U a) inv_l1``, two vectors, is computed twice."""
  if _on_gpu():
    return _rowdot(u, a)
  return jnp.einsum("...nk,...k->...n", u, a, precision=HIGHEST)


def _vdot(x, y):
  """``x . y`` over the last axis: a reduction of the product on GPUs; elsewhere a dot, which
  runs near copy bandwidth where XLA:CPU turns the reduction into a far slower YNNPACK
  reduce."""
  if _on_gpu():
    return jnp.sum(x * y, -1)
  return jnp.einsum("...n,...n->...", x, y, precision=HIGHEST)


def _first_residual(u, v, a, inv_l1):
  return (v - _matvec(u, a)) * inv_l1[..., None]


def _second_residual(u, g, y):
  """``q1 = g - U y``: one expression for :func:`_residual_sums_jnp` and :func:`_residual_jnp`."""
  return g - _matvec(u, y)


def _project_pair_jnp(u, v, g):
  cy = _row_sums(u, [v, g])
  return cy[..., 0], cy[..., 1], jnp.sum(jnp.abs(v), axis=-1)


def _residual_sums_jnp(u, v, g, a, inv_l1, ay, with_p1=False):
  p1 = _first_residual(u, v, a, inv_l1)
  q1 = _second_residual(u, g, ay)
  vs = v * inv_l1[..., None]
  sums = _row_sums(u, [p1, q1])
  sums = (sums[..., 0], _vdot(p1, p1), _vdot(p1, q1), _vdot(vs, vs), sums[..., 1])
  return sums + (p1, q1) if with_p1 else sums


def _residual_jnp(u, g, y):
  """Pass 2 for ``g`` alone: :func:`_residual_sums_jnp`'s ``q1`` and ``U^T q1``."""
  q1 = _second_residual(u, g, y)
  return _row_sums(u, [q1])[..., 0], q1


def _rotate_from_residual_jnp(u, p1, q, a2, inv_r, rot, b, a, beta, gamma, *, out_rowdot=True):
  """``out_rowdot``: ``U a`` as ``k`` multiply-adds (:func:`_rowdot`, as
  :func:`_correct_jnp`), else as a reduction over the rank axis, which XLA:CPU turns into a
  YNNPACK reduce many times slower than the multiply-adds. With row blocks
  (:func:`_jnp_row_blocks`: on GPUs) the reduction stays."""
  p = (p1 - _rowdot(u, a2)) * inv_r[..., None]
  u_new = _rowmatmul(u, rot) + p[..., None] * b[..., None, :]
  u_a = _rowdot(u, a) if out_rowdot else jnp.sum(u * a[..., None, :], axis=-1)
  return u_new, (q - u_a - p * beta[..., None]) / gamma[..., None]


def _jnp_row_blocks() -> bool:
  """Whether the jnp rotation runs in row blocks (:data:`JNP_ROW_BLOCKS`, when traced)."""
  return _on_gpu() if JNP_ROW_BLOCKS is None else bool(JNP_ROW_BLOCKS)


def row_block(shape, rows_per_block: int | None = None) -> int:
  """Rows per block of the jnp rotation of a ``U`` of ``shape`` (``(..., n, k)``): all ``n``
  (one block) up to :data:`ROW_BLOCK_ELEMENTS` elements, else ``n`` split into at most
  :data:`MAX_ROW_BLOCKS` blocks of about that many elements. ``rows_per_block`` overrides it."""
  n = shape[-2]
  if rows_per_block is not None:
    if (
      isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or rows_per_block < 1
    ):
      raise ValueError(f"rows_per_block must be an int >= 1 or None, got {rows_per_block!r}.")
    return min(rows_per_block, max(n, 1))
  total = math.prod(shape)
  blocks = min(MAX_ROW_BLOCKS, -(-total // ROW_BLOCK_ELEMENTS))
  return max(1, -(-n // max(blocks, 1)))


def _rotate_in_row_blocks(
  u, p1, g, a2, inv_r, rot, b, z, beta, gamma, *, rows_per_block=None, row_shards=1
):
  """:func:`_rotate_from_residual_jnp` over blocks of rows, each written back into ``U``.

  ``row_shards``: the rows are split over this many devices (``U`` sharded along its rows).
  Then the row axis is viewed as ``(row_shards, n / row_shards)`` and the blocks step along
  the second, so that every device rotates blocks of its own rows: a block sliced out of the
  split axis itself would make XLA's partitioner all-gather ``U``, ``p1`` and ``g``. Where a
  device's rows fit in one block, that block is all of them: the rotation runs unblocked
  (row-local, as on one device with a ``U`` of that size), never in blocks of the whole axis.

  Every row of ``U'`` and of the output depends only on the same row of ``U``, ``p1`` and
  ``g`` (and the small operands), so applying the formula block by block computes each entry
  with the same operations as on the whole array. The blocks run in a ``fori_loop`` whose carry
  is ``U`` itself: XLA updates a loop-carried buffer in place, so the rotation keeps a block
  of ``U'`` (and the block's slice of ``U``) alive besides ``U``, with ``U`` donated not even a
  copy of ``U``; the rows past the last whole block are one more block after the loop.
  """
  n = u.shape[-2]
  if row_shards > 1 and n % row_shards == 0:
    rows = row_block(u.shape[:-2] + (n // row_shards,) + u.shape[-1:], rows_per_block)
    if rows >= n // row_shards:
      # One block per device. Blocks of the whole axis (below) would cut across the split,
      # and XLA would all-gather U, p1, g and the output to form them, where each device's
      # share fits in one block.
      return _rotate_from_residual_jnp(
        u, p1, g, a2, inv_r, rot, b, z, beta, gamma, out_rowdot=False
      )
    split = u.ndim - 2
    view = lambda x: x.reshape(
      x.shape[:split] + (row_shards, n // row_shards) + x.shape[split + 1 :]
    )
    small = [jnp.expand_dims(x, split) for x in (a2, inv_r, rot, b, z, beta, gamma)]
    u_new, out = _rotate_in_row_blocks(view(u), view(p1), view(g), *small, rows_per_block=rows)
    return u_new.reshape(u.shape), out.reshape(g.shape)
  rows = row_block(u.shape, rows_per_block)
  if rows >= n:
    return _rotate_from_residual_jnp(u, p1, g, a2, inv_r, rot, b, z, beta, gamma, out_rowdot=False)
  row_axis = u.ndim - 2
  small = (a2, inv_r, rot, b, z, beta, gamma)

  def rotate(start, size, u, out):
    def rows_of(x, axis):
      return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    u_new, o = _rotate_from_residual_jnp(
      rows_of(u, row_axis), rows_of(p1, row_axis), rows_of(g, row_axis), *small, out_rowdot=False
    )
    return (
      jax.lax.dynamic_update_slice_in_dim(u, u_new, start, row_axis),
      jax.lax.dynamic_update_slice_in_dim(out, o, start, row_axis),
    )

  whole = n // rows
  u, out = jax.lax.fori_loop(
    0, whole, lambda i, c: rotate(i * rows, rows, *c), (u, jnp.zeros(g.shape, g.dtype))
  )
  if whole * rows < n:
    u, out = rotate(whole * rows, n - whole * rows, u, out)
  return u, out


def _rotate_and_precondition_jnp(u, v, q, a1, inv_l1, a2, inv_r, rot, b, a, beta, gamma):
  p1 = _first_residual(u, v, a1, inv_l1)
  return _rotate_from_residual_jnp(
    u, p1, q, a2, inv_r, rot, b, a, beta, gamma, out_rowdot=not _jnp_row_blocks()
  )


def _correct_jnp(u, q, a, gamma):
  return (q - _rowdot(u, a)) / gamma[..., None]


# ---- Pallas: tiling and masked tile access ----------------------------------------------------


def _pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def tiling(
  rows: int, rank: int, tile: int | None = None, steps: int | None = None, *, rotate: bool = False
):
  """``(tile, chunk, padded rank)``: rows per tile, rows per program, rank padded to a power
  of two >= :data:`MIN_PADDED_RANK` (Triton's block sizes are powers of two). ``rotate``: pass
  3's (:data:`ROTATE_MIN_PADDED_RANK`, :data:`ROTATE_TILE_ROWS`)."""
  for name in ("MIN_PADDED_RANK", "ROTATE_MIN_PADDED_RANK"):
    lanes = globals()[name]
    if lanes < 4 or lanes & (lanes - 1):
      raise ValueError(f"{name} must be a power of two >= 4, got {lanes}.")
  kp = max(ROTATE_MIN_PADDED_RANK if rotate else MIN_PADDED_RANK, _pow2(rank))
  tile = (
    tile
    or (ROTATE_TILE_ROWS.get(kp) if rotate else None)
    or TILE_ROWS.get(kp)
    or min(MAX_TILE_ROWS, max(16, TILE_ELEMENTS // kp))
  )
  if tile < 16 or tile & (tile - 1):
    raise ValueError(f"tile must be a power of two >= 16, got {tile}.")
  steps = steps or STEPS
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}.")
  chunk = tile * min(steps, pl.cdiv(rows, tile))
  return tile, chunk, kp


def compute_dtype(dtype):
  """The dtype arithmetic on a ``dtype`` state runs in: at least float32 (bf16 and float16
  states are stored narrow, computed wide)."""
  return jnp.promote_types(dtype, jnp.float32)


class _Tiles:
  """Masked access to the tiles of one program's chunk of rows (static sizes)."""

  def __init__(self, rows: int, rank: int, tile: int, chunk: int, kp: int, dtype):
    self.rows, self.rank, self.tile, self.chunk, self.kp = rows, rank, tile, chunk, kp
    self.steps = chunk // tile
    self.state_dtype = dtype
    self.dtype = compute_dtype(dtype)

  def rows_left(self):
    """Rows of the block from this program's first row on (read at the kernel's top level:
    the interpreter substitutes ``program_id`` only there, not inside loops)."""
    return self.rows - pl.program_id(1) * self.chunk

  def row_mask(self, left, step):
    """Rows of tile ``step`` that exist (the last chunk of a block overruns it)."""
    return step * self.tile + jnp.arange(self.tile) < left

  def col_mask(self):
    return jnp.arange(self.kp) < self.rank

  def vector(self, ref, step, mask):
    x = plgpu.load(ref.at[pl.ds(step * self.tile, self.tile)], mask=mask, other=0.0)
    return x.astype(self.dtype)

  def matrix(self, ref, step, mask):
    """``(tile, kp)`` tile of ``U``, zero in masked rows and padded columns."""
    full = mask[:, None] & self.col_mask()[None, :]
    x = plgpu.load(
      ref.at[pl.ds(step * self.tile, self.tile), pl.ds(0, self.kp)], mask=full, other=0.0
    )
    return x.astype(self.dtype)

  def small(self, ref):
    """A block's ``(k,)`` operand as ``(kp,)``, zero-padded."""
    return plgpu.load(ref.at[pl.ds(0, self.kp)], mask=self.col_mask(), other=0.0).astype(self.dtype)

  def square(self, ref):
    """A block's ``(k, k)`` operand as ``(kp, kp)``, zero-padded."""
    cols = self.col_mask()
    x = plgpu.load(
      ref.at[pl.ds(0, self.kp), pl.ds(0, self.kp)], mask=cols[:, None] & cols[None, :], other=0.0
    )
    return x.astype(self.dtype)

  def scalar(self, ref):
    return ref[...].astype(self.dtype)

  def column(self, x, j: int):
    """Column ``j`` of a ``(rows, kp)`` tile as ``(rows,)``: the row sums of the tile masked to
    lane ``j`` (one nonzero term a row: exact), since Triton cannot index a lane."""
    return jnp.sum(jnp.where(jnp.arange(self.kp)[None, :] == j, x, 0.0), axis=1)

  def row(self, x, j: int):
    """Row ``j`` of a ``(kp, kp)`` square as ``(kp,)``, likewise."""
    return jnp.sum(jnp.where(jnp.arange(self.kp)[:, None] == j, x, 0.0), axis=0)

  def loop(self, body, init):
    return jax.lax.fori_loop(0, self.steps, body, init)


def _specs(kp: int, chunk: int, first: int = 0):
  """BlockSpecs of the operand kinds over the grid ``(block, chunk of rows)``. Blocks span the
  padded rank ``kp`` (wider than the arrays' ``k``: the loads mask the extra columns), so that
  every slice a kernel takes lies inside its block. ``first``: block ``b`` of the grid reads
  block ``first + b`` of the small, square and scalar operands (joined operands)."""
  return {
    "u": pl.BlockSpec((None, chunk, kp), lambda b, c: (b, c, 0)),
    "vector": pl.BlockSpec((None, chunk), lambda b, c: (b, c)),
    "small": pl.BlockSpec((None, kp), lambda b, c: (b + first, 0)),
    "square": pl.BlockSpec((None, kp, kp), lambda b, c: (b + first, 0, 0)),
    "scalar": pl.BlockSpec((None,), lambda b, c: (b + first,)),
  }


def _partial_spec(parts: int, kp: int):
  return pl.BlockSpec((None, None, parts, kp), lambda b, c: (b, c, 0, 0))


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, aliases=None):
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    input_output_aliases=aliases or {},
    interpret=interpret,
    compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    name=name,
  )


def _flat(x, lead_ndim: int):
  """Leading axes (all but the trailing ``x.ndim - lead_ndim``) flattened into one."""
  return x.reshape((-1,) + x.shape[lead_ndim:])


# ---- Pallas: U^T [x_1 .. x_j] (passes 1 and the first half of precondition) -------------------


def _sums_kernel(t: _Tiles, count: int, l1: bool):
  """Partial ``U^T x_i`` (rows ``i``) of one program, and ``sum |x_1|`` in row ``count``."""

  def kernel(u_ref, *refs):
    x_refs, out_ref = refs[:count], refs[count]
    left = t.rows_left()

    def body(step, acc):
      mask = t.row_mask(left, step)
      u = t.matrix(u_ref, step, mask)
      xs = [t.vector(r, step, mask) for r in x_refs]
      sums = tuple(a + u * x[:, None] for a, x in zip(acc[:count], xs, strict=True))
      return sums + ((acc[count] + jnp.abs(xs[0]),) if l1 else ())

    zero = jnp.zeros((t.tile, t.kp), t.dtype)
    init = (zero,) * count + ((jnp.zeros((t.tile,), t.dtype),) if l1 else ())
    acc = t.loop(body, init)
    for i in range(count):
      out_ref[i, :] = jnp.sum(acc[i], axis=0)
    if l1:
      total = jnp.sum(acc[count])
      out_ref[count, :] = jnp.where(jnp.arange(t.kp) == 0, total, 0.0)

  return kernel


def _row_sums_pallas(u, xs, l1: bool, interpret: bool, tile=None, steps=None):
  """``(U^T x_i for each i, sum |x_1| or None)`` in the compute dtype, one read of ``U``."""
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  grid = (m, pl.cdiv(n, chunk))
  specs = _specs(kp, chunk)
  parts = len(xs) + (1 if l1 else 0)
  partial = _call(
    _sums_kernel(t, len(xs), l1),
    grid,
    [specs["u"]] + [specs["vector"]] * len(xs),
    _partial_spec(parts, kp),
    jax.ShapeDtypeStruct(grid + (parts, kp), t.dtype),
    interpret,
    "ginger_row_sums",
  )(u, *xs)
  total = jnp.sum(partial, axis=1)
  sums = [total[:, i, :k] for i in range(len(xs))]
  return sums, (total[:, len(xs), 0] if l1 else None)


# ---- Pallas: pass 2 --------------------------------------------------------------------------


def _first_residual_tile(t: _Tiles, u, v, a, inv_l1):
  """``p1 = (v - U a) inv_l1`` of a tile, rounded to the state dtype like the reference's: one
  expression shared by passes 2 and 3, so that both round it alike (on the GPU that relies on
  Triton compiling it alike in two kernels; ``with_p1`` / :func:`rotate_from_residual` avoid
  relying on it)."""
  p1 = (v - jnp.sum(u * a[None, :], axis=1)) * inv_l1
  return p1.astype(t.state_dtype).astype(t.dtype)


def _second_residual_tile(t: _Tiles, u, g, y):
  """``q1 = g - U y`` of a tile, rounded to the state dtype like the reference's: one
  expression for :func:`_residual_kernel` and :func:`_q1_kernel`, so that both give the same
  ``q1``."""
  q1 = g - jnp.sum(u * y[None, :], axis=1)
  return q1.astype(t.state_dtype).astype(t.dtype)


def _residual_kernel(t: _Tiles, with_p1: bool):
  def kernel(u_ref, v_ref, g_ref, a_ref, inv_l1_ref, ay_ref, out_ref, p1_ref=None, q1_ref=None):
    a, inv_l1, ay = t.small(a_ref), t.scalar(inv_l1_ref), t.small(ay_ref)
    left = t.rows_left()

    def body(step, acc):
      c2, c3, pp, pq, vv = acc
      mask = t.row_mask(left, step)
      u = t.matrix(u_ref, step, mask)
      v, g = t.vector(v_ref, step, mask), t.vector(g_ref, step, mask)
      p1 = _first_residual_tile(t, u, v, a, inv_l1)
      q1 = _second_residual_tile(t, u, g, ay)
      if with_p1:
        rows = pl.ds(step * t.tile, t.tile)
        plgpu.store(p1_ref.at[rows], p1.astype(p1_ref.dtype), mask=mask)
        plgpu.store(q1_ref.at[rows], q1.astype(q1_ref.dtype), mask=mask)
      vs = v * inv_l1
      return c2 + u * p1[:, None], c3 + u * q1[:, None], pp + p1 * p1, pq + p1 * q1, vv + vs * vs

    rows = jnp.zeros((t.tile,), t.dtype)
    square = jnp.zeros((t.tile, t.kp), t.dtype)
    c2, c3, pp, pq, vv = t.loop(body, (square, square, rows, rows, rows))
    out_ref[0, :] = jnp.sum(c2, axis=0)
    out_ref[1, :] = jnp.sum(c3, axis=0)
    lane = jnp.arange(t.kp)
    out_ref[2, :] = jnp.where(
      lane == 0,
      jnp.sum(pp),
      jnp.where(lane == 1, jnp.sum(pq), jnp.where(lane == 2, jnp.sum(vv), 0)),
    )

  return kernel


def _residual_sums_pallas(u, v, g, a, inv_l1, ay, interpret, tile=None, steps=None, with_p1=False):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  grid = (m, pl.cdiv(n, chunk))
  s = _specs(kp, chunk)
  out_specs = [_partial_spec(3, kp)]
  out_shape = [jax.ShapeDtypeStruct(grid + (3, kp), t.dtype)]
  if with_p1:
    out_specs += [s["vector"]] * 2
    out_shape += [jax.ShapeDtypeStruct(v.shape, u.dtype)] * 2
  partial, *vectors = _call(
    _residual_kernel(t, with_p1),
    grid,
    [s["u"], s["vector"], s["vector"], s["small"], s["scalar"], s["small"]],
    out_specs,
    out_shape,
    interpret,
    "ginger_residual_sums",
  )(u, v, g, a, inv_l1, ay)
  total = jnp.sum(partial, axis=1)
  return (
    total[:, 0, :k],
    total[:, 2, 0],
    total[:, 2, 1],
    total[:, 2, 2],
    total[:, 1, :k],
    *vectors,
  )


def _q1_kernel(t: _Tiles):
  """:func:`_residual_kernel` for ``g`` alone: ``q1 = g - U y`` (the same expression, rounded to
  the state dtype alike) stored, and the partial ``U^T q1``; no ``p1``, no norms."""

  def kernel(u_ref, g_ref, y_ref, out_ref, q1_ref):
    y = t.small(y_ref)
    left = t.rows_left()

    def body(step, c3):
      mask = t.row_mask(left, step)
      u = t.matrix(u_ref, step, mask)
      g = t.vector(g_ref, step, mask)
      q1 = _second_residual_tile(t, u, g, y)
      plgpu.store(q1_ref.at[pl.ds(step * t.tile, t.tile)], q1.astype(q1_ref.dtype), mask=mask)
      return c3 + u * q1[:, None]

    c3 = t.loop(body, jnp.zeros((t.tile, t.kp), t.dtype))
    out_ref[0, :] = jnp.sum(c3, axis=0)

  return kernel


def _residual_pallas(u, g, y, interpret, tile=None, steps=None):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  grid = (m, pl.cdiv(n, chunk))
  s = _specs(kp, chunk)
  partial, q1 = _call(
    _q1_kernel(t),
    grid,
    [s["u"], s["vector"], s["small"]],
    [_partial_spec(1, kp), s["vector"]],
    [jax.ShapeDtypeStruct(grid + (1, kp), t.dtype), jax.ShapeDtypeStruct(g.shape, u.dtype)],
    interpret,
    "ginger_residual",
  )(u, g, y)
  return jnp.sum(partial, axis=1)[:, 0, :k], q1


# ---- Pallas: pass 3 (in place) and the preconditioning half of precondition -------------------


def _rotate_kernel(t: _Tiles, from_p1: bool):
  """Pass 3 from ``(v, a1, inv_l1)`` (recomputing ``p1``) or from a stored ``p1``."""

  def kernel(u_ref, *refs):
    if from_p1:
      p1_ref, q_ref, *refs = refs
    else:
      v_ref, q_ref, a1_ref, inv_l1_ref, *refs = refs
      a1, inv_l1 = t.small(a1_ref), t.scalar(inv_l1_ref)
    a2_ref, inv_r_ref, rot_ref, b_ref, a_ref, beta_ref, gamma_ref, u_out_ref, out_ref = refs
    a2, b, a = t.small(a2_ref), t.small(b_ref), t.small(a_ref)
    inv_r, beta, gamma = t.scalar(inv_r_ref), t.scalar(beta_ref), t.scalar(gamma_ref)
    rot = t.square(rot_ref)
    rot_rows = None if t.kp >= 16 else [t.row(rot, j) for j in range(t.rank)]
    left = t.rows_left()

    @pl.loop(0, t.steps)
    def _(step):
      mask = t.row_mask(left, step)
      u = t.matrix(u_ref, step, mask)
      q = t.vector(q_ref, step, mask)
      if from_p1:
        p1 = t.vector(p1_ref, step, mask)
      else:
        p1 = _first_residual_tile(t, u, t.vector(v_ref, step, mask), a1, inv_l1)
      p = (p1 - jnp.sum(u * a2[None, :], axis=1)) * inv_r
      if rot_rows is None:
        # An fp32 dot at HIGHEST is Triton's "ieee" input precision (no TF32, which would
        # break U^T U = I).
        u_new = jnp.dot(u, rot, precision=HIGHEST, preferred_element_type=t.dtype)
      else:  # column j of the tile times row j of rot (ROTATE_MIN_PADDED_RANK)
        u_new = jnp.zeros((t.tile, t.kp), t.dtype)
        for j, row in enumerate(rot_rows):
          u_new = u_new + t.column(u, j)[:, None] * row[None, :]
      u_new = u_new + p[:, None] * b[None, :]
      out = (q - jnp.sum(u * a[None, :], axis=1) - p * beta) / gamma
      rows = pl.ds(step * t.tile, t.tile)
      full = mask[:, None] & t.col_mask()[None, :]
      plgpu.store(u_out_ref.at[rows, pl.ds(0, t.kp)], u_new.astype(u_out_ref.dtype), mask=full)
      plgpu.store(out_ref.at[rows], out.astype(out_ref.dtype), mask=mask)

  return kernel


def _rotate_pallas(u, *arrays, from_p1: bool, interpret, tile=None, steps=None, first=0):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps, rotate=True)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  s = _specs(kp, chunk, first)
  residual = [s["vector"]] if from_p1 else [s["vector"], s["small"], s["scalar"]]
  g = arrays[1]  # (p1 or v, g, ...)
  return _call(
    _rotate_kernel(t, from_p1),
    (m, pl.cdiv(n, chunk)),
    [s["u"]]
    + residual[:1]
    + [s["vector"]]
    + residual[1:]
    + [s["small"], s["scalar"], s["square"], s["small"], s["small"], s["scalar"], s["scalar"]],
    [s["u"], s["vector"]],
    [jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype)],
    interpret,
    "ginger_rotate_and_precondition",
    aliases={0: 0},  # U' overwrites U: each program reads its rows before writing them
  )(u, *arrays)


def _correct_kernel(t: _Tiles):
  def kernel(u_ref, q_ref, a_ref, gamma_ref, out_ref):
    a, gamma = t.small(a_ref), t.scalar(gamma_ref)
    left = t.rows_left()

    @pl.loop(0, t.steps)
    def _(step):
      mask = t.row_mask(left, step)
      u = t.matrix(u_ref, step, mask)
      q = t.vector(q_ref, step, mask)
      out = (q - jnp.sum(u * a[None, :], axis=1)) / gamma
      plgpu.store(out_ref.at[pl.ds(step * t.tile, t.tile)], out.astype(out_ref.dtype), mask=mask)

  return kernel


def _correct_pallas(u, q, a, gamma, *, interpret, tile=None, steps=None):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  s = _specs(kp, chunk)
  return _call(
    _correct_kernel(t),
    (m, pl.cdiv(n, chunk)),
    [s["u"], s["vector"], s["small"], s["scalar"]],
    s["vector"],
    jax.ShapeDtypeStruct(q.shape, q.dtype),
    interpret,
    "ginger_correct",
  )(u, q, a, gamma)


# ---- public API -------------------------------------------------------------------------------


def _dispatch(jnp_fn, pallas_fn, u, arrays, impl, interpret, tile, steps):
  """Runs ``jnp_fn(u, *arrays)`` or the kernel on ``(blocks, ...)``-flattened operands. A ``u``
  without entries (the bucket of a leaf of size 0) takes the jnp path: no kernel to launch."""
  impl, interpret = resolve_impl(impl, interpret)
  if impl == "jnp" or u.size == 0:
    return jnp_fn(u, *arrays)
  lead = u.shape[:-2]
  flat = [_flat(x, len(lead)) for x in (u, *arrays)]
  outs = pallas_fn(*flat, interpret=interpret, tile=tile, steps=steps)
  return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]).astype(u.dtype), outs)


def project_pair(u, v, g, *, impl="auto", interpret=None, tile=None, steps=None):
  """Pass 1 (reads ``U``): ``(U^T v, U^T g, sum |v|)`` per block.

  ``u``: ``(..., n, k)``; ``v, g``: ``(..., n)``. Returns ``(..., k)``, ``(..., k)``, ``(...)``.
  ``tile`` / ``steps`` (pallas only) override the rows per tile / tiles per program.
  """
  _check(u, {"v": v, "g": g})

  def pallas_fn(u, v, g, **kw):
    (cv, cg), l1 = _row_sums_pallas(u, [v, g], True, **kw)
    return cv, cg, l1

  return _dispatch(_project_pair_jnp, pallas_fn, u, (v, g), impl, interpret, tile, steps)


def residual_sums(
  u, v, g, a, inv_l1, ay, *, with_p1=False, impl="auto", interpret=None, tile=None, steps=None
):
  """Pass 2 (reads ``U``): the residuals ``p1 = (v - U a) inv_l1`` and ``q1 = g - U ay``, and
  ``(U^T p1, ||p1||^2, p1 . q1, ||v inv_l1||^2, U^T q1)`` per block. ``a``, ``ay``: ``(..., k)``
  (``U``'s coefficients of ``v`` and ``g`` from pass 1); ``inv_l1``: ``(...)`` or a scalar.

  ``U^T p1`` and ``U^T q1`` are the re-orthogonalisation coefficients of CGS2 (classical
  Gram-Schmidt with a second pass) for ``v`` and ``g``. ``with_p1``: also return ``p1`` and
  ``q1`` themselves (``(..., n)`` each) for :func:`rotate_from_residual`, so that pass 3
  subtracts ``U c`` from the very residual whose ``c = U^T p1`` (or ``U^T q1``) was measured
  here, by construction, not by two kernels compiling alike.
  """
  _check(u, {"v": v, "g": g}, {"a": a, "ay": ay})
  inv_l1 = _scalar("inv_l1", inv_l1, u)
  return _dispatch(
    functools.partial(_residual_sums_jnp, with_p1=with_p1),
    functools.partial(_residual_sums_pallas, with_p1=with_p1),
    u,
    (v, g, a, inv_l1, ay),
    impl,
    interpret,
    tile,
    steps,
  )


def rotate_and_precondition(
  u, v, q, a1, inv_l1, a2, inv_r, rot, b, a, beta, gamma, *, impl="auto", interpret=None,
  tile=None, steps=None,
):  # fmt: skip
  """Pass 3 (reads ``U``, writes ``U'``): ``p = ((v - U a1) inv_l1 - U a2) inv_r``,
  ``U' = U rot + p b^T`` and ``(q - U a - p beta) / gamma``. Returns ``(U', out)``.

  ``a1, a2, b, a``: ``(..., k)``; ``rot``: ``(..., k, k)``; ``inv_l1, inv_r, beta, gamma``:
  ``(...)`` or scalars. The pallas kernel writes ``U'`` into ``U``'s buffer (donate ``U`` to the
  jitted caller, or XLA copies it first to keep the input alive).
  """
  _check(u, {"v": v, "q": q}, {"a1": a1, "a2": a2, "b": b, "a": a}, {"rot": rot})
  scalars = [_scalar(n, x, u) for n, x in (("inv_l1", inv_l1), ("inv_r", inv_r))]
  beta, gamma = _scalar("beta", beta, u), _scalar("gamma", gamma, u)
  arrays = (v, q, a1, scalars[0], a2, scalars[1], rot, b, a, beta, gamma)
  return _dispatch(
    _rotate_and_precondition_jnp,
    functools.partial(_rotate_pallas, from_p1=False),
    u,
    arrays,
    impl,
    interpret,
    tile,
    steps,
  )


def rotate_from_residual(
  u, p1, q, a2, inv_r, rot, b, a, beta, gamma, *, first=0, impl="auto", interpret=None,
  tile=None, steps=None, rows_per_block=None, row_shards=1,
):  # fmt: skip
  """Pass 3 from pass 2's residuals (``residual_sums(..., with_p1=True)``): ``p = (p1 - U a2)
  inv_r``, ``U' = U rot + p b^T`` and ``(q - U a - p beta) / gamma`` (``q``: pass 2's ``q1``,
  the residual of the vector being preconditioned). Same as :func:`rotate_and_precondition`
  with ``p1 = (v - U a1) inv_l1``; reads ``p1`` instead of ``v``. ``U'`` is written into
  ``U``'s buffer as there: by the kernel (pallas), or block of rows by block of rows in a loop
  (jnp on GPUs, see :data:`JNP_ROW_BLOCKS`, for a ``U`` of more than
  :data:`ROW_BLOCK_ELEMENTS`; ``rows_per_block`` overrides the rows of a block, see
  :func:`row_block`, and forces the blocked path). The jnp path off GPUs rotates the whole
  ``U`` at once, with the output as ``k`` multiply-adds (faster on the CPU, one more ``U``
  of memory). ``row_shards``: the number of devices ``U``'s rows are split over (a sharded
  state), so that the row blocks are blocks of each device's own rows.

  ``first``: the small operands (``a2, inv_r, rot, b, a, beta``, and ``gamma`` unless a
  scalar) may be those of several calls joined along their first axis (one batched solve of
  Brand's cores for several buckets): ``u`` (``(blocks, n, k)``) then uses their blocks
  ``first`` to ``first + blocks``. The kernel reads them there (an offset in its block index
  maps): slices cut out for it would each be one more small copy kernel on a GPU."""
  blocks = _joined_blocks(u, first, a2)
  _check(u, {"p1": p1, "q": q}, {"a2": a2, "b": b, "a": a}, {"rot": rot}, blocks)
  inv_r, gamma = _scalar("inv_r", inv_r, u, blocks), _scalar("gamma", gamma, u, blocks)
  beta = _scalar("beta", beta, u, blocks)
  rows = row_block(u.shape, rows_per_block)  # checks rows_per_block before anything is traced
  if rows_per_block is not None or _jnp_row_blocks():
    jnp_fn = functools.partial(
      _rotate_in_row_blocks,
      rows_per_block=None if rows_per_block is None else rows,
      row_shards=row_shards,
    )
  else:
    jnp_fn = _rotate_from_residual_jnp
  if blocks is not None:
    m, joined_fn = u.shape[0], jnp_fn

    def jnp_fn(u, p1, q, *smalls):
      return joined_fn(u, p1, q, *(x[first : first + m] for x in smalls))

  return _dispatch(
    jnp_fn,
    functools.partial(_rotate_pallas, from_p1=True, first=first),
    u,
    (p1, q, a2, inv_r, rot, b, a, beta, gamma),
    impl,
    interpret,
    tile,
    steps,
  )


def project(u, g, *, impl="auto", interpret=None, tile=None, steps=None):
  """``U^T g`` per block (one read of ``U``), in the compute dtype (:func:`compute_dtype`):
  :func:`precondition`'s first pass, for callers that add it over devices themselves.
  ``u``: ``(..., n, k)``; ``g``: ``(..., n)``; returns ``(..., k)``."""
  _check(u, {"g": g})
  impl, interpret = resolve_impl(impl, interpret)
  # Widened exactly from U's dtype, which the passes round back to.
  if impl == "jnp" or u.size == 0:
    return _row_sums(u, [g])[..., 0].astype(compute_dtype(u.dtype))
  lead = u.shape[:-2]
  (y,), _ = _row_sums_pallas(
    _flat(u, len(lead)), [_flat(g, len(lead))], False, interpret, tile, steps
  )
  return y.reshape(lead + y.shape[1:])


def residual(u, g, y, *, impl="auto", interpret=None, tile=None, steps=None):
  """``(U^T q1, q1)`` with ``q1 = g - U y`` (one read of ``U``): :func:`precondition`'s second
  pass, the CGS2 coefficient of ``g``'s residual. ``y``: ``(..., k)``, ``U^T g`` as
  :func:`project` returns it. ``U^T q1`` in the compute dtype (rounded through ``U``'s dtype
  first, as :func:`residual_sums` returns it), ``q1`` in ``U``'s.

  :func:`residual_sums`' arithmetic for ``q1`` alone: the same ``q1`` and ``U^T q1``, without
  ``p1``, its sums and norms (a step without a curvature update has no ``v``), so the kernel
  reads ``U`` and ``g`` and writes ``q1``, one vector in and one out fewer."""
  y = y.astype(u.dtype)
  _check(u, {"g": g}, {"y": y})
  c, q1 = _dispatch(_residual_jnp, _residual_pallas, u, (g, y), impl, interpret, tile, steps)
  return c.astype(compute_dtype(u.dtype)), q1


def correct(u, q, a, gamma, *, impl="auto", interpret=None, tile=None, steps=None):
  """``(q - U a) / gamma`` per block (one read of ``U``): :func:`precondition`'s last pass.
  ``a``: ``(..., k)``; ``gamma``: ``(...)`` or a scalar."""
  a = a.astype(u.dtype)
  _check(u, {"q": q}, {"a": a})
  gamma = _scalar("gamma", gamma, u)
  return _dispatch(_correct_jnp, _correct_pallas, u, (q, a, gamma), impl, interpret, tile, steps)


def complement_coefficient(sigma, gamma, y, c):
  """``a`` of :func:`correct` that makes ``(q1 - U a) / gamma`` the preconditioned ``g``:
  ``a = c - gamma / (gamma + sigma) * (y + c)`` with ``y = U^T g``, ``c = U^T q1`` (in the
  compute dtype). ``G^{-1} g = (q + U s) / gamma`` with ``q = q1 - U c`` the part of ``g``
  outside ``span U`` (CGS2: orthogonal to ``U`` to working precision whatever ``g``) and
  ``s = gamma / (gamma + sigma) * (y + c)`` its part inside, scaled by ``1 / (gamma + sigma)``.
  Formed this way no term of size ``|g|`` cancels, so ``U^T`` of the result is accurate to
  rounding relative to ``|q1|``, not ``|g|`` (docs/ginger-math.md, section 6)."""
  dtype = compute_dtype(y.dtype)
  sigma, y, c = sigma.astype(dtype), y.astype(dtype), c.astype(dtype)
  gamma = jnp.asarray(gamma, dtype)
  gamma = gamma[..., None] if gamma.ndim else gamma
  return c - gamma / (gamma + sigma) * (y + c)


def precondition(
  u, sigma, g, gamma, *, uT_g=None, impl="auto", interpret=None, tile=None, steps=None
):
  """``G^{-1} g = (g - U diag(sigma / (gamma + sigma)) U^T g) / gamma`` with ``U`` as it is
  (a step without a curvature update), computed as :func:`complement_coefficient` says:
  three reads of ``U`` (:func:`project`, :func:`residual`, :func:`correct`). ``sigma``:
  ``(..., k)``. ``uT_g``: ``U^T g`` where the caller has it (:func:`project`, e.g. added over
  devices): then two."""
  _check(u, {"g": g}, {"sigma": sigma})
  kw = dict(impl=impl, interpret=interpret, tile=tile, steps=steps)
  if uT_g is not None and (uT_g.shape != sigma.shape or uT_g.dtype != compute_dtype(u.dtype)):
    raise ValueError(
      f"uT_g must have shape {sigma.shape} and dtype {compute_dtype(u.dtype)} (as project "
      f"returns it; u is {u.shape} {u.dtype}), got {uT_g.shape} {uT_g.dtype}."
    )
  gamma = _scalar("gamma", gamma, u)
  y = project(u, g, **kw) if uT_g is None else uT_g
  c, q1 = residual(u, g, y, **kw)
  return correct(u, q1, complement_coefficient(sigma, gamma, y, c), gamma, **kw)


__all__ = [
  "IMPLS",
  "JNP_ROW_BLOCKS",
  "MAX_ROW_BLOCKS",
  "MIN_PADDED_RANK",
  "ROTATE_MIN_PADDED_RANK",
  "ROTATE_TILE_ROWS",
  "ROW_BLOCK_ELEMENTS",
  "complement_coefficient",
  "correct",
  "precondition",
  "project",
  "project_pair",
  "residual",
  "residual_sums",
  "resolve_impl",
  "rotate_and_precondition",
  "rotate_from_residual",
  "row_block",
  "tiling",
]
