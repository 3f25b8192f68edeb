"""A run's configuration, checked and typed: what the code after the config check reads.

train.py composes a Hydra ``DictConfig``; :func:`parse` checks it once
(:func:`training.config_check.check_config`, which names each bad key, its value and what is
allowed) and turns it into a :class:`RunConfig`, frozen dataclasses whose fields are the keys
the framework reads, with their types and the defaults a null stands for already applied
(``fisher_backward: null`` is ``"auto"``, ``spectrum_every: null`` is 0). Building the run
(training/run_setup.py), its steps, its programs and its loop read that, never the raw
mapping.

The raw resolved config stays what a run records: ``run.json``, ``summary.json``'s
``"config"`` and ``"run"``, wandb's config and the kept programs' keys are made from
``OmegaConf.to_container(cfg, resolve=True)``, which the loop hands by name (``resolved``) to
``run_record.claim``, ``logs.MetricsLog``, ``summary.startup_record`` and
``compilation.programs``. A :class:`RunConfig` is never written.

It reads only the config: no JAX, like the check.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from training.config_check import check_config
from training.registry import OptimizerConfig, optimizer_config

__all__ = [
  "DataConfig",
  "LoggerConfig",
  "LoraConfig",
  "MeshConfig",
  "ModelConfig",
  "OptimizerConfig",
  "RunConfig",
  "parse",
]


def _frozen(mapping: Mapping | None) -> Mapping[str, Any]:
  """A read-only copy of ``mapping`` (a frozen dataclass's free-form part)."""
  return types.MappingProxyType(dict(mapping or {}))


def _optional(hint: Any) -> bool:
  """Whether the annotation ``hint`` takes None (``int | None``)."""
  return type(None) in typing.get_args(hint)


def _typed(hint: Any, value: Any) -> Any:
  """``value`` (not None) as the field annotated ``hint`` holds it: a number or a flag
  converted (``seed``: int, ``lr``: float), a dataclass built from its mapping
  (:func:`_build`), a mapping made read-only; a value of one of several types (``eval_every``:
  int | str) and a string as given."""
  kinds = [k for k in typing.get_args(hint) if k is not type(None)] if _optional(hint) else [hint]
  if len(kinds) != 1:
    return value
  (kind,) = kinds
  if dataclasses.is_dataclass(kind):
    return _build(kind, value)
  if typing.get_origin(kind) is Mapping:
    return _frozen(value)
  return kind(value) if kind in (int, float, bool) else value


def _build(cls, mapping: Mapping | None, **given: Any):
  """The dataclass ``cls`` from the entries of ``mapping`` that name its fields (a key no code
  reads, which the check lets through, stays out), typed by the fields' annotations
  (:func:`_typed`); ``given``: fields built elsewhere. A null or absent key takes the field's
  default, the value a null stands for (``fisher_backward``: "auto"), or None where the field
  allows it."""
  hints = typing.get_type_hints(cls)
  values = dict(given)
  for field in dataclasses.fields(cls):
    if field.name in given:
      continue
    value = (mapping or {}).get(field.name)
    if value is not None:
      values[field.name] = _typed(hints[field.name], value)
    elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
      if not _optional(hints[field.name]):
        raise KeyError(field.name)  # the check lets no config through without it
      values[field.name] = None
  return cls(**values)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """``mesh``: the ``(data, model)`` device mesh (training/sharding.py)."""

  data: int = -1  # devices on the data axis; -1: all that ``model`` leaves
  model: int = 1  # an axis only the optimizer state is split over
  shard_optimizer_state: bool = True  # split the optimizer state's big arrays over the mesh
  # State arrays with fewer elements stay replicated; None: ginger.sharding.MIN_SIZE.
  min_shard_size: int | None = None


@dataclasses.dataclass(frozen=True)
class LoggerConfig:
  """``logger``: the metrics logger beside the run dir's metrics.jsonl (training/logs.py)."""

  name: str  # wandb | none
  mode: str | None = None  # wandb's mode
  project: str | None = None  # wandb's project


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """``model.lora``: LoRA adapters on T5's 2-D weights (models/lora.py)."""

  rank: int
  alpha: float  # the adapters are scaled by alpha / rank
  targets: str  # a regex of the adapted weights' paths
  train_1d: bool  # also train every 1-D weight directly


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """``model``: the family (which ``Task`` of models/tasks.py) and its model's keys.

  A ResNet reads ``name`` only; a T5 the others too."""

  family: str  # resnet | t5
  name: str  # the ResNet's architecture; T5's label for the run
  pretrained: str | None = None  # T5 weights (a Hugging Face name or a folder); None: random
  dropout_rate: float | None = None
  size: Mapping[str, int] = dataclasses.field(default_factory=lambda: _frozen({}))  # T5Config's
  lora: LoraConfig | None = None  # None: full fine-tuning


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """``data``: the dataset and how it is read. The image datasets read ``holdout`` and
  ``augment``; XSUM reads the others (None where the family has no such key)."""

  name: str
  source: str  # hf | tfds | local | demo
  path: str | None = None  # for source=local
  # Images.
  holdout: int | None = None  # > 0: validate on this many held-out training images
  augment: bool | None = None  # random crops and flips of the training images
  # XSUM.
  tokenizer: str | None = None
  prefix: str | None = None  # text put before every document
  max_source_len: int | None = None
  max_target_len: int | None = None
  eval_split: str | None = None  # None: validation
  limit: int | None = None  # the first N examples of each split; None: all
  rouge_examples: int | None = None  # validation documents summarised at each evaluation
  max_new_tokens: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """A run's checked configuration (:func:`parse`), by the names of configs/config.yaml.

  ``optimizer`` holds the optimizer's part, as its registry entry reads it: the paper's
  ``tau``, ``alpha``, ``gamma``, ``rho``, ``block``, and ``curvature_every``, ``passes``,
  ``state_dtype``, ``b1``... (:class:`training.registry.OptimizerConfig`); ``lr``, the schedule
  and the d-pass's keys are the run's. A field's default is the value a null (or a key older
  configs lack) stands for.
  """

  name: str
  seed: int
  epochs: int
  max_steps: int | None  # overrides epochs where set
  batch_size: int  # over all devices
  eval_every: int | str  # steps, or "epoch"
  eval_batch_size: int
  eval_examples: int | None  # the first N examples of the evaluation split; None: all
  log_every: int
  checkpoint_every: int
  resume: bool
  precision: str  # the compute dtype: float32 | bfloat16
  lr: float  # the schedule's peak
  schedule: str  # constant | warmup_constant | cosine | warmup_cosine
  warmup_epochs: float
  weight_decay: float  # 0: none
  weight_decay_mode: str = "l2"  # l2: added to the gradient before the optimizer | decoupled
  grad_clip: float | None  # the loss gradient's global-norm clip; None: none
  fisher: str  # the d-pass's labels: sampled | empirical
  fisher_forward: str  # eval | shared
  fisher_backward: str = "auto"  # auto | batched | sequential | local (with fisher_forward=shared)
  fisher_batch: int | None  # the d-pass's examples, the batch's first; None: the whole batch
  spectrum_every: int = 0  # steps between logged spectra; 0: never
  profile_steps: int = 0  # steps traced by jax.profiler; 0: none
  profile_start: int = 0
  batchnorm: str = "sync"  # sync | per_device
  distributed: str | bool = "auto"  # auto | true | false
  compilation_cache_dir: str | None
  deterministic: bool = False  # XLA's run-to-run reproducible GPU mode (training/backend.py)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  logger: LoggerConfig
  optimizer: OptimizerConfig
  model: ModelConfig
  data: DataConfig
  sweep: str | None = None  # the table a run of sweeps/ belongs to

  @classmethod
  def from_resolved(cls, config: Mapping) -> RunConfig:
    """The typed config of a resolved config (plain containers) that passed the check: each
    field from the key of its name (:func:`_build`), the optimizer's from the keys its
    registry entry reads (:func:`training.registry.optimizer_config`)."""
    return _build(cls, config, optimizer=optimizer_config(config))


def parse(cfg: DictConfig, overrides: Iterable[str] | None = None) -> RunConfig:
  """Checks ``cfg`` (:func:`training.config_check.check_config`: a ``ConfigError`` naming every
  bad key, its value and what is allowed; warnings for the settings the optimizer ignores) and
  returns it typed. ``overrides``: as for ``check_config``."""
  check_config(cfg, overrides)
  return RunConfig.from_resolved(OmegaConf.to_container(cfg, resolve=True))
