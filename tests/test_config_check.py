"""training.config_check: every bad top-level value is named before any data or compiling."""

import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from training import registry
from training.config_check import ConfigError, check_config, refused_settings

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")
EXPERIMENTS = sorted(p.stem for p in Path(CONFIGS, "experiment").glob("*.yaml"))


def config(*overrides: str):
  with initialize_config_dir(config_dir=CONFIGS, version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def problems(*overrides: str) -> str:
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  return str(info.value)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("optimizer", registry.names())
def test_shipped_configs_pass_without_warnings(experiment, optimizer, caplog):
  """Every pair passes, except where the optimizer refuses the experiment's settings
  (``optimizer=kfac`` with a T5 model): then the check fails with exactly those lines."""
  overrides = (f"experiment={experiment}", f"optimizer={optimizer}")
  refused = refused_settings(config(*overrides), optimizer)
  if refused:
    with pytest.raises(ConfigError) as info:
      check_config(config(*overrides), overrides=overrides)
    assert str(info.value).splitlines()[1:] == [f"  {line}" for line in refused]
    return
  with caplog.at_level(logging.WARNING):
    check_config(config(*overrides), overrides=overrides)
  assert not caplog.records


@pytest.mark.parametrize(
  "override, named",
  [
    ("tau=2.5", "tau=2.5 (float): must be an integer >= 1"),  # trained at rank 2 before
    ("tau=0", "tau=0: must be an integer >= 1"),
    ("batch_size=0", "batch_size=0: must be an integer >= 1"),  # ZeroDivisionError before
    ("eval_every=0", "eval_every=0: must be 'epoch' or an integer >= 1"),
    ("log_every=0", "log_every=0: must be an integer >= 1"),
    ("checkpoint_every=0", "checkpoint_every=0: must be an integer >= 1"),
    ("max_steps=0", "max_steps=0: must be an integer >= 1 or null"),  # trained the full run
    ("max_steps=-5", "max_steps=-5: must be an integer >= 1 or null"),  # exited 0 before
    ("epochs=0", "epochs=0: must be an integer >= 1"),
    ("eval_every=epoc", "eval_every='epoc': must be 'epoch' or an integer >= 1"),
    ("seed=-1", "seed=-1: must be an integer >= 0"),
    ("seed=1.5", "seed=1.5 (float): must be an integer >= 0"),
    ("seed=4294967296", "seed=4294967296: must be an integer >= 0 and < 4294967296"),
    ("fisher=sampeld", "fisher='sampeld': must be one of ['sampled', 'empirical']"),
    ("fisher_forward=train", "fisher_forward='train': must be one of ['eval', 'shared']"),
    (
      "fisher_backward=both",
      "fisher_backward='both': must be one of ['auto', 'batched', 'sequential', 'local']",
    ),
    ("precision=float16", "precision='float16': must be one of ['float32', 'bfloat16']"),
    (
      "schedule=cos",
      "schedule='cos': must be one of ['constant', 'warmup_constant', 'cosine', 'warmup_cosine']",
    ),
    ("block=layer", "block='layer': must be one of ['per_tensor', 'global']"),
    ("alpha=1.0", "alpha=1.0 (float): must be a number in (0, 1)"),
    ("alpha=0", "alpha=0: must be a number in (0, 1)"),
    ("gamma=0", "gamma=0: must be a finite number > 0"),
    ("gamma=-1e-5", "gamma=-1e-05 (float): must be a finite number > 0"),
    ("rho=0", "rho=0: must be a finite number > 0 or null"),
    ("lr=0", "lr=0: must be a finite number > 0"),
    ("lr=-0.1", "lr=-0.1 (float): must be a finite number > 0"),
    ("lr=inf", "lr=inf (float): must be a finite number > 0"),
    ("lr=abc", "lr='abc': must be a finite number > 0"),
    ("warmup_epochs=-1", "warmup_epochs=-1: must be a finite number >= 0"),
    ("weight_decay=-0.1", "weight_decay=-0.1 (float): must be a finite number >= 0"),
    ("grad_clip=0", "grad_clip=0: must be a finite number > 0 or null"),
    ("eval_batch_size=0", "eval_batch_size=0: must be an integer >= 1"),
    ("spectrum_every=-1", "spectrum_every=-1: must be an integer >= 0 or null"),
    ("resume=maybe", "resume='maybe': must be true or false"),
    ("optimizer.b1=1.0", "optimizer.b1=1.0 (float): must be a number in [0, 1)"),
    ("optimizer.state_dtype=int8", "optimizer.state_dtype='int8': must be one of"),
    ("data.holdout=-1", "data.holdout=-1: must be an integer >= 0"),
    ("data.source=tfsd", "data.source='tfsd': must be one of"),
    ("mesh.data=0", "mesh.data=0: must be -1 (all) or >= 1"),
    ("mesh.model=0", "mesh.model=0: must be an integer >= 1"),
    ("distributed=maybe", "distributed='maybe': must be one of ['auto', True, False]"),
    ("logger.mode=loud", "logger.mode='loud': must be one of"),
    ("data.path=3", "data.path=3: must be a file or folder path, or null."),
    ("passes=triton", "passes='triton': must be one of ['jnp', 'pallas', 'auto'] or null"),
  ],
)
def test_bad_value_is_named_with_what_is_allowed(override, named):
  assert named in problems(override)


def test_every_problem_is_listed_at_once():
  message = problems("tau=2.5", "batch_size=0", "eval_every=epoc", "seed=-1")
  assert message.startswith("4 bad config values:")
  for key in ("tau=", "batch_size=", "eval_every=", "seed="):
    assert key in message


@pytest.mark.parametrize(
  "overrides, named",
  [
    (
      ("optimizer=adam", "optimizer.b2=1.5"),
      "optimizer.b2=1.5 (float): must be a number in [0, 1)",
    ),
    (("optimizer=adam", "optimizer.eps=0"), "optimizer.eps=0: must be a finite number > 0"),
    (("optimizer=qng", "tau=-2"), "tau=-2: must be an integer >= 1"),
    (("experiment=demo_xsum", "data.source=tfsd"), "data.source='tfsd': must be one of"),
    (("experiment=demo_xsum", "data.max_source_len=0"), "data.max_source_len=0"),
    (("experiment=demo_xsum", "data.limit=0"), "data.limit=0: must be an integer >= 1 or null"),
    (("experiment=demo_xsum", "data.eval_split=train"), "data.eval_split='train': must be one of"),
    (("experiment=xsum_t5_lora", "model.lora.rank=0"), "model.lora.rank=0"),
    (("experiment=demo", "data=xsum"), "data.name='xsum': must be one of"),
    (("experiment=demo_xsum", "data=cifar100"), "data.name='cifar100': must be one of ['xsum']"),
  ],
)
def test_group_values_are_checked(overrides, named):
  assert named in problems(*overrides)


@pytest.mark.parametrize(
  "overrides, key",
  [
    (("optimizer=adam", "tau=4"), "tau=4 is ignored: optimizer=adam has no tau"),
    (("optimizer=momentum", "alpha=0.5"), "alpha=0.5 (float) is ignored: optimizer=momentum"),
    (("optimizer=momentum", "block=global"), "block='global' is ignored"),
    (("optimizer=qng", "gamma=1e-3"), "gamma=0.001 (float) is ignored: optimizer=qng has no gamma"),
    (("optimizer=adam", "rho=1"), "rho=1 is ignored: optimizer=adam"),
    (("optimizer=adam", "fisher=empirical"), "fisher='empirical' is ignored"),
    (("optimizer=adam", "fisher_backward=sequential"), "fisher_backward='sequential' is ignored"),
    (
      ("optimizer=ginger", "fisher_forward=eval", "fisher_backward=sequential"),
      "fisher_backward='sequential' is ignored: with fisher_forward=eval",
    ),
    (("schedule=constant", "warmup_epochs=3"), "warmup_epochs is ignored: schedule=constant"),
  ],
)
def test_a_setting_the_optimizer_ignores_is_a_warning(overrides, key, caplog):
  with caplog.at_level(logging.WARNING, logger="train"):
    check_config(config(*overrides), overrides=overrides)
  assert any(key in r.getMessage() for r in caplog.records), caplog.text


def test_used_settings_are_not_warned_about(caplog):
  overrides = ("optimizer=ginger", "tau=8", "alpha=0.9", "fisher=empirical", "rho=null")
  with caplog.at_level(logging.WARNING, logger="train"):
    check_config(config(*overrides), overrides=overrides)
  assert not caplog.records


def test_config_error_is_a_value_error():
  assert issubclass(ConfigError, ValueError)


def test_check_loads_and_compiles_nothing(monkeypatch):
  """The check comes before any data loading or compiling (it is what makes it fast)."""
  import jax

  from data import images, xsum

  def forbidden(*args, **kwargs):
    raise AssertionError("check_config compiled or loaded data")

  for module, name in ((jax, "jit"), (images, "load_image_dataset"), (xsum, "load_xsum")):
    monkeypatch.setattr(module, name, forbidden)
  with pytest.raises(ConfigError):
    check_config(config("tau=2.5"), overrides=[])


def test_allowed_values_agree_with_the_code_that_uses_them():
  """training/choices.py lists each choice key's values once for the framework; the library,
  the models and the data loaders keep their own (they import nothing of the framework)."""
  import ginger.fisher
  from data import images, xsum
  from ginger._src import common
  from models import tasks
  from training import choices, config_check, logs, optimizers, registry

  assert optimizers.SCHEDULES is config_check.SCHEDULES is choices.SCHEDULES
  assert choices.BLOCKS == common.BLOCKS and registry.BLOCKS is choices.BLOCKS
  assert choices.PASSES == common.PASSES and registry.PASSES is choices.PASSES
  assert set(ginger.fisher.BACKWARDS) < set(choices.FISHER_BACKWARDS)
  assert set(choices.BATCHNORMS) == set(tasks.BATCHNORMS)
  assert set(choices.FAMILIES) == set(tasks.TASKS)
  assert set(choices.PRECISIONS) == set(tasks.DTYPES)
  assert set(choices.IMAGE_DATASETS) == set(images.DATASETS)
  assert set(choices.IMAGE_SOURCES) == set(images.SOURCES)
  assert set(choices.XSUM_SOURCES) == set(xsum.SOURCES)
  assert logs.LOGGERS is choices.LOGGERS


def test_float64_state_is_refused_with_the_reason():
  """optimizer.state_dtype=float64 used to train with a float32 state (JAX truncates float64
  arrays to float32 outside its 64-bit mode, with a warning only; in that mode the training loop
  does not run): named before anything runs, with why."""
  for optimizer in ("ginger", "qng"):
    message = problems(f"optimizer={optimizer}", "optimizer.state_dtype=float64")
    assert "optimizer.state_dtype='float64': must be one of ['float32', 'bfloat16'" in message
    assert "64-bit mode" in message


def test_float16_state_is_refused_for_ginger_with_the_reason():
  """optimizer=ginger optimizer.state_dtype=float16 trained into NaN at once (the update is about
  g / gamma, beyond float16's range): refused with why; QNG (no gamma) keeps it."""
  message = problems("optimizer=ginger", "optimizer.state_dtype=float16")
  assert "optimizer.state_dtype='float16': must be float32 or bfloat16 for optimizer=ginger" in (
    message
  )
  check_config(config("optimizer=qng", "optimizer.state_dtype=float16"), overrides=())


def test_keys_added_with_plus_that_nothing_reads_are_refused():
  """``+tua=8`` composes silently in Hydra and trains without tau; refused, naming the nearest
  key. Config groups added with ``+`` (the sweeps) pass."""
  from pathlib import Path

  from hydra import compose, initialize_config_dir

  from training import config_check

  configs = Path(__file__).resolve().parents[1] / "configs"
  overrides = ["experiment=demo", "+tua=8", "+model.widht=2"]
  with initialize_config_dir(config_dir=str(configs), version_base=None):
    cfg = compose(config_name="config", overrides=overrides)
  with pytest.raises(config_check.ConfigError, match=r"2 unknown") as e:
    config_check.check_added_keys(overrides, cfg)
  assert "+tua=8: tua is not a config key" in str(e.value) and "did you mean tau?" in str(e.value)
  assert "model.widht is not a config key" in str(e.value)
  groups = ["+sweep=table1", "+sweep/exp=standin/cifar100_resnet18", "+sweep/arm=adam"]
  config_check.check_added_keys([*groups, "tau=8", "++lr=0.1"], cfg)
