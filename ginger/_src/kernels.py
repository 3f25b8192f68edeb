"""The passes over the stacked bases ``U``: operands checked, then run as the jnp reference
(:mod:`ginger._src.lowrank`) or as fused Pallas kernels (:mod:`ginger._src.pallas_passes`).

A Ginger step reads the stacked bases ``u`` (``(blocks, rows, k)`` per bucket, see
:mod:`ginger._src.lowrank`) three times; everything else is ``O(k^2)`` per block. Each pass is
memory-bound (about ``2k`` flops per element of ``U`` read), so it should cost one read of
``U`` (and one write for the rotation) and nothing more. Each pass runs one of two ways:

* ``impl="jnp"``: the formulas of :mod:`ginger._src.lowrank` (the reference, and the CPU path):
  XLA decides what it fuses.
* ``impl="pallas"``: one ``pl.pallas_call`` per pass (:mod:`ginger._src.pallas_passes`: Triton
  lowering on GPUs, interpreted elsewhere).

Every pass takes ``tuning`` (:class:`Tuning`: tilings of the kernels, row blocks of the jnp
rotation), a frozen, hashable value fixed when the step is traced: a jitted caller that passes
another one compiles another program, and nothing here reads a module global while tracing.

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
:func:`rotate_from_residual` gets the same from XLA on GPUs (``tuning.jnp_row_blocks``; on the
CPU it rotates the whole ``U`` at once, which is faster there): on a ``U`` of more than
``tuning.row_block_elements`` elements it applies the reference formula to row blocks in a
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

import jax
import jax.numpy as jnp

from ginger._src import lowrank, pallas_passes
from ginger._src.lowrank import row_block
from ginger._src.pallas_passes import compute_dtype, tiling
from ginger._src.tuning import DEFAULT, Tuning

IMPLS = ("auto", "jnp", "pallas")
# The kernels, looked up here when a pass runs (tests substitute them).
_row_sums_pallas = pallas_passes.row_sums
_residual_sums_pallas = pallas_passes.residual_sums
_residual_pallas = pallas_passes.residual
_rotate_pallas = pallas_passes.rotate
_correct_pallas = pallas_passes.correct


# ---- arguments -------------------------------------------------------------------------------


def _on_gpu() -> bool:
  return lowrank.on_gpu()


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


def _check(
  u, vectors: dict, smalls: dict | None = None, squares: dict | None = None, blocks=None, *, tuning
):
  """Shapes of one pass's operands against ``u`` (``(..., n, k)``), before anything is traced
  into a kernel. ``blocks``: the leading shape of the small and square operands (default
  ``u``'s, see :func:`_joined_blocks`), and that ``tuning`` is a :class:`Tuning`."""
  if not isinstance(tuning, Tuning):
    raise ValueError(f"tuning must be a ginger.Tuning, got {tuning!r}.")
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


def _jnp_row_blocks(tuning: Tuning) -> bool:
  """Whether the jnp rotation runs in row blocks (``tuning.jnp_row_blocks``; None: on GPUs)."""
  return _on_gpu() if tuning.jnp_row_blocks is None else tuning.jnp_row_blocks


# ---- public API -------------------------------------------------------------------------------


def _flat(x, lead_ndim: int):
  """Leading axes (all but the trailing ``x.ndim - lead_ndim``) flattened into one."""
  return x.reshape((-1,) + x.shape[lead_ndim:])


def _dispatch(jnp_fn, pallas_fn, u, arrays, impl, interpret, tile, steps, tuning):
  """Runs ``jnp_fn(u, *arrays)`` or the kernel on ``(blocks, ...)``-flattened operands. A ``u``
  without entries (the bucket of a leaf of size 0) takes the jnp path: no kernel to launch."""
  impl, interpret = resolve_impl(impl, interpret)
  if impl == "jnp" or u.size == 0:
    return jnp_fn(u, *arrays)
  lead = u.shape[:-2]
  flat = [_flat(x, len(lead)) for x in (u, *arrays)]
  outs = pallas_fn(*flat, interpret=interpret, tile=tile, steps=steps, tuning=tuning)
  return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]).astype(u.dtype), outs)


def project_pair(u, v, g, *, impl="auto", interpret=None, tile=None, steps=None, tuning=DEFAULT):
  """Pass 1 (reads ``U``): ``(U^T v, U^T g, sum |v|)`` per block.

  ``u``: ``(..., n, k)``; ``v, g``: ``(..., n)``. Returns ``(..., k)``, ``(..., k)``, ``(...)``.
  ``tile`` / ``steps`` (pallas only) override the rows per tile / tiles per program;
  ``tuning``: the tilings and row blocks (:class:`Tuning`), static like the shapes.
  """
  _check(u, {"v": v, "g": g}, tuning=tuning)

  def pallas_fn(u, v, g, **kw):
    (cv, cg), l1 = _row_sums_pallas(u, [v, g], True, **kw)
    return cv, cg, l1

  return _dispatch(lowrank.project_pair, pallas_fn, u, (v, g), impl, interpret, tile, steps, tuning)


def residual_sums(
  u, v, g, a, inv_l1, ay, *, with_p1=False, impl="auto", interpret=None, tile=None, steps=None,
  tuning=DEFAULT,
):  # fmt: skip
  """Pass 2 (reads ``U``): the residuals ``p1 = (v - U a) inv_l1`` and ``q1 = g - U ay``, and
  ``(U^T p1, ||p1||^2, p1 . q1, ||v inv_l1||^2, U^T q1)`` per block. ``a``, ``ay``: ``(..., k)``
  (``U``'s coefficients of ``v`` and ``g`` from pass 1); ``inv_l1``: ``(...)`` or a scalar.

  ``U^T p1`` and ``U^T q1`` are the re-orthogonalisation coefficients of CGS2 (classical
  Gram-Schmidt with a second pass) for ``v`` and ``g``. ``with_p1``: also return ``p1`` and
  ``q1`` themselves (``(..., n)`` each) for :func:`rotate_from_residual`, so that pass 3
  subtracts ``U c`` from the very residual whose ``c = U^T p1`` (or ``U^T q1``) was measured
  here, by construction, not by two kernels compiling alike.
  """
  _check(u, {"v": v, "g": g}, {"a": a, "ay": ay}, tuning=tuning)
  inv_l1 = _scalar("inv_l1", inv_l1, u)
  return _dispatch(
    functools.partial(lowrank.residual_sums, with_p1=with_p1),
    functools.partial(_residual_sums_pallas, with_p1=with_p1),
    u,
    (v, g, a, inv_l1, ay),
    impl,
    interpret,
    tile,
    steps,
    tuning,
  )


def rotate_and_precondition(
  u, v, q, a1, inv_l1, a2, inv_r, rot, b, a, beta, gamma, *, impl="auto", interpret=None,
  tile=None, steps=None, tuning=DEFAULT,
):  # fmt: skip
  """Pass 3 (reads ``U``, writes ``U'``): ``p = ((v - U a1) inv_l1 - U a2) inv_r``,
  ``U' = U rot + p b^T`` and ``(q - U a - p beta) / gamma``. Returns ``(U', out)``.

  ``a1, a2, b, a``: ``(..., k)``; ``rot``: ``(..., k, k)``; ``inv_l1, inv_r, beta, gamma``:
  ``(...)`` or scalars. The pallas kernel writes ``U'`` into ``U``'s buffer (donate ``U`` to the
  jitted caller, or XLA copies it first to keep the input alive).
  """
  _check(u, {"v": v, "q": q}, {"a1": a1, "a2": a2, "b": b, "a": a}, {"rot": rot}, tuning=tuning)
  scalars = [_scalar(n, x, u) for n, x in (("inv_l1", inv_l1), ("inv_r", inv_r))]
  beta, gamma = _scalar("beta", beta, u), _scalar("gamma", gamma, u)
  arrays = (v, q, a1, scalars[0], a2, scalars[1], rot, b, a, beta, gamma)
  return _dispatch(
    functools.partial(lowrank.rotate_and_precondition, out_rowdot=not _jnp_row_blocks(tuning)),
    functools.partial(_rotate_pallas, from_p1=False),
    u,
    arrays,
    impl,
    interpret,
    tile,
    steps,
    tuning,
  )


def rotate_from_residual(
  u, p1, q, a2, inv_r, rot, b, a, beta, gamma, *, first=0, impl="auto", interpret=None,
  tile=None, steps=None, rows_per_block=None, row_shards=1, tuning=DEFAULT,
):  # fmt: skip
  """Pass 3 from pass 2's residuals (``residual_sums(..., with_p1=True)``): ``p = (p1 - U a2)
  inv_r``, ``U' = U rot + p b^T`` and ``(q - U a - p beta) / gamma`` (``q``: pass 2's ``q1``,
  the residual of the vector being preconditioned). Same as :func:`rotate_and_precondition`
  with ``p1 = (v - U a1) inv_l1``; reads ``p1`` instead of ``v``. ``U'`` is written into
  ``U``'s buffer as there: by the kernel (pallas), or block of rows by block of rows in a loop
  (jnp where ``tuning.jnp_row_blocks`` says, by default on GPUs, for a ``U`` of more than
  ``tuning.row_block_elements``; ``rows_per_block`` overrides the rows of a block, see
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
  _check(u, {"p1": p1, "q": q}, {"a2": a2, "b": b, "a": a}, {"rot": rot}, blocks, tuning=tuning)
  inv_r, gamma = _scalar("inv_r", inv_r, u, blocks), _scalar("gamma", gamma, u, blocks)
  beta = _scalar("beta", beta, u, blocks)
  rows = row_block(
    u.shape, rows_per_block, tuning
  )  # checks rows_per_block before anything is traced
  if rows_per_block is not None or _jnp_row_blocks(tuning):
    jnp_fn = functools.partial(
      lowrank.rotate_in_row_blocks,
      rows_per_block=None if rows_per_block is None else rows,
      row_shards=row_shards,
      tuning=tuning,
    )
  else:
    jnp_fn = lowrank.rotate_from_residual
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
    tuning,
  )


def project(u, g, *, impl="auto", interpret=None, tile=None, steps=None, tuning=DEFAULT):
  """``U^T g`` per block (one read of ``U``), in the compute dtype (:func:`compute_dtype`):
  :func:`precondition`'s first pass, for callers that add it over devices themselves.
  ``u``: ``(..., n, k)``; ``g``: ``(..., n)``; returns ``(..., k)``."""
  _check(u, {"g": g}, tuning=tuning)
  impl, interpret = resolve_impl(impl, interpret)
  # Widened exactly from U's dtype, which the passes round back to.
  if impl == "jnp" or u.size == 0:
    return lowrank.backend_row_sums(u, [g])[..., 0].astype(compute_dtype(u.dtype))
  lead = u.shape[:-2]
  (y,), _ = _row_sums_pallas(
    _flat(u, len(lead)), [_flat(g, len(lead))], False, interpret, tile, steps, tuning
  )
  return y.reshape(lead + y.shape[1:])


def residual(u, g, y, *, impl="auto", interpret=None, tile=None, steps=None, tuning=DEFAULT):
  """``(U^T q1, q1)`` with ``q1 = g - U y`` (one read of ``U``): :func:`precondition`'s second
  pass, the CGS2 coefficient of ``g``'s residual. ``y``: ``(..., k)``, ``U^T g`` as
  :func:`project` returns it. ``U^T q1`` in the compute dtype (rounded through ``U``'s dtype
  first, as :func:`residual_sums` returns it), ``q1`` in ``U``'s.

  :func:`residual_sums`' arithmetic for ``q1`` alone: the same ``q1`` and ``U^T q1``, without
  ``p1``, its sums and norms (a step without a curvature update has no ``v``), so the kernel
  reads ``U`` and ``g`` and writes ``q1``, one vector in and one out fewer."""
  y = y.astype(u.dtype)
  _check(u, {"g": g}, {"y": y}, tuning=tuning)
  c, q1 = _dispatch(
    lowrank.residual, _residual_pallas, u, (g, y), impl, interpret, tile, steps, tuning
  )
  return c.astype(compute_dtype(u.dtype)), q1


def correct(u, q, a, gamma, *, impl="auto", interpret=None, tile=None, steps=None, tuning=DEFAULT):
  """``(q - U a) / gamma`` per block (one read of ``U``): :func:`precondition`'s last pass.
  ``a``: ``(..., k)``; ``gamma``: ``(...)`` or a scalar."""
  a = a.astype(u.dtype)
  _check(u, {"q": q}, {"a": a}, tuning=tuning)
  gamma = _scalar("gamma", gamma, u)
  arrays = (q, a, gamma)
  return _dispatch(
    lowrank.correct, _correct_pallas, u, arrays, impl, interpret, tile, steps, tuning
  )


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
  u, sigma, g, gamma, *, uT_g=None, impl="auto", interpret=None, tile=None, steps=None,
  tuning=DEFAULT,
):  # fmt: skip
  """``G^{-1} g = (g - U diag(sigma / (gamma + sigma)) U^T g) / gamma`` with ``U`` as it is
  (a step without a curvature update), computed as :func:`complement_coefficient` says:
  three reads of ``U`` (:func:`project`, :func:`residual`, :func:`correct`). ``sigma``:
  ``(..., k)``. ``uT_g``: ``U^T g`` where the caller has it (:func:`project`, e.g. added over
  devices): then two."""
  _check(u, {"g": g}, {"sigma": sigma}, tuning=tuning)
  kw = dict(impl=impl, interpret=interpret, tile=tile, steps=steps, tuning=tuning)
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
  "DEFAULT",
  "IMPLS",
  "Tuning",
  "complement_coefficient",
  "compute_dtype",
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
