"""A fifth optimizer is one YAML and one registry entry: optax's ADOPT (Taniguchi et al. 2024).

The test writes ADOPT's YAML to a config folder of its own (on Hydra's search path, and taken
as the folder of the optimizers' YAMLs for the run identity) and registers its entry for the
test only; nothing else in the repository names it. It then trains the demo, and follows it
into the run identity (its own keys, where a run moves them off its YAML), the FLOPs and state
bytes summary.json records, Table 1, the comparisons file (against Adam and Ginger τ=8, one
Holm family each) and the table of today's optimizers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from models import flops
from results import newcomers, tables
from results.comparisons import build_comparisons
from results.runs import collect_runs
from results.selection import config_key
from training import registry, run_record

ROOT = Path(__file__).resolve().parents[1]
FAST = ["logger=none", "max_steps=2", "eval_every=2", "log_every=1", "checkpoint_every=2"]

ADOPT_YAML = """\
# @package _global_
# ADOPT (Taniguchi et al. 2024): Adam with the second moment taken before the current gradient.
optimizer:
  name: adopt
  b1: 0.9                   # first-moment decay
  b2: 0.9999                # second-moment decay
  eps: 1e-6                 # added to the square root of the second moment
tau: null
alpha: null
gamma: null
rho: null
block: null
lr: 1e-3
"""


def _build_adopt(opt, schedule, sharding):
  import optax

  return optax.contrib.adopt(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)


ADOPT = registry.Optimizer(
  name="adopt",
  display="ADOPT",
  keys={
    "optimizer.b1": registry.DECAY,
    "optimizer.b2": registry.DECAY,
    "optimizer.eps": registry.number(0, closed=(False, True)),
  },
  build=_build_adopt,
  update_flops=registry.elementwise_flops,
  state_bytes=registry.moments_state_bytes(2, counts=2),  # mu, nu; its and the schedule's count
)


@pytest.fixture
def adopt(tmp_path, monkeypatch):
  """ADOPT's YAML on Hydra's search path and as the identity's optimizer folder, its entry
  registered: the override to compose with."""
  configs = tmp_path / "configs"
  (configs / "optimizer").mkdir(parents=True)
  (configs / "optimizer" / "adopt.yaml").write_text(ADOPT_YAML)
  monkeypatch.setattr(run_record, "OPTIMIZER_CONFIGS", configs / "optimizer")
  run_record._defaults.cache_clear()
  with registry.registered(ADOPT):
    yield f"hydra.searchpath=[file://{configs}]"
  run_record._defaults.cache_clear()
  assert "adopt" not in registry.names()


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def test_its_own_keys_are_part_of_the_identity(adopt):
  default = run_record.identity(config(adopt, "optimizer=adopt"))
  assert default["optimizer"] == "adopt" and run_record.OPTIONS not in default
  moved = run_record.identity(config(adopt, "optimizer=adopt", "optimizer.b2=0.999"))
  assert moved[run_record.OPTIONS] == {"optimizer.b2": 0.999}
  assert config_key({"run": default}) != config_key({"run": moved})


def test_it_is_compared_with_adam_and_ginger(adopt):
  assert ADOPT.arms == (("adam", None), ("ginger", 8))
  assert "adopt" in registry.compared(("adam", None))
  assert "adopt" in registry.compared(("ginger", 8))
  assert run_record.lr_key("adopt", None) == "adopt"


def test_it_trains_and_is_counted_and_tabulated(adopt, tmp_path):
  from training import loop

  cfg = config(adopt, "experiment=demo", "optimizer=adopt", *FAST)
  summary = loop.train(cfg, tmp_path / "runs" / "adopt")
  assert summary["status"] == "completed" and summary["steps"] == 2
  assert summary["run"]["optimizer"] == "adopt"

  # The FLOPs: the passes and ADOPT's element-wise update, 10 FLOPs a parameter.
  setup_forward = summary["flops_per_iter"]["analytic"] - 10 * summary["trained_parameters"]
  assert setup_forward > 0
  assert setup_forward % (flops.TRAIN_FORWARD_MULTIPLIER * int(cfg.batch_size)) == 0
  # The state bytes: mu and nu like the parameters and two int32 counts, as the run allocated.
  assert summary["optimizer_state_bytes_per_device"] == 2 * 4 * summary["trained_parameters"] + 8

  # Adam and Ginger τ=8 beside it: the same run relabelled, its accuracy moved.
  run_dir = tmp_path / "runs" / "adopt"
  for name, run, shift in (
    ("adam", {"optimizer": "adam"}, -1.0),
    ("ginger", {"optimizer": "ginger", "tau": 8, "alpha": 0.99, "rho": 1.0}, -2.0),
  ):
    copy = shutil.copytree(run_dir, tmp_path / "runs" / name)
    other = json.loads((copy / "summary.json").read_text())
    other["run"].update(run)
    other["best_val_accuracy"] += shift
    (copy / "summary.json").write_text(json.dumps(other))
  runs = collect_runs([tmp_path / "runs"])

  table1 = tables.build_table1(runs, "digits", ["resnet_tiny"], length="2steps")
  assert [r.label for r in table1.rows if r.label == "ADOPT"] == ["ADOPT"]
  comparisons = tables.to_markdown(build_comparisons(runs, "digits", ["resnet_tiny"], "2steps"))
  assert "| ADOPT − Adam |" in comparisons and "newcomers − Adam (" in comparisons
  assert "| ADOPT − Ginger (τ=8) |" in comparisons and "newcomers − Ginger (τ=8) (" in comparisons

  [(name, table)] = newcomers.newcomer_tables(runs)
  assert name == "newcomers_digits_2steps_resnet_tiny"
  rows = {r.label: r.cells for r in table.rows}
  assert list(rows) == ["Adam", "Ginger (τ=8)", "ADOPT"]
  assert rows["ADOPT"][:2] == ["1", f"{summary['best_val_accuracy']:.2f}"]
  assert rows["ADOPT"][2:8] == ["+1.00", "", "n < 2", "+2.00", "", "n < 2"]
  assert rows["ADOPT"][-2] == f"{summary['optimizer_state_bytes_per_device'] * 1e-6:.1f}"
  # the digits set has no targets (results.profiles.IMAGE_TARGETS): no time columns
  assert not any(c.label.startswith("s to ") for c in table.columns)
  # a user's `make tables` (results.tables over their runs) writes it beside Table 1
  out = tmp_path / "tables"
  assert tables.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
  assert (out / "newcomers_digits_2steps_resnet_tiny.md").is_file()
