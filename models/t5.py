"""T5 v1.0 encoder-decoder (t5-small and friends) in Flax NNX.

A faithful port of Hugging Face's ``T5ForConditionalGeneration`` with ``feed_forward_proj="relu"``
(the original T5, not v1.1), so converted t5-small weights give the same logits
(``models/t5_convert.py``). What makes T5 differ from a textbook Transformer, all kept here:

* relative position buckets instead of absolute positions: bidirectional in the encoder, causal in
  the decoder; one bias table per stack, computed once and shared by every layer of that stack;
* RMS layer norm (no mean subtraction, no bias) before each sub-layer (pre-norm residuals);
* ReLU feed-forward (``DenseReluDense``) without biases, and no bias in any projection;
* no ``1/sqrt(d_kv)`` attention scaling (T5 folds it into the query initialisation);
* one shared token embedding for encoder input, decoder input and (tied) LM head, with the decoder
  output scaled by ``d_model**-0.5`` before the tied head.

Parameter paths (``nnx.state(model, nnx.Param)``; what LoRA regexes and the HF mapping use)::

    shared/embedding                                         (vocab, d_model)
    {encoder,decoder}/relative_attention_bias/embedding      (num_buckets, num_heads)
    {encoder,decoder}/blocks/{i}/self_attention/{q,k,v,o}/kernel      [in, out]
    {encoder,decoder}/blocks/{i}/self_attention_norm/scale
    decoder/blocks/{i}/cross_attention/{q,k,v,o}/kernel
    decoder/blocks/{i}/cross_attention_norm/scale
    {encoder,decoder}/blocks/{i}/mlp/{wi,wo}/kernel
    {encoder,decoder}/blocks/{i}/mlp_norm/scale
    {encoder,decoder}/final_norm/scale
    lm_head/kernel                                           (only if not tie_word_embeddings)

Parameters are stored in ``param_dtype`` (float32); matmuls run in ``dtype`` (float32 or
bfloat16); layer norms, softmax and the logits are always float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
Cache = dict[str, list[dict[str, Array]]]


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Hyper-parameters of a T5 v1.0 model; defaults are t5-small's."""

  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64
  d_ff: int = 2048
  num_layers: int = 6
  num_decoder_layers: int = 6
  num_heads: int = 8
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  dropout_rate: float = 0.1
  layer_norm_epsilon: float = 1e-6
  initializer_factor: float = 1.0
  pad_token_id: int = 0
  eos_token_id: int = 1
  decoder_start_token_id: int = 0
  tie_word_embeddings: bool = True
  dtype: str = "float32"  # compute dtype of the matmuls: "float32" or "bfloat16"
  param_dtype: str = "float32"

  @classmethod
  def small(cls, **overrides: Any) -> T5Config:
    """t5-small (60,506,624 parameters)."""
    return cls(**overrides)

  @classmethod
  def tiny(cls, vocab_size: int = 128, **overrides: Any) -> T5Config:
    """A few-hundred-thousand-parameter T5 for tests and CPU demos."""
    kw: dict[str, Any] = dict(
      vocab_size=vocab_size,
      d_model=64,
      d_kv=16,
      d_ff=128,
      num_layers=2,
      num_decoder_layers=2,
      num_heads=4,
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_hf_config(cls, hf_config: Any, **overrides: Any) -> T5Config:
    """Build from a ``transformers.T5Config`` or the dict of a ``config.json``.

    Transformers 5 always reports ``tie_word_embeddings=True`` for T5 and keeps the real
    "scale the decoder output" switch in ``scale_decoder_outputs``; older configs only have
    ``tie_word_embeddings`` (absent means True, as in the original t5-small config).
    """
    d = dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()
    proj = d.get("feed_forward_proj", "relu")
    if proj != "relu":
      raise NotImplementedError(
        f"feed_forward_proj={proj!r}: only T5 v1.0 (ReLU DenseReluDense) is implemented"
      )
    tie = d.get("scale_decoder_outputs", d.get("tie_word_embeddings", True))
    pad = d.get("pad_token_id", 0)
    start = d.get("decoder_start_token_id")
    num_layers = d.get("num_layers", 6)
    kw: dict[str, Any] = dict(
      vocab_size=d.get("vocab_size", 32128),
      d_model=d.get("d_model", 512),
      d_kv=d.get("d_kv", 64),
      d_ff=d.get("d_ff", 2048),
      num_layers=num_layers,
      num_decoder_layers=d.get("num_decoder_layers") or num_layers,
      num_heads=d.get("num_heads", 8),
      relative_attention_num_buckets=d.get("relative_attention_num_buckets", 32),
      relative_attention_max_distance=d.get("relative_attention_max_distance", 128),
      dropout_rate=d.get("dropout_rate", 0.1),
      layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-6),
      initializer_factor=d.get("initializer_factor", 1.0),
      pad_token_id=pad,
      eos_token_id=d.get("eos_token_id", 1),
      decoder_start_token_id=pad if start is None else start,
      tie_word_embeddings=bool(tie),
    )
    kw.update(overrides)
    return cls(**kw)

  @property
  def inner_dim(self) -> int:
    return self.num_heads * self.d_kv


def _dtypes(config: T5Config) -> dict[str, Any]:
  return {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.param_dtype)}


def _normal(std: float) -> nnx.Initializer:
  return nnx.initializers.normal(stddev=std)


def relative_position_bucket(
  relative_position: Array, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Array:
  """Mesh-TensorFlow's bucketing: exact buckets for small offsets, log-spaced up to max_distance.

  ``relative_position = key_position - query_position``. Causal stacks (``bidirectional=False``)
  map every future offset to bucket 0 (those keys are masked anyway).
  """
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # float32 like the reference; clamp at 1 so log never sees 0 (those entries take is_small).
  ratio = jnp.maximum(distance, 1).astype(jnp.float32) / max_exact
  large = max_exact + (
    jnp.log(ratio) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(relative_position.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(is_small, distance, large)


def shift_right(labels: Array, decoder_start_token_id: int = 0, pad_token_id: int = 0) -> Array:
  """Teacher-forcing decoder inputs from labels, as HF's ``_shift_right`` (-100 -> pad)."""
  labels = jnp.asarray(labels)
  start = jnp.full(labels[:, :1].shape, decoder_start_token_id, labels.dtype)
  shifted = jnp.concatenate([start, labels[:, :-1]], axis=1)
  return jnp.where(shifted == -100, pad_token_id, shifted)


class RMSNorm(nnx.Module):
  """T5LayerNorm: scale * x / rms(x), computed in float32, no mean and no bias."""

  def __init__(self, dim: int, eps: float, *, param_dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + self.eps)
    return (self.scale[...].astype(jnp.float32) * y).astype(x.dtype)


class Attention(nnx.Module):
  """Multi-head attention without biases or score scaling; position bias comes from outside."""

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    c, f = config, config.initializer_factor
    d, inner = c.d_model, c.inner_dim

    def dense(n_in: int, n_out: int, std: float) -> nnx.Linear:
      return nnx.Linear(
        n_in, n_out, use_bias=False, kernel_init=_normal(f * std), rngs=rngs, **_dtypes(c)
      )

    # HF's init: the query std also carries the 1/sqrt(d_kv) that T5 never applies to scores
    self.q = dense(d, inner, (d * c.d_kv) ** -0.5)
    self.k = dense(d, inner, d**-0.5)
    self.v = dense(d, inner, d**-0.5)
    self.o = dense(inner, d, inner**-0.5)
    self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)
    self.num_heads = c.num_heads

  def _heads(self, x: Array) -> Array:
    b, t, _ = x.shape
    return x.reshape(b, t, self.num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, T, d_kv)

  def query(self, x: Array) -> Array:
    return self._heads(self.q(x))

  def key_value(self, x: Array) -> tuple[Array, Array]:
    return self._heads(self.k(x)), self._heads(self.v(x))

  def attend(self, q: Array, k: Array, v: Array, bias: Array | None, mask: Array) -> Array:
    """softmax(q k^T + bias, masked) v, then the output projection; softmax in float32."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    if bias is not None:
      scores = scores + bias
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = self.dropout(jax.nn.softmax(scores, axis=-1).astype(v.dtype))
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
    b, _, t, _ = out.shape
    return self.o(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class DenseReluDense(nnx.Module):
  """T5 v1.0 feed-forward: wo(dropout(relu(wi x))), no biases."""

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    c, f = config, config.initializer_factor
    dense = dict(use_bias=False, rngs=rngs, **_dtypes(c))
    self.wi = nnx.Linear(c.d_model, c.d_ff, kernel_init=_normal(f * c.d_model**-0.5), **dense)
    self.wo = nnx.Linear(c.d_ff, c.d_model, kernel_init=_normal(f * c.d_ff**-0.5), **dense)
    self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)

  def __call__(self, x: Array) -> Array:
    return self.wo(self.dropout(jax.nn.relu(self.wi(x))))


def _norm(config: T5Config) -> RMSNorm:
  eps, dtype = config.layer_norm_epsilon, jnp.dtype(config.param_dtype)
  return RMSNorm(config.d_model, eps, param_dtype=dtype)


class EncoderBlock(nnx.Module):
  """Pre-norm self-attention + feed-forward, each with a dropped-out residual."""

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    self.self_attention_norm = _norm(config)
    self.self_attention = Attention(config, rngs=rngs)
    self.mlp_norm = _norm(config)
    self.mlp = DenseReluDense(config, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

  def __call__(self, h: Array, bias: Array, mask: Array) -> Array:
    y = self.self_attention_norm(h)
    att = self.self_attention
    k, v = att.key_value(y)
    h = h + self.dropout(att.attend(att.query(y), k, v, bias, mask))
    return h + self.dropout(self.mlp(self.mlp_norm(h)))


class DecoderBlock(nnx.Module):
  """Causal self-attention, cross-attention over the encoder, feed-forward."""

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    self.self_attention_norm = _norm(config)
    self.self_attention = Attention(config, rngs=rngs)
    self.cross_attention_norm = _norm(config)
    self.cross_attention = Attention(config, rngs=rngs)
    self.mlp_norm = _norm(config)
    self.mlp = DenseReluDense(config, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

  def __call__(
    self,
    h: Array,
    cross_kv: dict[str, Array],
    bias: Array,
    self_mask: Array,
    cross_mask: Array,
    cache: dict[str, Array] | None = None,
    index: Array | None = None,
  ) -> tuple[Array, dict[str, Array] | None]:
    """One block; with ``cache`` the new keys/values are written at ``index`` (decoding)."""
    y = self.self_attention_norm(h)
    att = self.self_attention
    k, v = att.key_value(y)
    if cache is not None:
      start = (0, 0, index, 0)
      k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start)
      v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)
      cache = {"k": k, "v": v}
    h = h + self.dropout(att.attend(att.query(y), k, v, bias, self_mask))
    y = self.cross_attention_norm(h)
    cross = self.cross_attention
    out = cross.attend(cross.query(y), cross_kv["k"], cross_kv["v"], None, cross_mask)
    h = h + self.dropout(out)
    h = h + self.dropout(self.mlp(self.mlp_norm(h)))
    return h, cache


class _Stack(nnx.Module):
  """What encoder and decoder share: the relative-bias table, final norm and dropout."""

  bidirectional: bool

  def _init_common(self, config: T5Config, rngs: nnx.Rngs) -> None:
    c = config
    self.relative_attention_bias = nnx.Embed(
      c.relative_attention_num_buckets,
      c.num_heads,
      embedding_init=_normal(c.initializer_factor * c.d_model**-0.5),
      param_dtype=jnp.dtype(c.param_dtype),
      rngs=rngs,
    )
    self.final_norm = _norm(c)
    self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)
    self.num_buckets = c.relative_attention_num_buckets
    self.max_distance = c.relative_attention_max_distance

  def position_bias(self, query_positions: Array, key_length: int) -> Array:
    """(1, H, Tq, Tk) float32 bias for the given query positions against keys 0..Tk-1."""
    rel = jnp.arange(key_length, dtype=jnp.int32)[None, :] - query_positions[:, None]
    buckets = relative_position_bucket(
      rel,
      bidirectional=self.bidirectional,
      num_buckets=self.num_buckets,
      max_distance=self.max_distance,
    )
    table = self.relative_attention_bias.embedding[...].astype(jnp.float32)
    return jnp.take(table, buckets, axis=0).transpose(2, 0, 1)[None]


class Encoder(_Stack):
  bidirectional = True

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    self._init_common(config, rngs)
    self.blocks = nnx.List([EncoderBlock(config, rngs=rngs) for _ in range(config.num_layers)])

  def __call__(self, embeds: Array, attention_mask: Array) -> Array:
    s = embeds.shape[1]
    bias = self.position_bias(jnp.arange(s, dtype=jnp.int32), s)
    mask = attention_mask.astype(bool)[:, None, None, :]
    h = self.dropout(embeds)
    for block in self.blocks:
      h = block(h, bias, mask)
    return self.dropout(self.final_norm(h))


class Decoder(_Stack):
  bidirectional = False

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    self._init_common(config, rngs)
    n = config.num_decoder_layers
    self.blocks = nnx.List([DecoderBlock(config, rngs=rngs) for _ in range(n)])

  def cross_kv(self, encoder_hidden: Array) -> list[dict[str, Array]]:
    """Per-layer cross-attention keys/values; computed once per source for generation."""
    out = []
    for block in self.blocks:
      k, v = block.cross_attention.key_value(encoder_hidden)
      out.append({"k": k, "v": v})
    return out

  def __call__(
    self,
    embeds: Array,
    encoder_hidden: Array,
    attention_mask: Array,
    decoder_attention_mask: Array | None = None,
  ) -> Array:
    t = embeds.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)
    bias = self.position_bias(pos, t)
    self_mask = (pos[None, :] <= pos[:, None])[None, None]
    if decoder_attention_mask is not None:
      self_mask = self_mask & decoder_attention_mask.astype(bool)[:, None, None, :]
    cross_mask = attention_mask.astype(bool)[:, None, None, :]
    h = self.dropout(embeds)
    for block, kv in zip(self.blocks, self.cross_kv(encoder_hidden), strict=True):
      h, _ = block(h, kv, bias, self_mask, cross_mask)
    return self.dropout(self.final_norm(h))

  def step(
    self, embeds: Array, index: Array, cache: Cache, attention_mask: Array
  ) -> tuple[Array, Cache]:
    """One decoding position (embeds: (B, 1, D)) against the KV cache."""
    max_len = cache["self"][0]["k"].shape[2]
    index = jnp.asarray(index, jnp.int32)
    bias = self.position_bias(index[None], max_len)
    self_mask = (jnp.arange(max_len) <= index)[None, None, None, :]
    cross_mask = attention_mask.astype(bool)[:, None, None, :]
    h = self.dropout(embeds)
    new_self = []
    for block, kv, layer_cache in zip(self.blocks, cache["cross"], cache["self"], strict=True):
      h, layer_cache = block(h, kv, bias, self_mask, cross_mask, layer_cache, index)
      new_self.append(layer_cache)
    return self.dropout(self.final_norm(h)), {"self": new_self, "cross": cache["cross"]}


class T5(nnx.Module):
  """T5ForConditionalGeneration: ``model(input_ids, attention_mask, decoder_input_ids)``."""

  def __init__(self, config: T5Config, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.shared = nnx.Embed(
      c.vocab_size,
      c.d_model,
      embedding_init=_normal(c.initializer_factor),
      rngs=rngs,
      **_dtypes(c),
    )
    self.encoder = Encoder(c, rngs=rngs)
    self.decoder = Decoder(c, rngs=rngs)
    if not c.tie_word_embeddings:
      self.lm_head = nnx.Linear(
        c.d_model,
        c.vocab_size,
        use_bias=False,
        kernel_init=_normal(c.initializer_factor),
        rngs=rngs,
        **_dtypes(c),
      )

  def encode(self, input_ids: Array, attention_mask: Array) -> Array:
    """Encoder hidden states (B, S, d_model) in the compute dtype."""
    return self.encoder(self.shared(input_ids), attention_mask)

  def logits(self, hidden: Array) -> Array:
    """LM head in float32; with tied embeddings the input is scaled by d_model**-0.5."""
    c = self.config
    if c.tie_word_embeddings:
      hidden = hidden * (c.d_model**-0.5)
      kernel = self.shared.embedding[...].T
    else:
      kernel = self.lm_head.kernel[...]
    return jnp.einsum(
      "...d,dv->...v",
      hidden,
      kernel.astype(hidden.dtype),
      preferred_element_type=jnp.float32,
    ).astype(jnp.float32)

  def decode(
    self,
    decoder_input_ids: Array,
    encoder_hidden: Array,
    attention_mask: Array,
    decoder_attention_mask: Array | None = None,
  ) -> Array:
    """Teacher-forced decoder logits (B, T, V) given the encoder output."""
    h = self.decoder(
      self.shared(decoder_input_ids), encoder_hidden, attention_mask, decoder_attention_mask
    )
    return self.logits(h)

  def __call__(
    self,
    input_ids: Array,
    attention_mask: Array,
    decoder_input_ids: Array,
    decoder_attention_mask: Array | None = None,
  ) -> Array:
    enc = self.encode(input_ids, attention_mask)
    return self.decode(decoder_input_ids, enc, attention_mask, decoder_attention_mask)

  def init_cache(self, encoder_hidden: Array, max_len: int) -> Cache:
    """Empty decoder self-attention KV buffers of length max_len + precomputed cross K/V."""
    c = self.config
    b = encoder_hidden.shape[0]
    shape = (b, c.num_heads, max_len, c.d_kv)
    zeros = jnp.zeros(shape, encoder_hidden.dtype)
    empty = [{"k": zeros, "v": zeros} for _ in range(c.num_decoder_layers)]
    return {"self": empty, "cross": self.decoder.cross_kv(encoder_hidden)}

  def decode_step(
    self, tokens: Array, index: Array, cache: Cache, attention_mask: Array
  ) -> tuple[Array, Cache]:
    """Logits (B, V) for decoder position ``index`` fed ``tokens`` (B,), and the new cache."""
    h, cache = self.decoder.step(self.shared(tokens[:, None]), index, cache, attention_mask)
    return self.logits(h[:, 0]), cache


def greedy_generate(
  model: T5, input_ids: Array, attention_mask: Array, max_new_tokens: int = 128
) -> Array:
  """Greedy decoding with a KV cache: int32 tokens (B, max_new_tokens), pad after EOS.

  The decoder start token is not included (HF's ``generate`` output without its first column).
  Runs a ``lax.while_loop`` that stops early once every row has emitted EOS, so it works eagerly,
  under ``nnx.jit`` or inside a ``jax.jit`` that merged the model. Dropout is always off.
  """
  model = nnx.view(model, deterministic=True)
  c = model.config
  input_ids = jnp.asarray(input_ids)
  attention_mask = jnp.asarray(attention_mask)
  b = input_ids.shape[0]
  cache = model.init_cache(model.encode(input_ids, attention_mask), max_new_tokens)

  def cond(carry: tuple) -> Array:
    i, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry: tuple) -> tuple:
    i, prev, cache, done, out = carry
    logits, cache = model.decode_step(prev, i, cache, attention_mask)
    nxt = jnp.where(done, c.pad_token_id, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
    return i + 1, nxt, cache, done | (nxt == c.eos_token_id), out

  init = (
    jnp.int32(0),
    jnp.full((b,), c.decoder_start_token_id, jnp.int32),
    cache,
    jnp.zeros((b,), bool),
    jnp.full((b, max_new_tokens), c.pad_token_id, jnp.int32),
  )
  return jax.lax.while_loop(cond, body, init)[-1]


def param_count(model: nnx.Module) -> int:
  """Number of trainable scalars (nnx.Param); works on nnx.eval_shape'd abstract models too."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return int(sum(math.prod(x.shape) for x in leaves))
