"""scale_by_qng / qng against the dense EMA G_t = alpha G_{t-1} + (1-alpha) d d^T, G_0 = I."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import SubspaceQNG, TruncatedQNG, block_vectors, hard_fisher_vectors, qng_step

import ginger


def _run(block, tau, alpha, steps, shapes=((4, 3), (5,)), scale=1.0, seed=0):
  rng = np.random.default_rng(seed)
  params = [jnp.zeros(s, jnp.float64) for s in shapes]
  tx = ginger.scale_by_qng(tau, alpha, block, state_dtype="float64")
  state = tx.init(params)
  update = jax.jit(tx.update)
  blocks = [list(range(len(shapes)))] if block == "global" else [[i] for i in range(len(shapes))]
  dense = [np.eye(len(v)) for v in block_vectors(params, blocks)]
  errors = []
  for _ in range(steps):
    g = [jnp.asarray(rng.normal(size=s)) for s in shapes]
    d = [jnp.asarray(scale * rng.normal(size=s)) for s in shapes]
    out, state = update(g, state, fisher_grads=d)
    for b, (gv, dv, ov) in enumerate(
      zip(block_vectors(g, blocks), block_vectors(d, blocks), block_vectors(out, blocks))
    ):
      dense[b] = qng_step(dense[b], dv, alpha)
      # Backward error ||G x - g|| / (||G|| ||x||): meaningful however ill-conditioned G is.
      residual = np.linalg.norm(dense[b] @ ov - gv)
      errors.append(residual / (np.linalg.norm(dense[b], 2) * np.linalg.norm(ov)))
  return max(errors), state


@pytest.mark.parametrize("block", ["global", "per_tensor"])
@pytest.mark.parametrize("alpha", [0.9, 0.99, 0.999])
def test_exact_while_tau_covers_all_steps(x64, block, alpha):
  err, _ = _run(block, tau=16, alpha=alpha, steps=16)
  assert err < 1e-13


def test_exact_for_huge_and_tiny_vectors(x64):
  for scale in (1e-6, 1e6):
    err, _ = _run("global", tau=8, alpha=0.9, steps=8, scale=scale)
    assert err < 1e-13, scale


@pytest.mark.parametrize("block", ["per_tensor", "global"])
@pytest.mark.parametrize("tau", [4, 8])
def test_float32_exact_at_condition_1e9(block, tau):
  """float32 factors against the float64 definition on every step where QNG is exact
  (``t <= tau``), with ``(1 - alpha) ||d||^2 / alpha^t`` from 1e9 at the first step (G_0 = I:
  QNG's damping is 1), alpha 0.99, leaves of 10..5000 entries: within 5e-4, as Ginger."""
  sizes, alpha = (10, 37, 200, 1000, 5000), 0.99
  tx = ginger.scale_by_qng(tau, alpha, block)
  update = jax.jit(tx.update)
  state = tx.init([jnp.zeros(n) for n in sizes])
  blocks = [list(range(len(sizes)))] if block == "global" else [[i] for i in range(len(sizes))]
  refs = [SubspaceQNG(sum(sizes[i] for i in b), alpha) for b in blocks]
  rng = np.random.default_rng(tau)
  for t, (ds, gs) in enumerate(hard_fisher_vectors(rng, sizes, tau, np.sqrt(1e9 / (1 - alpha)))):
    out, state = update(gs, state, fisher_grads=ds)
    for b, ref in zip(blocks, refs, strict=True):
      cat = lambda xs, b=b: np.concatenate([np.asarray(xs[i], np.float64) for i in b])
      ref.step(cat(ds))
      expected = ref.direction(cat(gs))
      err = np.max(np.abs(cat(out) - expected)) / np.max(np.abs(expected))
      assert err < 5e-4, (t, b, err)


def test_truncation_keeps_only_tau_factors(x64):
  """Past tau steps the product is truncated: no longer exact, but still finite and SPD."""
  err, state = _run("global", tau=3, alpha=0.9, steps=10)
  assert np.isfinite(err)
  assert int(state.count) == 10
  assert np.all(np.asarray(state.kappa) >= 0) and np.all(np.asarray(state.kappa) < 1)


@pytest.mark.parametrize("block", ["global", "per_tensor"])
@pytest.mark.parametrize("tau", [1, 3])
def test_truncated_product_matches_its_definition(x64, block, tau):
  """Past tau steps: the last tau factors, each from the truncated product before it."""
  rng = np.random.default_rng(tau)
  shapes = ((4, 3), (5,))
  params = [jnp.zeros(s, jnp.float64) for s in shapes]
  tx = ginger.scale_by_qng(tau, 0.9, block, state_dtype="float64")
  state, update = tx.init(params), jax.jit(tx.update)
  blocks = [[0, 1]] if block == "global" else [[0], [1]]
  refs = [TruncatedQNG(len(v), tau, 0.9) for v in block_vectors(params, blocks)]
  for _ in range(3 * tau + 2):
    g = [jnp.asarray(rng.normal(size=s)) for s in shapes]
    d = [jnp.asarray(rng.normal(size=s)) for s in shapes]
    out, state = update(g, state, fisher_grads=d)
    for ref, gv, dv, ov in zip(
      refs, block_vectors(g, blocks), block_vectors(d, blocks), block_vectors(out, blocks)
    ):
      ref.step(dv)
      np.testing.assert_allclose(ov, ref.direction(gv), rtol=1e-9)


def test_float32_extreme_scales_stay_finite():
  tx = ginger.scale_by_qng(4, 0.99)
  params = {"w": jnp.zeros((8, 4))}
  state = tx.init(params)
  for scale in (0.0, 1e-20, 1e20, 1.0):
    g = {"w": jnp.full((8, 4), scale)}
    out, state = jax.jit(tx.update)(g, state, fisher_grads=g)
    assert np.all(np.isfinite(out["w"])), scale


def test_qng_errors_and_masked():
  params = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="tau must be >= 1"):
    ginger.scale_by_qng(0)
  with pytest.raises(ValueError, match="alpha must lie"):
    ginger.scale_by_qng(2, alpha=1.5)
  with pytest.raises(ValueError, match="block must be one of"):
    ginger.scale_by_qng(2, block="rows")
  masked = optax.masked(ginger.scale_by_qng(2), {"w": True}, mask_compatible_extra_args=True)
  masked.update(params, masked.init(params), params, fisher_grads=params)


@pytest.mark.parametrize("block", ["global", "per_tensor"])
def test_qng_clip_bounds_every_entry_and_leaves_the_rest(block):
  """``rho`` clips the preconditioned update element-wise before ``-lr``: entries of
  ``G^{-1} m`` beyond ``rho`` come back as ``-lr * rho * sign``, the others unchanged."""
  rng = np.random.default_rng(3)
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(5)}
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 3.0, jnp.float32), params)
  fisher = jax.tree.map(lambda g: 0.5 * g, grads)
  free, clipped = (ginger.qng(0.1, tau=2, block=block, rho=r) for r in (None, 1.0))
  u_free, _ = free.update(grads, free.init(params), params, fisher_grads=fisher)
  u_clip, _ = clipped.update(grads, clipped.init(params), params, fisher_grads=fisher)
  for f, c in zip(jax.tree.leaves(u_free), jax.tree.leaves(u_clip)):
    assert float(jnp.max(jnp.abs(f))) > 0.1  # some entries beyond the clip
    np.testing.assert_allclose(c, jnp.clip(f, -0.1, 0.1), rtol=1e-6, atol=0)
  with pytest.raises(ValueError, match="rho must be > 0 or None"):
    ginger.qng(0.1, rho=0.0)


def test_momentum_is_kept_in_the_state_dtype_and_updates_in_the_params():
  """bfloat16 params: QNG's momentum is float32 like its factors (the state's dtype), and the
  updates come back in bfloat16, as Ginger's."""
  params = {"w": jnp.zeros((4, 3), jnp.bfloat16)}
  grads = {"w": jnp.ones((4, 3), jnp.bfloat16)}
  tx = ginger.qng(1e-2, tau=2)
  state = tx.init(params)
  floats = [x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(d == jnp.float32 for d in floats), floats
  updates, state = tx.update(grads, state, params, fisher_grads=grads)
  assert updates["w"].dtype == jnp.bfloat16
  floats = [x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert all(d == jnp.float32 for d in floats), floats
