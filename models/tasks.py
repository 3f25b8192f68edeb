"""Tasks: what the training loop needs from a model family, without knowing the model.

A task owns the NNX model, the dataset arrays it trains on and everything that differs
between image classification and seq2seq: loading its data from the config, the example order
of an epoch, how a batch is formed (inside the jitted step), the forward pass, evaluation
(additive statistics per batch, and generation where the task has it), which evaluation is the
best and what the summary reports about it, and the forward FLOP count. The steps
(training/steps.py) only ever see ``(logits, labels, mask)``, which is all that the loss and the
sampled-Fisher vector need, and never asks which kind of task it runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.flops import FLOPS_PER_MAC

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(precision: str):
  if precision not in DTYPES:
    raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}.")
  return DTYPES[precision]


# The one-off initialisation program runs on the host's CPU whatever the accelerator: XLA:GPU
# compiling a model's many small random fills took most of a run's build for a program that
# then runs once, and XLA:CPU without LLVM's expensive passes compiles it several times faster
# and runs it no slower to notice (docs/benchmarks.md, "Design decisions"); the run then
# places the parameters. One draw on every backend: threefry's bits are exact, the normal
# sampler's rounding is the CPU's.
_CPU_INIT_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def host_cpu():
  """This process's first CPU device, or None where JAX runs without its CPU backend
  (``JAX_PLATFORMS=cuda``): where a run's initial values are made before they are placed
  (``with jax.default_device(host_cpu())``; None there means the default device). Local: in a
  multi-process CPU run ``jax.devices("cpu")[0]`` is process 0's, which another process cannot
  read."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def init_model(build: Callable[[jax.Array], nnx.Module], seed: int) -> nnx.Module:
  """``build(key)`` as one compiled program (op by op, a ResNet's initialisation dispatches
  hundreds of small programs), ``key = jax.random.key(seed)``, on the host's CPU
  (``_CPU_INIT_OPTIONS``): the arrays stay there (uncommitted) until the run places them where
  its plan says (``training.sharding.put``). The key is an argument, not a
  constant of the program: every seed runs the one compiled initialisation, which the
  persistent compilation cache then serves to a sweep's other seeds."""
  graphdef = []

  def init(key):
    model_graphdef, state = nnx.split(build(key))
    graphdef.append(model_graphdef)  # static structure, recorded while tracing
    return state

  cpu = host_cpu()
  with jax.default_device(cpu):  # None: the default device
    key = jax.random.key(seed)
    lowered = jax.jit(init).lower(key)
    state = lowered.compile(compiler_options=_CPU_INIT_OPTIONS if cpu else None)(key)
  return nnx.merge(graphdef[0], state)


def build_task(cfg) -> Task:
  """The task of ``cfg.model.family``, with its data loaded. ``cfg``: the run's checked config
  (``training.run_config.RunConfig``), as in every ``from_config``."""
  family = cfg.model.family
  if family not in TASKS:
    raise ValueError(f"model.family must be one of {sorted(TASKS)}, got {family!r}.")
  return TASKS[family].from_config(cfg)


def abstract_trainable(cfg) -> Any | None:
  """The trained parameters of ``cfg``'s model as ``jax.ShapeDtypeStruct`` s, from its
  construction under ``jax.eval_shape`` (no data read, nothing allocated, nothing compiled);
  None where they depend on the data: T5's on the tokenizer's vocabulary or pretrained weights.
  ``cfg``: the run's checked config, as :func:`build_task` takes it. A ResNet's classes are
  its dataset's usual count (an image folder of another count changes only the last layer)."""
  if cfg.model.family != "resnet":
    return None
  from data.images import IMAGE_CHANNELS, NUM_CLASSES
  from models.resnet import build_resnet

  def params():
    model = build_resnet(
      cfg.model.name,
      NUM_CLASSES[cfg.data.name],
      rngs=nnx.Rngs(0),
      dtype=compute_dtype(cfg.precision),
      in_channels=IMAGE_CHANNELS[cfg.data.name],
      batchnorm_groups=resolve_batchnorm_groups(cfg),
    )
    return nnx.state(model, nnx.Param)

  return jax.eval_shape(params)


BATCHNORMS = ("sync", "per_device")


def resolve_batchnorm_groups(cfg) -> int:
  """The groups of the ResNet's BatchNorm statistics for ``cfg.batchnorm``: 1 for "sync" (or
  null), the size of the mesh's data axis for "per_device"
  (statistics over each device's share of the batch; models.resnet.GroupedBatchNorm)."""
  mode = cfg.batchnorm
  if mode not in BATCHNORMS:
    raise ValueError(f"batchnorm must be one of {list(BATCHNORMS)}, got {mode!r}.")
  if mode == "sync":
    return 1
  # The data axis as training.sharding.make_mesh sizes it (mesh.data=-1: all the devices
  # mesh.model leaves); the loop has checked the mesh before building the task.
  data = cfg.mesh.data
  return jax.device_count() // cfg.mesh.model if data == -1 else data


def per_shard_model(model: nnx.Module, axis_name: str) -> nnx.Module:
  """A copy of a task's model for one device's shard of the batch inside ``jax.shard_map`` over
  ``axis_name`` (train.py's ``fisher_backward=local``), with the BatchNorm statistics the
  model has on the whole split batch (:func:`models.resnet.per_shard_batchnorm`); a model
  without BatchNorm is copied unchanged."""
  from models.resnet import per_shard_batchnorm

  return per_shard_batchnorm(model, axis_name)


@dataclasses.dataclass
class Task:
  """Shared plumbing. Subclasses set the fields and implement the marked methods.

  Attributes:
    model: the NNX module (train mode); split into ``graphdef/params/rest`` by the loop.
    train_arrays / val_arrays: dicts of numpy arrays with a common leading axis; the loop
      places them on the device once and gathers batches by index inside the jitted step.
    eval_split: the name of the split in ``val_arrays`` ("test", "holdout", "validation").
  """

  model: nnx.Module
  train_arrays: dict[str, np.ndarray]
  val_arrays: dict[str, np.ndarray]
  eval_split: str
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(cls, cfg) -> Task:
    """The task with its data loaded, from train.py's config."""
    raise NotImplementedError

  @property
  def num_train(self) -> int:
    return len(next(iter(self.train_arrays.values())))

  @property
  def num_val(self) -> int:
    return len(next(iter(self.val_arrays.values())))

  def batch_order(self, seed: int, epoch: int) -> np.ndarray:
    """The order of the training examples in ``epoch``: a pure function of (seed, epoch), so a
    resumed run sees exactly the batches of an uninterrupted one (int32, gathered on device)."""
    return np.random.default_rng([seed, epoch]).permutation(self.num_train).astype(np.int32)

  # -- parameters: full fine-tuning by default; LoRA overrides these three -----------------
  def trainable_params(self, params: nnx.State) -> Any:
    """The pytree the optimizer sees (and whose size is Ginger's d)."""
    return params

  def full_params(self, trainable: Any, frozen: Any) -> Any:
    """The model's parameters from the trainable part and the frozen part."""
    del frozen
    return trainable

  def frozen_params(self, params: nnx.State) -> Any:
    del params
    return None

  def model_with(self, trainable: Any, frozen: Any, rest: Any) -> nnx.Module:
    """The task's model holding these parameters and state (for work outside jit)."""
    nnx.update(self.model, self.full_params(trainable, frozen), rest)
    return self.model

  # -- evaluation and summary ----------------------------------------------------------------
  def generation_metrics(self, model: Callable[[], nnx.Module]) -> dict[str, float]:
    """Metrics that need more than a teacher-forced forward (none by default); ``model()``
    gives the model with the evaluated parameters."""
    del model
    return {}

  def best_of(self, evals: list[dict]) -> dict[str, Any]:
    """summary.json's fields from the run's best evaluation (``{}`` without evaluations)."""
    raise NotImplementedError

  def train_summary(self, mean_train_loss: float) -> dict[str, Any]:
    """Extra summary.json fields from the mean training loss (none by default)."""
    del mean_train_loss
    return {}

  # -- implemented by subclasses -----------------------------------------------------------
  def train_batch(self, arrays, idx, rng):
    """Inputs, labels, mask for the training step (jittable)."""
    raise NotImplementedError

  def forward(self, model, inputs):
    raise NotImplementedError

  def eval_sums(self, model, arrays, idx) -> dict[str, jax.Array]:
    """Additive evaluation statistics of one batch (jittable)."""
    raise NotImplementedError

  def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
    raise NotImplementedError

  def forward_flops_per_example(self) -> float:
    raise NotImplementedError


class ImageClassification(Task):
  """A ResNet on an :class:`data.images.ImageDataset`, with the augmentation in JAX."""

  @classmethod
  def from_config(cls, cfg) -> ImageClassification:
    from data.images import load_image_dataset

    dataset = load_image_dataset(
      cfg.data.name,
      cfg.data.source,
      cfg.data.path,
      holdout=int(cfg.data.holdout),
      seed=int(cfg.seed),
    )
    return cls(
      cfg.model,
      dataset,
      precision=cfg.precision,
      seed=int(cfg.seed),
      augment=bool(cfg.data.augment),
      batchnorm_groups=resolve_batchnorm_groups(cfg),
    )

  def __init__(
    self,
    model_cfg,
    dataset,
    *,
    precision: str,
    seed: int,
    augment: bool = True,
    batchnorm_groups: int = 1,
  ):
    from models.flops import forward_macs
    from models.resnet import build_resnet

    channels = dataset.train_images.shape[-1]
    # nnx.Rngs(seed) starts from jax.random.key(seed): the same draw as init_model's.
    model = init_model(
      lambda key: build_resnet(
        model_cfg.name,
        dataset.num_classes,
        rngs=nnx.Rngs(key),
        dtype=compute_dtype(precision),
        in_channels=channels,
        batchnorm_groups=batchnorm_groups,
      ),
      seed,
    )
    super().__init__(
      model=model,
      train_arrays={"images": dataset.train_images, "labels": dataset.train_labels},
      val_arrays={"images": dataset.val_images, "labels": dataset.val_labels},
      eval_split=dataset.val_split_name,
      info={"num_classes": dataset.num_classes},
    )
    self.mean = np.asarray(dataset.mean, np.float32)
    self.std = np.asarray(dataset.std, np.float32)
    self.augment = augment
    self._macs = forward_macs(model, tuple(dataset.train_images.shape[1:]))

  def train_batch(self, arrays, idx, rng):
    from data.images import augment, normalize

    images = arrays["images"][idx]
    x = (
      augment(rng, images, self.mean, self.std)
      if self.augment
      else normalize(images, self.mean, self.std)
    )
    return x, arrays["labels"][idx], None

  def forward(self, model, inputs):
    return model(inputs)

  def eval_sums(self, model, arrays, idx):
    from data.images import normalize
    from ginger.fisher import cross_entropy

    labels = arrays["labels"][idx]
    logits = model(normalize(arrays["images"][idx], self.mean, self.std))
    n = labels.shape[0]
    return {
      "loss_sum": cross_entropy(logits, labels) * n,
      "correct": jnp.sum(jnp.argmax(logits, -1) == labels),
      "count": jnp.asarray(n, jnp.float32),
    }

  def eval_metrics(self, sums):
    return {
      "val_loss": sums["loss_sum"] / sums["count"],
      "val_accuracy": 100.0 * sums["correct"] / sums["count"],
    }

  def best_of(self, evals):
    """The evaluation of highest accuracy."""
    if not evals:
      return {}
    best = max(evals, key=lambda e: e["val_accuracy"])
    return {
      "best_val_accuracy": best["val_accuracy"],
      "val_loss_at_best": best["val_loss"],
      "best_step": best["step"],
    }

  def forward_flops_per_example(self) -> float:
    return FLOPS_PER_MAC * self._macs


class Seq2Seq(Task):
  """T5 on tokenized document/summary pairs; optionally LoRA (only adapters trained)."""

  @classmethod
  def from_config(cls, cfg) -> Seq2Seq:
    from data import xsum
    from models.t5_convert import ModelUnavailableError, resolve_model_dir

    # The evaluated split is "validation" unless data.eval_split says otherwise (evaluate.py
    # data.eval_split=test); the task holds it as its val_arrays either way.
    eval_split = cfg.data.eval_split or "validation"
    pretrained = cfg.model.pretrained
    # Every input is tried before failing, so one message lists all that is missing offline.
    inputs = xsum.load_inputs(
      {
        "tokenizer": lambda: xsum.load_tokenizer(cfg.data.tokenizer),
        "data": lambda: xsum.load_xsum(
          cfg.data.source, cfg.data.path, splits=("train", eval_split), limit=cfg.data.limit
        ),
        "weights": lambda: resolve_model_dir(pretrained) if pretrained else None,
      },
      unavailable=(ModelUnavailableError,),
    )
    tokenizer, raw = inputs["tokenizer"], inputs["data"]
    arrays = {
      split: xsum.tokenize_split(
        raw[split],
        tokenizer,
        prefix=cfg.data.prefix,
        max_source_len=cfg.data.max_source_len,
        max_target_len=cfg.data.max_target_len,
      )
      for split in ("train", eval_split)
    }
    return cls(
      cfg.model,
      arrays,
      tokenizer,
      precision=cfg.precision,
      seed=int(cfg.seed),
      eval_split=eval_split,
      rouge_examples=int(cfg.data.rouge_examples or 0),
      max_new_tokens=int(cfg.data.max_new_tokens),
      generate_batch_size=int(cfg.eval_batch_size),
    )

  def __init__(
    self,
    model_cfg,
    arrays: dict[str, dict[str, np.ndarray]],
    tokenizer,
    *,
    precision: str,
    seed: int,
    eval_split: str = "validation",
    rouge_examples: int = 0,
    max_new_tokens: int = 128,
    generate_batch_size: int = 32,
  ):
    from models import t5

    self.cfg = model_cfg
    if model_cfg.pretrained:
      from models.t5_convert import load_t5

      config, model = load_t5(
        model_cfg.pretrained, dtype=precision, dropout_rate=model_cfg.dropout_rate, seed=seed
      )
    else:
      sizes = dict(model_cfg.size)
      vocab = sizes.pop("vocab_size", tokenizer.vocab_size)
      config = t5.T5Config(
        vocab_size=vocab, dropout_rate=model_cfg.dropout_rate, dtype=precision, **sizes
      )
      model = init_model(lambda key: t5.T5(config, rngs=nnx.Rngs(key)), seed)
    if config.vocab_size < tokenizer.vocab_size:
      raise ValueError(
        f"model vocab_size {config.vocab_size} < tokenizer vocab_size {tokenizer.vocab_size}"
      )
    super().__init__(
      model=model,
      train_arrays=arrays["train"],
      val_arrays=arrays[eval_split],
      eval_split=eval_split,
    )
    self.config = config
    self.rouge_examples = rouge_examples
    self.max_new_tokens = max_new_tokens
    self.generate_batch_size = generate_batch_size
    self.tokenizer = tokenizer
    self.lora = model_cfg.lora or None
    self.seed = seed

  # -- LoRA ---------------------------------------------------------------------------------
  def trainable_params(self, params):
    if not self.lora:
      return params
    from models.lora import lora_init

    return lora_init(
      params,
      jax.random.key(self.seed + 1),
      rank=self.lora.rank,
      targets=self.lora.targets,
      train_1d=self.lora.train_1d,
    )

  def frozen_params(self, params):
    return params if self.lora else None

  def full_params(self, trainable, frozen):
    if not self.lora:
      return trainable
    from models.lora import lora_merge

    return lora_merge(frozen, trainable, rank=self.lora.rank, alpha=self.lora.alpha)

  # -- batches and forward -------------------------------------------------------------------
  def _inputs(self, arrays, idx):
    from models.t5 import shift_right

    b = {k: v[idx] for k, v in arrays.items()}
    dec_in = shift_right(b["labels"], self.config.decoder_start_token_id, self.config.pad_token_id)
    # Padding sits at the end of the targets, so the causal mask alone keeps real positions
    # from seeing it; padded positions are excluded from the loss by the label mask.
    return (b["input_ids"], b["attention_mask"], dec_in), b["labels"], b["decoder_attention_mask"]

  def train_batch(self, arrays, idx, rng):
    del rng
    return self._inputs(arrays, idx)

  def forward(self, model, inputs):
    return model(*inputs)

  def eval_sums(self, model, arrays, idx):
    from ginger.fisher import cross_entropy

    inputs, labels, mask = self._inputs(arrays, idx)
    logits = model(*inputs)
    tokens = jnp.sum(mask).astype(jnp.float32)
    return {"loss_sum": cross_entropy(logits, labels, mask) * tokens, "tokens": tokens}

  def eval_metrics(self, sums):
    return {"val_loss": sums["loss_sum"] / sums["tokens"]}

  def generation_metrics(self, model):
    """ROUGE of greedy summaries (:meth:`rouge`) when ``data.rouge_examples`` asks for it."""
    if not self.rouge_examples:
      return {}
    return self.rouge(
      model(),
      examples=self.rouge_examples,
      batch_size=self.generate_batch_size,
      max_new_tokens=self.max_new_tokens,
    )

  def best_of(self, evals):
    """The evaluation of highest ROUGE-L (of lowest validation loss without ROUGE)."""
    if not evals:
      return {}
    if "rougeL" in evals[0]:
      best = max(evals, key=lambda e: e["rougeL"])
    else:
      best = min(evals, key=lambda e: e["val_loss"])
    return {
      "rouge1": best.get("rouge1"),
      "rouge2": best.get("rouge2"),
      "rougeL": best.get("rougeL"),
      "rougeLsum": best.get("rougeLsum"),
      "val_loss": best["val_loss"],
      "best_step": best["step"],
    }

  def train_summary(self, mean_train_loss):
    finite = math.isfinite(mean_train_loss)
    return {"train_perplexity": math.exp(mean_train_loss) if finite else None}

  def forward_flops_per_example(self) -> float:
    from models.flops import t5_forward_flops

    src = self.train_arrays["input_ids"].shape[1]
    tgt = self.train_arrays["labels"].shape[1]
    return float(t5_forward_flops(self.config, 1, src, tgt))

  def rouge(
    self, model, *, examples: int, batch_size: int, max_new_tokens: int
  ) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum (percent) of greedy summaries of the first ``examples`` validation
    documents against their reference summaries."""
    from models.rouge import rouge_scores
    from models.t5 import greedy_generate

    model.eval()
    generate = nnx.jit(greedy_generate, static_argnames="max_new_tokens")
    n = min(examples, len(self.val_arrays["input_ids"]))
    predictions, references = [], []
    for start in range(0, n, batch_size):
      stop = min(start + batch_size, n)
      tokens = generate(
        model,
        self.val_arrays["input_ids"][start:stop],
        self.val_arrays["attention_mask"][start:stop],
        max_new_tokens=max_new_tokens,
      )
      # The model's vocabulary may be padded past the tokenizer's (t5-small: 32128 > 32100):
      # ids the tokenizer cannot decode are dropped like padding.
      tokens = np.asarray(tokens)
      tokens = np.where(tokens < self.tokenizer.vocab_size, tokens, self.tokenizer.pad_id)
      predictions += self.tokenizer.batch_decode(tokens.tolist())
      references += self.tokenizer.batch_decode(
        (
          self.val_arrays["labels"][start:stop]
          * self.val_arrays["decoder_attention_mask"][start:stop]
        ).tolist()
      )
    scores = rouge_scores(predictions, references)
    return {k: float(v) for k, v in scores.items()} | {"rouge_examples": n}


TASKS: dict[str, type[Task]] = {"resnet": ImageClassification, "t5": Seq2Seq}
