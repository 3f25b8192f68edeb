"""LoRA over parameter pytrees: exact step-0 identity, frozen base, counts, distinct inits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ginger.fisher import cross_entropy
from models.lora import (
  DEFAULT_TARGETS,
  lora_init,
  lora_merge,
  lora_param_count,
  named_leaves,
)
from models.t5 import T5, T5Config, shift_right

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def tiny():
  config = T5Config.tiny(vocab_size=64, dropout_rate=0.0)
  model = T5(config, rngs=nnx.Rngs(0))
  model.eval()
  graphdef, base, rest = nnx.split(model, nnx.Param, ...)
  return config, graphdef, base, rest


def _leaves_equal(x, y) -> bool:
  return all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
  )


def test_step0_is_base_model_exactly(tiny):
  _, _, base, _ = tiny
  lora = lora_init(base, jax.random.key(0), rank=RANK)
  merged = lora_merge(base, lora, rank=RANK, alpha=ALPHA)
  assert jax.tree.structure(merged) == jax.tree.structure(base)
  assert _leaves_equal(merged, base)
  # 2 enc layers x 4 + 2 dec layers x 8 projections
  assert len(lora) == 24 and all(k.endswith("/kernel") for k in lora)


def test_sgd_step_moves_only_lora(tiny):
  config, graphdef, base, rest = tiny
  base_copy = jax.tree.map(lambda x: np.array(x, copy=True), base)
  lora = lora_init(base, jax.random.key(1), rank=RANK)
  ids = jnp.array([[5, 6, 7, 1], [8, 9, 1, 0]])
  mask = (ids != 0).astype(jnp.int32)
  labels = jnp.array([[10, 11, 1], [12, 1, -100]])

  def loss_fn(lora):
    params = lora_merge(base, lora, rank=RANK, alpha=ALPHA)
    model = nnx.merge(graphdef, params, rest)
    logits = model(ids, mask, shift_right(labels))
    return cross_entropy(logits, jnp.maximum(labels, 0), labels != -100)

  tx = optax.sgd(0.5)
  opt_state = tx.init(lora)
  assert len(jax.tree.leaves(opt_state)) <= len(jax.tree.leaves(lora))  # only LoRA is tracked
  loss0, grads = jax.jit(jax.value_and_grad(loss_fn))(lora)
  updates, _ = tx.update(grads, opt_state, lora)
  new = optax.apply_updates(lora, updates)
  for name, entry in new.items():
    np.testing.assert_array_equal(entry["a"], lora[name]["a"])  # dL/dA = 0 while B = 0
    assert np.any(entry["b"] != 0), name
  assert _leaves_equal(base, base_copy)
  assert float(jax.jit(loss_fn)(new)) < float(loss0)
  # the merged weights moved only where adapted
  merged = lora_merge(base, new, rank=RANK, alpha=ALPHA)
  for (name, w), (_, w0) in zip(named_leaves(merged), named_leaves(base), strict=True):
    assert np.array_equal(w, w0) != (name in new), name


def test_t5_small_rank8_count_without_allocation():
  abstract = nnx.eval_shape(lambda: T5(T5Config.small(), rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  lora = jax.eval_shape(functools.partial(lora_init, rank=8), params, jax.random.key(0))
  assert len(lora) == 72  # 6 enc x 4 + 6 dec self x 4 + 6 dec cross x 4
  assert lora_param_count(lora) == 72 * (512 * 8 + 8 * 512) == 589_824
  with_norms = jax.eval_shape(
    functools.partial(lora_init, rank=8, train_1d=True), params, jax.random.key(0)
  )
  n_norms = 6 * 2 + 6 * 3 + 2  # per-block norms + two final norms
  assert lora_param_count(with_norms) == 589_824 + n_norms * 512


def test_distinct_and_reproducible_a(tiny):
  _, _, base, _ = tiny
  lora = lora_init(base, jax.random.key(0), rank=RANK)
  a = [np.asarray(v["a"]).ravel() for v in lora.values()]
  for i in range(len(a)):
    for j in range(i + 1, len(a)):
      assert not np.allclose(a[i], a[j])
  assert 0.005 < float(np.std(np.concatenate(a))) < 0.02
  again = lora_init(base, jax.random.key(0), rank=RANK)
  assert _leaves_equal(lora, again)


def test_generic_pytree_train_1d_and_errors():
  params = {
    "dense": {"kernel": jnp.ones((6, 5)), "bias": jnp.zeros(5)},
    "head": [jnp.ones((5, 3))],
  }
  lora = lora_init(params, jax.random.key(0), rank=2, targets=r"kernel$|head/0", train_1d=True)
  assert set(lora) == {"dense/kernel", "dense/bias", "head/0"}
  assert lora_param_count(lora) == (6 * 2 + 2 * 5) + 5 + (5 * 2 + 2 * 3)
  lora["dense/bias"]["w"] = jnp.full(5, 3.0)
  merged = lora_merge(params, lora, rank=2, alpha=4.0)
  np.testing.assert_array_equal(merged["dense"]["bias"], 3.0)
  for bad in (0, -1, 2.5, True, 6):
    with pytest.raises(ValueError):
      lora_init(params, jax.random.key(0), rank=bad, targets="kernel")
  with pytest.raises(ValueError, match="match no"):
    lora_init(params, jax.random.key(0), rank=2, targets=DEFAULT_TARGETS)
  with pytest.raises(ValueError):
    lora_merge(params, lora, rank=3, alpha=4.0)
  with pytest.raises(ValueError):
    lora_merge(params, lora, rank=2, alpha=0.0)
  with pytest.raises(ValueError, match="unknown"):
    lora_merge(params, {"nope": {"w": jnp.ones(1)}}, rank=2, alpha=1.0)
