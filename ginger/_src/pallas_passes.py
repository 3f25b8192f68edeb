"""The passes over the stacked bases ``U`` as fused Pallas kernels.

The formulas are those of the jnp reference, :mod:`ginger._src.lowrank`; the public entry
points, which check their operands and pick an implementation, are :mod:`ginger._src.kernels`.

One ``pl.pallas_call`` per pass (Triton lowering on GPUs, interpreted elsewhere), each program
owning a chunk of rows of one block: it streams ``tile x k`` tiles of ``U`` (rows past the block
masked, ``k`` padded to a power of two of at least ``tuning.min_padded_rank`` lanes,
``tuning.rotate_min_padded_rank`` in pass 3, as Triton requires, see :class:`Tuning`) and keeps
the small ``(k,)`` / ``(k, k)`` operands of its block in registers. Row reductions (``U^T x``)
leave one partial sum per program, added up by a small jnp sum over the chunks (no atomics: the
result does not depend on the launch order). Pass 3 writes ``U'`` over ``U``
(``input_output_aliases``): each program reads its rows before writing them.

Operands arrive flattened to ``(blocks, ...)``; arithmetic runs in :func:`compute_dtype` (at
least float32), ``p1`` and ``q1`` rounded to ``U``'s dtype like the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ginger._src.tuning import DEFAULT, Tuning

HIGHEST = jax.lax.Precision.HIGHEST


# ---- Pallas: tiling and masked tile access ----------------------------------------------------


def _pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def tiling(
  rows: int,
  rank: int,
  tile: int | None = None,
  steps: int | None = None,
  *,
  rotate: bool = False,
  tuning: Tuning = DEFAULT,
):
  """``(tile, chunk, padded rank)``: rows per tile, rows per program, rank padded to a power
  of two >= ``tuning.min_padded_rank`` (Triton's block sizes are powers of two). ``rotate``:
  pass 3's (``tuning.rotate_min_padded_rank``, ``tuning.rotate_tile_rows``). ``tile`` /
  ``steps`` override the tuning's."""
  kp = max(tuning.rotate_min_padded_rank if rotate else tuning.min_padded_rank, _pow2(rank))
  tile = tile or tuning.rows_per_tile(kp, rotate)
  if tile < 16 or tile & (tile - 1):
    raise ValueError(f"tile must be a power of two >= 16, got {tile}.")
  steps = steps or tuning.steps
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


def call(
  kernel, grid, in_specs, out_specs, out_shape, interpret, name, aliases=None, tuning=DEFAULT
):
  """``pl.pallas_call`` with the tuning's Triton parameters (warps, pipelining stages)."""
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    input_output_aliases=aliases or {},
    interpret=interpret,
    compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
    name=name,
  )


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


def row_sums(u, xs, l1: bool, interpret: bool, tile=None, steps=None, tuning=DEFAULT):
  """``(U^T x_i for each i, sum |x_1| or None)`` in the compute dtype, one read of ``U``."""
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps, tuning=tuning)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  grid = (m, pl.cdiv(n, chunk))
  specs = _specs(kp, chunk)
  parts = len(xs) + (1 if l1 else 0)
  partial = call(
    _sums_kernel(t, len(xs), l1),
    grid,
    [specs["u"]] + [specs["vector"]] * len(xs),
    _partial_spec(parts, kp),
    jax.ShapeDtypeStruct(grid + (parts, kp), t.dtype),
    interpret,
    "ginger_row_sums",
    tuning=tuning,
  )(u, *xs)
  total = jnp.sum(partial, axis=1)
  sums = [total[:, i, :k] for i in range(len(xs))]
  return sums, (total[:, len(xs), 0] if l1 else None)


# ---- Pallas: pass 2 --------------------------------------------------------------------------


def _first_residual_tile(t: _Tiles, u, v, a, inv_l1):
  """``p1 = (v - U a) inv_l1`` of a tile, rounded to the state dtype like the reference's: one
  expression shared by passes 2 and 3, so that both round it alike (on the GPU that relies on
  Triton compiling it alike in two kernels; ``with_p1`` and pass 3 from a stored ``p1`` avoid
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


def residual_sums(
  u, v, g, a, inv_l1, ay, interpret, tile=None, steps=None, tuning=DEFAULT, with_p1=False
):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps, tuning=tuning)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  grid = (m, pl.cdiv(n, chunk))
  s = _specs(kp, chunk)
  out_specs = [_partial_spec(3, kp)]
  out_shape = [jax.ShapeDtypeStruct(grid + (3, kp), t.dtype)]
  if with_p1:
    out_specs += [s["vector"]] * 2
    out_shape += [jax.ShapeDtypeStruct(v.shape, u.dtype)] * 2
  partial, *vectors = call(
    _residual_kernel(t, with_p1),
    grid,
    [s["u"], s["vector"], s["vector"], s["small"], s["scalar"], s["small"]],
    out_specs,
    out_shape,
    interpret,
    "ginger_residual_sums",
    tuning=tuning,
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


def residual(u, g, y, interpret, tile=None, steps=None, tuning=DEFAULT):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps, tuning=tuning)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  grid = (m, pl.cdiv(n, chunk))
  s = _specs(kp, chunk)
  partial, q1 = call(
    _q1_kernel(t),
    grid,
    [s["u"], s["vector"], s["small"]],
    [_partial_spec(1, kp), s["vector"]],
    [jax.ShapeDtypeStruct(grid + (1, kp), t.dtype), jax.ShapeDtypeStruct(g.shape, u.dtype)],
    interpret,
    "ginger_residual",
    tuning=tuning,
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
      else:  # column j of the tile times row j of rot (tuning.rotate_min_padded_rank)
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


def rotate(u, *arrays, from_p1: bool, interpret, tile=None, steps=None, tuning=DEFAULT, first=0):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps, rotate=True, tuning=tuning)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  s = _specs(kp, chunk, first)
  residual = [s["vector"]] if from_p1 else [s["vector"], s["small"], s["scalar"]]
  g = arrays[1]  # (p1 or v, g, ...)
  return call(
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
    tuning=tuning,
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


def correct(u, q, a, gamma, *, interpret, tile=None, steps=None, tuning=DEFAULT):
  m, n, k = u.shape
  tile, chunk, kp = tiling(n, k, tile, steps, tuning=tuning)
  t = _Tiles(n, k, tile, chunk, kp, u.dtype)
  s = _specs(kp, chunk)
  return call(
    _correct_kernel(t),
    (m, pl.cdiv(n, chunk)),
    [s["u"], s["vector"], s["small"], s["scalar"]],
    s["vector"],
    jax.ShapeDtypeStruct(q.shape, q.dtype),
    interpret,
    "ginger_correct",
    tuning=tuning,
  )(u, q, a, gamma)
