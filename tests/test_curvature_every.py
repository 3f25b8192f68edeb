"""``curvature_every=K``: Ginger's d-pass and curvature update on steps 0, K, 2K, ... only.

The loop runs two programs built from one step function: the paper's step (d-pass, curvature
update) and, between curvature updates, the same step without the d-pass (the optimizer then
preconditions with the current G and leaves the curvature as it is). Checked here on the demo
experiment: K=1 (or null) is the paper's step, K=3 updates the curvature on steps 0, 3, 6 only, the
step without the d-pass has none of its work, a run resumed mid-period continues bit for bit,
summary.json's FLOPs are the mean over K steps, bad values are refused up front, and the
run-dir fingerprint tells K apart.
"""

import logging
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import ginger
from models import flops
from training import loop as train
from training import registry, run_record
from training.checkpoints import Checkpointer
from training.config_check import ConfigError, check_config
from training.errors import Interrupted
from training.run_config import parse
from training.summary import analytic_flops

ROOT = Path(__file__).resolve().parents[1]
BASE = [
  "experiment=demo",
  "optimizer=ginger",
  "logger=none",
  "log_every=1",
  "spectrum_every=1",
  "eval_every=100",
  "checkpoint_every=100",
  "max_steps=7",
  "batch_size=16",  # the programs of the demo's 64, a quarter of the convolution work
]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def events(run_dir: Path, kind: str) -> list[dict]:
  """The run's events of one kind, without their wall-clock times."""
  out = []
  logged = run_record.read_spectrum if kind == "spectrum" else run_record.read_events
  for event in logged(run_dir, strict=True):
    if event["event"] == kind:
      out.append(
        {
          k: v
          for k, v in event.items()
          if k not in ("wall_time_s", "step_time_s", "examples_per_s")
        }
      )
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Seven steps at K=3 straight through, and the same run stopped after step 4 (inside a
  period: step 4 is not a curvature step) and resumed."""
  root = tmp_path_factory.mktemp("curvature_every")
  cfg = config(*BASE, "curvature_every=3")
  straight = root / "straight"
  summary = train.train(cfg, straight)
  resumed = root / "resumed"
  with pytest.raises(Interrupted, match="stopped by SIGTERM at step 4 of 7"):
    train.train(cfg, resumed, stop=lambda step: signal.SIGTERM if step == 4 else None)
  assert Checkpointer(resumed).latest_step() == 4
  train.train(cfg, resumed)  # continues from step 4 with the step without the d-pass
  return {"cfg": cfg, "straight": straight, "resumed": resumed, "summary": summary}


@pytest.fixture(scope="module")
def runs_setup(runs):
  """``train.build`` of the runs' config, once for the tests that read their checkpoints or
  lower their steps (neither changes it)."""
  return train.build(runs["cfg"])


# ---- K = 1 is the paper's step ---------------------------------------------------------------


def test_k1_and_null_build_the_papers_step():
  """``curvature_every=1`` and ``curvature_every=null`` build one program, the same one, with
  the d-pass on every step."""
  cfg = config(*BASE, "curvature_every=1")
  unset = config(*BASE, "curvature_every=null")
  texts = []
  for c in (cfg, unset):
    setup = train.build(c)
    assert setup.precondition_step is None and setup.curvature_every == 1
    assert all(setup.updates_curvature(step) for step in range(5))
    arrays = setup.task.train_arrays
    idx = setup.plan.indices(np.arange(int(c.batch_size)))
    texts.append(setup.train_step.lower(setup.state, setup.frozen, arrays, idx).as_text())
  assert texts[0] == texts[1]


# ---- K = 3 ---------------------------------------------------------------------------------


def test_curvature_changes_only_on_steps_0_3_6(runs, runs_setup):
  """The spectrum logged after every step: sigma changes after steps 0, 3 and 6 (logged at
  done = 1, 4, 7) and stays exactly as it was after the others."""
  sigma = {e["step"]: e["sigma"] for e in events(runs["straight"], "spectrum")}
  assert sorted(sigma) == list(range(1, 8))
  zero = {k: [0.0] * len(v) for k, v in sigma[1].items()}
  previous = zero
  for done in range(1, 8):
    if (done - 1) % 3 == 0:
      assert sigma[done] != previous, done
    else:
      assert sigma[done] == previous, done
    previous = sigma[done]
  # The state itself: three curvature updates in seven steps.
  state = Checkpointer(runs["straight"]).restore(runs_setup.state, 7)
  (gstate,) = [
    s
    for s in jax.tree.leaves(
      state.opt_state, is_leaf=lambda x: isinstance(x, ginger.ScaleByGingerState)
    )
    if isinstance(s, ginger.ScaleByGingerState)
  ]
  assert int(gstate.count) == 3


def _primitives(jaxpr, counts=None) -> dict[str, int]:
  """How often each primitive occurs in a jaxpr, sub-jaxprs included."""
  from jax.extend import core as jex_core

  counts = {} if counts is None else counts
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    for sub in jex_core.jaxprs_in_params(eqn.params):
      _primitives(sub, counts)
  return counts


def _convs(setup, step, batch_size: int) -> int:
  """The convolutions in ``step``'s jaxpr (``setup``'s state, a batch of ``batch_size``)."""
  arrays = setup.task.train_arrays
  idx = setup.plan.indices(np.arange(batch_size))
  jaxpr = jax.make_jaxpr(step)(setup.state, setup.frozen, arrays, idx)
  return _primitives(jaxpr).get("conv_general_dilated", 0)


@pytest.fixture(scope="module")
def plain_step_convs():
  """The convolutions of a plain gradient step (Momentum's: one forward, one backward)."""
  cfg = config(*BASE, "optimizer=momentum")
  plain = train.build(cfg)
  return _convs(plain, plain.train_step, int(cfg.batch_size))


@pytest.mark.parametrize("fisher_forward", ["eval", "shared"])
def test_the_step_without_curvature_update_has_no_d_pass(fisher_forward, plain_step_convs):
  """The step between curvature updates is a program of its own without the d-pass: it has
  the convolutions of a plain gradient step (Momentum's: one forward, one backward), none
  behind a cond (the shared forward's curvature step: the same convolutions, its backward's
  on two cotangents at once; XLA's FLOPs of both programs: the summary test below)."""
  cfg = config(*BASE, "curvature_every=3", f"fisher_forward={fisher_forward}")
  setup = train.build(cfg)
  arrays = setup.task.train_arrays
  idx = setup.plan.indices(np.arange(int(cfg.batch_size)))
  convs = lambda step: _convs(setup, step, int(cfg.batch_size))  # noqa: E731
  with_d, without_d = setup.train_step, setup.precondition_step
  assert convs(without_d) == plain_step_convs
  if fisher_forward == "eval":
    assert convs(with_d) > convs(without_d)
  else:  # fisher_backward=batched: the backward's convolutions once, on a pair of cotangents
    assert convs(with_d) == convs(without_d)
  assert "cond" not in _primitives(
    jax.make_jaxpr(without_d)(setup.state, setup.frozen, arrays, idx)
  )


def test_the_sequential_shared_d_pass_has_a_second_backward(plain_step_convs):
  """fisher_backward=sequential: the curvature step has a second backward's convolutions
  (the default, batched, has none: test above)."""
  cfg = config(*BASE, "fisher_forward=shared", "fisher_backward=sequential")
  setup = train.build(cfg)
  assert _convs(setup, setup.train_step, int(cfg.batch_size)) > plain_step_convs


def test_summary_flops_are_the_mean_over_k_steps(runs, runs_setup):
  """flops_per_iter: one step with the d-pass and curvature update, K-1 without, averaged."""
  cfg, summary, setup = runs["cfg"], runs["summary"], runs_setup
  forward = setup.task.forward_flops_per_example() * int(cfg.batch_size)
  params, opt = setup.state.trainable, setup.rc.optimizer
  full = flops.train_step_flops(forward, fisher_forward=cfg.fisher_forward) + registry.update_flops(
    opt, params
  )
  light = flops.train_step_flops(forward, fisher_forward=None) + registry.update_flops(
    opt, params, curvature_update=False
  )
  assert light < full
  analytic = summary["flops_per_iter"]["analytic"]
  assert analytic == pytest.approx((full + 2 * light) / 3, rel=1e-12)
  assert analytic == pytest.approx(analytic_flops(setup.task, setup.rc, params), rel=1e-12)
  k1 = parse(config(*BASE, "curvature_every=1"))
  assert analytic_flops(setup.task, k1, params) == pytest.approx(full, rel=1e-12)

  arrays = setup.task.train_arrays
  idx = setup.plan.indices(np.arange(int(cfg.batch_size)))
  xla = []
  for step in (setup.train_step, setup.precondition_step):
    analysis = step.lower(setup.state, setup.frozen, arrays, idx).compile().cost_analysis()
    xla.append(float((analysis[0] if isinstance(analysis, (list, tuple)) else analysis)["flops"]))
  assert xla[1] < xla[0]  # XLA counts fewer FLOPs for the step without the d-pass
  assert summary["flops_per_iter"]["xla"] == pytest.approx((xla[0] + 2 * xla[1]) / 3)


def test_resume_inside_a_period_is_bit_for_bit(runs, runs_setup):
  straight, resumed = runs["straight"], runs["resumed"]
  for kind in ("train", "spectrum"):
    assert events(straight, kind) == events(resumed, kind)
  a = Checkpointer(straight).restore(runs_setup.state, 7)
  b = Checkpointer(resumed).restore(runs_setup.state, 7)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- the config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "value, shown", [("0", "0"), ("-1", "-1"), ("2.5", "2.5 (float)"), ("true", "True")]
)
def test_bad_values_are_refused_up_front(tmp_path, value, shown):
  named = f"curvature_every={shown}: must be an integer >= 1"
  overrides = ("optimizer=ginger", f"curvature_every={value}")
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  assert named in str(info.value)
  # train.py: before any data is loaded or anything compiled (the run dir stays empty).
  with pytest.raises(ConfigError) as info:
    train.train(config(*BASE, f"curvature_every={value}"), tmp_path / "run")
  assert named in str(info.value)
  assert not (tmp_path / "run").exists()


def test_qng_takes_only_1():
  overrides = ("optimizer=qng", "curvature_every=2")
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  assert "curvature_every=2: must be 1 for optimizer=qng" in str(info.value)
  assert "only ginger take curvature_every > 1" in str(info.value)
  check_config(config("optimizer=qng", "curvature_every=1"), overrides=())


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_adam_and_momentum_ignore_it_with_a_warning(optimizer, caplog):
  overrides = (f"optimizer={optimizer}", "curvature_every=4")
  with caplog.at_level(logging.WARNING, logger="train"):
    check_config(config(*overrides), overrides=overrides)
  assert f"curvature_every=4 is ignored: optimizer={optimizer}" in caplog.text
  # What the loop and the FLOP count read.
  assert parse(config(*overrides), overrides=overrides).optimizer.curvature_every == 1


def test_fingerprint_tells_k_apart(tmp_path):
  k1, k3 = config(*BASE, "curvature_every=1"), config(*BASE, "curvature_every=3")
  assert "curvature_every" not in run_record.NOT_FINGERPRINTED
  assert run_record.fingerprint(k1) != run_record.fingerprint(k3)
  assert run_record.fingerprinted(k1)["curvature_every"] == 1
  # A completed summary counts for its own K only (sweeps do not rerun it, nor skip another K).
  run_record.write_summary(tmp_path, {"config": run_record.plain(k1), "status": "completed"})
  assert run_record.status(tmp_path, k1) == "completed"
  assert run_record.status(tmp_path, k3) is None


def test_precondition_only_update_flops():
  """A Ginger step without a curvature update: U^T g and U z, 2 n k multiply-adds a block."""
  params = [jax.ShapeDtypeStruct((100, 10), jnp.float32), jax.ShapeDtypeStruct((10,), jnp.float32)]
  elementwise = 10 * 1010
  per_tensor = registry.OptimizerConfig("ginger", tau=4, block="per_tensor")
  assert registry.update_flops(
    per_tensor, params, curvature_update=False
  ) == elementwise + 2 * 2 * (1000 * 4 + 10 * 4)
  whole = registry.OptimizerConfig("ginger", tau=4, block="global")
  assert (
    registry.update_flops(whole, params, curvature_update=False) == elementwise + 2 * 2 * 1010 * 4
  )
