"""training.registry: each optimizer described once, and a new one is one YAML plus one entry.

The end-to-end test adds optax's Lion as docs/adding-an-optimizer.md says, without touching the
repository: the doc's entry is registered for the test only (``registry.registered``) and the
doc's YAML is written to a config folder of the test's own, put on Hydra's search path. Lion
then trains the demo, is checked like the shipped optimizers, and appears in
``results.compare`` and in a table of results/tables.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import registry, run_record
from training.config_check import ConfigError, check_config

ROOT = Path(__file__).resolve().parents[1]
FAST = ["logger=none", "max_steps=2", "eval_every=2", "log_every=1", "checkpoint_every=2"]


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


# ----------------------------------------------------------------------------- the entries


def test_every_optimizer_has_its_yaml_and_every_yaml_its_optimizer():
  shipped = sorted(p.stem for p in (ROOT / "configs" / "optimizer").glob("*.yaml"))
  assert sorted(registry.names()) == shipped
  for name in registry.names():
    assert config(f"optimizer={name}").optimizer.name == name


@pytest.mark.parametrize("name", registry.names())
def test_a_yaml_sets_the_paper_keys_its_optimizer_does_not_read_to_null(name):
  """The keys config_check warns about when set: none may be set by the optimizer's own YAML."""
  cfg = config(f"optimizer={name}")
  unread = [k for k in registry.PAPER_KEYS if not registry.reads(name, k)]
  assert {k: cfg[k] for k in unread} == dict.fromkeys(unread)


def test_what_each_optimizer_reads():
  ginger, qng, adam = registry.get("ginger"), registry.get("qng"), registry.get("adam")
  assert ginger.curvature and ginger.curvature_every
  assert qng.curvature and not qng.curvature_every
  assert not adam.curvature and adam.hyperparameters == ()
  assert set(qng.hyperparameters) == set(ginger.hyperparameters) - {"gamma", "passes"}
  assert {"fisher", "fisher_forward", "fisher_backward"} <= set(qng.hyperparameters)
  # The run identity keeps what the optimizer reads, None for the rest.
  run = run_record.identity(config("optimizer=qng", "gamma=0.5"))
  assert run["tau"] == 8 and run["gamma"] is None and run["state_dtype"] == "float32"
  run = run_record.identity(config("optimizer=adam"))
  assert run["tau"] is None and run["fisher"] is None and run["state_dtype"] is None


def shapes(*leaves: tuple[int, ...], **named: tuple[int, ...]):
  """A parameter layout: ``jax.ShapeDtypeStruct`` s of float32, in a list or by name."""
  import jax
  import jax.numpy as jnp

  if named:
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in named.items()}
  return [jax.ShapeDtypeStruct(s, jnp.float32) for s in leaves]


def opt(name: str, **values):
  """The checked config of optimizer ``name`` at its YAML's values, ``values`` replacing some."""
  config = run_record.plain(OmegaConf.create(OmegaConf.to_container(config_of(name))))
  return dataclasses.replace(registry.optimizer_config(config), **values)


def config_of(name: str, *overrides: str):
  return config(f"optimizer={name}", *overrides)


def test_update_flops():
  layout = shapes((100, 10), (10,))  # 1000 and 10 entries
  assert registry.update_flops(opt("adam"), layout) == 10 * 1010
  assert registry.update_flops(opt("momentum"), layout) == 10 * 1010
  assert registry.update_flops(opt("qng", tau=2), layout) == 10 * 1010 + 3 * 2 * 4 * 1010
  # Ginger per block, rank k = min(tau, n): 2 (4nk + nk(k+1) + 2nk) + 9 (k+1)^3
  per_block = lambda n, k: 2 * (4 * n * k + n * k * (k + 1) + 2 * n * k) + 9 * (k + 1) ** 3
  assert registry.update_flops(opt("ginger", tau=4, block="per_tensor"), layout) == (
    10 * 1010 + per_block(1000, 4) + per_block(10, 4)
  )
  assert registry.update_flops(opt("ginger", tau=4, block="global"), layout) == (
    10 * 1010 + per_block(1010, 4)
  )


def test_muons_update_flops_follow_the_matrices_shapes():
  """Newton-Schulz on an m x n matrix, m <= n: 4 m^2 n + 2 m^3 FLOPs an iteration, on each
  hidden matrix (a conv filter as its (kh kw in, out) matrix); the input and output layers,
  biases and norms only element-wise (training/muon_layout.py)."""
  layout = {
    "conv1": shapes(kernel=(3, 3, 3, 16)),  # the input layer: AdamW
    "layer1": shapes(kernel=(3, 3, 16, 32), bias=(32,)),  # (144, 32): Muon
    "layer2": shapes(kernel=(32, 64)),  # (32, 64): Muon
    "fc": shapes(kernel=(64, 10)),  # the output layer: AdamW
  }
  sizes = 3 * 3 * 3 * 16 + 3 * 3 * 16 * 32 + 32 + 32 * 64 + 64 * 10
  ns = lambda m, n: 4 * m * m * n + 2 * m**3
  for steps in (5, 3):
    muon = opt("muon", extra={**opt("muon").extra, "optimizer.ns_steps": steps})
    expected = 10 * sizes + steps * (ns(32, 144) + ns(32, 64))
    assert registry.update_flops(muon, layout) == expected
  # The shapes, not the sizes: the same 4,608 entries as a (4608, 1) matrix cost 1/32 of it.
  thin = {"layer1": shapes(kernel=(4608, 1))}
  square = {"layer1": shapes(kernel=(3, 3, 16, 32))}
  work = lambda layout: registry.update_flops(opt("muon"), layout) - 10 * 4608
  assert work(thin) == 5 * ns(1, 4608) and work(square) == 5 * ns(32, 144)


@pytest.mark.parametrize("name", [n for n in registry.names() if not registry.get(n).traces_loss])
def test_state_bytes_are_what_the_transformation_allocates(name):
  """Each entry's state bytes for a layout equal the bytes of its transformation's state,
  built as a run builds it (with a learning-rate schedule) and initialised on that layout
  (K-FAC's, built from a training loss: tests/test_kfac.py)."""
  import jax
  import numpy as np

  layout = {
    "conv1": shapes(kernel=(3, 3, 3, 8)),
    "layer1": shapes(kernel=(3, 3, 8, 8), scale=(8,)),
    "fc": shapes(kernel=(8, 10), bias=(10,)),
  }
  config = opt(name)
  tx = registry.get(name).build(config, lambda step: 1e-3, None)
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), layout)
  state = tx.init(params)
  allocated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert registry.state_bytes(config, layout) == allocated > 0


def test_an_entry_without_its_costs_is_refused():
  entry = registry.get("adam")
  for field in ("update_flops", "state_bytes"):
    bare = dataclasses.replace(entry, name="bare", **{field: None})
    with pytest.raises(ValueError, match=f"optimizer 'bare' has no {field}"):
      registry.register(bare)
    assert "bare" not in registry.names()


def test_the_lr_key_is_the_entrys():
  assert run_record.lr_key("ginger", None) == "ginger_unclipped"
  assert run_record.lr_key("ginger", 1.0) == "ginger"
  assert run_record.lr_key("qng", 1.0) == "qng_clipped"
  assert run_record.lr_key("muon", None) == "muon"
  clipped = dataclasses.replace(
    registry.get("adam"), name="clipped_adam", lr_key=lambda v: "clipped_adam_" + str(v["rho"])
  )
  with registry.registered(clipped):
    assert run_record.lr_key("clipped_adam", 2.0) == "clipped_adam_2.0"


def test_an_optimizers_own_keys_are_part_of_the_identity():
  """Runs that differ only in an optimizer's own key (Muon's ns_steps, Adam's b1) have other
  identities; at its YAML's values a run's identity has no such field (a committed run keeps
  the identity it was recorded with)."""
  from results.selection import config_key

  default = run_record.identity(config("optimizer=muon"))
  fewer = run_record.identity(config("optimizer=muon", "optimizer.ns_steps=3"))
  assert run_record.OPTIONS not in default
  assert fewer[run_record.OPTIONS] == {"optimizer.ns_steps": 3}
  assert {k: v for k, v in fewer.items() if k != run_record.OPTIONS} == default
  assert config_key({"run": default}) != config_key({"run": fewer})
  adam = run_record.identity(config("optimizer=adam", "optimizer.b1=0.8"))
  assert adam[run_record.OPTIONS] == {"optimizer.b1": 0.8}
  # Keys held elsewhere in the identity, or that do not change the result, are not repeated.
  ginger = run_record.identity(config("optimizer=ginger", "passes=jnp", "tau=4"))
  assert run_record.OPTIONS not in ginger and ginger["tau"] == 4
  assert run_record.own_keys(registry.get("ginger")) == ("optimizer.b1",)


def test_the_registry_and_its_readers_import_no_jax():
  """Config checks, sweeps and tables read the entries in milliseconds."""
  code = (
    "import sys; import training.registry, training.config_check, training.run_record, "
    "results.tables, results.compare, sweeps.expand; "
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'optax', 'flax')))"
  )
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def test_a_name_is_registered_once():
  with pytest.raises(ValueError, match="already registered"):
    registry.register(registry.get("adam"))
  with pytest.raises(ValueError, match=re.escape(f"must be one of {registry.names()}")):
    registry.get("adamw")


def test_unknown_optimizer_names_the_registered_ones():
  with pytest.raises(ConfigError) as info:
    check_config(config("optimizer.name=lion"), overrides=[])
  assert f"optimizer.name='lion': must be one of {list(registry.names())}" in str(info.value)


# ----------------------------------------------------------------------------- a new optimizer


DOC = ROOT / "docs" / "adding-an-optimizer.md"


def doc_block(language: str) -> str:
  """The first ```language block of docs/adding-an-optimizer.md."""
  return re.search(rf"```{language}\n(.*?)```", DOC.read_text(), re.S).group(1)


def doc_entry() -> registry.Optimizer:
  """The entry docs/adding-an-optimizer.md adds at the end of training/registry_recent.py, run
  among the registry's names; its ``register(...)`` call hands the entry back instead of keeping
  it."""
  entries = []
  exec(doc_block("python"), {**vars(registry), "register": entries.append})
  [entry] = entries
  return entry


@pytest.fixture
def lion(tmp_path):
  """Lion as docs/adding-an-optimizer.md adds it, for this test only: its entry registered, its
  YAML on Hydra's search path (the override to compose with)."""
  configs = tmp_path / "configs"
  (configs / "optimizer").mkdir(parents=True)
  (configs / "optimizer" / "lion.yaml").write_text(doc_block("yaml"))
  with registry.registered(doc_entry()):
    yield f"hydra.searchpath=[file://{configs}]"
  assert "lion" not in registry.names()


def test_a_new_optimizer_is_checked_like_the_others(lion, caplog):
  overrides = ("optimizer=lion", "optimizer.b2=1.5")
  with pytest.raises(
    ConfigError, match=r"optimizer.b2=1.5 \(float\): must be a number in \[0, 1\)"
  ):
    check_config(config(lion, *overrides), overrides=overrides)
  with caplog.at_level(logging.WARNING, logger="train"):
    check_config(config(lion, "optimizer=lion", "tau=4"), overrides=["tau=4"])
    check_config(config(lion, "optimizer=lion", "fisher=empirical"), overrides=["fisher"])
  assert [r.getMessage() for r in caplog.records] == [
    "tau=4 is ignored: optimizer=lion has no tau (only ginger, qng use it).",
    "fisher='empirical' is ignored: optimizer=lion uses no Fisher vector (only ginger, qng do).",
  ]
  others = tuple(n for n in registry.names() if n not in registry.PAPER_ORDER)
  assert registry.table_order() == ("momentum", "adam", "qng", "ginger", *others)
  assert others[-1] == "lion"
  assert registry.table_order(first=("adam",)) == ("adam", "momentum", "qng", "ginger", *others)


def test_a_new_optimizer_trains_and_is_tabulated(lion, tmp_path, capsys, caplog):
  from results import compare, tables
  from results.runs import collect_runs
  from training import loop

  cfg = config(lion, "experiment=demo", "optimizer=lion", *FAST)
  with caplog.at_level(logging.WARNING, logger="train"):
    summary = loop.train(cfg, tmp_path / "runs" / "lion")
  assert not [r for r in caplog.records if "ignored" in r.getMessage()]
  assert summary["status"] == "completed" and summary["steps"] == 2
  run = summary["run"]
  assert run["optimizer"] == "lion" and run["tau"] is None and run["state_dtype"] is None
  assert OmegaConf.select(cfg, "optimizer.b2") == 0.99

  capsys.readouterr()
  compare.main([str(tmp_path / "runs")])
  rows = capsys.readouterr().out.splitlines()
  assert rows[0].startswith("| optimizer | lr |") and rows[2].startswith("| lion | 0.0001 |")

  runs = collect_runs([tmp_path / "runs"])
  table = tables.build_table1(runs, "digits", ["resnet_tiny"], length="2steps")
  [row] = [r for r in table.rows if r.label == "Lion"]
  assert row.cells[0] != ""  # its best validation accuracy
  assert "| Lion |" in tables.to_markdown(table)
