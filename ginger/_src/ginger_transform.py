"""Ginger: a damped low-rank Gauss-Newton preconditioner as optax transformations.

The curvature model of each block is ``G = gamma I + U diag(sigma) U^T`` (``U`` is
``d x tau`` with orthonormal columns, ``sigma >= 0`` sorted descending). Every step first
folds the sampled-Fisher vector ``d_t`` into the curvature::

    S_t = top_tau( alpha S_{t-1} + (1 - alpha) d_t d_t^T ),     S_0 = 0

(Brand's rank-one eigen-update, O(d tau^2 + tau^3)), then returns ``G_t^{-1} g`` by the
stable split of the Woodbury identity (O(d tau)). See docs/ginger-math.md for why this
sigma-space form, and not the paper's inverse-space algorithm, is the one implemented.

The file follows the step: :func:`scale_by_ginger` and its state (:func:`init_state`,
:func:`update_state`); the curvature update of all buckets, :func:`brand_step`: pass 1
projects ``d_t`` and ``g`` on ``U`` (:func:`_project`), pass 2 forms their residuals outside
``span U`` (:func:`_residual`), Brand's small eigenproblem gives the new ``sigma`` and the
rotation (:func:`_eigen_update`), pass 3 rotates ``U`` and writes ``G^{-1} g``
(:func:`_rotate`); the periodic re-orthonormalisation (:func:`_basis_factors`,
:func:`reorthonormalise`); and :func:`ginger`, the optimizer as the authors compose it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ginger._src import common, kernels, lowrank
from ginger._src import sharding as gsharding
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


def check_settings(
  tau, alpha, gamma, block, state_dtype, reorthonormalise_every, eigensolver, curvature_every,
  passes, sharding, b1,
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
    curvature_every, passes, sharding, b1,
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
    passes, sharding, b1,
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
  layout = common.plan_layout([v.size for v in vectors], s.tau, s.block, treedef)
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
    outs = _precondition(us, sigmas, gs, s.gamma, s.sharding, impl)
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
    sharding=s.sharding, keep=~finite,
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


def _precondition(us, sigmas, gs, gamma, sharding, impl) -> list:
  """``G^{-1} g`` per bucket with the curvature as it is, by the stable split of Woodbury::

    G^{-1} g = (q + U (gamma / (gamma + sigma)) (y + c)) / gamma,   y = U^T g,
    q1 = g - U y,   c = U^T q1,   q = q1 - U c

  (CGS2: ``q``, the part of ``g`` outside ``span U``, is orthogonal to ``U`` to working
  precision; :func:`kernels.complement_coefficient` forms the coefficient with no term of the
  size of ``g`` cancelling). Three passes over ``U``, run per device on a split state as
  :func:`brand_step`'s are."""
  kw = dict(impl=impl[0], interpret=impl[1])
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
  Brand's core and its eigenpairs (:func:`_eigen_update`); pass 3 (:func:`_rotate`) writes
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
  Returns ``(new U per bucket, G'^{-1} g per bucket, new sigma per bucket)``.
  """
  kw = dict(impl=impl, interpret=interpret)
  if not us:
    return [], [], []
  small = _project(us, vs, gs, factors, sharding, kw)
  residuals = _residual(us, vs, gs, factors, small, sharding, kw)
  coefs, new_sigmas = _eigen_update(us, factors, small, alpha, gamma, eigensolver, keep, kw)
  new_us, outs = [], []
  for u, (p1, q1), (co, first_block) in zip(us, residuals, coefs, strict=True):
    smalls = [co[key] for key in ("a2", "inv_r", "rot", "b", "a", "beta")]
    u_new, out = _rotate(u, p1, q1, smalls, gamma, first_block, sharding, kw)
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


def _rotate(u, p1, q1, smalls, gamma, first_block, sharding, kw):
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
  opt_state, *, passes: str = "jnp", sharding: gsharding.StateSharding | None = None
):
  """``opt_state`` with the ``U`` of every Ginger state in it re-orthonormalised.

  The same Cholesky-QR as ``scale_by_ginger``'s periodic one (:func:`lowrank.gram`, one read
  of ``U``; :func:`lowrank.reorthonormalising_factor`): ``U <- U Q`` with ``(U Q)^T (U Q) =
  I`` and ``sigma <- sigma'`` such that ``U diag(sigma) U^T`` is unchanged; the count and the
  momentum are left as they are. ``U Q`` is pass 3's rotation with a zero residual
  (:func:`ginger._src.kernels.rotate_from_residual`), so it is written over ``U`` (when the state
  is donated) with ``passes`` as in the update, and within each device's rows with
  ``sharding`` (the ``passes`` and ``sharding`` the optimizer was built with).

  For ``scale_by_ginger(..., reorthonormalise_every=0)``, whose update never does it (no
  ``lax.cond`` in the step): call this as its own jitted program every
  :func:`default_reorthonormalise_every` curvature updates, e.g. after step ``t`` when
  ``(t + 1) % N == 0`` with a curvature update every step. ``opt_state`` may hold the
  Ginger state at any depth (``optax.chain``, ``inject_hyperparams``...); other states pass
  through unchanged. Pure: usable under ``jax.jit``.
  """
  common.check_passes(passes)
  impl = kernels.resolve_impl(passes, None)

  def one(state):
    if not isinstance(state, ScaleByGingerState) or not state.u.stacks:
      return state
    layout, us = state.u.layout, list(state.u.stacks)
    per_tensor = isinstance(state.sigma, StackedSigma)
    sigmas = _sigma_stacks(layout, state.sigma, "per_tensor" if per_tensor else "global")
    kw = dict(impl=impl[0], interpret=impl[1])
    new_us, new_sigmas = [], []
    for u, (q, sigma) in zip(us, _reorthonormalising_factors(us, sigmas), strict=True):
      rows = jnp.zeros(u.shape[:-1], u.dtype)  # p1 and g: a zero residual and output
      small = jnp.zeros(u.shape[:-2] + u.shape[-1:], u.dtype)
      inv_r = jnp.zeros(u.shape[:1], u.dtype)
      smalls = [small, inv_r, q.astype(u.dtype), small, small, inv_r]  # U' = U Q
      u_new, _ = _rotate(u, rows, rows, smalls, 1.0, 0, sharding, kw)
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
    state_dtype, reorthonormalise_every, eigensolver, curvature_every, passes, sharding: as in
      :func:`scale_by_ginger`.

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
    curvature_every=curvature_every, passes=passes, sharding=sharding,
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
