"""``fisher_batch=m``: the d-pass on the batch's first ``m`` examples only, with a forward and a
backward of its own on them.

Checked on the demo experiment at batch 16: ``m`` = the batch size is the whole-batch step (the
same program), ``m`` < the batch gives the optimizer exactly the d-pass of the first ``m``
examples computed directly (in the mode ``fisher_forward`` names), bad values are refused up
front with the key, the value and what is allowed, and only a set ``m`` enters the run's
identity and fingerprint.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hydra import compose, initialize_config_dir

import ginger
from models import flops
from training import loop as train
from training import run_record, run_setup
from training.config_check import ConfigError, check_config
from training.steps import TrainState, initial_stats, make_steps

ROOT = Path(__file__).resolve().parents[1]
BATCH = 16
BASE = ["experiment=demo", "optimizer=ginger", "logger=none", f"batch_size={BATCH}"]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("fisher_forward", ["eval", "shared"])
def test_the_whole_batch_is_the_step_without_the_key(fisher_forward):
  """``fisher_batch`` = the batch size lowers to the very program of ``fisher_batch=null``: the
  step is today's bit for bit."""
  texts = []
  for value in ("null", str(BATCH)):
    setup = train.build(config(*BASE, f"fisher_forward={fisher_forward}", f"fisher_batch={value}"))
    idx = setup.plan.indices(np.arange(BATCH))
    lowered = setup.train_step.lower(setup.state, setup.frozen, setup.task.train_arrays, idx)
    texts.append(lowered.as_text())
  assert texts[0] == texts[1]


def _recording():
  """An optimizer that leaves the parameters as they are and keeps the step's ``fisher_grads``
  as its state: what the step hands a curvature optimizer."""

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(updates, state, params=None, *, fisher_grads=None, **extra):
    del state, params, extra
    return jax.tree.map(jnp.zeros_like, updates), fisher_grads

  return optax.GradientTransformationExtraArgs(init, update)


def _d_of_step(setup, idx):
  """The ``d_t`` the training step of ``setup``'s run hands its optimizer on batch ``idx``."""
  rc, task, plan = setup.rc, setup.task, setup.plan
  graphs = run_setup.split_model(task.model, rc, plan)
  tx = _recording()
  trainable = task.trainable_params(graphs.params)
  key = jax.random.key(rc.seed)
  state = TrainState(
    np.zeros((), np.int32), trainable, graphs.rest, tx.init(trainable), key, initial_stats()
  )
  steps = make_steps(
    task, graphs.train, graphs.eval, tx, rc, plan, plan.state(state), graphs.backward,
    graphs.per_shard, setup.schedule,
  )  # fmt: skip
  kept = jax.device_get(state)  # the step donates its state
  return steps.train_step(state, setup.frozen, task.train_arrays, idx).opt_state, graphs, kept


@pytest.mark.parametrize("fisher_forward", ["eval", "shared"])
def test_d_is_the_d_pass_of_the_first_m_examples(fisher_forward):
  """With ``fisher_batch=4`` of 16 the optimizer gets ``ginger.fisher.fisher_vector`` of the
  model (in inference mode for ``fisher_forward=eval``, in training mode for ``shared``) on the
  batch's first 4 examples, with the step's Fisher key: normalised by their own count, not the
  batch's. The whole batch's d-pass differs (the comparison is not vacuous)."""
  m = 4
  setup = train.build(config(*BASE, f"fisher_forward={fisher_forward}", f"fisher_batch={m}"))
  task = setup.task
  idx = setup.plan.indices(np.arange(BATCH))
  got, graphs, state = _d_of_step(setup, idx)
  # The step's randomness: the batch's augmentation key and the Fisher key.
  _, batch_key, fisher_key = jax.random.split(jax.random.key(setup.rc.seed), 3)
  inputs, labels, _ = task.train_batch(task.train_arrays, idx, batch_key)
  graphdef = graphs.eval if fisher_forward == "eval" else graphs.train

  def logits(params, x):
    rest = jax.tree.map(jnp.asarray, state.rest)  # a training-mode forward writes its statistics
    model = nnx.merge(graphdef, task.full_params(params, setup.frozen), rest, copy=True)
    return task.forward(model, x)

  def d_pass(x, y):  # one program each, not the model's d-pass op by op
    return jax.jit(lambda p: ginger.fisher.fisher_vector(lambda q: logits(q, x), p, y, fisher_key))

  want = d_pass(inputs[:m], labels[:m])(state.trainable)
  whole = d_pass(inputs, labels)(state.trainable)
  # The same arithmetic, fused differently in the step: float32 summation order through a
  # dozen layers, amplified by BatchNorm's 1 / std of 4 examples in training mode, is ~1e-5 of
  # a leaf's largest entry; the whole batch's d differs at order 1 (checked below).
  tol, apart = 1e-4, 0.0
  for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(whole)):
    scale = float(np.max(np.abs(b))) + 1e-30
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=tol * scale)
    apart = max(apart, float(np.max(np.abs(np.asarray(a) - np.asarray(c)))) / scale)
  assert apart > 100 * tol


@pytest.mark.parametrize(
  ("overrides", "shown"),
  [
    (["fisher_batch=0"], "fisher_batch=0: must be an integer in [1, batch_size] or null"),
    (["fisher_batch=2.5"], "fisher_batch=2.5 (float): must be an integer in [1, batch_size]"),
    (["fisher_batch=true"], "fisher_batch=True: must be an integer in [1, batch_size]"),
    ([f"fisher_batch={BATCH + 1}"], f"fisher_batch=17: must be at most batch_size={BATCH}"),
    (["optimizer=adam", "fisher_batch=4"], "fisher_batch=4: must be null for optimizer=adam"),
    (["optimizer=momentum", "fisher_batch=4"], "which has no d-pass (only ginger, qng"),
  ],
)
def test_bad_values_are_refused_up_front(overrides, shown):
  with pytest.raises(ConfigError) as e:
    check_config(config(*BASE, *overrides), overrides=[])
  assert shown in str(e.value)


def test_a_set_value_is_part_of_the_run_and_null_leaves_it_as_it_was():
  """``fisher_batch=4``: its own fingerprint and identity field; null: the fingerprint and
  identity of a config that lacks the key (the records written without it)."""
  plain = run_record.plain(config(*BASE))
  without = {k: v for k, v in plain.items() if k != "fisher_batch"}
  assert plain["fisher_batch"] is None
  assert run_record.fingerprint(plain) == run_record.fingerprint(without)
  assert run_record.identity(plain) == run_record.identity(without)
  assert "fisher_batch" not in run_record.identity(plain)
  four = run_record.plain(config(*BASE, "fisher_batch=4"))
  assert run_record.fingerprint(four) != run_record.fingerprint(plain)
  assert run_record.identity(four)["fisher_batch"] == 4


def test_the_d_pass_flops_scale_with_the_fraction():
  """The summary's analytic FLOPs: the sub-batch's d-pass is a forward and a backward (3x) on
  its fraction of the batch, whatever the mode; the whole batch's are as without the key."""
  forward = 1.0
  assert flops.train_step_flops(forward, fisher_forward="eval", fisher_fraction=0.25) == 3.75
  assert flops.train_step_flops(forward, fisher_forward="shared", fisher_fraction=0.25) == 3.75
  assert flops.train_step_flops(forward, fisher_forward="shared") == 5
  assert flops.train_step_flops(forward, fisher_forward=None, fisher_fraction=0.25) == 3


def test_fisher_backward_is_ignored_with_a_sub_batch():
  """With ``fisher_batch`` < the batch the d-pass has a backward of its own: a
  ``fisher_backward`` given on the command line is ignored, with a warning saying so."""
  from training.config_check import ignored_settings

  overrides = ["fisher_forward=shared", "fisher_backward=sequential", "fisher_batch=4"]
  messages = ignored_settings(config(*BASE, *overrides), "ginger", {"fisher_backward"})
  assert any("fisher_backward='sequential' is ignored: with fisher_batch=4" in m for m in messages)
  whole = ignored_settings(
    config(*BASE, *overrides[:2], f"fisher_batch={BATCH}"), "ginger", {"fisher_backward"}
  )
  assert not any("fisher_backward" in m for m in whole)
