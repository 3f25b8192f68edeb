"""K-FAC (training/kfac.py, registry entry ``kfac``): the framework's optimizer is kfac-jax's own,
it trains the demo through train.py's loop, and the models it cannot run are refused first."""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hydra import compose, initialize_config_dir

from ginger.fisher import cross_entropy
from training import registry
from training.config_check import ConfigError, check_config, refused_settings
from training.steps import LossBatch, TrainingLoss, loss_and_grads, model_logits

ROOT = Path(__file__).resolve().parents[1]
LR, B1, DAMPING, PERIOD, EMA = 0.01, 0.9, 0.1, 2, 0.95
STEPS, BATCH = 5, 16
# The demo as both demo tests run it: one training-step program (the keys that differ between
# them, max_steps and the loop's, do not change it), compiled once for both through the
# suite's compilation cache. Period 2: the inverses recomputed on steps 0, 2, ..., cached between.
DEMO = ("experiment=demo", "optimizer=kfac", "logger=none", "optimizer.inverse_update_period=2")


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


class SmallNet(nnx.Module):
  """One layer of each kind kfac-jax registers: conv2d, scale-and-shift (BatchNorm), dense."""

  def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
    self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, dtype=dtype, rngs=rngs)
    self.bn = nnx.BatchNorm(4, dtype=dtype, rngs=rngs)
    self.dense = nnx.Linear(4, 5, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.dense(jnp.mean(jax.nn.relu(self.bn(self.conv(x))), axis=(1, 2)))


def small_problem(dtype=jnp.float32):
  """The net's graph in training mode, its parameters and BatchNorm state, and STEPS batches."""
  model = SmallNet(nnx.Rngs(0), dtype)
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = jax.random.normal(jax.random.key(1), (STEPS, BATCH, 6, 6, 1))
  y = jax.random.randint(jax.random.key(2), (STEPS, BATCH), 0, 5)
  batches = [LossBatch(x[t], y[t], None, None, rest) for t in range(STEPS)]
  return graphdef, params, batches


def framework_tx(graphdef, batches):
  """The registry's K-FAC from configs/optimizer/kfac.yaml's keys and the test's settings,
  built as a run builds it: ``(loss, opt, tx)``."""
  task = types.SimpleNamespace(full_params=lambda t, f: t, forward=lambda m, x: m(x))
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
  loss = TrainingLoss(model_logits(task, graphdef), shapes)
  overrides = [f"lr={LR}", f"optimizer.b1={B1}", f"optimizer.damping={DAMPING}"]
  overrides += [f"optimizer.inverse_update_period={PERIOD}", f"optimizer.curvature_ema={EMA}"]
  cfg = config("optimizer=kfac", *overrides)
  check_config(cfg, overrides=overrides)
  opt = registry.optimizer_config(cfg)
  return loss, opt, registry.get("kfac").build(opt, optax.constant_schedule(LR), None, loss)


def test_state_bytes_are_what_kfac_allocates():
  graphdef, params, batches = small_problem()
  _, opt, tx = framework_tx(graphdef, batches)
  state = tx.init(params)
  allocated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert registry.state_bytes(opt, params) == allocated


def framework_kfac(graphdef, params, batches, keys):
  """The registry's K-FAC (:func:`framework_tx`), stepped as training/steps.py steps it: the
  loss gradient of the step's forward, then ``update(..., batch=, key=)``."""
  loss, _, tx = framework_tx(graphdef, batches)

  @jax.jit
  def step(params, opt_state, batch, key):
    forward = lambda p: (loss.logits(p, batch)[0], None)
    (_, _), grads = loss_and_grads(forward, params, batch.labels, batch.mask)
    updates, opt_state = tx.update(grads, opt_state, params, batch=batch, key=key)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for batch, key in zip(batches, keys, strict=True):
    params, opt_state = step(params, opt_state, batch, key)
  return params


def kfac_jax_optimizer(graphdef, params, batches, keys, lr=LR, damping=DAMPING, period=PERIOD):
  """kfac-jax's own ``kfac_jax.Optimizer`` on the same loss: fixed learning rate, momentum
  and damping, no burn-in, sampled Fisher ("fisher_gradients")."""
  import kfac_jax

  def loss_fn(p, batch):
    logits = nnx.merge(graphdef, p, batch.rest, copy=True)(batch.inputs)
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch.labels)
    return cross_entropy(logits, batch.labels)

  optimizer = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    learning_rate_schedule=lambda _: lr,
    momentum_schedule=lambda _: B1,
    damping_schedule=lambda _: damping,
    num_burnin_steps=0,
    estimation_mode="fisher_gradients",
    curvature_ema=EMA,
    inverse_update_period=period,
    batch_size_extractor=lambda batch: batch.labels.shape[0],
    distributed_inverses=False,
    distributed_precon_apply=False,
    multi_device=False,
  )
  params = jax.tree.map(jnp.copy, params)  # its step donates them
  state = optimizer.init(jax.tree.map(jnp.copy, params), keys[0], batches[0])
  for batch, key in zip(batches, keys, strict=True):
    params, state, _ = optimizer.step(params, state, key, batch=batch)
  return params


def largest_difference(a, b) -> float:
  return max(
    float(jnp.max(jnp.abs(x - y))) for x, y in zip(*map(jax.tree.leaves, (a, b)), strict=True)
  )


def test_framework_kfac_equals_kfac_jax_optimizer():
  """Both run kfac-jax's estimator on the same batches with the same sampled labels (the same
  keys), so they differ only by float32 rounding in differently compiled programs. A step
  multiplies by the inverses of damped factors (A + sqrt(lambda) I, G + sqrt(lambda) I), whose
  condition numbers stay below ~1e2 here (factors of norm O(1), lambda = 0.1): float32's 1.2e-7
  grows to ~1e-5 of the update, so 1e-4 of the parameters' whole change over STEPS steps
  bounds the difference with margin. A wrong step (another key, a missed or extra inverse
  update, momentum applied to the unscaled direction) changes the update at the order of
  itself: the same parameters with other keys for the framework sit far outside."""
  graphdef, params, batches = small_problem()
  keys = [jax.random.key(10 + t) for t in range(STEPS)]
  ours = framework_kfac(graphdef, params, batches, keys)
  theirs = kfac_jax_optimizer(graphdef, params, batches, keys)
  moved = largest_difference(theirs, params)
  assert moved > 1e-2  # the steps moved the parameters
  tolerance = 1e-4 * moved
  assert largest_difference(ours, theirs) <= tolerance
  other_keys = [jax.random.key(20 + t) for t in range(STEPS)]
  other = framework_kfac(graphdef, params, batches, other_keys)
  assert largest_difference(other, theirs) > 100 * tolerance


@pytest.mark.slow  # ~2-4 min on 2 cores, compile-bound (make test-all)
def test_the_training_step_is_kfac_jax_optimizer():
  """train.py's own training step (training/steps.py: the TrainingLoss hook, the batch and the
  fisher_key it passes) on the demo's first steps equals ``kfac_jax.Optimizer`` given the same
  batches and keys: the framework's batch augmentation and key splits reproduced outside, the
  reference on the demo's ResNet (conv2d, scale-and-shift and dense layers). The tolerance is
  the test above's, relative to the parameters' change (the inverses' conditioning with the
  demo's damping 1e-3 is below ~1e3: float32's 1.2e-7 stays under 1e-4 of the update)."""
  from training import run_setup, sharding

  steps = 3  # the inverses recomputed on steps 0 and 2, cached on step 1
  setup = run_setup.build(config(*DEMO, f"max_steps={steps}"))
  rc, task, state = setup.rc, setup.task, setup.state
  graphdef = nnx.split(task.model, nnx.Param, ...)[0]  # the training graph (model.train())
  arrays = sharding.put(task.train_arrays, setup.plan.replicated)
  order, size = task.batch_order(rc.seed, 0), rc.batch_size
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the step donates its state
  params, rng, batches, keys = copy(state.trainable), state.rng, [], []
  for t in range(steps):
    idx = order[t * size : (t + 1) * size]
    rng, batch_key, fisher_key = jax.random.split(rng, 3)  # as the step splits its key
    inputs, labels, mask = task.train_batch(arrays, jnp.asarray(idx), batch_key)
    batches.append(LossBatch(inputs, labels, mask, None, copy(state.rest)))
    keys.append(fisher_key)
    state = setup.train_step(state, setup.frozen, arrays, setup.plan.indices(idx))
  opt = rc.optimizer
  theirs = kfac_jax_optimizer(
    graphdef,
    params,
    batches,
    keys,
    rc.lr,
    opt.extra["optimizer.damping"],
    opt.extra["optimizer.inverse_update_period"],
  )
  moved = largest_difference(theirs, params)
  assert moved > 1e-3
  assert largest_difference(state.trainable, theirs) <= 1e-4 * moved


def test_a_model_kfac_finds_no_layers_in_is_refused():
  """A bfloat16 model hides its layers from kfac-jax's graph matcher behind casts: init names
  the parameters it would only have scaled by a diagonal, instead of training them so."""
  from training.kfac import scale_by_kfac

  graphdef, params, batches = small_problem(jnp.bfloat16)
  task = types.SimpleNamespace(full_params=lambda t, f: t, forward=lambda m, x: m(x))
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
  tx = scale_by_kfac(
    TrainingLoss(model_logits(task, graphdef), shapes),
    damping=DAMPING,
    inverse_update_period=PERIOD,
    curvature_ema=EMA,
  )
  with pytest.raises(ValueError, match=r"no dense, conv2d or scale-and-shift layer for .*conv"):
    jax.eval_shape(tx.init, params)


@pytest.mark.parametrize("experiment", ["xsum_t5_lora", "xsum_t5_full", "demo_xsum"])
def test_t5_is_refused_in_one_line_by_the_config_check(experiment):
  """The config check reads the config only (tests/test_config_check.py: it loads and
  compiles nothing), so the refusal comes before any data, model or kfac-jax import."""
  overrides = (f"experiment={experiment}", "optimizer=kfac")
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  lines = str(info.value).splitlines()
  assert lines[0] == "1 bad config value:"
  assert lines[1].startswith("  model.family='t5': must be 'resnet' for optimizer=kfac (")
  assert "weight sharing" in lines[1] and len(lines) == 2


def test_bfloat16_is_refused_and_float32_resnets_pass():
  overrides = ("experiment=demo", "optimizer=kfac", "precision=bfloat16")
  assert refused_settings(config(*overrides), "kfac") == [
    "precision='bfloat16': must be 'float32' for optimizer=kfac (kfac-jax's graph matcher "
    "finds no dense or conv layer behind bfloat16's casts: no Kronecker factors)."
  ]
  for experiment in ("demo", "cifar100_resnet18", "cifar100_resnet50"):
    cfg = config(f"experiment={experiment}", "optimizer=kfac")
    assert refused_settings(cfg, "kfac") == []
    check_config(cfg, overrides=[])


def test_the_check_before_the_data_leaves_kfacs_state_to_build():
  """run_setup.check sizes an optimizer state from the parameters' shapes before any model
  exists; K-FAC's state comes from the training loss's trace, which needs the model, so its
  memory check is build()'s (with the loss), not this one's."""
  from training import run_setup

  rc, _ = run_setup.check(config(*DEMO))
  assert rc.optimizer.name == "kfac"


@pytest.mark.slow  # ~45 s on 2 cores, compile-bound (make test-all; make test compares the update)
def test_the_demo_trains_with_kfac(tmp_path):
  """train.py's loop on the demo (digits, resnet_tiny): every parameter in a K-FAC layer (init
  refuses otherwise), a checkpoint written and the loss falling."""
  from training import loop

  steps = 8
  fast = [f"max_steps={steps}", f"eval_every={steps}", "log_every=1"]
  cfg = config(*DEMO, *fast, f"checkpoint_every={steps}")
  summary = loop.train(cfg, tmp_path / "kfac")
  assert summary["status"] == "completed" and summary["steps"] == steps
  assert summary["run"]["optimizer"] == "kfac"
  records = [json.loads(line) for line in (tmp_path / "kfac" / "metrics.jsonl").open()]
  losses = [r["train_loss"] for r in records if r["event"] == "train"]
  assert len(losses) == steps and np.all(np.isfinite(losses))
  # ln(10) = 2.3 at the start; lr 1e-3 with damping 1e-3 takes the demo below 1 in 8 steps.
  assert losses[0] > 2.0 and losses[-1] < 0.5 * losses[0]


def test_the_vendored_kfac_jax_is_the_one_imported():
  """optimizer=kfac runs on kfac-jax's source in third_party/kfac_jax (no kfac-jax release
  runs on the pinned JAX): the config check accepts it, and ``import kfac_jax`` finds that
  copy, before any kfac-jax installed in the environment."""
  import kfac_jax

  assert registry.kfac_jax_unavailable() is None
  assert Path(kfac_jax.__file__).is_relative_to(ROOT / "third_party" / "kfac_jax" / "kfac_jax")


def _refusal() -> str:
  """The config check's one line refusing the demo with optimizer=kfac."""
  overrides = ("experiment=demo", "optimizer=kfac")
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  lines = str(info.value).splitlines()
  assert lines[0] == "1 bad config value:" and len(lines) == 2
  assert lines[1].startswith(
    "  optimizer.name='kfac': must be an optimizer whose library can be imported here "
    "(kfac_jax cannot be imported: "
  )
  return lines[1]


def test_without_kfac_jax_kfac_is_refused_in_one_line(monkeypatch, tmp_path):
  """Where kfac_jax cannot be imported (its vendored source missing, or a distribution it
  imports not installed), the config check refuses optimizer=kfac in one line naming what is
  missing, before anything loads or compiles. Nothing is imported to find out."""
  from importlib import util

  import training

  monkeypatch.setattr(training, "KFAC_JAX_DIR", tmp_path)
  assert f"its vendored source {tmp_path / 'kfac_jax'} is missing)" in _refusal()
  monkeypatch.undo()

  find_spec = util.find_spec
  absent = ("distrax", "tensorflow_probability")

  def find_spec_without(name, *args):
    return None if name in absent else find_spec(name, *args)

  monkeypatch.setattr(util, "find_spec", find_spec_without)
  assert "distrax, tfp-nightly not installed (pip install -r requirements.txt))" in _refusal()
