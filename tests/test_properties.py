"""Hypothesis properties of Ginger's float32 state: orthonormal U, sorted non-negative sigma,
finite outputs at extreme scales, zero and repeated vectors, leaves smaller than tau."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ginger
from ginger._src import lowrank

SHAPES = {"w": (6, 4), "b": (3,), "s": (1,)}


_TX = {
  (tau, block): ginger.scale_by_ginger(tau, 0.9, 1e-5, block)
  for tau in (1, 3, 8)
  for block in ("per_tensor", "global")
}
_UPDATE = {key: jax.jit(tx.update) for key, tx in _TX.items()}  # compiled once per key


def _check_state(state, block):
  us = jax.tree.leaves(state.u)
  blocks = [us] if block == "global" else [[u] for u in us]
  sigmas = [state.sigma] if block == "global" else jax.tree.leaves(state.sigma)
  for pieces, sigma in zip(blocks, sigmas):
    assert float(lowrank.orthonormality_error(pieces)) < 1e-4
    s = np.asarray(sigma)
    assert np.all(np.isfinite(s)) and np.all(s >= 0)
    assert np.all(np.diff(s) <= 0), s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  tau=st.sampled_from([1, 3, 8]),
  block=st.sampled_from(["per_tensor", "global"]),
  log_scales=st.lists(st.floats(-20, 20), min_size=1, max_size=6),
  repeat=st.booleans(),
  zero_grad=st.booleans(),
  seed=st.integers(0, 2**16),
)
# A repeated direction 1e11 times larger puts a secular root within a subnormal distance of
# its pole (XLA flushes subnormals to zero: a division by zero, NaN updates).
@example(tau=3, block="per_tensor", log_scales=[0.0, 11.0], repeat=True, zero_grad=False, seed=0)
# Under other compiler flags: after a 1e-3.25 step the core's poles are 0 and 2.2e-38 (closer
# than two normal numbers), then a root between them a subnormal from one (NaN again).
@example(
  tau=3, block="per_tensor", log_scales=[0.0, -3.25, 7.25], repeat=True, zero_grad=False, seed=1
)
def test_state_invariants_and_finite_outputs(tau, block, log_scales, repeat, zero_grad, seed):
  rng = np.random.default_rng(seed)
  tx = _TX[(tau, block)]
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state = tx.init(params)
  fixed = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  for log_scale in log_scales:
    scale = 10.0**log_scale
    base = (
      fixed
      if repeat
      else {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
    )
    d = jax.tree.map(lambda x, scale=scale: x * scale, base)
    g = jax.tree.map(jnp.zeros_like, d) if zero_grad else d
    out, state = _UPDATE[(tau, block)](g, state, fisher_grads=d)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out)), log_scale
    _check_state(state, block)


def test_zero_fisher_vector_keeps_state_valid():
  tx = ginger.scale_by_ginger(3)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state = tx.init(params)
  out, state = jax.jit(tx.update)(params, state, fisher_grads=params)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  _check_state(state, "per_tensor")
  assert all(np.all(np.asarray(s) == 0) for s in jax.tree.leaves(state.sigma))


def test_repeated_vector_is_rank_one():
  """The same d every step: S -> (1 - alpha^t) d d^T, rank one, with U still orthonormal."""
  tx = ginger.scale_by_ginger(4, 0.9, 1e-3, "global")
  d = {"w": jnp.arange(1.0, 13.0).reshape(3, 4)}
  state = tx.init(d)
  step = jax.jit(lambda s: tx.update(d, s, fisher_grads=d))
  for _ in range(50):
    _, state = step(state)
  _check_state(state, "global")
  expected = (1 - 0.9**50) * float(jnp.sum(d["w"] ** 2))
  np.testing.assert_allclose(state.sigma[0], expected, rtol=1e-5)
  assert np.all(np.asarray(state.sigma[1:]) <= 1e-5 * expected)


def _long_run(steps, d_size=48, tau=8):
  tx = ginger.scale_by_ginger(tau, 0.99, 1e-5, "global")
  params = {"w": jnp.zeros(d_size)}
  basis = jax.random.normal(jax.random.key(0), (tau + 2, d_size))

  def body(state, key):
    # Vectors from a (tau+2)-dim subspace: repeatedly near span U, the hard case for drift.
    d = {"w": jax.random.normal(key, (tau + 2,)) @ basis}
    _, state = tx.update(d, state, fisher_grads=d)
    return state, None

  # One program running many steps: compiled with LLVM's optimisations (the suite's -O0 suits
  # programs that run a few steps), 1e5 steps take ~1.7 s instead of ~5.4 s on 2 CPU cores for
  # the same compilation time; `make test-all` runs this test at -O3 anyway.
  run = lambda state, keys: jax.lax.scan(body, state, keys)[0]  # noqa: E731
  args = (tx.init(params), jax.random.split(jax.random.key(1), steps))
  return jax.jit(run).lower(*args).compile({"xla_backend_optimization_level": 3})(*args)


def test_orthonormal_over_1e5_float32_steps():
  state = _long_run(100_000)
  assert float(lowrank.orthonormality_error([state.u["w"]])) < 1e-5


# ---- the momentum kept in Ginger's state -------------------------------------------------

_B1, _GAMMA, _STEPS = 0.9, 0.1, 6
_SMALL = {"w": (6, 4), "b": (5,)}  # one rank: a small program (the compile is the cost)


@functools.cache
def _momentum_run(block):
  """``STEPS`` steps of ``scale_by_ginger(b1=...)`` and of ``optax.ema`` chained before
  ``scale_by_ginger``, on the same ``g`` and ``d``, ``d`` folded in where ``folds`` says (a
  ``cond`` of both kinds of step: one program per block). Returns each step's updates, the
  first's per-leaf momentum and counts, the second's ``EmaState`` and curvature count."""
  inside = ginger.scale_by_ginger(3, 0.9, _GAMMA, block, curvature_every=2, b1=_B1)
  chained = optax.chain(
    optax.ema(_B1, debias=True), ginger.scale_by_ginger(3, 0.9, _GAMMA, block, curvature_every=2)
  )

  def both(states, g, d):
    (out_in, s_in), (out_ch, s_ch) = (
      tx.update(g, s, fisher_grads=d) for tx, s in zip((inside, chained), states, strict=True)
    )
    return (s_in, s_ch), (out_in, out_ch)

  def step(states, xs):
    g, d, fold = xs
    states, outs = jax.lax.cond(fold, lambda: both(states, g, d), lambda: both(states, g, None))
    s_in, (ema, pre) = states
    seen = (s_in.mu.tree(), s_in.mu_count, s_in.count, ema, pre.count)
    return states, (outs, seen)

  def run(params, gs, ds, folds):
    return jax.lax.scan(step, (inside.init(params), chained.init(params)), (gs, ds, folds))[1]

  return jax.jit(run)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  block=st.sampled_from(["per_tensor", "global"]),
  folds=st.lists(st.booleans(), min_size=_STEPS, max_size=_STEPS),
  log_scales=st.lists(st.floats(-2, 2), min_size=_STEPS, max_size=_STEPS),
  seed=st.integers(0, 2**16),
)
def test_momentum_in_the_state_is_optax_ema_chained_before(block, folds, log_scales, seed):
  """``scale_by_ginger(b1=...)`` keeps the momentum stacked as ``U`` (``state.mu``) and is
  ``optax.ema(b1, debias=True)`` chained before ``scale_by_ginger``: the same momentum and
  update every step, also on steps without a curvature update (``curvature_every=2``,
  ``fisher_grads=None``: ``folds`` says which steps fold in a ``d``).

  Both compute ``m_t = (1 - b1) g_t + b1 m_{t-1}`` in float32, in possibly different
  fusions: each step adds at most 2 roundings of size ``eps M`` to each (``M = max |g|`` so
  far bounds every ``|m|``), so the two ``m_t`` differ by at most ``4 eps M (1 - b1^t) /
  (1 - b1)`` and the bias-corrected ``m_t / (1 - b1^t)`` by ``(4 / (1 - b1) + 2) eps M``.
  ``G^{-1}`` is linear with norm ``<= 1 / gamma``, so the updates differ by at most that
  times ``sqrt(n) / gamma`` in any entry (``n`` entries). The curvature sees the same ``d``
  in both; ``sigma_max / gamma`` stays small here (``d`` of norm ~0.5, ``gamma = 0.1``), so
  its rounding, amplified by that ratio, stays far below the momentum's bound. A momentum
  taken from the wrong step, not bias-corrected or not updated on a step without curvature
  differs by ``O(M)``."""
  rng = np.random.default_rng(seed)
  normal = lambda scale: {  # noqa: E731
    k: (scale[:, None] * rng.normal(size=(_STEPS, math.prod(s)))).reshape(_STEPS, *s)
    for k, s in _SMALL.items()
  }
  gs = normal(10.0 ** np.asarray(log_scales))
  ds = normal(np.full(_STEPS, 0.1))
  params = {k: jnp.zeros(s) for k, s in _SMALL.items()}
  cast = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)  # noqa: E731
  outs, seen = _momentum_run(block)(params, cast(gs), cast(ds), jnp.asarray(folds))
  (out_in, out_ch), (mu, mu_count, count, ema, pre_count) = jax.tree.map(np.asarray, (outs, seen))
  np.testing.assert_array_equal(mu_count, ema.count)
  np.testing.assert_array_equal(mu_count, np.arange(1, _STEPS + 1))
  np.testing.assert_array_equal(count, pre_count)
  np.testing.assert_array_equal(count, np.cumsum(folds))
  eps, n = float(np.finfo(np.float32).eps), sum(math.prod(s) for s in _SMALL.values())
  for t in range(_STEPS):
    top = max(float(np.max(np.abs(gs[k][: t + 1]))) for k in _SMALL)  # M
    bound = 4 * eps * top * (1 - _B1 ** (t + 1)) / (1 - _B1)
    for key in _SMALL:
      assert mu[key].shape[1:] == (ema.ema[key][t].size,) and mu[key].dtype == np.float32
      assert np.max(np.abs(mu[key][t] - ema.ema[key][t].ravel())) <= bound, (t, key)
    bound = (4 / (1 - _B1) + 2) * eps * top * math.sqrt(n) / _GAMMA
    for key in _SMALL:
      assert np.max(np.abs(out_in[key][t] - out_ch[key][t])) <= bound, (t, key)
