"""Muon and schedule-free AdamW as the framework runs them.

Muon: which leaves optax's Muon orthogonalises (training/muon_layout.py: the Muon authors'
split), and that a convolution filter's update is the 2-D Muon update of its flattened
``(kh * kw * in, out)`` matrix while the input and output layers get the AdamW branch's update.
Schedule-free AdamW: evaluations score the x sequence (optax's ``schedule_free_eval_params``)
with BatchNorm's statistics recomputed over fixed, shuffled training batches; training itself
is unchanged. Both train the demo through train.py's loop.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hydra import compose, initialize_config_dir

from models import resnet, t5
from training import muon_layout, registry, steps

ROOT = Path(__file__).resolve().parents[1]
FAST = ["logger=none", "max_steps=8", "eval_every=4", "log_every=1", "checkpoint_every=8"]
AdamW, Muon = None, object()


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def _layout(params) -> dict[str, object]:
  """Each leaf's dimension numbers by its path ("blocks/0/conv1/kernel")."""
  flat = jax.tree_util.tree_flatten_with_path(
    muon_layout.dimension_numbers(params),
    is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers),
  )[0]
  return {"/".join(muon_layout._names(path)): leaf for path, leaf in flat}


def _tiny_resnet():
  return resnet.build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(0), in_channels=1)


def test_muon_takes_every_hidden_conv_filter_and_leaves_the_ends_to_adamw():
  layout = _layout(nnx.state(_tiny_resnet(), nnx.Param))
  assert layout["conv1/kernel"] is None and layout["fc/kernel"] is None  # stem, head
  assert layout["blocks/0/conv1/kernel"] == muon_layout.CONV
  assert layout["blocks/1/shortcut/conv/kernel"] == muon_layout.CONV  # 1x1 shortcut
  hidden = [k for k, v in layout.items() if v is not None]
  assert all(k.startswith("blocks/") and k.endswith("kernel") for k in hidden)
  assert all(layout[k] is None for k in layout if k.endswith(("bias", "scale")))


def test_muon_takes_t5s_dense_kernels_but_not_its_embeddings():
  model = nnx.eval_shape(lambda: t5.T5(t5.T5Config.tiny(), rngs=nnx.Rngs(0)))
  layout = _layout(nnx.state(model, nnx.Param))
  embeddings = [k for k in layout if "embedding" in k]
  assert embeddings and all(layout[k] is None for k in embeddings)  # shared, relative bias
  dense = [k for k in layout if k.endswith("kernel") and not k.startswith("lm_head")]
  assert dense and all(layout[k] == muon_layout.DENSE for k in dense)
  assert all(layout[k] is None for k in layout if k.startswith("lm_head"))


def _muon_config(**overrides):
  values = {
    "optimizer.b1": 0.95,
    "optimizer.nesterov": True,
    "optimizer.ns_steps": 5,
    "optimizer.consistent_rms": 0.2,
    "optimizer.adam_b1": 0.9,
    "optimizer.b2": 0.999,
    "optimizer.eps": 1e-8,
  } | overrides
  return registry.OptimizerConfig(
    "muon",
    b1=values["optimizer.b1"],
    b2=values["optimizer.b2"],
    eps=values["optimizer.eps"],
    extra={k: v for k, v in values.items() if k.rsplit(".", 1)[1] not in ("b1", "b2", "eps")},
  )


def test_a_conv_filter_gets_the_muon_update_of_its_flattened_matrix_the_ends_adamws():
  keys = jax.random.split(jax.random.key(0), 6)
  params = {
    "conv1": {"kernel": jax.random.normal(keys[0], (3, 3, 1, 8))},
    "blocks": {"conv": {"kernel": jax.random.normal(keys[1], (3, 3, 8, 16))}},
    "fc": {"kernel": jax.random.normal(keys[2], (16, 4))},
  }
  grads = jax.tree.map(
    lambda p, k: jax.random.normal(k, p.shape),
    params,
    {
      "conv1": {"kernel": keys[3]},
      "blocks": {"conv": {"kernel": keys[4]}},
      "fc": {"kernel": keys[5]},
    },
  )
  lr = 0.01
  tx = registry.get("muon").build(_muon_config(), lr, None)
  updates, _ = tx.update(grads, tx.init(params), params)

  # The same filter as a 2-D matrix, under optax's default Muon (every 2-D leaf is Muon's).
  flat = lambda x: x.reshape(-1, x.shape[-1])
  ref = optax.contrib.muon(lr, beta=0.95, nesterov=True, ns_steps=5, consistent_rms=0.2)
  matrix = {"w": flat(params["blocks"]["conv"]["kernel"])}
  expected, _ = ref.update({"w": flat(grads["blocks"]["conv"]["kernel"])}, ref.init(matrix), matrix)
  np.testing.assert_allclose(
    flat(updates["blocks"]["conv"]["kernel"]), expected["w"], rtol=1e-5, atol=1e-7
  )
  # The stem and the head: the AdamW branch (b1 0.9, b2 0.999, Nesterov as Muon's momentum),
  # no orthogonalisation.
  adam = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, nesterov=True)
  for name in ("conv1", "fc"):
    leaf = {"w": params[name]["kernel"]}
    want, _ = adam.update({"w": grads[name]["kernel"]}, adam.init(leaf), leaf)
    np.testing.assert_allclose(updates[name]["kernel"], want["w"], rtol=1e-6)


def test_schedule_free_evaluates_optaxs_x_sequence():
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  tx = optax.with_extra_args_support(
    optax.chain(optax.add_decayed_weights(0.0), optax.contrib.schedule_free_adamw(0.1))
  )
  state = tx.init(params)
  for _ in range(3):
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  x = registry.get("schedule_free_adamw").eval_params(state, params)
  sf_state = state[1]  # the chain's second transformation
  assert isinstance(sf_state, optax.contrib.ScheduleFreeState)
  want = optax.contrib.schedule_free_eval_params(sf_state, params)
  np.testing.assert_array_equal(x["w"], want["w"])
  assert not np.allclose(x["w"], params["w"])  # x is not the trained y


def test_batchnorm_is_recomputed_over_shuffled_examples_not_the_first_ones():
  # A training set read class by class: 1,000 examples, the first half of class 0.
  labels = np.repeat([0, 1], 500)
  idx = steps.recalibration_indices(len(labels), batch_size=10)
  assert idx.shape == (steps.RECALIBRATION_BATCHES, 10)
  assert len(np.unique(idx)) == idx.size  # 500 distinct examples
  assert abs(labels[idx].mean() - 0.5) < 0.1  # both classes, about evenly
  small = steps.recalibration_indices(7, batch_size=4)  # a set smaller than the batches
  assert set(small.ravel()) == set(range(7))


def test_eval_weights_recompute_batchnorm_at_x_and_leave_the_state_alone():
  model = _tiny_resnet()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  graphdef_train = nnx.split(model, nnx.Param, ...)[0]
  task = _ImageTask(np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32))

  def apply(graphdef, trainable, frozen, rest, inputs):
    m = nnx.merge(graphdef, trainable, rest, copy=True)
    m.train()
    logits = m(inputs)
    return logits, nnx.split(m, nnx.Param, ...)[2]

  shifted = jax.tree.map(lambda p: p * 1.5, params)
  eval_weights = steps.make_eval_weights(
    task, apply, graphdef_train, lambda opt_state, p: shifted, batch_size=16
  )
  state = steps.TrainState(0, params, rest, None, None, {})
  trainable, new_rest = eval_weights(state, None, {"x": task.x})
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), trainable, shifted))
  assert steps.has_batchnorm(rest) and not steps.has_batchnorm({"w": jnp.ones(2)})
  before = nnx.state(nnx.merge(graphdef, params, rest), nnx.BatchStat)
  after = nnx.state(nnx.merge(graphdef, params, new_rest), nnx.BatchStat)
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  # The running mean of the stem's BatchNorm is that of the recomputed batches' statistics.
  x = task.x[steps.recalibration_indices(64, 16)]
  conv = nnx.merge(graphdef, shifted, rest).conv1
  h = jax.vmap(conv)(jnp.asarray(x))  # (batches, 16, 8, 8, channels)
  expected = np.zeros(h.shape[-1])
  for batch in h:
    expected = 0.9 * expected + 0.1 * np.asarray(batch.mean(axis=(0, 1, 2)))
  expected += 0.9 ** len(h) * np.asarray(nnx.state(model, nnx.BatchStat)["bn1"]["mean"][...])
  np.testing.assert_allclose(after["bn1"]["mean"][...], expected, rtol=1e-4, atol=1e-5)


class _ImageTask:
  """The two things eval_weights asks of a task: the training set's size and a batch."""

  def __init__(self, x):
    self.x = x
    self.num_train = len(x)

  def train_batch(self, arrays, idx, rng):
    return arrays["x"][idx], None, None


# End-to-end demo runs (Muon ~10 s on 2 cores; schedule-free AdamW ~26 s: it compiles its
# BatchNorm recalibration at each evaluation): with `make test-all`; Muon's layout and update and
# schedule-free AdamW's evaluation weights are tested above without a run.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["muon", "schedule_free_adamw"])
def test_it_trains_the_demo(name, tmp_path):
  from training import loop

  summary = loop.train(config("experiment=demo", f"optimizer={name}", *FAST), tmp_path / name)
  assert summary["status"] == "completed" and summary["run"]["optimizer"] == name
  assert summary["min_train_loss"] < math.log(10)  # below a uniform guess over 10 digits
