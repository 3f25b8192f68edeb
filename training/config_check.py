"""Checks every value of train.py's resolved config before any data is loaded or compiled.

A bad value otherwise surfaces late (``log_every=0`` as a ``ZeroDivisionError`` after a minute
of compiling), silently (``tau=2.5`` trained at rank 2, ``max_steps=0`` trained the full run) or
without the key's name. :func:`check_config` collects every problem of a config into one
:class:`ConfigError` whose lines each name the key, the bad value and what is allowed, and logs a
warning for each setting that the chosen optimizer ignores (``optimizer=adam tau=4``).

The values each choice key accepts are training/choices.py's; the optimizers, the keys each
reads and their checks are training/registry.py's. It reads only the config: no JAX, no devices,
no files, so it answers in milliseconds.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from training import registry
from training.choices import (
  BATCHNORMS,
  DISTRIBUTED,
  FAMILIES,
  FISHER_BACKWARDS,
  FISHER_FORWARDS,
  FISHERS,
  IMAGE_DATASETS,
  IMAGE_SOURCES,
  LOGGERS,
  PRECISIONS,
  SCHEDULES,
  WANDB_MODES,
  WARMUP_SCHEDULES,
  WEIGHT_DECAY_MODES,
  XSUM_EVAL_SPLITS,
  XSUM_SOURCES,
)

log = logging.getLogger("train")

SEED_LIMIT = 2**32  # jax.random.key keeps only the low 32 bits of larger seeds


class ConfigError(ValueError):
  """A config value train.py cannot run with; the message names each key, value and what is
  allowed."""


_MISSING = object()

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def check_added_keys(overrides: Sequence[str], cfg: Mapping, config_dir: Path = CONFIG_DIR):
  """Refuses ``+key=value`` overrides that add a key no code reads (a typo, say ``+tua=8``):
  Hydra composes them silently. ``+group=option`` (a config group, e.g. ``+sweep=table1``)
  passes; an existing key cannot be added (Hydra refuses), so every other ``+`` key is new.
  The message names the keys nearest to it."""
  bad = []
  for override in overrides:
    if not override.startswith("+") or override.startswith("++") or "=" not in override:
      continue
    key = override[1:].split("=", 1)[0]
    if (config_dir / key.split("@")[0]).is_dir():
      continue  # a config group
    *parents, name = key.split(".")
    node: Any = cfg
    for part in parents:
      node = node.get(part, {}) if isinstance(node, Mapping) else {}
    known = [k for k in (node.keys() if isinstance(node, Mapping) else []) if k != name]
    near = difflib.get_close_matches(name, known, n=3)
    hint = (
      f"did you mean {', '.join('.'.join([*parents, k]) for k in near)}?"
      if near
      else (f"the keys there: {', '.join(sorted(map(str, known)))}")
    )
    bad.append(f"  {override}: {key} is not a config key, so nothing would read it; {hint}")
  if bad:
    raise ConfigError(f"{len(bad)} unknown config key(s) added with +:\n" + "\n".join(bad))


def top_level_keys(config_dir: Path = CONFIG_DIR) -> set[str]:
  """What a command-line ``key=value`` may start with: the keys of ``config.yaml`` and of every
  config in the global package (experiments, sweeps: ``+sweep=table1 scale=smoke``), the
  config groups, and ``hydra``."""
  keys = {"hydra"} | {p.name for p in config_dir.iterdir() if p.is_dir()}
  for path in sorted(config_dir.rglob("*.yaml")):
    if path == config_dir / "config.yaml" or "@package _global_" in path.read_text():
      keys |= {str(k) for k in (OmegaConf.load(path) or {}).keys() if k != "defaults"}
  return keys


def check_command_line_keys(arguments: Sequence[str], config_dir: Path = CONFIG_DIR) -> None:
  """Refuses a ``key=value`` argument whose first key the config does not have (a typo,
  ``optimzer=adam``) with the nearest keys; Hydra's own message would advise adding the key
  with ``+``, where nothing would read it. Options (``-m``), ``+``/``~`` overrides and Hydra's
  own keys pass; composing the config answers for everything below the top level."""
  known = top_level_keys(config_dir)
  bad = []
  for argument in arguments:
    if argument.startswith(("-", "+", "~")) or "=" not in argument:
      continue
    key = argument.split("=", 1)[0]
    top = key.split("@", 1)[0].split("/", 1)[0].split(".", 1)[0]
    if top in known:
      continue
    near = difflib.get_close_matches(top, sorted(known), n=3)
    hint = f"did you mean {' or '.join(near)}?" if near else "train.py --help lists the keys."
    bad.append(f"{argument}: {top} is not a config key; {hint}")
  if bad:
    raise ConfigError("; ".join(bad))


def _show(value: Any) -> str:
  if isinstance(value, str):
    return repr(value)
  if value is None:
    return "null"
  return f"{value!r} ({type(value).__name__})" if isinstance(value, float) else repr(value)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Checker:
  """Collects the problems of one config; each check reads one key (dotted path)."""

  def __init__(self, cfg: DictConfig):
    self.cfg = cfg
    self.problems: list[str] = []

  def get(self, key: str) -> Any:
    value = OmegaConf.select(self.cfg, key, default=_MISSING, throw_on_resolution_failure=False)
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
      return OmegaConf.to_container(value, resolve=True)
    return value

  def bad(self, key: str, value: Any, allowed: str) -> None:
    self.problems.append(f"{key}={_show(value)}: must be {allowed}.")

  def check(self, key: str, ok: Callable[[Any], bool], allowed: str, *, optional=False) -> Any:
    value = self.get(key)
    if value is _MISSING:
      self.problems.append(f"{key} is missing: must be {allowed}.")
      return None
    if optional and value is None:
      return None
    if not ok(value):
      self.bad(key, value, allowed + (" or null" if optional else ""))
      return None
    return value

  def integer(self, key: str, minimum: int, *, optional=False, maximum: int | None = None):
    allowed = f"an integer >= {minimum}" + ("" if maximum is None else f" and < {maximum}")
    return self.check(
      key,
      lambda v: _is_int(v) and v >= minimum and (maximum is None or v < maximum),
      allowed,
      optional=optional,
    )

  def number(
    self, key: str, low: float, high: float | None = None, *, closed=(True, True), optional=False
  ):
    lo_ok = (lambda v: v >= low) if closed[0] else (lambda v: v > low)
    hi_ok = (lambda v: True) if high is None else (lambda v: v <= high if closed[1] else v < high)
    if high is None:
      allowed = f"a finite number {'>=' if closed[0] else '>'} {low}"
    else:
      allowed = f"a number in {'[' if closed[0] else '('}{low}, {high}{']' if closed[1] else ')'}"
    return self.check(
      key, lambda v: _is_number(v) and lo_ok(v) and hi_ok(v), allowed, optional=optional
    )

  def choice(self, key: str, choices: Sequence[Any], *, optional=False) -> Any:
    # `True in (1,)` is true in Python: compare types too, so 1 is not taken for true.
    def ok(v):
      return any(v == c and type(v) is type(c) for c in choices)

    return self.check(key, ok, f"one of {list(choices)}", optional=optional)

  def boolean(self, key: str) -> Any:
    return self.check(key, lambda v: isinstance(v, bool), "true or false")

  def text(self, key: str, *, optional=False) -> Any:
    return self.check(
      key, lambda v: isinstance(v, str) and v != "", "a non-empty string", optional=optional
    )


def override_keys(overrides: Iterable[str]) -> set[str]:
  """The keys a list of Hydra overrides sets (``+a.b=1`` -> ``a.b``; groups included)."""
  keys = set()
  for item in overrides:
    key = item.split("=", 1)[0].lstrip("+~")
    keys.add(key.split("@", 1)[0])
  return keys


def _hydra_overrides() -> list[str]:
  """The command line's overrides of the running Hydra job, or [] outside one."""
  try:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
      return list(HydraConfig.get().overrides.task)
  except Exception:  # noqa: BLE001 - no Hydra job (compose API, tests): nothing was overridden
    pass
  return []


def check_config(cfg: DictConfig, overrides: Iterable[str] | None = None) -> None:
  """Validates every value train.py reads; raises :class:`ConfigError` listing all problems.

  Args:
    cfg: the composed config of train.py (``configs/config.yaml`` with its groups).
    overrides: the command line's overrides (``["optimizer=adam", "fisher=empirical"]``), used
      only to warn about keys the optimizer ignores whose defaults are always present; by
      default those of the running Hydra job.

  Logs a warning (logger ``train``) for each setting the chosen optimizer ignores.
  """
  c = _Checker(cfg)
  _check_run(c)
  optimizer = _check_optimizer(c)
  _check_model_and_data(c)
  _check_devices_and_logger(c)
  if c.problems:
    lines = "\n  ".join(c.problems)
    s = "s" if len(c.problems) > 1 else ""
    raise ConfigError(f"{len(c.problems)} bad config value{s}:\n  {lines}")
  if optimizer is not None:
    given = override_keys(_hydra_overrides() if overrides is None else overrides)
    for message in ignored_settings(cfg, optimizer, given):
      log.warning("%s", message)


class _Recorder(_Checker):
  """A checker that also notes what it allows for each key it checks (:func:`allowed_values`)."""

  def __init__(self, cfg: DictConfig):
    super().__init__(cfg)
    self.allowed: dict[str, str | tuple] = {}
    self._choosing = False

  def choice(self, key: str, choices: Sequence[Any], *, optional=False) -> Any:
    self.allowed[key] = (*choices, None) if optional else tuple(choices)
    self._choosing = True
    try:
      return super().choice(key, choices, optional=optional)
    finally:
      self._choosing = False

  def check(self, key: str, ok: Callable[[Any], bool], allowed: str, *, optional=False) -> Any:
    if not self._choosing:
      self.allowed[key] = allowed + (" or null" if optional else "")
    return super().check(key, ok, allowed, optional=optional)


def allowed_values(cfg: DictConfig) -> dict[str, str | tuple]:
  """What :func:`check_config` accepts for each key it checks in ``cfg``, by dotted key.

  A tuple lists the allowed values (``None``: null); a string describes them ("an integer >=
  1"). The checks depend on the config (``optimizer=adam`` checks ``optimizer.b2``, ResNet and
  T5 models check different ``data.*`` keys), so a key appears only for configs that check it.
  training/config_doc.py builds the "allowed" column of docs/configuration.md from this.
  """
  c = _Recorder(cfg)
  _check_run(c)
  _check_optimizer(c)
  _check_model_and_data(c)
  _check_devices_and_logger(c)
  return c.allowed


def _check_run(c: _Checker) -> None:
  c.text("name")
  c.integer("seed", 0, maximum=SEED_LIMIT)
  c.integer("epochs", 1)
  c.integer("max_steps", 1, optional=True)
  c.integer("batch_size", 1)
  c.check(
    "eval_every",
    lambda v: v == "epoch" or (_is_int(v) and v >= 1),
    "'epoch' or an integer >= 1 (steps)",
  )
  c.integer("eval_batch_size", 1)
  if c.get("eval_examples") is not _MISSING:  # absent from the configs of older runs: null
    c.integer("eval_examples", 1, optional=True)
  c.integer("log_every", 1)
  c.integer("checkpoint_every", 1)
  c.boolean("resume")
  c.choice("precision", PRECISIONS)
  c.choice("schedule", SCHEDULES)
  c.number("warmup_epochs", 0)
  c.number("weight_decay", 0)
  if c.get("weight_decay_mode") is not _MISSING:  # absent from the configs of older runs: l2
    c.choice("weight_decay_mode", WEIGHT_DECAY_MODES)
  c.number("grad_clip", 0, closed=(False, True), optional=True)
  c.choice("fisher", FISHERS)
  c.choice("fisher_forward", FISHER_FORWARDS)
  if c.get("fisher_backward") not in (_MISSING, None):
    c.choice("fisher_backward", FISHER_BACKWARDS)
  _check_fisher_batch(c)
  c.integer("spectrum_every", 0, optional=True)
  c.integer("profile_steps", 0, optional=True)
  c.integer("profile_start", 0, optional=True)
  c.text("sweep", optional=True)
  c.number("lr", 0, closed=(False, True))


def _check_fisher_batch(c: _Checker) -> None:
  """``fisher_batch``: null, or the d-pass's examples, at most the batch, for an optimizer with a
  d-pass (an error, not a warning, for the others: the value asks for a cheaper d-pass that a run
  without one would silently not have)."""
  value = c.check(
    "fisher_batch", lambda v: _is_int(v) and v >= 1, "an integer in [1, batch_size]", optional=True
  )
  if value is None:
    return
  batch = c.get("batch_size")
  if _is_int(batch) and value > batch:
    c.bad(
      "fisher_batch",
      value,
      f"at most batch_size={batch} (the d-pass runs on the batch's first fisher_batch examples) "
      "or null",
    )
  name = c.get("optimizer.name")
  if (
    isinstance(name, str) and registry.find(name) is not None and not registry.keeps_curvature(name)
  ):
    curvature = [n for n in registry.names() if registry.keeps_curvature(n)]
    c.bad(
      "fisher_batch",
      value,
      f"null for optimizer={name}, which has no d-pass (only {', '.join(curvature)} have one)",
    )


def _check_optimizer(c: _Checker) -> str | None:
  name = c.choice("optimizer.name", registry.names())
  if name is None:
    return None
  optimizer = registry.get(name)
  for key, check in optimizer.keys.items():
    check(c, key, optimizer)
  if optimizer.refuses is not None:
    optimizer.refuses(c, optimizer)
  return name


def _check_model_and_data(c: _Checker) -> None:
  family = c.choice("model.family", FAMILIES)
  c.text("model.name")
  if family == "resnet":
    c.choice("data.name", IMAGE_DATASETS)
    c.choice("data.source", IMAGE_SOURCES)
    c.integer("data.holdout", 0)
    c.boolean("data.augment")
  elif family == "t5":
    c.choice("data.name", ("xsum",))
    c.choice("data.source", XSUM_SOURCES)
    c.text("data.tokenizer")
    c.check("data.prefix", lambda v: isinstance(v, str), "a string")
    c.integer("data.max_source_len", 2)
    c.integer("data.max_target_len", 2)
    c.choice("data.eval_split", XSUM_EVAL_SPLITS, optional=True)
    c.integer("data.limit", 1, optional=True)
    c.integer("data.rouge_examples", 0, optional=True)
    c.integer("data.max_new_tokens", 1)
    c.text("model.pretrained", optional=True)
    c.number("model.dropout_rate", 0, 1, closed=(True, False))
    if c.get("model.lora") is not None:
      c.integer("model.lora.rank", 1)
      c.number("model.lora.alpha", 0, closed=(False, True))
      c.text("model.lora.targets")
      c.boolean("model.lora.train_1d")
  _check_batchnorm(c, family)
  if c.get("data.path") is not _MISSING:
    c.check(
      "data.path", lambda v: v is None or isinstance(v, str), "a file or folder path, or null"
    )


def _check_batchnorm(c: _Checker, family: str | None) -> None:
  value = c.choice("batchnorm", BATCHNORMS, optional=True)  # null: sync
  if value != "per_device":
    return
  if family == "t5":
    c.bad(
      "batchnorm",
      value,
      "'sync' for model.family='t5' (T5 has no BatchNorm; per_device only changes the "
      "BatchNorm statistics of the ResNet models)",
    )
  data = c.get("mesh.data")
  if data is _MISSING or data is None or (isinstance(data, int) and data < 1):
    # The groups are part of the run (its fingerprint): "all devices" would make them depend
    # on the machine a run starts or resumes on.
    c.bad(
      "mesh.data",
      -1 if data is _MISSING else data,
      "an explicit number of devices (>= 1) with batchnorm=per_device: its statistics groups "
      "are that many, and part of the run's identity",
    )


def _check_devices_and_logger(c: _Checker) -> None:
  if c.get("mesh") not in (_MISSING, None):
    c.check("mesh.data", lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 (all) or >= 1")
    c.integer("mesh.model", 1)
    c.boolean("mesh.shard_optimizer_state")
    c.integer("mesh.min_shard_size", 0)
  if c.get("distributed") is not _MISSING:
    c.choice("distributed", DISTRIBUTED)
  c.text("compilation_cache_dir", optional=True)
  if c.get("deterministic") is not _MISSING:
    c.boolean("deterministic")
  logger = c.choice("logger.name", LOGGERS)
  if logger == "wandb":
    c.choice("logger.mode", WANDB_MODES)
    c.text("logger.project")


def ignored_settings(cfg: DictConfig, optimizer: str, given: set[str]) -> list[str]:
  """One message per setting that ``optimizer`` ignores but the config sets."""
  out = []
  reads = registry.get(optimizer).keys
  for key in registry.PAPER_KEYS:
    value = OmegaConf.select(cfg, key, default=None)
    if key not in reads and value is not None:
      out.append(
        f"{key}={_show(value)} is ignored: optimizer={optimizer} has no {key} "
        f"(only {', '.join(o for o in registry.names() if registry.reads(o, key))} use it)."
      )
  every = OmegaConf.select(cfg, "curvature_every", default=None)
  if "curvature_every" not in reads and every is not None:
    out.append(
      f"curvature_every={_show(every)} is ignored: optimizer={optimizer} has no curvature to "
      f"update (only {', '.join(_names(lambda o: o.curvature_every))} use it)."
    )
  curvature = registry.keeps_curvature(optimizer)
  if not curvature:
    # These keys have defaults in configs/config.yaml: warned about only where the command
    # line set them.
    for key in registry.FISHER_KEYS:
      if key in given:
        out.append(
          f"{key}={_show(OmegaConf.select(cfg, key))} is ignored: optimizer={optimizer} "
          f"uses no Fisher vector (only {', '.join(_names(lambda o: o.curvature))} do)."
        )
  if (
    curvature
    and "fisher_backward" in given
    and OmegaConf.select(cfg, "fisher_forward", default=None) == "eval"
  ):
    out.append(
      f"fisher_backward={_show(OmegaConf.select(cfg, 'fisher_backward'))} is ignored: with "
      "fisher_forward=eval the d-pass has a forward and a backward of its own (only "
      "fisher_forward=shared pulls both cotangents back through one forward)."
    )
  sub_batch = OmegaConf.select(cfg, "fisher_batch", default=None)
  if (
    curvature
    and "fisher_backward" in given
    and OmegaConf.select(cfg, "fisher_forward", default=None) == "shared"
    and sub_batch is not None
    and sub_batch < OmegaConf.select(cfg, "batch_size", default=0)
  ):
    out.append(
      f"fisher_backward={_show(OmegaConf.select(cfg, 'fisher_backward'))} is ignored: with "
      f"fisher_batch={sub_batch} the d-pass has a forward and a backward of its own on the "
      "batch's first fisher_batch examples."
    )
  schedule = OmegaConf.select(cfg, "schedule", default=None)
  if "warmup_epochs" in given and schedule not in WARMUP_SCHEDULES:
    out.append(
      f"warmup_epochs is ignored: schedule={schedule} has no warm-up "
      f"(only schedule={' or '.join(WARMUP_SCHEDULES)} uses it)."
    )
  if "weight_decay_mode" in given and not OmegaConf.select(cfg, "weight_decay", default=0):
    out.append("weight_decay_mode is ignored: weight_decay=0 (no decay).")
  return out


def refused_settings(cfg: DictConfig, optimizer: str) -> list[str]:
  """The lines :func:`check_config` refuses ``cfg`` with because ``optimizer`` cannot run
  its settings (its registry entry's ``refuses``: ``optimizer=kfac`` with a T5 model); []
  where it can."""
  refuses = registry.get(optimizer).refuses
  if refuses is None:
    return []
  c = _Checker(cfg)
  refuses(c, registry.get(optimizer))
  return c.problems


def _names(has: Callable[[registry.Optimizer], bool]) -> list[str]:
  """The registered optimizers for which ``has`` is true."""
  return [n for n in registry.names() if has(registry.get(n))]


__all__ = [
  "ConfigError",
  "allowed_values",
  "check_command_line_keys",
  "check_config",
  "ignored_settings",
  "override_keys",
  "refused_settings",
]
