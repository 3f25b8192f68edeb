"""Which keys name a run dir: every override that changes the run's result; the experiment
(and ``name``) name the first level; logging, checkpoint cadence and the data's location do
not."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.types import RunMode

from sweeps.expand import CONFIG_NAME, hydra_context


def run_dir(*overrides: str) -> Path:
  """Where ``python train.py <overrides>`` runs, composed as train.py composes it."""
  with hydra_context() as hydra:
    cfg = hydra.compose_config(CONFIG_NAME, list(overrides), run_mode=RunMode.RUN, from_shell=False)
    return Path(str(cfg.hydra.run.dir))


@pytest.mark.parametrize(
  "overrides, expected",
  [
    (["optimizer=ginger", "tau=8"], "outputs/resnet18_cifar100/optimizer=ginger,tau=8"),
    (
      ["experiment=demo_xsum", "data.source=local", "data.path=/data/xsum"],
      "outputs/demo_xsum/data.source=local",
    ),
    (["experiment=demo", "max_steps=5", "eval_every=2"], "outputs/demo/eval_every=2,max_steps=5"),
    (["experiment=demo", "name=mine"], "outputs/mine/default"),
    (
      ["experiment=demo", "logger=none", "log_every=1", "checkpoint_every=7"],
      "outputs/demo/default",
    ),
  ],
)
def test_the_keys_that_change_a_result_name_its_dir(overrides, expected):
  assert run_dir(*overrides) == Path(expected)


def test_a_local_source_does_not_share_the_default_runs_dir():
  assert run_dir("experiment=demo_xsum", "data.source=local") != run_dir("experiment=demo_xsum")
