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


def _fields(cls, mapping: Mapping | None) -> dict[str, Any]:
  """The entries of ``mapping`` that name a field of the dataclass ``cls`` (a key no code
  reads, which the check lets through, stays out)."""
  names = {f.name for f in dataclasses.fields(cls)}
  return {k: v for k, v in (mapping or {}).items() if k in names}


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


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A run's checked configuration (:func:`parse`), by the names of configs/config.yaml.

  ``optimizer`` holds the optimizer's part, as its registry entry reads it: the paper's
  ``tau``, ``alpha``, ``gamma``, ``rho``, ``block``, and ``curvature_every``, ``passes``,
  ``state_dtype``, ``b1``... (:class:`training.registry.OptimizerConfig`); ``lr``, the schedule
  and the d-pass's keys are the run's.
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
  schedule: str  # constant | warmup_constant | cosine
  warmup_epochs: float
  weight_decay: float  # decoupled, chained before the optimizer; 0: none
  grad_clip: float | None  # the loss gradient's global-norm clip; None: none
  fisher: str  # the d-pass's labels: sampled | empirical
  fisher_forward: str  # eval | shared
  fisher_backward: str  # auto | batched | sequential | local (with fisher_forward=shared)
  fisher_batch: int | None  # the d-pass's examples, the batch's first; None: the whole batch
  spectrum_every: int  # steps between logged spectra; 0: never
  profile_steps: int  # steps traced by jax.profiler; 0: none
  profile_start: int
  batchnorm: str  # sync | per_device
  distributed: str | bool  # auto | true | false
  compilation_cache_dir: str | None
  deterministic: bool  # XLA's run-to-run reproducible GPU mode (training/backend.py)
  mesh: MeshConfig
  logger: LoggerConfig
  optimizer: OptimizerConfig
  model: ModelConfig
  data: DataConfig
  sweep: str | None = None  # the table a run of sweeps/ belongs to

  @classmethod
  def from_resolved(cls, config: Mapping) -> RunConfig:
    """The typed config of a resolved config (plain containers) that passed the check."""
    c = dict(config)
    model = c["model"]
    return cls(
      name=c["name"],
      seed=int(c["seed"]),
      epochs=int(c["epochs"]),
      max_steps=c["max_steps"],
      batch_size=int(c["batch_size"]),
      eval_every=c["eval_every"],
      eval_batch_size=int(c["eval_batch_size"]),
      eval_examples=c.get("eval_examples"),
      log_every=int(c["log_every"]),
      checkpoint_every=int(c["checkpoint_every"]),
      resume=bool(c["resume"]),
      precision=c["precision"],
      lr=float(c["lr"]),
      schedule=c["schedule"],
      warmup_epochs=float(c["warmup_epochs"]),
      weight_decay=float(c["weight_decay"]),
      grad_clip=None if c["grad_clip"] is None else float(c["grad_clip"]),
      fisher=c["fisher"],
      fisher_forward=c["fisher_forward"],
      fisher_backward=c.get("fisher_backward") or "auto",
      fisher_batch=c.get("fisher_batch"),
      spectrum_every=int(c.get("spectrum_every") or 0),
      profile_steps=int(c.get("profile_steps") or 0),
      profile_start=int(c.get("profile_start") or 0),
      batchnorm=c.get("batchnorm") or "sync",
      distributed=c.get("distributed", "auto"),
      compilation_cache_dir=c.get("compilation_cache_dir"),
      deterministic=bool(c.get("deterministic", False)),
      mesh=MeshConfig(**_fields(MeshConfig, c.get("mesh"))),
      logger=LoggerConfig(**_fields(LoggerConfig, c["logger"])),
      optimizer=optimizer_config(c),
      model=ModelConfig(
        **_fields(ModelConfig, model)
        | {"size": _frozen(model.get("size")), "lora": _lora(model.get("lora"))}
      ),
      data=DataConfig(**_fields(DataConfig, c["data"])),
      sweep=c.get("sweep"),
    )


def _lora(lora: Mapping | None) -> LoraConfig | None:
  if not lora:
    return None
  return LoraConfig(int(lora["rank"]), float(lora["alpha"]), lora["targets"], lora["train_1d"])


def parse(cfg: DictConfig, overrides: Iterable[str] | None = None) -> RunConfig:
  """Checks ``cfg`` (:func:`training.config_check.check_config`: a ``ConfigError`` naming every
  bad key, its value and what is allowed; warnings for the settings the optimizer ignores) and
  returns it typed. ``overrides``: as for ``check_config``."""
  check_config(cfg, overrides)
  return RunConfig.from_resolved(OmegaConf.to_container(cfg, resolve=True))
