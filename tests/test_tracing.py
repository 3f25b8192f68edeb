"""Start-up's Python tracing: a run's programs trace the model once.

With ``curvature_every`` > 1 a run lowers two training steps (with and without the curvature
update) one after the other, holding the GIL; on a GPU host, with a warm compilation cache,
that lowering is most of Ginger's start-up. The model's forward is a function of its own under
``jax.jit`` (XLA inlines the call: the compiled steps are unchanged), so the second step reuses
the first one's traced forward and its derivatives instead of tracing the model again.
"""

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import compilation, sharding
from training import loop as train

ROOT = Path(__file__).resolve().parents[1]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("fisher_forward, traces", [("shared", 1), ("eval", 2)])
def test_the_training_steps_trace_the_model_once(monkeypatch, fisher_forward, traces):
  """Lowering both training steps calls the model's forward once per mode it runs in (the
  default shared d-pass: the training mode only; the authors' separate d-pass: the training
  mode for the loss, the inference mode for the d-pass); the step without the curvature update
  traces nothing anew."""
  cfg = config(
    "experiment=demo",
    "optimizer=ginger",
    "curvature_every=3",
    f"fisher_forward={fisher_forward}",
    "logger=none",
  )
  setup = train.build(cfg, materialize=False)
  calls = []
  forward = type(setup.task).forward

  def counting(self, model, inputs):
    calls.append(inputs.shape)
    return forward(self, model, inputs)

  monkeypatch.setattr(type(setup.task), "forward", counting)
  arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
  val = sharding.put(setup.task.val_arrays, setup.plan.replicated)
  idx = setup.plan.indices(np.arange(int(cfg.batch_size)))
  resolved = OmegaConf.to_container(cfg, resolve=True)
  lower = compilation.programs(
    setup, setup.state, setup.frozen, arrays, val, idx, setup.rc, resolved
  )
  lower[True]()
  assert len(calls) == traces
  lower[False]()
  assert len(calls) == traces  # the step without the curvature update: no trace of its own
