"""Tasks: what the training loop needs from a model family, without knowing the model.

A task owns the NNX model, the dataset arrays it trains on and everything that differs
between image classification and seq2seq: how a batch is formed (inside the jitted step),
the forward pass, evaluation metrics and the analytic FLOP count. The loop only ever sees
``(logits, labels, mask)``, which is all that the loss and the sampled-Fisher vector need.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(precision: str):
  if precision not in DTYPES:
    raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}.")
  return DTYPES[precision]


@dataclasses.dataclass
class Task:
  """Shared plumbing. Subclasses set the fields and implement the marked methods.

  Attributes:
    model: the NNX module (train mode); split into ``graphdef/params/rest`` by the loop.
    train_arrays / val_arrays: dicts of numpy arrays with a common leading axis; the loop
      places them on the device once and gathers batches by index inside the jitted step.
    kind: "classification" or "seq2seq" (what summary keys the run reports).
  """

  model: nnx.Module
  train_arrays: dict[str, np.ndarray]
  val_arrays: dict[str, np.ndarray]
  kind: str
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  # -- parameters: full fine-tuning by default; LoRA overrides these two --------------------
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

  def __init__(self, model_cfg, dataset, *, precision: str, seed: int, augment: bool = True):
    from models.flops import resnet_forward_macs
    from models.resnet import build_resnet

    channels = dataset.train_images.shape[-1]
    model = nnx.jit(
      lambda: build_resnet(
        model_cfg.name,
        dataset.num_classes,
        rngs=nnx.Rngs(seed),
        dtype=compute_dtype(precision),
        in_channels=channels,
      )
    )()
    super().__init__(
      model=model,
      train_arrays={"images": dataset.train_images, "labels": dataset.train_labels},
      val_arrays={"images": dataset.val_images, "labels": dataset.val_labels},
      kind="classification",
      info={"val_split": dataset.val_split_name, "num_classes": dataset.num_classes},
    )
    self.mean = np.asarray(dataset.mean, np.float32)
    self.std = np.asarray(dataset.std, np.float32)
    self.augment = augment
    self._macs = resnet_forward_macs(
      model_cfg.name, dataset.num_classes, tuple(dataset.train_images.shape[1:])
    )

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

  def forward_flops_per_example(self) -> float:
    return 2.0 * self._macs


class Seq2Seq(Task):
  """T5 on tokenized document/summary pairs; optionally LoRA (only adapters trained)."""

  def __init__(
    self,
    model_cfg,
    arrays: dict[str, dict[str, np.ndarray]],
    tokenizer,
    *,
    precision: str,
    seed: int,
  ):
    from models import t5

    self.cfg = model_cfg
    if model_cfg.get("pretrained"):
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
      model = nnx.jit(lambda: t5.T5(config, rngs=nnx.Rngs(seed)))()
    if config.vocab_size < tokenizer.vocab_size:
      raise ValueError(
        f"model vocab_size {config.vocab_size} < tokenizer vocab_size {tokenizer.vocab_size}"
      )
    super().__init__(
      model=model, train_arrays=arrays["train"], val_arrays=arrays["validation"], kind="seq2seq"
    )
    self.config = config
    self.tokenizer = tokenizer
    self.lora = model_cfg.get("lora") or None
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

  def forward_flops_per_example(self) -> float:
    from models.t5 import t5_forward_flops

    src = self.train_arrays["input_ids"].shape[1]
    tgt = self.train_arrays["labels"].shape[1]
    return float(t5_forward_flops(self.config, 1, src, tgt))

  def generation_metrics(
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
