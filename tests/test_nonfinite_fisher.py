"""A non-finite d_t (NaN or Inf only in ``fisher_grads``, which ``optax.apply_if_finite`` does
not check) is skipped by the curvature update: the state keeps its curvature, counts the skip,
and the step's update stays finite; the next finite d_t updates the curvature as before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ginger


def _params():
  return {"w": jnp.zeros((4, 3)), "b": jnp.zeros(5)}


def _tree(rng):
  return {
    "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=5), jnp.float32),
  }


OPTIMIZERS = {
  "ginger": lambda block: ginger.scale_by_ginger(tau=2, alpha=0.9, gamma=1e-2, block=block),
  "qng": lambda block: ginger.scale_by_qng(tau=2, alpha=0.9, block=block),
  "ginger_chain": lambda block: ginger.ginger(1e-2, tau=2, block=block),
  "qng_chain": lambda block: ginger.qng(1e-2, tau=2, block=block),
}


def _curvature(state):
  """The curvature part of a (possibly chained) state: Ginger's U and sigma, QNG's factors."""
  parts = []
  for s in jax.tree.leaves(
    state, is_leaf=lambda x: isinstance(x, (ginger.ScaleByGingerState, ginger.ScaleByQNGState))
  ):
    if isinstance(s, ginger.ScaleByGingerState):
      parts.append((s.count, s.u, s.sigma))
    elif isinstance(s, ginger.ScaleByQNGState):
      parts.append((s.count, s.qhat, s.kappa, s.scale))
  assert parts
  return parts


def _skipped(state):
  found = [
    int(s.skipped)
    for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, (ginger.ScaleByGingerState, ginger.ScaleByQNGState))
    )
    if isinstance(s, (ginger.ScaleByGingerState, ginger.ScaleByQNGState))
  ]
  assert len(found) == 1
  return found[0]


@pytest.mark.parametrize(
  "name, block, bad",
  [
    ("ginger", "per_tensor", np.nan),
    ("ginger", "global", np.inf),
    ("qng", "global", np.nan),
    ("qng", "per_tensor", -np.inf),
    ("ginger_chain", "per_tensor", np.nan),
    ("qng_chain", "global", np.nan),
  ],
)
def test_a_non_finite_fisher_vector_is_skipped(name, block, bad):
  rng = np.random.default_rng(0)
  tx = OPTIMIZERS[name](block)
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(_tree(rng), state, params, fisher_grads=_tree(rng))  # a curvature to keep
  before = _curvature(state)
  g, d = _tree(rng), _tree(rng)
  d["b"] = d["b"].at[2].set(bad)  # one entry of one leaf
  out, after = update(g, state, params, fisher_grads=d)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(after))
  chex_equal = jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), before, _curvature(after))
  assert all(jax.tree.leaves(chex_equal)), "the curvature changed on a skipped d_t"
  assert _skipped(after) == 1
  # A finite d_t afterwards updates the curvature again, and the count of skips stays.
  _, later = update(_tree(rng), after, params, fisher_grads=_tree(rng))
  moved = jax.tree.map(
    lambda x, y: bool(jnp.array_equal(x, y)), _curvature(after), _curvature(later)
  )
  assert not all(jax.tree.leaves(moved))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(later))
  assert _skipped(later) == 1


def test_a_fresh_state_has_skipped_nothing():
  for make in OPTIMIZERS.values():
    assert _skipped(make("per_tensor").init(_params())) == 0
