"""Ginger: a damped low-rank Gauss-Newton preconditioner as optax transformations.

The curvature model of each block is ``G = gamma I + U diag(sigma) U^T`` (``U`` is
``d x tau`` with orthonormal columns, ``sigma >= 0`` sorted descending). Every step first
folds the sampled-Fisher vector ``d_t`` into the curvature::

    S_t = top_tau( alpha S_{t-1} + (1 - alpha) d_t d_t^T ),     S_0 = 0

(Brand's rank-one eigen-update, O(d tau^2 + tau^3)), then returns ``G_t^{-1} g`` by the
stable split of the Woodbury identity (O(d tau)). See docs/ginger-math.md for why this
sigma-space form, and not the paper's inverse-space algorithm, is the one implemented.

The file follows the step: :func:`scale_by_ginger` and its state (:func:`init_state`,
:func:`update_state`); the curvature update of all buckets, :func:`ginger._src.brand.brand_step`
(three passes over ``U`` around Brand's small eigenproblem); the periodic
re-orthonormalisation (:func:`_basis_factors`, :func:`reorthonormalise`); and :func:`ginger`,
the optimizer as the authors compose it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ginger._src import common, kernels, lowrank
from ginger._src import sharding as gsharding
from ginger._src.brand import brand_step, rotate
from ginger._src.stacked import StackedBasis, StackedRows, StackedSigma


class ScaleByGingerState(NamedTuple):
  """State of :func:`scale_by_ginger`.

  Attributes:
    count: number of curvature updates taken (int32).
    u: a :class:`StackedBasis`. Its leaves are one ``(members, rows, k)`` array per bucket
      of equal-rank blocks (``k = min(tau, block size)``), zero-padded to the bucket's
      largest block; ``u[key]`` gives a leaf's rows ``(leaf.size, k)``.
    sigma: the eigenvalues ``sigma`` of each block: for ``block="per_tensor"`` a
      :class:`StackedSigma` (one ``(members, k)`` array per bucket; ``sigma[key]`` gives a
      leaf's ``(k,)``), for ``"global"`` a single ``(k,)`` array.
    mu: with ``b1``, the momentum (EMA of the updates) as a :class:`StackedRows`; else None.
    mu_count: with ``b1``, the number of updates averaged into ``mu`` (int32); else None.
    skipped: curvature updates skipped because ``d_t`` had a NaN or Inf entry (int32): such a
      step keeps ``count``, ``u`` and ``sigma`` as they were.
  """

  count: chex.Array
  u: Any
  sigma: Any
  mu: Any = None
  mu_count: Any = None
  skipped: Any = None


# Curvature updates between re-orthonormalisations of U (scale_by_ginger's default): for a 32-
# or 64-bit state, and for a 16-bit one (bf16, float16), whose U drifts ~1000x faster. A float32
# U drifts by ~3e-8 a step; the direction's error grows with the drift times sqrt(sigma_max /
# gamma) (docs/ginger-math.md, section 6): every 100 keeps the drift below 1e-5, a G-norm error
# of ~0.03 at sigma_max / gamma = 1e9 (every 1000: 4e-5 and ~2), for a Gram pass and a rotation
# of U every 100 updates.
REORTHONORMALISE_EVERY = 100
REORTHONORMALISE_EVERY_NARROW = 10


def default_reorthonormalise_every(state_dtype) -> int:
  """Curvature updates between re-orthonormalisations for a state of ``state_dtype``:
  :data:`REORTHONORMALISE_EVERY`, or :data:`REORTHONORMALISE_EVERY_NARROW` for 16 bits."""
  narrow = common.check_dtype(state_dtype).itemsize < 4
  return REORTHONORMALISE_EVERY_NARROW if narrow else REORTHONORMALISE_EVERY


class GingerSettings(NamedTuple):
  """The checked arguments of :func:`scale_by_ginger` (:func:`check_settings`), as its init and
  update read them. ``in_update``: whether the step re-orthonormalises ``U`` itself (a
  ``lax.cond`` every ``reorthonormalise_every`` updates) rather than leaving it to
  :func:`reorthonormalise`."""

  tau: int
  alpha: float
  gamma: float
  block: str
  state_dtype: Any
  reorthonormalise_every: Any
  in_update: bool
  eigensolver: str
  curvature_every: int
  passes: str
  sharding: gsharding.StateSharding | None
  b1: float | None
  tuning: kernels.Tuning


def check_settings(
  tau, alpha, gamma, block, state_dtype, reorthonormalise_every, eigensolver, curvature_every,
  passes, sharding, b1, tuning,
) -> GingerSettings:  # fmt: skip
  """:func:`scale_by_ginger`'s arguments checked (a ``ValueError`` naming a bad one), with the
  defaults filled in."""
  tau = common.check_tau(tau)
  common.check_alpha(alpha)
  common.check_b1(b1)
  common.check_gamma(gamma)
  common.check_block(block)
  state_dtype = common.check_dtype(state_dtype)
  common.check_eigensolver(eigensolver)
  curvature_every = common.check_every("curvature_every", curvature_every)
  common.check_passes(passes)
  common.check_tuning(tuning)
  if reorthonormalise_every is None:
    reorthonormalise_every = default_reorthonormalise_every(state_dtype)
  # Traced under optax.inject_hyperparams (then >= 1 is the caller's to keep): the cond stays.
  if isinstance(reorthonormalise_every, bool) or not isinstance(
    reorthonormalise_every, (int, np.integer, jax.Array)
  ):
    raise ValueError(f"reorthonormalise_every must be an int, got {reorthonormalise_every!r}.")
  every = common._concrete(reorthonormalise_every)
  if every is not None and every < 0:
    raise ValueError(
      f"reorthonormalise_every must be >= 0 (0: only by reorthonormalise()) or None, got "
      f"{reorthonormalise_every}."
    )
  in_update = every is None or every > 0
  return GingerSettings(
    tau, alpha, gamma, block, state_dtype, reorthonormalise_every, in_update, eigensolver,
    curvature_every, passes, sharding, b1, tuning,
  )  # fmt: skip


def scale_by_ginger(
  tau: int,
  alpha: float = 0.99,
  gamma: float = 1e-5,
  block: str = "per_tensor",
  *,
  state_dtype: str = "float32",
  reorthonormalise_every: int | None = None,
  eigensolver: str = "secular",
  curvature_every: int | None = None,
  passes: str = "jnp",
  sharding: gsharding.StateSharding | None = None,
  b1: float | None = None,
  tuning: kernels.Tuning = kernels.DEFAULT,
) -> optax.GradientTransformationExtraArgs:
  r"""Preconditions updates by Ginger's damped low-rank curvature model.

  Every block of parameters (each leaf, or all of them: ``block``) keeps the model
  ``G = gamma I + U diag(sigma) U^T`` of its generalized Gauss-Newton matrix, ``U`` a ``d x k``
  orthonormal basis, ``k = min(tau, d)``. ``update(updates, state, params=None, *,
  fisher_grads=d_t)`` folds the sampled-Fisher vector ``d_t`` (:mod:`ginger.fisher`) into the
  model, then preconditions with the updated one, as in the paper's Algorithm 1::

    U diag(sigma) U^T <- top_k(alpha U diag(sigma) U^T + (1 - alpha) d_t d_t^T)
    g <- G^{-1} g = (g - U diag(sigma / (gamma + sigma)) U^T g) / gamma

  in ``O(d k^2 + k^3)`` (Brand's rank-one eigen-update: three passes over ``U``). With ``b1``,
  ``G^{-1} m_t / (1 - b1^t)`` of the average ``m_t = b1 m_{t-1} + (1 - b1) g_t`` is returned.
  ``fisher_grads=None`` folds in the updates themselves (the empirical Fisher) or, with
  ``curvature_every > 1``, leaves the curvature as it is (static under ``jit``: compile one
  step with and one without ``fisher_grads``).

  Args:
    tau: rank of the curvature model, a Python int >= 1.
    alpha: EMA decay of the curvature, in (0, 1).
    gamma: damping, > 0; ``G^{-1}`` scales directions outside ``span U`` by ``1 / gamma``.
    block: ``"per_tensor"`` (a model per leaf, the authors' code) or ``"global"`` (the paper).
    state_dtype: dtype of ``U``, ``sigma`` and ``mu``; the small algebra runs in >= float32.
    reorthonormalise_every: updates between re-orthonormalisations of ``U`` (a ``lax.cond``,
      which on a GPU waits for the device); 0: only by :func:`reorthonormalise`.
    eigensolver: ``"secular"`` (``O(k^2)``) or ``"dense"`` (``eigh``) for Brand's core.
    curvature_every: steps between the caller's curvature updates, a static int; None: 1.
    passes: how the passes over ``U`` run: ``"jnp"``, ``"pallas"`` or ``"auto"``.
    sharding: the :class:`ginger.sharding.StateSharding` of a state split over devices
      (needed with ``passes="pallas"``: XLA cannot partition a Pallas kernel).
    b1: decay of the bias-corrected momentum kept in the state; None: no momentum.
    tuning: tilings of the Pallas passes, row blocks of the jnp rotation and how the blocks
      are stacked into buckets (:class:`ginger.Tuning`, static): speed and
      memory; the values change by float summation order at most.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Examples:
    From a fresh state (``sigma = 0``), one step with ``d_t = g`` makes ``G = gamma I +
    (1 - alpha) g g^T``, so ``G^{-1} g = g / (gamma + (1 - alpha) ||g||^2)``: per leaf,
    ``||g||^2`` = 6 for ``w`` and 2 for ``b``.

    >>> import jax, jax.numpy as jnp
    >>> import ginger
    >>> params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    >>> tx = ginger.scale_by_ginger(tau=2, alpha=0.5, gamma=1.0)
    >>> grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    >>> updates, _ = jax.jit(tx.update)(grads, tx.init(params), fisher_grads=grads)
    >>> print(f"{float(updates['w'][0, 0]):.4f} {float(updates['b'][0]):.4f}")
    0.2500 0.5000

  References:
    Yongchang Hao, Yanshuai Cao and Lili Mou, `Ginger: An Efficient Curvature Approximation
    with Linear Complexity for General Neural Networks <https://arxiv.org/abs/2402.03295>`_
  """
  settings = check_settings(
    tau, alpha, gamma, block, state_dtype, reorthonormalise_every, eigensolver, curvature_every,
    passes, sharding, b1, tuning,
  )  # fmt: skip
  init = functools.partial(init_state, settings=settings)
  return optax.GradientTransformationExtraArgs(init, functools.partial(_update_fn, settings))


def _update_fn(settings, updates, state, params=None, *, fisher_grads=None, **extra_args):
  """``update`` of :func:`scale_by_ginger` built with ``settings``: :func:`update_state`."""
  del params, extra_args
  return update_state(updates, state, fisher_grads, settings)


def _placeholder_state(s: GingerSettings) -> ScaleByGingerState:
  """The state for ``optax.tree.map_params``' placeholder params: it looks for params-shaped
  trees by initialising with one (as ``optax.masked``, Ginger detects it); the stacked ``U``,
  ``sigma`` and momentum are no such tree, so each is one leaf here and ``map_params`` leaves
  them to ``transform_non_params``."""
  leaf = jnp.zeros([], s.state_dtype)
  counter = jnp.zeros([], jnp.int32)
  return ScaleByGingerState(
    count=counter,
    u=leaf,
    sigma=leaf,
    mu=None if s.b1 is None else leaf,
    mu_count=None if s.b1 is None else counter,
    skipped=counter,
  )


def init_state(params, settings: GingerSettings) -> ScaleByGingerState:
  """``S_0 = 0``: each bucket's ``U`` an orthonormal basis (:func:`lowrank.init_basis`),
  ``sigma = 0``, the momentum ``m_0 = 0`` (with ``b1``) and the counts 0."""
  s = settings
  if isinstance(params, common.params_placeholder_type()):
    return _placeholder_state(s)
  common.check_float_params(params)
  vectors, treedef = common.flat_vectors(params, s.state_dtype)
  layout = common.plan_layout([v.size for v in vectors], s.tau, s.block, treedef, s.tuning)
  u = StackedBasis(
    [lowrank.init_basis(len(b.members), b.rows, b.rank, s.state_dtype) for b in layout.buckets],
    layout,
  )
  sigmas = [jnp.zeros((len(b.members), b.rank), s.state_dtype) for b in layout.buckets]
  if s.block == "per_tensor":
    sigma = StackedSigma(sigmas, layout)
  else:
    sigma = sigmas[0][0] if sigmas else jnp.zeros((0,), s.state_dtype)
  mu = mu_count = None
  if s.b1 is not None:
    mu = StackedRows(
      [jnp.zeros((len(b.members), b.rows), s.state_dtype) for b in layout.buckets], layout
    )
    mu_count = jnp.zeros([], jnp.int32)
  return ScaleByGingerState(
    count=jnp.zeros([], jnp.int32),
    u=u,
    sigma=sigma,
    mu=mu,
    mu_count=mu_count,
    skipped=jnp.zeros([], jnp.int32),
  )


def update_state(updates, state: ScaleByGingerState, fisher_grads, settings: GingerSettings):
  """One step of :func:`scale_by_ginger`: ``(G_t^{-1} g, new state)``.

  The updates ``g`` (with ``b1``: their average ``m_t``, :func:`_average`) and ``d_t`` are
  gathered into the stacked layout of ``U``. Then ``d_t`` is folded into the curvature and
  ``g`` preconditioned with the new model (:func:`brand_step`, on the basis re-orthonormalised
  when due, :func:`_basis_factors`), or, on a step without ``fisher_grads`` when
  ``curvature_every > 1``, preconditioned with the model as it is (:func:`_precondition`).
  With ``b1`` the result is divided by ``1 - b1^t``.
  """
  s = settings
  if s.sharding is not None:
    # Whole on every device, as data parallelism makes gradients: then each device's rows
    # of the stacked g and d are a local slice. Left free, XLA propagates the rows' split
    # back into whatever produced them (e.g. the momentum) and gathers it to re-lay it out.
    updates, fisher_grads = s.sharding.replicate((updates, fisher_grads))
  layout = state.u.layout
  us = list(state.u.stacks)
  gs = common.gather(layout, common.flat_vectors(updates, s.state_dtype)[0])
  gs, debias, mu, mu_count = _average(_on_rows(s.sharding, gs, us), state, s.b1)
  # For the backend that jax.default_backend() names while the step is traced ("auto":
  # "pallas" on a GPU); a step jitted for another backend names "jnp" or "pallas" instead.
  impl = kernels.resolve_impl(s.passes, None)
  if fisher_grads is None and s.curvature_every > 1:  # no curvature update this step
    sigmas = _sigma_stacks(layout, state.sigma, s.block)
    outs = _precondition(us, sigmas, gs, s.gamma, s.sharding, impl, s.tuning)
    new_state = state._replace(mu=mu, mu_count=mu_count)
    outs = debias(_whole(s.sharding, outs))
    return common.unflatten_like(common.scatter(layout, outs), updates), new_state
  fisher = common.fisher_vectors(updates, fisher_grads, s.state_dtype)
  vs = _on_rows(s.sharding, common.gather(layout, fisher), us)
  # A NaN or Inf in d_t alone (optax.apply_if_finite checks only g) would enter U and sigma
  # for good: such a d_t enters as zero and the curvature is kept as it was (U by brand_step,
  # in place: a select over U would hold a second U in the step; the rest by _curvature_state).
  finite = common.all_finite(vs)
  vs = common.zero_unless(finite, vs)
  sigmas = _sigma_stacks(layout, state.sigma, s.block)
  count = optax.safe_increment(state.count)
  factors = _basis_factors(us, sigmas, count, s)
  new_us, outs, new_sigmas = brand_step(
    us, factors, vs, gs, s.alpha, s.gamma, s.eigensolver, impl=impl[0], interpret=impl[1],
    sharding=s.sharding, keep=~finite, tuning=s.tuning,
  )  # fmt: skip
  new_us, outs = _on_rows(s.sharding, new_us, us), debias(_whole(s.sharding, outs))
  new_state = _curvature_state(state, new_us, new_sigmas, count, finite, s.block)
  new_state = new_state._replace(mu=mu, mu_count=mu_count)
  return common.unflatten_like(common.scatter(layout, outs), updates), new_state


def _curvature_state(state, new_us, new_sigmas, count, finite, block) -> ScaleByGingerState:
  """The state after a curvature update: ``U'`` and the new ``sigma`` and count, or where
  ``d_t`` was not ``finite`` the old count and ``sigma`` (``U'`` is then ``U`` already:
  :func:`brand_step`'s ``keep``) and one more ``skipped``."""
  layout = state.u.layout
  if block == "per_tensor":
    sigma = StackedSigma(new_sigmas, layout)
  else:
    sigma = new_sigmas[0][0] if new_sigmas else state.sigma
  count, sigma = common.keep_unless(finite, (count, sigma), (state.count, state.sigma))
  skipped = state.skipped + (~finite).astype(jnp.int32)
  return ScaleByGingerState(
    count, StackedBasis(new_us, layout), sigma, mu=state.mu, mu_count=state.mu_count,
    skipped=skipped,
  )  # fmt: skip


def _average(gs, state: ScaleByGingerState, b1):
  """The EMA of the stacked updates, ``m_t = b1 m_{t-1} + (1 - b1) g_t``, as the state's new
  ``mu``, and a function that divides the preconditioned ``m_t`` by the bias correction
  ``1 - b1^t`` (``optax.ema(b1, debias=True)``'s, after ``G^{-1}`` rather than before:
  ``G^{-1}`` is linear, and the division then fuses into the per-leaf ops after the update
  instead of writing a corrected copy of every bucket's ``m``); plus the new ``mu_count``.
  Without ``b1``: ``gs``, the identity and the state's ``mu`` and ``mu_count``."""
  if b1 is None:
    return gs, lambda outs: outs, state.mu, state.mu_count
  mu_count = optax.safe_increment(state.mu_count)
  mu = [(1 - b1) * g + b1 * m for g, m in zip(gs, state.mu.stacks, strict=True)]
  correction = 1 - b1**mu_count

  def debias(outs):
    return [out / correction.astype(out.dtype) for out in outs]

  return mu, debias, StackedRows(mu, state.mu.layout), mu_count


def _on_rows(sharding: gsharding.StateSharding | None, xs, us) -> list:
  """``xs`` (one array per bucket) pinned to the rows of ``us`` each device holds."""
  if sharding is None:
    return list(xs)
  return [sharding.constrain(x, u.shape) for x, u in zip(xs, us, strict=True)]


def _whole(sharding: gsharding.StateSharding | None, xs) -> list:
  """The update's stacks gathered on every device before its leaves are sliced out: sliced
  from split stacks, a leaf ending inside a device's rows costs a collective-permute."""
  return list(xs) if sharding is None else sharding.replicate(list(xs))


def _basis_factors(us, sigmas, count, s: GingerSettings) -> list[tuple]:
  """``(Q, sigma')`` per bucket, with which :func:`brand_step` works in the orthonormal basis
  ``U Q``: the Cholesky-QR factors of ``U`` every ``reorthonormalise_every`` updates
  (:func:`_reorthonormalising_factors`), ``(I, sigma)`` on the others; with
  ``reorthonormalise_every=0`` (the caller's :func:`reorthonormalise`) ``Q = None``, ``I``
  known while tracing, so that no product with it is formed. In the compute dtype."""
  if not s.in_update:
    return [
      (None, sigma.astype(kernels.compute_dtype(u.dtype)))
      for u, sigma in zip(us, sigmas, strict=True)
    ]
  # Only the small factors leave the cond, so skipping it copies nothing of U.
  return jax.lax.cond(
    count % s.reorthonormalise_every == 0,
    _reorthonormalising_factors,
    _identity_factors,
    us,
    sigmas,
  )


def _precondition(us, sigmas, gs, gamma, sharding, impl, tuning) -> list:
  """``G^{-1} g`` per bucket with the curvature as it is, by the stable split of Woodbury::

    G^{-1} g = (q + U (gamma / (gamma + sigma)) (y + c)) / gamma,   y = U^T g,
    q1 = g - U y,   c = U^T q1,   q = q1 - U c

  (CGS2: ``q``, the part of ``g`` outside ``span U``, is orthogonal to ``U`` to working
  precision; :func:`kernels.complement_coefficient` forms the coefficient with no term of the
  size of ``g`` cancelling). Three passes over ``U``, run per device on a split state as
  :func:`brand_step`'s are."""
  kw = dict(impl=impl[0], interpret=impl[1], tuning=tuning)
  # U^T g of all buckets first, so that a split state adds them over devices at once.
  ys = gsharding.per_shard_sums(
    lambda u, g: (kernels.project(u, g, **kw),),
    sharding,
    impl[0],
    list(zip(us, gs, strict=True)),
    gsharding.PROJECT,
  )
  residuals = gsharding.per_shard_sums(
    lambda u, g, y: kernels.residual(u, g, y, **kw),
    sharding,
    impl[0],
    [(u, g, y) for u, g, (y,) in zip(us, gs, ys, strict=True)],
    gsharding.RESIDUAL,
  )
  return [
    gsharding.per_shard(
      lambda u, q1, a: kernels.correct(u, q1, a, gamma, **kw),
      sharding,
      impl[0],
      (u, q1, kernels.complement_coefficient(s, gamma, y, c)),
      gsharding.CORRECT,
    )
    for u, s, (y,), (c, q1) in zip(us, sigmas, ys, residuals, strict=True)
  ]


def _identity_factors(us, sigmas):
  """``(Q = I, sigma)`` per bucket, in the compute dtype (the small algebra's, see
  :func:`brand_step`), as arrays (a branch of the re-orthonormalisation's ``lax.cond``)."""
  factors = []
  for u, sigma in zip(us, sigmas, strict=True):
    dtype = kernels.compute_dtype(u.dtype)
    eye = jnp.broadcast_to(jnp.eye(u.shape[-1], dtype=dtype), (u.shape[0],) + u.shape[-1:] * 2)
    factors.append((eye, sigma.astype(dtype)))
  return factors


def _reorthonormalising_factors(us, sigmas):
  """``(Q, sigma')`` per bucket from ``U^T U`` (:func:`lowrank.reorthonormalising_factor`), in
  the compute dtype."""
  factors = []
  for u, sigma in zip(us, sigmas, strict=True):
    dtype = kernels.compute_dtype(u.dtype)
    factors.append(lowrank.reorthonormalising_factor(lowrank.gram(u, dtype), sigma.astype(dtype)))
  return factors


def _sigma_stacks(layout: common.Layout, sigma, block) -> list[jax.Array]:
  """State ``sigma`` as one ``(members, rank)`` array per bucket."""
  if block != "per_tensor":
    return [sigma[None]] if layout.buckets else []
  return list(sigma.stacks)


def reorthonormalise(
  opt_state,
  *,
  passes: str = "jnp",
  sharding: gsharding.StateSharding | None = None,
  tuning: kernels.Tuning = kernels.DEFAULT,
):
  """``opt_state`` with the ``U`` of every Ginger state in it re-orthonormalised.

  The same Cholesky-QR as ``scale_by_ginger``'s periodic one (:func:`lowrank.gram`, one read
  of ``U``; :func:`lowrank.reorthonormalising_factor`): ``U <- U Q`` with ``(U Q)^T (U Q) =
  I`` and ``sigma <- sigma'`` such that ``U diag(sigma) U^T`` is unchanged; the count and the
  momentum are left as they are. ``U Q`` is pass 3's rotation with a zero residual
  (:func:`ginger._src.kernels.rotate_from_residual`), so it is written over ``U`` (when the state
  is donated) with ``passes`` as in the update, and within each device's rows with
  ``sharding``, under ``tuning`` (the ``passes``, ``sharding`` and ``tuning`` the optimizer was
  built with).

  For ``scale_by_ginger(..., reorthonormalise_every=0)``, whose update never does it (no
  ``lax.cond`` in the step): call this as its own jitted program every
  :func:`default_reorthonormalise_every` curvature updates, e.g. after step ``t`` when
  ``(t + 1) % N == 0`` with a curvature update every step. ``opt_state`` may hold the
  Ginger state at any depth (``optax.chain``, ``inject_hyperparams``...); other states pass
  through unchanged. Pure: usable under ``jax.jit``.
  """
  common.check_passes(passes)
  common.check_tuning(tuning)
  impl = kernels.resolve_impl(passes, None)

  def one(state):
    if not isinstance(state, ScaleByGingerState) or not state.u.stacks:
      return state
    layout, us = state.u.layout, list(state.u.stacks)
    per_tensor = isinstance(state.sigma, StackedSigma)
    sigmas = _sigma_stacks(layout, state.sigma, "per_tensor" if per_tensor else "global")
    kw = dict(impl=impl[0], interpret=impl[1], tuning=tuning)
    new_us, new_sigmas = [], []
    for u, (q, sigma) in zip(us, _reorthonormalising_factors(us, sigmas), strict=True):
      rows = jnp.zeros(u.shape[:-1], u.dtype)  # p1 and g: a zero residual and output
      small = jnp.zeros(u.shape[:-2] + u.shape[-1:], u.dtype)
      inv_r = jnp.zeros(u.shape[:1], u.dtype)
      smalls = [small, inv_r, q.astype(u.dtype), small, small, inv_r]  # U' = U Q
      u_new, _ = rotate(u, rows, rows, smalls, 1.0, 0, sharding, kw)
      new_us.append(u_new)
      new_sigmas.append(sigma.astype(u.dtype))
    sigma = StackedSigma(new_sigmas, layout) if per_tensor else new_sigmas[0][0]
    return state._replace(u=StackedBasis(new_us, layout), sigma=sigma)

  return jax.tree.map(one, opt_state, is_leaf=lambda x: isinstance(x, ScaleByGingerState))


def ginger(
  learning_rate: optax.ScalarOrSchedule,
  tau: int = 4,
  alpha: float = 0.99,
  gamma: float = 1e-5,
  b1: float = 0.9,
  rho: float | None = None,
  block: str = "per_tensor",
  *,
  state_dtype: str = "float32",
  reorthonormalise_every: int | None = None,
  eigensolver: str = "secular",
  curvature_every: int | None = None,
  passes: str = "jnp",
  sharding: gsharding.StateSharding | None = None,
  tuning: kernels.Tuning = kernels.DEFAULT,
) -> optax.GradientTransformationExtraArgs:
  r"""The Ginger optimizer as the authors compose it.

  A bias-corrected momentum, preconditioned by :func:`scale_by_ginger`, optionally clipped
  element-wise, scaled by the learning rate (:func:`clip_and_scale`)::

    m_t = b1 m_{t-1} + (1 - b1) g_t
    u_t = clip(G_t^{-1} m_t / (1 - b1^t), -rho, rho)
    params <- params - lr_t u_t

  ``G_t`` is first updated with ``fisher_grads`` (``d_t``, from
  :func:`ginger.fisher.value_grad_and_fisher`) as in :func:`scale_by_ginger`. The defaults
  ``tau=4``, ``alpha=0.99``, ``gamma=1e-5``, ``b1=0.9`` are the paper's and the authors'; the
  authors also clip with ``rho=1``, off here by default (with ``rho=1`` on ResNet-18 the clip
  changes about a fifth of the entries: it bounds the large ones, see results/REPRODUCTION.md).

  Args:
    learning_rate: a scalar or an optax schedule.
    tau, alpha, gamma, block: the curvature model's, as in :func:`scale_by_ginger`.
    b1: decay of the momentum, kept in Ginger's state, in [0, 1).
    rho: if set, each update entry is clipped to ``[-rho, rho]`` before the learning rate.
    state_dtype, reorthonormalise_every, eigensolver, curvature_every, passes, sharding,
      tuning: as in :func:`scale_by_ginger`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; its ``update`` takes ``fisher_grads``.

  Examples:
    A softmax regression trained with the sampled-Fisher vector of each step's batch:

    >>> import jax, jax.numpy as jnp, optax
    >>> import ginger
    >>> x = jax.random.normal(jax.random.key(0), (64, 4))
    >>> y = (x[:, 0] + x[:, 1] > 0).astype(jnp.int32)
    >>> params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
    >>> logits_fn = lambda p: x @ p["w"] + p["b"]
    >>> tx = ginger.ginger(learning_rate=1e-2, tau=2, rho=1.0)
    >>> @jax.jit
    ... def step(params, state, key):
    ...   (loss, _), grads, d = ginger.fisher.value_grad_and_fisher(logits_fn, params, y, key)
    ...   updates, state = tx.update(grads, state, params, fisher_grads=d)
    ...   return optax.apply_updates(params, updates), state, loss
    >>> state = tx.init(params)
    >>> for t in range(30):
    ...   params, state, loss = step(params, state, jax.random.key(t))
    >>> print(bool(loss < 0.6))  # from log(2) = 0.69
    True

  References:
    As :func:`scale_by_ginger`.
  """
  every = common.check_every("curvature_every", curvature_every)
  common.check_rho(rho)
  preconditioner = scale_by_ginger(
    tau, alpha, gamma, block, state_dtype=state_dtype,
    reorthonormalise_every=reorthonormalise_every, eigensolver=eigensolver,
    curvature_every=curvature_every, passes=passes, sharding=sharding, tuning=tuning,
    b1=b1,  # the momentum, kept stacked as U is (optax.ema's arithmetic)
  )  # fmt: skip
  chain = optax.chain(preconditioner, *clip_and_scale(learning_rate, rho))
  # With curvature_every > 1 a missing d_t means "no curvature update", not the gradient.
  return common.default_fisher_to_gradient(chain) if every == 1 else chain


def clip_and_scale(
  learning_rate: optax.ScalarOrSchedule, rho: float | None
) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
  """The last two links of :func:`ginger`'s chain: ``u <- clip(u, -rho, rho)`` element-wise
  (``optax.clip``; the identity without ``rho``), then ``u <- -lr_t u``
  (``optax.scale_by_learning_rate``). Two links, not a chain of them: the optimizer state
  keeps one entry per link, as checkpoints hold it."""
  clip = optax.clip(rho) if rho is not None else optax.identity()
  return clip, optax.scale_by_learning_rate(learning_rate)
