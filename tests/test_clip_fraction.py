"""The training log's ``clip_fraction``: the share of update entries the element-wise clip
changes, read from the updates the optimizer returns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ginger
from training.steps import clip_fraction


def _updates(optimizer, rho, lr=0.1, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.zeros((6, 5)), "b": jnp.zeros(7)}
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  fisher = jax.tree.map(lambda g: 0.3 * g + 0.1, grads)
  tx = optimizer(lr, tau=2, rho=rho)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params, fisher_grads=fisher)
  return updates


@pytest.mark.parametrize("optimizer", [ginger.ginger, ginger.qng])
@pytest.mark.parametrize("quantile", [0.3, 0.8])
def test_counts_the_entries_the_clip_changed(optimizer, quantile):
  free = _updates(optimizer, None)
  u = np.concatenate([np.ravel(x) / -0.1 for x in jax.tree.leaves(free)])
  # a bound between two entries' magnitudes, so that none sits on it
  sizes = np.sort(np.abs(u))
  i = int(quantile * len(sizes))
  rho = float(0.5 * (sizes[i - 1] + sizes[i]))
  expected = np.mean(np.abs(u) >= rho)
  assert 0 < expected < 1  # the case has entries on both sides of the bound
  clipped = _updates(optimizer, rho)
  assert float(clip_fraction(clipped, jnp.float32(0.1), rho)) == pytest.approx(
    expected, rel=1e-6
  )  # a float32 quotient
  # unclipped: the share the clip would change
  assert float(clip_fraction(free, jnp.float32(0.1), rho)) == pytest.approx(
    expected, rel=1e-6
  )  # a float32 quotient


def test_no_learning_rate_or_no_entries_is_zero():
  updates = {"w": jnp.ones(3)}
  assert float(clip_fraction(updates, jnp.float32(0.0), 1.0)) == 0.0
  assert float(clip_fraction({"w": jnp.zeros((0, 3))}, jnp.float32(0.1), 1.0)) == 0.0
