"""The training loop re-orthonormalises Ginger's ``U`` as a program of its own.

Ginger's update is built with ``reorthonormalise_every=0`` (no ``lax.cond`` in the step: on a
GPU every XLA conditional stops the host until the device has caught up), and the loop runs
``ginger.reorthonormalise`` after every ``default_reorthonormalise_every``-th curvature update,
counted as the update would count them: with ``curvature_every=K`` only the curvature steps.
Checked on the demo experiment with the period shortened to 2, by a host callback that records
the Ginger update count each time the program runs; and a run stopped and resumed across such
a step continues bit for bit.
"""

import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import ginger
from ginger._src import ginger_transform
from training import loop as train
from training import optimizers, run_record
from training.errors import Interrupted

ROOT = Path(__file__).resolve().parents[1]
BASE = [
  "experiment=demo",
  "optimizer=ginger",
  "logger=none",
  "log_every=1",
  "spectrum_every=0",
  "eval_every=100",
  "checkpoint_every=100",
  "batch_size=16",
]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def period_two(monkeypatch):
  """Re-orthonormalise every 2 curvature updates, and record Ginger's update count each time
  the loop's program runs (a host callback inside it)."""
  monkeypatch.setattr(ginger_transform, "REORTHONORMALISE_EVERY", 2)
  counts: list[int] = []
  real = ginger.reorthonormalise

  def spied(opt_state, **kwargs):
    states = [
      s
      for s in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, ginger.ScaleByGingerState)
      )
      if isinstance(s, ginger.ScaleByGingerState)
    ]
    jax.debug.callback(lambda c: counts.append(int(c)), states[0].count)
    return real(opt_state, **kwargs)

  monkeypatch.setattr(ginger, "reorthonormalise", spied)
  return counts


def test_the_steps_have_no_conditional(period_two):
  """Ginger's training steps (also with and without the curvature update at K=3) lower
  without a conditional: the re-orthonormalisation is a program of its own (that the loop runs
  it after the right curvature updates: the K=3 run below and test_reorthonormalises_after)."""
  cfg = config(*BASE, "max_steps=5")
  setup = train.build(cfg)
  assert setup.reorthonormalise_every == 2 and setup.reorthonormalise_step is not None
  arrays = setup.task.train_arrays
  idx = setup.plan.indices(np.arange(int(cfg.batch_size)))
  texts = [setup.train_step.lower(setup.state, setup.frozen, arrays, idx).as_text()]
  every_3 = train.build(config(*BASE, "max_steps=5", "curvature_every=3"))
  for step in (every_3.train_step, every_3.precondition_step):
    texts.append(step.lower(every_3.state, every_3.frozen, arrays, idx).as_text())
  for text in texts:
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


@pytest.mark.slow  # a training run of its own; the program and its period: the tests above
def test_a_run_too_short_to_need_it_never_compiles_it(tmp_path):
  """With the default period (100 curvature updates) a 5-step run neither runs nor compiles
  the program (compiled in the background only by a run that gets that far)."""
  compiled: list = []

  def listener(event, start, end, **kwargs):
    del start, end
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(kwargs.get("fun_name"))

  jax.monitoring.register_event_time_span_listener(listener)
  try:
    train.train(config(*BASE, "max_steps=5"), tmp_path / "run")
  finally:
    jax.monitoring.unregister_event_time_span_listener(listener)
  assert "jit(step)" in compiled and "jit(reorthonormalise)" not in compiled


def test_with_curvature_every_it_counts_curvature_updates_only(period_two, tmp_path):
  """K=3, seven steps: curvature updates on steps 0, 3, 6 (counts 1, 2, 3), so the program
  runs once, after step 3."""
  train.train(config(*BASE, "max_steps=7", "curvature_every=3"), tmp_path / "run")
  jax.effects_barrier()
  assert period_two == [2]


@pytest.mark.parametrize(
  ("every", "curvature", "after"),
  [
    (2, 1, [1, 3, 5, 7, 9, 11]),
    (2, 3, [3, 9]),
    (3, 2, [4, 10]),
    (0, 1, []),
    (1, 1, list(range(12))),
  ],
)
def test_reorthonormalises_after(every, curvature, after):
  setup = train.Setup(*[None] * len(train.Setup._fields))._replace(
    curvature_every=curvature, reorthonormalise_every=every
  )
  assert [step for step in range(12) if setup.reorthonormalises_after(step)] == after
  for start in range(12):  # the first at or after start, as the loop looks it up
    later = [step for step in range(start, 40) if setup.reorthonormalises_after(step)]
    assert setup.first_reorthonormalisation(start) == (later[0] if later else None), start


def test_period_follows_the_state_dtype_and_only_ginger_has_one():
  assert optimizers.reorthonormalise_every(config(*BASE)) == ginger_transform.REORTHONORMALISE_EVERY
  narrow = config(*BASE, "optimizer.state_dtype=bfloat16")
  assert optimizers.reorthonormalise_every(narrow) == ginger_transform.REORTHONORMALISE_EVERY_NARROW
  for name in ("adam", "qng", "momentum"):
    assert optimizers.reorthonormalise_every(config(*BASE, f"optimizer={name}")) == 0
  assert train.build(config(*BASE, "optimizer=adam")).reorthonormalise_step is None


@pytest.mark.slow  # ~40 s; resuming bit for bit: test_train.py (SIGTERM), fast
def test_a_run_resumed_after_a_reorthonormalisation_continues_bit_for_bit(period_two, tmp_path):
  """Stopped after step 2 (the program ran after step 1) and resumed: the same losses and
  gradient norms as the run straight through, and the program ran at the same counts."""
  cfg = config(*BASE, "max_steps=5")
  train.train(cfg, tmp_path / "straight")
  jax.effects_barrier()
  straight_counts = list(period_two)
  period_two.clear()
  with pytest.raises(Interrupted, match="stopped by SIGTERM at step 2 of 5"):
    train.train(cfg, tmp_path / "resumed", stop=lambda s: signal.SIGTERM if s == 2 else None)
  train.train(cfg, tmp_path / "resumed")
  jax.effects_barrier()
  assert straight_counts == period_two == [2, 4]

  def train_events(run_dir):
    keep = ("step", "train_loss", "grad_norm")
    events = run_record.read_events(run_dir, strict=True)
    return [{k: e[k] for k in keep} for e in events if e["event"] == "train"]

  assert train_events(tmp_path / "resumed") == train_events(tmp_path / "straight")
