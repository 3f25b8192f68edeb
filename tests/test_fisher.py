"""Sampled-Fisher helpers: one forward pass, correct loss gradient, E[d d^T] = Fisher."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ginger import fisher


def _linear_model(key, n=6, features=4, classes=3):
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (n, features), jnp.float64)
  w = 0.5 * jax.random.normal(kw, (features, classes), jnp.float64)
  y = jnp.arange(n) % classes
  return x, w, y


def test_loss_and_gradient_match_autodiff(x64):
  x, w, y = _linear_model(jax.random.key(0))
  (loss, aux), grads, _ = fisher.value_grad_and_fisher(lambda w: x @ w, w, y, jax.random.key(1))
  ref_loss, ref_grad = jax.value_and_grad(lambda w: fisher.cross_entropy(x @ w, y))(w)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
  np.testing.assert_allclose(grads, ref_grad, rtol=1e-12)
  assert aux is None
  import optax

  np.testing.assert_allclose(
    loss, optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean(), rtol=1e-12
  )


def test_forward_runs_once():
  calls = []

  def logits_fn(w):
    calls.append(1)
    return jnp.ones((2, 3)) @ w

  fisher.value_grad_and_fisher(logits_fn, jnp.ones((3, 4)), jnp.array([0, 1]), jax.random.key(0))
  assert len(calls) == 1


def test_expected_outer_product_is_the_fisher(x64):
  """Monte Carlo: mean of d d^T over many label draws equals (1/N) sum_i J_i^T H_i J_i."""
  x, w, y = _linear_model(jax.random.key(2))
  n = x.shape[0]

  def d_of(key):
    _, _, d = fisher.value_grad_and_fisher(lambda w: x @ w, w, y, key)
    return d.ravel()

  ds = jax.vmap(d_of)(jax.random.split(jax.random.key(3), 40_000))
  mc = ds.T @ ds / ds.shape[0]
  probs = jax.nn.softmax(x @ w)
  exact = (
    sum(
      np.kron(np.outer(x[i], x[i]), np.diag(probs[i]) - np.outer(probs[i], probs[i]))
      for i in range(n)
    )
    / n
  )
  np.testing.assert_allclose(mc, exact, atol=0.03 * np.max(np.abs(exact)))


def test_sequence_mask_excludes_padding_and_scales_by_token_count(x64):
  logits = jax.random.normal(jax.random.key(4), (2, 5, 7), jnp.float64)
  labels = jnp.zeros((2, 5), jnp.int32)
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
  ct = fisher.fisher_cotangent(logits, jax.random.key(5), mask)
  assert np.all(np.asarray(ct)[mask == 0] == 0)
  # Each counted row is (onehot - p) / sqrt(5): its entries sum to zero.
  np.testing.assert_allclose(np.asarray(ct).sum(-1), 0, atol=1e-12)
  np.testing.assert_allclose(np.abs(ct[0, 0]).max() <= 1 / np.sqrt(5), True)
  loss_ct = fisher.loss_cotangent(logits, labels, mask)
  ref = jax.grad(lambda z: fisher.cross_entropy(z, labels, mask))(logits)
  np.testing.assert_allclose(loss_ct, ref, rtol=1e-12)


def test_empirical_option_uses_true_labels(x64):
  x, w, y = _linear_model(jax.random.key(6))
  _, grads, d = fisher.value_grad_and_fisher(
    lambda w: x @ w, w, y, jax.random.key(7), fisher="empirical"
  )
  np.testing.assert_allclose(d, -grads * np.sqrt(x.shape[0]), rtol=1e-12)


def test_has_aux_and_errors():
  w = jnp.ones((3, 2))
  (loss, aux), _, _ = fisher.value_grad_and_fisher(
    lambda w: (jnp.ones((4, 3)) @ w, {"stat": 1}),
    w,
    jnp.zeros(4, jnp.int32),
    jax.random.key(0),
    has_aux=True,
  )
  assert aux == {"stat": 1} and np.isfinite(loss)
  with pytest.raises(ValueError, match="fisher must be"):
    fisher.value_grad_and_fisher(
      lambda w: w, w, jnp.zeros(3, jnp.int32), jax.random.key(0), fisher="true"
    )
  with pytest.raises(ValueError, match="does not match labels shape"):
    fisher.value_grad_and_fisher(lambda w: w, w, jnp.zeros(5, jnp.int32), jax.random.key(0))
