"""The typed run configuration (training/run_config.py): every shipped config parses, the result
is frozen and holds the values the config asked for, a bad value is refused naming the key, and
the code after the check reads it instead of the raw config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import registry
from training.config_check import ConfigError, refused_settings
from training.run_config import (
  DataConfig,
  LoraConfig,
  MeshConfig,
  ModelConfig,
  OptimizerConfig,
  RunConfig,
  parse,
)

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))
OPTIMIZERS = sorted(p.stem for p in (ROOT / "configs" / "optimizer").glob("*.yaml"))


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def typed(*overrides: str) -> RunConfig:
  return parse(config(*overrides), overrides=overrides)


@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_every_shipped_config_parses(experiment):
  """Every experiment with every optimizer: the typed config holds the resolved config's values
  (the scalars at the top, the optimizer's keys, model and data), with their types. A pair
  the optimizer refuses (``optimizer=kfac`` with T5) is refused by parse."""
  for optimizer in OPTIMIZERS:
    overrides = [f"optimizer={optimizer}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = config(*overrides)
    if refused_settings(cfg, optimizer):
      with pytest.raises(ConfigError, match=refused_settings(cfg, optimizer)[0].split(":")[0]):
        parse(cfg, overrides=overrides)
      continue
    rc = parse(cfg, overrides=overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for field in dataclasses.fields(RunConfig):
      value, raw = getattr(rc, field.name), resolved.get(field.name)
      if not dataclasses.is_dataclass(value) and raw is not None:
        assert value == raw, (field.name, value, raw)
    assert isinstance(rc.seed, int) and isinstance(rc.lr, float)
    assert isinstance(rc.mesh, MeshConfig) and isinstance(rc.data, DataConfig)
    assert rc.model.family == resolved["model"]["family"]
    assert rc.data.name == resolved["data"]["name"]
    opt = rc.optimizer
    assert isinstance(opt, OptimizerConfig) and opt.name == optimizer
    for key in registry.get(optimizer).keys:
      field = key.rsplit(".", 1)[-1]
      raw = OmegaConf.select(cfg, key)
      # A key no field names is in opt.extra, by its dotted key (optimizer=kfac's own keys).
      value = getattr(opt, field) if hasattr(opt, field) else opt.extra[key]
      if field not in ("curvature_every", "passes") and raw is not None:
        assert value == raw and isinstance(value, type(raw)), key
    for name in registry.PAPER_KEYS:  # the keys it does not read hold None
      if name not in registry.get(optimizer).keys:
        assert getattr(opt, name) is None, name


def _mistyped(value, prefix: str = "") -> list[str]:
  """The fields of the dataclass ``value`` (nested ones too) whose value is not of the type
  their annotation names (``int | None``: an int or None; ``int | str``: either)."""
  import types
  import typing

  wrong = []
  hints = typing.get_type_hints(type(value))
  for field in dataclasses.fields(value):
    held, hint = getattr(value, field.name), hints[field.name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = tuple(typing.get_origin(k) or k for k in (typing.get_args(hint) if union else [hint]))
    if dataclasses.is_dataclass(held):
      wrong += _mistyped(held, f"{prefix}{field.name}.")
    elif not isinstance(held, kinds):
      wrong.append(f"{prefix}{field.name}={held!r} ({hint})")
  return wrong


@pytest.mark.parametrize(
  "overrides",
  [
    (),
    ("experiment=xsum_t5_lora",),
    ("experiment=demo_xsum", "model.dropout_rate=0"),
    ("fisher_backward=null", "spectrum_every=null", "batchnorm=null", "grad_clip=1"),
  ],
)
def test_every_field_holds_its_annotated_type(overrides):
  """From_resolved types every field, nested ones too, by its annotation: an integer in the
  YAML of a float field is a float (``model.dropout_rate=0``: 0.0)."""
  assert _mistyped(typed(*overrides)) == []


def test_a_config_without_a_required_key_is_refused_by_name():
  resolved = OmegaConf.to_container(config(), resolve=True)
  del resolved["fisher"]
  with pytest.raises(KeyError, match="fisher"):
    RunConfig.from_resolved(resolved)
  del resolved["mesh"], resolved["deterministic"]  # absent from older configs: their defaults
  resolved["fisher"] = "sampled"
  rc = RunConfig.from_resolved(resolved)
  assert rc.mesh == MeshConfig() and rc.deterministic is False


def test_the_shipped_optimizers_parse_to_their_values():
  assert typed("optimizer=ginger").optimizer == OptimizerConfig(
    name="ginger",
    b1=0.9,
    state_dtype="float32",
    tau=4,
    alpha=0.99,
    gamma=1e-5,
    rho=1.0,
    block="per_tensor",
    curvature_every=1,
    passes="auto",
  )
  assert typed("optimizer=adam").optimizer == OptimizerConfig("adam", b1=0.9, b2=0.99, eps=1e-8)
  qng = typed("optimizer=qng", "tau=16").optimizer
  assert (qng.tau, qng.rho, qng.block, qng.passes) == (16, None, "global", None)
  lora = typed("experiment=xsum_t5_lora").model
  assert lora.lora == LoraConfig(
    8, 32.0, "(self_attention|cross_attention)/(q|k|v|o)/kernel$", False
  )
  tiny = typed("experiment=demo_xsum").model
  assert tiny.lora is None and tiny.pretrained is None and tiny.size["num_heads"] == 4


def test_nulls_stand_for_their_defaults():
  """A null in the config is the value the code takes for it, decided here once."""
  rc = typed(
    "fisher_backward=null",
    "spectrum_every=null",
    "profile_steps=null",
    "profile_start=null",
    "batchnorm=null",
    "curvature_every=null",
    "passes=null",
  )
  assert (rc.fisher_backward, rc.spectrum_every, rc.profile_steps, rc.profile_start) == (
    "auto",
    0,
    0,
    0,
  )
  assert rc.batchnorm == "sync"
  assert (rc.optimizer.curvature_every, rc.optimizer.passes) == (1, "jnp")
  # An optimizer that does not update its curvature every K-th step: 1, whatever was asked.
  assert typed("optimizer=adam", "curvature_every=4").optimizer.curvature_every == 1
  assert typed("optimizer=adam", "tau=4").optimizer.tau is None  # ignored, with a warning
  assert typed("optimizer=ginger", "curvature_every=3").optimizer.curvature_every == 3


def test_it_is_frozen():
  rc = typed("experiment=demo_xsum")
  with pytest.raises(dataclasses.FrozenInstanceError):
    rc.lr = 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    rc.optimizer.tau = 8
  with pytest.raises(dataclasses.FrozenInstanceError):
    rc.data.limit = 3
  with pytest.raises(TypeError):
    rc.model.size["d_model"] = 8  # the free-form parts are read-only too
  with pytest.raises(TypeError):
    rc.optimizer.extra["x"] = 1
  changed = dataclasses.replace(rc, lr=0.5)  # a changed copy is a new value
  assert changed.lr == 0.5 and rc.lr != 0.5


@pytest.mark.parametrize(
  "override, message",
  [
    ("tau=2.5", "tau=2.5 (float): must be an integer >= 1."),
    ("log_every=0", "log_every=0: must be an integer >= 1."),
    ("optimizer.state_dtype=int8", "optimizer.state_dtype='int8': must be one of"),
    ("passes=fast", "passes='fast': must be one of ['jnp', 'pallas', 'auto'] or null."),
    ("mesh.model=0", "mesh.model=0: must be an integer >= 1."),
  ],
)
def test_a_bad_value_is_refused_naming_key_value_and_what_is_allowed(override, message):
  with pytest.raises(ConfigError) as info:
    typed("optimizer=ginger", override)
  assert message in str(info.value)


def test_a_key_of_an_optimizer_of_its_own_is_kept_in_extra():
  """A registered optimizer's key that no field names is typed as the config gave it."""
  entry = registry.Optimizer(
    name="own",
    display="Own",
    keys={"optimizer.b1": registry.DECAY, "optimizer.beta": registry.number(0)},
    build=lambda opt, schedule, sharding: None,
    update_flops=registry.elementwise_flops,
    state_bytes=registry.moments_state_bytes(1),
  )
  with registry.registered(entry):
    opt = registry.optimizer_config({"optimizer": {"name": "own", "b1": 0.5, "beta": 3}})
  assert opt == OptimizerConfig("own", b1=0.5, extra={"optimizer.beta": 3})


def test_model_and_data_hold_only_what_their_family_reads():
  rc = typed("experiment=demo")
  assert rc.model == ModelConfig("resnet", "resnet_tiny")
  assert (rc.data.holdout, rc.data.augment, rc.data.tokenizer) == (0, False, None)


# Modules after the check: they read the typed config (rc), never the raw one.
AFTER_THE_CHECK = (
  "training/compilation.py",
  "training/logs.py",
  "training/loop.py",
  "training/optimizers.py",
  "training/registry.py",
  "training/registry_costs.py",
  "training/registry_paper.py",
  "training/registry_recent.py",
  "training/registry_schema.py",
  "training/run_setup.py",
  "training/sharding.py",
  "training/steps.py",
  "training/summary.py",
)


@pytest.mark.parametrize("path", AFTER_THE_CHECK)
def test_the_code_after_the_check_reads_the_typed_config(path):
  source = (ROOT / path).read_text()
  assert not re.findall(r"\bcfg\.\w+", source), path
