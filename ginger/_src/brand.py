"""Ginger's curvature update of every bucket: Brand's rank-one eigen-update of
``S = U diag(sigma) U^T`` in three passes over ``U``, fused with ``G^{-1} g``.

:func:`brand_step` follows the step: pass 1 projects ``d_t`` and ``g`` on ``U``
(:func:`_project`), pass 2 forms their residuals outside ``span U`` (:func:`_residual`),
Brand's small eigenproblem gives the new ``sigma`` and the rotation (:func:`_eigen_update`,
from the passes' sums: :func:`_after_residual`), pass 3 rotates ``U`` and writes ``G^{-1} g``
(:func:`rotate`). docs/ginger-math.md derives each step and its error bound.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from ginger._src import kernels, lowrank
from ginger._src import sharding as gsharding


def brand_step(
  us,
  factors,
  vs,
  gs,
  alpha,
  gamma,
  eigensolver="secular",
  *,
  impl="jnp",
  interpret=False,
  sharding: gsharding.StateSharding | None = None,
  keep: jax.Array | None = None,
  tuning: kernels.Tuning = kernels.DEFAULT,
):
  """One curvature update and preconditioning for every bucket.

  With ``B = [U p]`` (``p`` the unit residual of ``v = d_t`` outside ``span U``) Brand's
  update of ``S = U diag(sigma) U^T`` is::

    alpha S + (1 - alpha) v v^T = B K B^T,   K = diag(alpha sigma, 0) + (1 - alpha) w w^T,
    w = B^T v,   K = V diag(lambda) V^T,   U' = B V[:, :k],   sigma' = lambda[:k]

  ``factors[b] = (Q, sigma)``: the step works with the orthonormal basis ``U Q`` (``Q = I``
  except on re-orthonormalisation steps; ``Q`` None: ``I``, known while tracing), folded into
  the small matrices so that ``U Q`` is never formed. Per bucket: pass 1 (:func:`_project`)
  gives ``c = U^T v`` and ``y = U^T g``; pass 2 (:func:`_residual`) the CGS2 correction
  ``c2 = U^T p1`` and norms, and ``p1`` itself; then, for all blocks of one rank at once,
  Brand's core and its eigenpairs (:func:`_eigen_update`); pass 3 (:func:`rotate`) writes
  ``U' = [U p] V[:, :k]`` (over ``U``) and ``G'^{-1} g``, where ``U'^T g = V[:, :k]^T [y; p^T
  g]`` needs no further pass. Pass 3 reads pass 2's ``p1`` rather than recomputing it, so that
  it removes the rounding that pass 2 measured from the very same ``p1`` (CGS2), whatever the
  compiler fuses. The passes run with ``impl`` (``"jnp"`` or ``"pallas"``, all three alike: see
  :mod:`ginger._src.kernels`), and so does the secular eigensolver's bisection
  (:mod:`ginger._src.secular`); ``sharding``: where the buckets are split over devices (None:
  nowhere). The jnp passes are then partitioned by XLA (pass 3 in blocks of each device's rows);
  the Pallas kernels, which XLA cannot partition, run per device under ``shard_map`` on its own
  rows, with the sums of passes 1 and 2 added over the devices, all buckets' in one all-reduce a
  pass (:func:`ginger._src.sharding.per_shard_sums`).
  The passes return their sums in ``U``'s dtype; everything between them (``factors``
  included) runs in the compute dtype (:func:`ginger._src.kernels.compute_dtype`: float32 for a
  bf16 or float16 state, whose eigenproblems neither LAPACK nor the secular solver's bit
  arithmetic take), and pass 3's operands and the new sigma are rounded back to ``U``'s dtype.
  ``keep`` (a traced bool, or None: never): where true, pass 3 writes ``U`` back unchanged
  (its rotation set to the identity and the new direction's weights to 0, so that ``U'`` is
  still written in place, with no select over it); the caller keeps the old ``sigma``.
  ``tuning``: the passes' tilings and row blocks (:class:`ginger._src.tuning.Tuning`).
  Returns ``(new U per bucket, G'^{-1} g per bucket, new sigma per bucket)``.
  """
  kw = dict(impl=impl, interpret=interpret)  # the secular solver's
  passes_kw = dict(kw, tuning=tuning)  # the passes over U
  if not us:
    return [], [], []
  small = _project(us, vs, gs, factors, sharding, passes_kw)
  residuals = _residual(us, vs, gs, factors, small, sharding, passes_kw)
  coefs, new_sigmas = _eigen_update(us, factors, small, alpha, gamma, eigensolver, keep, kw)
  new_us, outs = [], []
  for u, (p1, q1), (co, first_block) in zip(us, residuals, coefs, strict=True):
    smalls = [co[key] for key in ("a2", "inv_r", "rot", "b", "a", "beta")]
    u_new, out = rotate(u, p1, q1, smalls, gamma, first_block, sharding, passes_kw)
    new_us.append(u_new)
    outs.append(out)
  return new_us, outs, new_sigmas


def _in_compute_dtype(u, *xs) -> list:
  """``xs`` in the compute dtype of a state of ``u``'s dtype (:func:`kernels.compute_dtype`)."""
  compute = kernels.compute_dtype(u.dtype)
  return [x.astype(compute) for x in xs]


def _project(us, vs, gs, factors, sharding, kw) -> list[dict]:
  """Pass 1 of :func:`brand_step`: ``U^T v``, ``U^T g`` and ``l1 = ||v||`` per bucket, as
  :func:`_before_residual`'s small quantities in the basis ``U Q``."""
  projections = gsharding.per_shard_sums(
    functools.partial(kernels.project_pair, **kw),
    sharding,
    kw["impl"],
    list(zip(us, vs, gs, strict=True)),
    gsharding.PROJECT_PAIR,
  )
  return [
    _before_residual(*_in_compute_dtype(us[0], *sums), q)
    for sums, (q, _) in zip(projections, factors, strict=True)
  ]


def _residual(us, vs, gs, factors, small, sharding, kw) -> list[tuple]:
  """Pass 2 of :func:`brand_step`: the residuals ``p1 = (v - U c) / l1`` and ``q1 = g - U y``
  per bucket, and their sums, added to ``small`` (in the basis ``U Q``): the CGS2 corrections
  ``c2 = U^T p1``, ``c3 = U^T q1`` and ``pp = ||p1||^2``, ``pq = p1 . q1``, ``vv = ||v / l1||^2``
  (:func:`_after_residual` uses them)."""
  sums = gsharding.per_shard_sums(
    functools.partial(kernels.residual_sums, with_p1=True, **kw),
    sharding,
    kw["impl"],
    [
      (u, v, g, s["a1"].astype(u.dtype), s["inv_l1"].astype(u.dtype), s["ay"].astype(u.dtype))
      for u, v, g, s in zip(us, vs, gs, small, strict=True)
    ],
    gsharding.RESIDUAL_SUMS,
  )
  residuals = [(p1, q1) for *_, p1, q1 in sums]
  for s, bucket_sums, (q, sigma) in zip(small, sums, factors, strict=True):
    c2u, pp, pq, vv, c3u = _in_compute_dtype(us[0], *bucket_sums[:5])
    s.update(
      c2=_times(q, c2u, transpose=True),
      c3=_times(q, c3u, transpose=True),
      pp=pp,
      pq=pq,
      vv=vv,
      sigma=sigma,
    )
  return residuals


def _eigen_update(us, factors, small, alpha, gamma, eigensolver, keep, kw):
  """Brand's small eigenproblem of every block, all blocks of one rank in one batched solve
  (:func:`_after_residual`): per bucket, pass 3's coefficients as ``(the rank's joined
  coefficients, the bucket's first block in them)`` (pass 3 reads them there: slices would
  each be a small copy kernel on a GPU), and the new ``sigma``. Pass 3's operands and
  ``sigma`` are rounded to the state's dtype. Where ``keep``, the rotation is ``I`` and the
  new direction's weights 0, so that pass 3 writes ``U`` back as it was."""
  state_dtype = us[0].dtype
  qs = [q for q, _ in factors]
  by_rank: dict[int, list[int]] = defaultdict(list)
  for b, u in enumerate(us):
    by_rank[u.shape[-1]].append(b)
  coefs: list[tuple[dict, int]] = [({}, 0)] * len(us)
  new_sigmas: list = [None] * len(us)
  for members in by_rank.values():
    sizes = [us[b].shape[0] for b in members]
    joined = {key: jnp.concatenate([small[b][key] for b in members]) for key in small[members[0]]}
    joined["q"] = None if qs[members[0]] is None else jnp.concatenate([qs[b] for b in members])
    co = _after_residual(joined, alpha, gamma, eigensolver, jnp.finfo(state_dtype).eps, **kw)
    co = {key: x.astype(state_dtype) for key, x in co.items()}  # pass 3's operands, the state
    if keep is not None:  # U' = U rot + p b^T is U itself: rot = I, b = 0 (no select over U)
      eye = jnp.broadcast_to(jnp.eye(co["rot"].shape[-1], dtype=co["rot"].dtype), co["rot"].shape)
      co["rot"] = jnp.where(keep, eye, co["rot"])
      co["b"] = jnp.where(keep, jnp.zeros((), co["b"].dtype), co["b"])
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    for b, first_block, sigma in zip(
      members, starts, jnp.split(co["sigma"], starts[1:]), strict=True
    ):
      coefs[b], new_sigmas[b] = (co, first_block), sigma
  return coefs, new_sigmas


def rotate(u, p1, q1, smalls, gamma, first_block, sharding, kw):
  """Pass 3 of one bucket (:func:`ginger._src.kernels.rotate_from_residual`): ``smalls`` are
  ``(a2, inv_r, rot, b, a, beta)``, joined over the buckets of one rank from ``first_block``
  on. Writes ``U' = U rot + p b^T`` (``p = (p1 - U a2) inv_r``) and ``(q1 - U a - p beta) /
  gamma``. On a split state the jnp pass rotates blocks of each device's rows; the kernel runs
  per device (row-local: no collective) on the bucket's own slice of them."""
  if not gsharding.bucket_split(sharding, kw["impl"], u):
    return kernels.rotate_from_residual(
      u, p1, q1, *smalls, gamma, first=first_block,
      row_shards=1 if sharding is None else sharding.row_shards(u.shape), **kw,
    )  # fmt: skip
  mine = [x[first_block : first_block + u.shape[0]] for x in smalls]
  gamma = jnp.broadcast_to(jnp.asarray(gamma, u.dtype), u.shape[:1])
  rotate = functools.partial(kernels.rotate_from_residual, **kw)
  args = (u, p1, q1, *mine, gamma)
  return gsharding.per_shard(rotate, sharding, kw["impl"], args, gsharding.ROTATE)


def _times(q, x, transpose=False):
  """``Q x`` (or ``Q^T x``) batched over blocks; ``x`` itself where ``Q`` is None (``I``, known
  while tracing: no product, which XLA would run as one more small kernel per bucket)."""
  return x if q is None else lowrank.small_matvec(q, x, transpose=transpose)


def _before_residual(cu, yu, l1, q):
  """Small quantities after pass 1, in the orthonormal basis ``U Q`` (``Q`` None: ``U``)."""
  c = _times(q, cu, transpose=True)
  inv_l1 = 1.0 / jnp.maximum(l1, jnp.finfo(l1.dtype).tiny)
  return {
    "c": c,
    "y": _times(q, yu, transpose=True),
    "l1": l1,
    "inv_l1": inv_l1,
    "a1": _times(q, c),
    "ay": _times(q, _times(q, yu, transpose=True)),
  }


def _after_residual(s, alpha, gamma, eigensolver, eps, *, impl="jnp", interpret=False):
  """From the pass-1/2 sums to pass 3's coefficients (batched over blocks), in the sums' dtype
  (the compute dtype, at least float32). ``eps``: the machine epsilon of the state dtype, to
  which the sums are accurate. ``impl``: how the secular solver's bisection runs
  (:func:`ginger._src.secular.eigh_diag_plus_rank_one`), as the passes do: one Pallas kernel with
  ``"pallas"``.

  With ``p1 = (v - U c) / l1``, ``c2 = U^T p1``, ``p = p1 - U c2``: ``||p||^2 = ||p1||^2 -
  ||c2||^2``, ``r = l1 ||p||``, ``U^T v = c + l1 c2``. ``v`` counts as in ``span U`` when ``r <=
  max(32 eps ||v||, l1 ||c2||)``. Likewise for the preconditioned ``g``: ``q1 = g - U y``, ``c3 =
  U^T q1``, so ``g = U (y + c3) + p_hat beta + q_perp`` with ``beta = p_hat^T q1`` and ``q_perp``
  outside ``B = [U p_hat]``. With Brand's eigenvectors ``V`` (``V_k`` kept) and ``w = [y + c3;
  beta] = B^T g``, ``G'^{-1} g = (B s + q_perp) / gamma`` with ``s = w - V_k diag(sigma' / (gamma
  + sigma')) V_k^T w``, formed as ``V_k diag(gamma / (gamma + sigma')) V_k^T w + v_last v_last^T
  w`` (no cancellation), so pass 3 computes ``(q1 - U (c3 - s_U) - p_hat (beta - s_p)) / gamma``:
  ``a = c3 - s_U``.
  """
  rank = s["c"].shape[-1]
  p_norm = jnp.sqrt(jnp.maximum(s["pp"] - jnp.sum(s["c2"] * s["c2"], -1), 0.0))
  v_norm_l1 = jnp.sqrt(s["vv"])  # ||v|| / l1
  # In span also when the second projection removed more than is left (|c2| >= |p|): the
  # residual is then below U's own defect, ||p||^2 = ||p1||^2 - ||c2||^2 assumed U^T U = I,
  # and the new column's defect would be that of U times (|c2| / |p|)^2.
  in_span = p_norm <= jnp.maximum(32 * eps * v_norm_l1, jnp.sqrt(jnp.sum(s["c2"] * s["c2"], -1)))
  p_norm = jnp.where(in_span, 0.0, p_norm)
  inv_p = jnp.where(in_span, 0.0, 1.0 / jnp.where(in_span, 1.0, p_norm))
  c = s["c"] + s["l1"][..., None] * s["c2"]
  w, vecs, scale = lowrank.brand_eigh(
    c,
    s["l1"] * p_norm,
    s["sigma"],
    s["l1"] * v_norm_l1,
    in_span,
    alpha,
    eigensolver,
    impl=impl,
    interpret=interpret,
  )
  sigma = lowrank.rescale_sigma(w, scale, rank, lowrank.rank_after_update(s["sigma"]))
  top, b = vecs[..., :rank, :rank], vecs[..., rank, :rank]
  beta = (s["pq"] - jnp.sum(s["c2"] * s["c3"], -1)) * inv_p  # p_hat^T q1, p_hat of unit norm
  coef = jnp.concatenate([s["y"] + s["c3"], beta[..., None]], -1)  # w = B^T g
  y_new = lowrank.small_matvec(vecs[..., :rank], coef, transpose=True)  # U'^T g
  last = vecs[..., rank]
  damped = gamma / (gamma + sigma) * y_new
  kept = lowrank.small_matvec(vecs[..., :rank], damped)
  inside = kept + last * jnp.sum(last * coef, -1, keepdims=True)  # s
  return {
    "sigma": sigma,
    "a2": _times(s["q"], s["c2"]),
    "inv_r": inv_p,
    "rot": top if s["q"] is None else jnp.matmul(s["q"], top, precision=lowrank.HIGHEST),
    "b": b,
    "a": _times(s["q"], s["c3"] - inside[..., :rank]),
    "beta": beta - inside[..., rank],
  }
