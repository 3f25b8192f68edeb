"""SOAP (Vyas et al., 2024): Adam run in the eigenbasis of Shampoo's Kronecker factors.

For a leaf of shape ``(d_1, ..., d_k)`` with gradient ``G_t``, each axis ``i`` whose size is at
most ``max_precond_dim`` keeps Shampoo's factor, an exponential average of the gradient's
second moment along that axis (for a matrix, ``L = E[G G^T]`` and ``R = E[G^T G]``)::

    F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T          (G_(i): G unfolded along axis i)

and an orthonormal basis ``Q_i`` of its eigenvectors. ``Q^T G`` below means ``G`` rotated by
``Q_i^T`` along every axis ``i`` that has a factor (``Q_L^T G Q_R`` for a matrix); an axis
without one is left as it is. Adam runs in the rotated coordinates::

    G'_t = Q^T G_t
    m_t = b1 m_{t-1} + (1 - b1) G'_t,      v_t = b2 v_{t-1} + (1 - b2) G'_t^2
    u_t = sqrt(1 - b2^t) / (1 - b1^t) * Q (m_t / (sqrt(v_t) + eps))

(``m`` and ``v`` live in the eigenbasis). Every ``precondition_frequency`` steps, after the
update, each ``Q_i`` is refreshed by one step of power iteration and a QR decomposition,
``Q_i <- qr(F_i Q_i)``, its columns first ordered by the eigenvalue estimates
``diag(Q_i^T F_i Q_i)``, descending; ``v`` is permuted with them and ``m`` rotated into the
new basis. The first call only sets up the preconditioner (``F_i`` from ``G_1``, ``Q_i`` from a
full eigendecomposition ``eigh(F_i)``) and returns a zero update, so that no step projects a
gradient with a basis computed from that same gradient.

This follows the authors' PyTorch implementation (github.com/nikhilvyas/SOAP, ``soap.py``),
which ``tests/vendored/soap_torch.py`` vendors and ``tests/test_soap.py`` runs beside this one.
The update is invariant to the signs of the eigenvectors (a column of ``Q_i`` and the matching
slice of ``m`` flip together; ``v`` holds squares). One difference in the order of operations:
the reference rotates ``m`` back to the parameters' coordinates and into the eigenbasis again
after every step (the same basis but on refreshes: the identity, to rounding); here ``m`` stays
in the eigenbasis and is rotated only when the basis changes, ``Q_new^T Q_old m``.

Memory: ``m`` and ``v`` (two floats per parameter) plus, per factor of size ``d``, ``F_i`` and
``Q_i`` (``2 d^2`` floats).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.tree_utils import _state_utils

from ginger._src import common

HIGHEST = jax.lax.Precision.HIGHEST
# Added to a factor before its first eigendecomposition, as the authors do.
EIGH_SHIFT = 1e-30
# The authors' largest axis given a factor: it leaves out most vocabularies.
DEFAULT_MAX_PRECOND_DIM = 10000
# Factors of at most this many rows (a convolution's kernel-height and -width axes: 3 x 3 from a
# contraction over every other entry of the kernel, up to 2.4M for ResNet-18) are computed as an
# elementwise product reduced over those entries, not as a dot: XLA:GPU emits a dot with one
# thread block per tile of its output, so a 3 x 3 output would be reduced by one block
# (openxla/xla#46645), where a reduction spreads over the whole GPU. Same arithmetic.
NARROW_FACTOR = 16
# The branches of the preconditioner's basis update (one ``lax.switch`` a step).
_FIRST, _KEEP, _REFRESH = 0, 1, 2


class ScaleBySoapState(NamedTuple):
  """State of :func:`scale_by_soap`.

  Attributes:
    count: number of updates so far (int32). The first only sets up the preconditioner, so
      update ``count`` (>= 1) is Adam's step ``t = count``.
    mu: pytree like the params: Adam's first moment ``m``, in the eigenbasis.
    nu: pytree like the params: Adam's second moment ``v``, in the eigenbasis.
    factors: one tuple per leaf (in ``jax.tree.leaves`` order), one entry per axis of the
      leaf's preconditioned shape: Shampoo's factor ``F_i``, ``(d_i, d_i)``, or None for an
      axis without one.
    bases: as ``factors``: the eigenbasis ``Q_i`` of each factor (columns by descending
      eigenvalue estimate), or None.
  """

  count: chex.Array
  mu: Any
  nu: Any
  factors: list[tuple[jax.Array | None, ...]]
  bases: list[tuple[jax.Array | None, ...]]


def merged_shape(shape: tuple[int, ...], max_precond_dim: int) -> tuple[int, ...]:
  """The authors' ``merge_dims``: consecutive axes merged while the product of their sizes
  stays at most ``max_precond_dim``; an axis larger than that stays alone.

  >>> merged_shape((3, 3, 64, 128), 10000)
  (576, 128)
  """
  new, current = [], 1
  for size in shape:
    if current * size > max_precond_dim:
      if current > 1:
        new.append(current)
        current = size
      else:
        new.append(size)
        current = 1
    else:
      current *= size
  if current > 1 or not new:
    new.append(current)
  return tuple(new)


def preconditioned_shape(
  shape: tuple[int, ...], max_precond_dim: int, merge_dims: bool, precondition_1d: bool
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
  """The shape a leaf of ``shape`` is preconditioned in (:func:`merged_shape` with
  ``merge_dims``, else ``shape``) and, per axis of it, whether it has a factor: an axis of
  size at most ``max_precond_dim``; of a 1-D leaf only with ``precondition_1d``. A leaf without
  entries has none."""
  shape = tuple(int(d) for d in shape)
  if len(shape) == 1:
    return shape, (precondition_1d and shape[0] <= max_precond_dim and shape[0] > 0,)
  if merge_dims:
    shape = merged_shape(shape, max_precond_dim)
  empty = math.prod(shape) == 0
  return shape, tuple(not empty and d <= max_precond_dim for d in shape)


def contract_first_axis(x: jax.Array, q: jax.Array) -> jax.Array:
  """``tensordot(x, q, [[0], [0]])``: axis 0 of ``x`` contracted with the rows of ``q``, the
  new axis last (float32 products)."""
  return jnp.tensordot(x, q, axes=[[0], [0]], precision=HIGHEST)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a b``, float32 products."""
  return jnp.matmul(a, b, precision=HIGHEST)


def project(x: jax.Array, bases) -> jax.Array:
  """``Q^T x``: ``x`` rotated by ``Q_i^T`` along each axis ``i`` with a basis (None: left as
  it is). Contracts axis 0 and appends the new axis last, once per axis, as the authors do."""
  for q in bases:
    x = jnp.moveaxis(x, 0, -1) if q is None else contract_first_axis(x, q)
  return x


def project_back(x: jax.Array, bases) -> jax.Array:
  """``Q x``: the inverse of :func:`project` (each ``Q_i`` is orthonormal)."""
  for q in bases:
    x = jnp.moveaxis(x, 0, -1) if q is None else contract_first_axis(x, q.T)
  return x


def axis_second_moment(g: jax.Array, axis: int) -> jax.Array:
  """``G_(i) G_(i)^T``: ``g`` contracted with itself over every axis but ``axis``. A factor of
  at most :data:`NARROW_FACTOR` rows is a sum of products, the rest a dot."""
  if g.shape[axis] <= NARROW_FACTOR:
    rows = jnp.moveaxis(g, axis, 0).reshape(g.shape[axis], -1)
    return jnp.sum(rows[:, None, :] * rows[None, :, :], axis=-1)
  others = [a for a in range(g.ndim) if a != axis]
  return jnp.tensordot(g, g, axes=[others, others], precision=HIGHEST)


def update_factors(factors, g: jax.Array, beta) -> tuple:
  """``F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T`` for each axis with a factor."""
  return tuple(
    None if f is None else f + (1.0 - beta) * (axis_second_moment(g, i) - f)
    for i, f in enumerate(factors)
  )


def initial_basis(factor: jax.Array) -> jax.Array:
  """The eigenvectors of ``factor``, by descending eigenvalue (``eigh`` gives ascending)."""
  shift = EIGH_SHIFT * jnp.eye(factor.shape[0], dtype=factor.dtype)
  _, vectors = jnp.linalg.eigh(factor + shift)
  return vectors[:, ::-1]


def refreshed_basis(factor: jax.Array, basis: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One power-iteration step from ``basis``: ``qr(F Q)``, with the columns of ``Q`` first
  ordered by the eigenvalue estimates ``diag(Q^T F Q)``, descending. Returns the new basis and
  that order (the permutation of ``Q``'s columns)."""
  fq = matmul(factor, basis)
  estimates = jnp.sum(basis * fq, axis=0)  # diag(Q^T F Q)
  order = jnp.argsort(-estimates)
  new_basis, _ = jnp.linalg.qr(fq[:, order])
  return new_basis, order


def rotate_moments(mu: jax.Array, nu: jax.Array, rotations, orders):
  """``m`` and ``v`` carried into refreshed bases: ``v`` permuted along each axis as the columns
  of its ``Q_i`` (``orders``), ``m`` rotated by ``Q_old^T Q_new`` along each axis
  (``rotations``; None: an axis without a factor)."""
  for axis, order in enumerate(orders):
    if order is not None:
      nu = jnp.take(nu, order, axis=axis)
  return project(mu, rotations), nu


def refresh_factor(factor: jax.Array, basis: jax.Array):
  """:func:`refreshed_basis` of one factor, with the order of its columns and the rotation
  ``Q_old^T Q_new`` that carries ``m`` into the new basis."""
  new_basis, order = refreshed_basis(factor, basis)
  return new_basis, order, matmul(basis.T, new_basis)


def adam_in_eigenbasis(g, mu, nu, bases, t, *, b1, b2, eps, correct_bias, normalize_grads):
  """One Adam step on ``Q^T g``, rotated back: the update direction and the new moments."""
  g_rotated = project(g, bases)
  mu = b1 * mu + (1.0 - b1) * g_rotated
  nu = b2 * nu + (1.0 - b2) * jnp.square(g_rotated)
  direction = project_back(mu / (jnp.sqrt(nu) + eps), bases)
  if correct_bias:
    direction = direction * (jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t))
  if normalize_grads:
    direction = direction / (1e-30 + jnp.sqrt(jnp.mean(jnp.square(direction))))
  return direction, mu, nu


def _check_decay(name: str, value, optional: bool = False) -> None:
  concrete = None if value is None else common._concrete(value)
  if value is None and not optional:
    raise ValueError(f"{name} must lie in [0, 1), got None.")
  if concrete is not None and not 0.0 <= concrete < 1.0:
    raise ValueError(f"{name} must lie in [0, 1) (a moving average's decay), got {concrete}.")


def _check_flag(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {value!r}.")
  return bool(value)


def _check_int(name: str, value, what: str) -> None:
  """An integer >= 1: a Python or NumPy int, or a concrete integer array (optax.inject_hyperparams
  passes its values as arrays); a traced value passes."""
  if isinstance(value, jax.core.Tracer):
    return
  integer = (
    not isinstance(value, (bool, np.bool_))
    and np.ndim(value) == 0
    and np.issubdtype(np.asarray(value).dtype, np.integer)
  )
  if not integer or int(value) < 1:
    raise ValueError(f"{name} must be an int >= 1 ({what}), got {value!r}.")


class SoapOptions(NamedTuple):
  """:func:`scale_by_soap`'s arguments, checked by :func:`soap_options` (``beta``: the factors'
  decay, ``shampoo_beta`` or ``b2``)."""

  b1: Any
  b2: Any
  beta: Any
  eps: Any
  precondition_frequency: Any
  max_precond_dim: int
  merge_dims: bool
  precondition_1d: bool
  normalize_grads: bool
  correct_bias: bool


def soap_options(
  b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims, *flags
) -> SoapOptions:
  """:func:`scale_by_soap`'s arguments checked (a bad one raises a ValueError naming it) and
  completed (``max_precond_dim=None``: the authors' 10000). ``flags``: ``precondition_1d``,
  ``normalize_grads``, ``correct_bias``."""
  _check_decay("b1", b1)
  _check_decay("b2", b2)
  _check_decay("shampoo_beta", shampoo_beta, optional=True)
  concrete_eps = common._concrete(eps)
  if concrete_eps is not None and not (concrete_eps >= 0.0 and math.isfinite(concrete_eps)):
    raise ValueError(f"eps must be a finite number >= 0, got {concrete_eps}.")
  _check_int("precondition_frequency", precondition_frequency, "steps between refreshes")
  if max_precond_dim is None:
    max_precond_dim = DEFAULT_MAX_PRECOND_DIM
  if not isinstance(max_precond_dim, (int, np.integer)) or isinstance(max_precond_dim, bool):
    raise ValueError(
      f"max_precond_dim must be a Python int >= 1 (it fixes the state's shapes, so under "
      f"optax.inject_hyperparams pass it in static_args), got {max_precond_dim!r}."
    )
  _check_int("max_precond_dim", max_precond_dim, "the largest axis given a factor")
  names = ("precondition_1d", "normalize_grads", "correct_bias")
  return SoapOptions(
    b1,
    b2,
    b2 if shampoo_beta is None else shampoo_beta,
    eps,
    precondition_frequency,
    int(max_precond_dim),
    _check_flag("merge_dims", merge_dims),
    *(_check_flag(name, value) for name, value in zip(names, flags, strict=True)),
  )


def leaf_layout(leaf, options: SoapOptions) -> tuple[tuple[int, ...], tuple[bool, ...]]:
  """:func:`preconditioned_shape` of a leaf under ``options``."""
  return preconditioned_shape(
    jnp.shape(leaf), options.max_precond_dim, options.merge_dims, options.precondition_1d
  )


def init_soap(params, options: SoapOptions) -> ScaleBySoapState:
  """Zero moments, zero factors and identity bases, laid out per leaf as
  :class:`ScaleBySoapState` says."""
  if isinstance(params, _state_utils._ParamsPlaceholder):  # noqa: SLF001
    # optax.tree.map_params looks for params-shaped trees by initialising with a placeholder:
    # m and v are such trees, the per-leaf lists of factors and bases are not (one leaf each
    # here, so map_params leaves them to transform_non_params).
    leaf = jnp.zeros([], jnp.float32)
    return ScaleBySoapState(jnp.zeros([], jnp.int32), params, params, leaf, leaf)
  common.check_float_params(params)
  factors, bases = [], []
  for leaf in jax.tree.leaves(params):
    shape, has = leaf_layout(leaf, options)
    sizes = [d if h else None for d, h in zip(shape, has, strict=True)]
    factors.append(tuple(None if d is None else jnp.zeros((d, d)) for d in sizes))
    bases.append(tuple(None if d is None else jnp.eye(d) for d in sizes))
  zeros = lambda p: jnp.zeros(jnp.shape(p), jnp.float32)
  return ScaleBySoapState(
    count=jnp.zeros([], jnp.int32),
    mu=jax.tree.map(zeros, params),
    nu=jax.tree.map(zeros, params),
    factors=factors,
    bases=bases,
  )


def refresh_leaf(factors, bases, mu: jax.Array, nu: jax.Array):
  """Every basis of a leaf refreshed (:func:`refresh_factor`) and its moments carried along
  (:func:`rotate_moments`). Returns the new bases, ``m`` and ``v``."""
  refreshed = [
    None if f is None else refresh_factor(f, q) for f, q in zip(factors, bases, strict=True)
  ]
  output = lambda k: tuple(None if r is None else r[k] for r in refreshed)
  mu, nu = rotate_moments(mu, nu, output(2), output(1))
  return output(0), mu, nu


def update_bases(branch, factors, bases, mus, nus):
  """The step's basis work, one ``lax.switch`` on ``branch`` for all leaves: set up
  (``Q_i = eigh(F_i)``, :func:`initial_basis`), keep, or refresh (:func:`refresh_leaf`).
  ``factors``, ``bases``: per leaf, tuples over axes. Returns the bases, ``m`` and ``v``."""

  def set_up(bases, mus, nus):
    return [tuple(None if f is None else initial_basis(f) for f in fs) for fs in factors], mus, nus

  def refresh(bases, mus, nus):
    out = [refresh_leaf(*a) for a in zip(factors, bases, mus, nus, strict=True)]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]

  keep = lambda *operands: operands
  return jax.lax.switch(branch, (set_up, keep, refresh), bases, mus, nus)


def update_soap(updates, state: ScaleBySoapState, params=None, *, options: SoapOptions, **extra):
  """One SOAP update (:func:`scale_by_soap`): Adam in the eigenbasis, the factors' moving
  average, then the basis work of the step (:func:`update_bases`)."""
  del params, extra
  leaves, treedef = jax.tree.flatten(updates)
  shapes = [leaf_layout(g, options)[0] for g in leaves]
  grads = [g.astype(jnp.float32).reshape(s) for g, s in zip(leaves, shapes, strict=True)]
  mus = [m.reshape(s) for m, s in zip(treedef.flatten_up_to(state.mu), shapes, strict=True)]
  nus = [v.reshape(s) for v, s in zip(treedef.flatten_up_to(state.nu), shapes, strict=True)]
  first = state.count == 0
  adam = functools.partial(
    adam_in_eigenbasis,
    t=jnp.maximum(state.count, 1).astype(jnp.float32),  # Adam's step (1 on the first call)
    b1=options.b1,
    b2=options.b2,
    eps=options.eps,
    correct_bias=options.correct_bias,
    normalize_grads=options.normalize_grads,
  )
  stepped = [adam(*a) for a in zip(grads, mus, nus, state.bases, strict=True)]
  # The first call takes no step: its basis is not set up yet.
  directions = [jnp.where(first, 0.0, u) for u, _, _ in stepped]
  mus = [jnp.where(first, old, new) for old, (_, new, _) in zip(mus, stepped, strict=True)]
  nus = [jnp.where(first, old, new) for old, (_, _, new) in zip(nus, stepped, strict=True)]
  factors = [update_factors(f, g, options.beta) for f, g in zip(state.factors, grads, strict=True)]
  refresh = state.count % options.precondition_frequency == 0
  branch = jnp.where(first, _FIRST, jnp.where(refresh, _REFRESH, _KEEP))
  bases, mus, nus = update_bases(branch, factors, list(state.bases), mus, nus)

  def unflatten(xs, dtype=None):
    shaped = [
      x.reshape(jnp.shape(g)).astype(dtype or g.dtype) for x, g in zip(xs, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, shaped)

  new_state = ScaleBySoapState(
    count=optax.safe_increment(state.count),
    mu=unflatten(mus, jnp.float32),
    nu=unflatten(nus, jnp.float32),
    factors=factors,
    bases=bases,
  )
  return unflatten(directions), new_state


def scale_by_soap(
  b1: float = 0.95,
  b2: float = 0.95,
  shampoo_beta: float | None = None,
  eps: float = 1e-8,
  precondition_frequency: int = 10,
  max_precond_dim: int | None = None,
  merge_dims: bool = False,
  precondition_1d: bool = False,
  normalize_grads: bool = False,
  correct_bias: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by SOAP: Adam in the eigenbasis of Shampoo's Kronecker factors.

  Per leaf, with ``Q^T G`` the gradient rotated by each factor's eigenbasis ``Q_i^T`` along
  its axis (``Q_L^T G Q_R`` for a matrix; axes without a factor are left alone)::

    F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T       (Shampoo's factors; beta = shampoo_beta)
    m_t = b1 m_{t-1} + (1 - b1) Q^T G_t,   v_t = b2 v_{t-1} + (1 - b2) (Q^T G_t)^2
    u_t = sqrt(1 - b2^t) / (1 - b1^t) Q (m_t / (sqrt(v_t) + eps))

  and every ``precondition_frequency`` steps ``Q_i <- qr(F_i Q_i)``, columns ordered by the
  estimates ``diag(Q_i^T F_i Q_i)`` (``v`` permuted and ``m`` rotated along). The first update
  sets up ``F_i`` and ``Q_i = eigh(F_i)`` and is zero; ``t`` counts the updates after it.
  Returns ``u_t`` (positive: chain ``optax.scale_by_learning_rate``). As the authors' PyTorch
  ``SOAP`` (``data_format="channels_first"``; the module docstring gives the details): float32
  state and ``Precision.HIGHEST`` products whatever the params' dtype; the step's basis work is
  one ``lax.switch`` on the count (on a GPU the host reads its index once a step).

  Args:
    b1, b2: decays of the first and second moments, in [0, 1).
    shampoo_beta: decay of the factors ``F_i``, in [0, 1); None: ``b2`` (the authors' -1).
    eps: added to ``sqrt(v_t)``, >= 0.
    precondition_frequency: steps between refreshes of the eigenbases, an int >= 1.
    max_precond_dim: axes longer than this get no factor, a Python int >= 1 (it fixes the
      state's shapes: under ``optax.inject_hyperparams`` pass it in ``static_args``); None:
      the authors' 10000.
    merge_dims: merge consecutive axes while their product stays at most
      ``max_precond_dim`` (:func:`merged_shape`): fewer, larger factors.
    precondition_1d: give 1-D leaves (biases, norms) a factor; by default they get Adam.
    normalize_grads: divide each leaf's update by its root mean square.
    correct_bias: Adam's bias correction ``sqrt(1 - b2^t) / (1 - b1^t)``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` (extra arguments are ignored).

  Examples:
    The first update is zero; the second is Adam's first step in the eigenbasis (on a 1-D leaf
    without a factor, Adam's own: ``sign(g)``):

    >>> import jax, jax.numpy as jnp
    >>> import ginger
    >>> tx = ginger.scale_by_soap()
    >>> g = {"b": jnp.array([3.0, -4.0]), "w": jnp.ones((2, 3))}
    >>> update = jax.jit(tx.update)
    >>> u, state = update(g, tx.init(g))
    >>> print(u["b"])
    [0. 0.]
    >>> u, state = update(g, state)
    >>> print(jnp.round(u["b"], 4), u["w"].shape, [f.shape for f in state.factors[1]])
    [ 1. -1.] (2, 3) [(2, 2), (3, 3)]

  References:
    Vyas, Morwani, Zhao, Shapira, Brandfonbrener, Janson and Kakade, `SOAP: Improving and
    Stabilizing Shampoo using Adam <https://arxiv.org/abs/2409.11321>`_, 2024
  """
  options = soap_options(
    b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims,
    precondition_1d, normalize_grads, correct_bias,
  )  # fmt: skip
  return optax.GradientTransformationExtraArgs(
    functools.partial(init_soap, options=options),
    functools.partial(update_soap, options=options),
  )


def soap(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.95,
  b2: float = 0.95,
  shampoo_beta: float | None = None,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  precondition_frequency: int = 10,
  max_precond_dim: int | None = None,
  merge_dims: bool = False,
  precondition_1d: bool = False,
  normalize_grads: bool = False,
  correct_bias: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""The SOAP optimizer: :func:`scale_by_soap`, decoupled weight decay, ``-lr``::

    params <- params - lr_t (u_t + weight_decay params)

  The defaults are the authors' (``betas=(0.95, 0.95)``, ``eps=1e-8``,
  ``precondition_frequency=10``, ``max_precond_dim=10000`` as None) but ``weight_decay``: 0.01
  theirs, 0 here (a framework adds its own). Theirs is applied after the step, ``params <-
  (params - lr u) (1 - lr weight_decay)``, and skipped with the first (zero) step; this one is
  optax's ``add_decayed_weights``: the two differ by ``lr^2 weight_decay u``.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims,
      precondition_1d, normalize_grads, correct_bias: as in :func:`scale_by_soap`.
    weight_decay: decoupled weight decay (AdamW's), >= 0.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Examples:
    A least-squares fit of a matrix:

    >>> import jax, jax.numpy as jnp, optax
    >>> import ginger
    >>> x = jax.random.normal(jax.random.key(0), (64, 6))
    >>> y = x @ jax.random.normal(jax.random.key(1), (6, 3))
    >>> params = {"w": jnp.zeros((6, 3))}
    >>> loss_fn = lambda p: jnp.mean((x @ p["w"] - y) ** 2)
    >>> tx = ginger.soap(learning_rate=3e-2)
    >>> @jax.jit
    ... def step(params, state):
    ...   loss, grads = jax.value_and_grad(loss_fn)(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state, loss
    >>> state = tx.init(params)
    >>> first = float(loss_fn(params))
    >>> for _ in range(100):
    ...   params, state, loss = step(params, state)
    >>> print(bool(loss < 0.01 * first))
    True

  References:
    Vyas et al., `SOAP <https://arxiv.org/abs/2409.11321>`_, 2024
  """
  concrete = common._concrete(weight_decay)
  if concrete is not None and not concrete >= 0.0:
    raise ValueError(f"weight_decay must be >= 0, got {concrete}.")
  scale = scale_by_soap(
    b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims,
    precondition_1d, normalize_grads, correct_bias,
  )  # fmt: skip
  parts = [scale]
  # A Python 0 adds nothing; an array (optax.inject_hyperparams passes one, concrete in init
  # and traced in update) always chains the decay, so that both see the same chain.
  if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.with_extra_args_support(optax.chain(*parts))
