"""How the passes over ``U`` are tiled and blocked: speed knobs, never results.

A :class:`Tuning` is frozen and hashable, and every pass takes it as an argument
(``tuning=``), so that it is part of what a jitted caller is specialised on (a static argument,
or a value its traced function closes over): two tunings are two compiled programs, and no
pass reads a module global while it is traced. :data:`DEFAULT` is what the passes use unless
given another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


def _pairs(name: str, x) -> tuple[tuple[int, int], ...]:
  """A ``{padded rank: rows}`` mapping (or its items) as a sorted tuple of pairs (hashable)."""
  items = x.items() if isinstance(x, Mapping) else x
  try:
    pairs = tuple(sorted((int(k), int(v)) for k, v in items))
  except (TypeError, ValueError):
    raise ValueError(f"{name} must map padded ranks to rows per tile, got {x!r}.") from None
  for kp, rows in pairs:
    if not _power_of_two(rows, 16):
      raise ValueError(f"{name}[{kp}] must be a power of two >= 16 (rows per tile), got {rows}.")
  return pairs


def _power_of_two(x, least: int) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= least and not x & (x - 1)


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Tilings of the Pallas passes and row blocks of the jnp rotation.

  Pallas (a program streams ``steps`` tiles of ``tile x kp`` elements of ``U``, ``kp`` the rank
  padded to a power of two). The defaults are what ``bench.kernel_tiling`` measured fastest for
  ResNet-18's buckets on an H200 (docs/benchmarks.md, "Design decisions", Tiling):

  * ``tile_rows``: rows per tile by padded rank, ``{kp: rows}`` (a mapping or its items): the
    largest tile that keeps the registers from spilling, 512 rows at 16 lanes, 64 at 32. Other
    ranks take ``tile_elements / kp`` rows, at most ``max_tile_rows``.
  * ``rotate_tile_rows``: pass 3's rows per tile where they differ from ``tile_rows``. None:
    larger tiles at rank 32 speed up pass 3's dot alone but not the whole update.
  * ``steps``: tiles a program streams. One: fewer, larger tiles beat more, smaller ones.
  * ``min_padded_rank``: lanes of passes 1 and 2 (a power of two >= 4); 16, since rank 8 in 8
    lanes made the update slower.
  * ``rotate_min_padded_rank``: lanes of pass 3 (a power of two >= 4). Below 16 lanes the
    rotation ``U rot`` is formed column by column (column ``j`` of the tile, a masked row sum,
    exact, times row ``j`` of ``rot``: ``k`` multiply-adds per entry in the reference's order);
    at 16 and more it is one Triton dot (``tl.dot`` needs 16). At rank 8 the dot is slower (its
    operands change layout through shared memory, and 16 lanes quadruple the multiply-adds),
    close to an elementwise pass over the same bytes column by column; at rank 32 the dot is
    several times faster than the columns.
  * ``num_warps``, ``num_stages``: Triton's warps per program and software-pipelining stages
    (None: Triton's own).

  jnp (the rotation's memory):

  * ``jnp_row_blocks``: whether the jnp rotation runs in row blocks written back into ``U`` (a
    ``fori_loop``), so that besides ``U`` only a block of ``U'`` is alive: None on GPUs only,
    True always, False never. Not on the CPU by default: XLA:CPU copies each block's slice of
    ``U`` out and back and, inside the loop, no longer fuses the output's multiply-adds, so
    there the rotation in one piece, bought with a second ``U``'s memory, is faster.
  * ``row_block_elements``: a ``U`` of more elements than this is rotated in blocks of about
    this many, in at most ``max_row_blocks`` blocks (each a loop iteration: a few kernel
    launches on a GPU).

  Buckets (how the blocks' bases are stacked, :func:`ginger._src.common.plan_layout`, read when
  the state is initialised; a checkpoint does not depend on them):

  * ``bucket_overhead``: the fixed per-step cost of one bucket (a few kernel launches) in
    padded row-entries (rows x (rank + 2): ``U`` plus the vectors). Blocks of different sizes
    share a bucket while the padding that adds costs less than this; the default, 2^21, gave
    ResNet-18 the fastest update on an H200 (docs/benchmarks.md, "How many buckets").
  * ``solo_buckets``: whether per-tensor blocks of at least ``solo_rows`` rows get a bucket of
    their own (no padding, no stacking): None off GPUs only, True always, False never.
    Stacking is what makes a GPU step a few launches per bucket; on the CPU a bucket costs a
    few thunks, but a stacked bucket copies every step's ``v`` and ``g`` into ``(members,
    rows)`` arrays, while a bucket of one block reads them where they are (a reshape), which
    makes the CPU step faster.
  """

  tile_rows: tuple[tuple[int, int], ...] = ((16, 512), (32, 64))
  rotate_tile_rows: tuple[tuple[int, int], ...] = ()
  tile_elements: int = 2048
  max_tile_rows: int = 512
  steps: int = 1
  min_padded_rank: int = 16
  rotate_min_padded_rank: int = 8
  num_warps: int = 4
  num_stages: int | None = None
  jnp_row_blocks: bool | None = None
  row_block_elements: int = 1 << 24
  max_row_blocks: int = 16
  bucket_overhead: int = 1 << 21
  solo_buckets: bool | None = None
  solo_rows: int = 1 << 15

  def __post_init__(self):
    for name in ("tile_rows", "rotate_tile_rows"):
      object.__setattr__(self, name, _pairs(name, getattr(self, name)))
    for name in ("min_padded_rank", "rotate_min_padded_rank"):
      if not _power_of_two(getattr(self, name), 4):
        raise ValueError(f"{name} must be a power of two >= 4, got {getattr(self, name)!r}.")
    for name in ("tile_elements", "max_tile_rows", "steps", "num_warps", "row_block_elements"):
      _positive(name, getattr(self, name))
    for name in ("max_row_blocks", "solo_rows"):
      _positive(name, getattr(self, name))
    if self.num_stages is not None:
      _positive("num_stages", self.num_stages)
    if isinstance(self.bucket_overhead, bool) or not isinstance(self.bucket_overhead, int):
      raise ValueError(f"bucket_overhead must be an int >= 0, got {self.bucket_overhead!r}.")
    if self.bucket_overhead < 0:
      raise ValueError(f"bucket_overhead must be an int >= 0, got {self.bucket_overhead!r}.")
    for name in ("jnp_row_blocks", "solo_buckets"):
      if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
        raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}.")

  def rows_per_tile(self, kp: int, rotate: bool) -> int:
    """Rows of one tile of ``U`` at padded rank ``kp`` (pass 3's if ``rotate``)."""
    rows = (dict(self.rotate_tile_rows).get(kp) if rotate else None) or dict(self.tile_rows).get(kp)
    return rows or min(self.max_tile_rows, max(16, self.tile_elements // kp))


def _positive(name: str, x) -> None:
  if isinstance(x, bool) or not isinstance(x, int) or x < 1:
    raise ValueError(f"{name} must be an int >= 1, got {x!r}.")


DEFAULT = Tuning()
