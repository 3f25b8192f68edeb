"""T5 in NNX: equivalence with Hugging Face's torch T5 (random tiny weights, no download)."""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ginger.fisher import cross_entropy
from models.flops import t5_forward_flops
from models.t5 import (
  T5,
  T5Config,
  greedy_generate,
  param_count,
  relative_position_bucket,
  shift_right,
)
from models.t5_convert import ModelUnavailableError, load_t5, state_dict_to_nnx


# Imported by the tests that compare with them, not when the file is collected (torch and
# transformers take ~6 s to import, in every pytest-xdist worker).
@pytest.fixture(scope="module")
def torch():
  return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def transformers():
  return pytest.importorskip("transformers")


HF_KW = dict(
  vocab_size=100,
  d_model=32,
  d_kv=8,
  d_ff=64,
  num_layers=2,
  num_decoder_layers=2,
  num_heads=4,
  dropout_rate=0.0,
  feed_forward_proj="relu",
  tie_word_embeddings=True,
  decoder_start_token_id=0,
)


@pytest.fixture(scope="module")
def hf_model(torch, transformers):
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**HF_KW))
  with torch.no_grad():  # shrink the embedding so a random model does not just copy its input
    model.shared.weight.mul_(0.1)
  return model.eval()


@pytest.fixture(scope="module")
def converted(hf_model):
  config = T5Config.from_hf_config(hf_model.config)
  sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
  model = T5(config, rngs=nnx.Rngs(0))
  nnx.update(model, state_dict_to_nnx(sd, config))
  model.eval()
  return config, model


def _batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(2, 100, size=(3, 9))
  mask = np.ones_like(ids)
  mask[1, 6:] = 0
  mask[2, 4:] = 0
  ids = ids * mask + 1 * (np.arange(9) == mask.sum(1, keepdims=True) - 1)  # EOS at the end
  ids = np.where(mask == 1, ids, 0)
  labels = rng.integers(2, 100, size=(3, 7))
  labels[0, 6], labels[1, 3], labels[2, 5] = 1, 1, 1
  labels[1, 4:] = -100
  labels[2, 6:] = -100
  return ids, mask, labels


def _rel_close(a, b, tol=1e-4):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


def test_config_presets_and_param_count():
  small = T5Config.small()
  assert (small.d_model, small.num_layers, small.num_heads, small.d_ff) == (512, 6, 8, 2048)
  abstract = nnx.eval_shape(lambda: T5(small, rngs=nnx.Rngs(0)))
  assert param_count(abstract) == 60_506_624
  untied = nnx.eval_shape(lambda: T5(T5Config.small(tie_word_embeddings=False), rngs=nnx.Rngs(0)))
  assert param_count(untied) == 60_506_624 + 32128 * 512


def test_relative_position_bucket_matches_hf(torch, transformers):
  rel = np.arange(-300, 300)[None, :]
  for bidirectional in (True, False):
    ours = relative_position_bucket(
      jnp.asarray(rel), bidirectional=bidirectional, num_buckets=32, max_distance=128
    )
    ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
      torch.tensor(rel), bidirectional=bidirectional, num_buckets=32, max_distance=128
    )
    np.testing.assert_array_equal(np.asarray(ours), ref.numpy())


def test_shift_right_hf_semantics():
  labels = jnp.array([[5, 6, 1], [7, 1, -100]])
  np.testing.assert_array_equal(shift_right(labels, 0, 0), [[0, 5, 6], [0, 7, 1]])
  np.testing.assert_array_equal(shift_right(jnp.array([[4, -100, -100]]), 0, 0), [[0, 4, 0]])


def test_matches_hf_encoder_logits_loss(hf_model, converted, torch):
  config, model = converted
  ids, mask, labels = _batch()
  with torch.no_grad():
    out = hf_model(
      input_ids=torch.tensor(ids),
      attention_mask=torch.tensor(mask),
      labels=torch.tensor(labels),
    )
  enc = model.encode(jnp.asarray(ids), jnp.asarray(mask))
  _rel_close(enc, out.encoder_last_hidden_state.numpy())
  dec_in = shift_right(jnp.asarray(labels), config.decoder_start_token_id, config.pad_token_id)
  logits = model(jnp.asarray(ids), jnp.asarray(mask), dec_in)
  assert logits.dtype == jnp.float32 and logits.shape == (3, 7, 100)
  _rel_close(logits, out.logits.numpy())
  # The loss the Seq2Seq task trains with: padding (HF's -100) as pad id 0, masked out.
  loss = cross_entropy(logits, jnp.asarray(np.maximum(labels, 0)), jnp.asarray(labels != -100))
  assert abs(float(loss) - out.loss.item()) <= 1e-4 * abs(out.loss.item())


def test_greedy_matches_hf_generate(hf_model, converted, torch):
  _, model = converted
  ids, mask, _ = _batch()
  with torch.no_grad():
    ref = hf_model.generate(
      input_ids=torch.tensor(ids),
      attention_mask=torch.tensor(mask),
      do_sample=False,
      num_beams=1,
      max_new_tokens=10,
    ).numpy()[:, 1:]  # drop the decoder start token
  ours = np.asarray(
    nnx.jit(greedy_generate, static_argnames="max_new_tokens")(
      model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=10
    )
  )
  assert ours.dtype == np.int32 and ours.shape == (3, 10)
  assert len(set(ours.ravel().tolist())) > 2  # a non-degenerate check
  np.testing.assert_array_equal(ours[:, : ref.shape[1]], ref)
  assert np.all(ours[:, ref.shape[1] :] == 0)


def test_cached_decoding_matches_teacher_forcing_under_jit(converted):
  """KV-cache greedy == argmax of the full decoder fed its own output (split/merge + jax.jit)."""
  config, model = converted
  ids, mask, _ = _batch()
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, ids, mask):
    m = nnx.merge(graphdef, state)
    toks = greedy_generate(m, ids, mask, max_new_tokens=6)
    dec_in = shift_right(toks, config.decoder_start_token_id, config.pad_token_id)
    return toks, jnp.argmax(m(ids, mask, dec_in), -1)

  toks, tf = run(state, jnp.asarray(ids), jnp.asarray(mask))
  toks, tf = np.asarray(toks), np.asarray(tf)
  for row, ref in zip(toks, tf, strict=True):
    n = int(np.argmax(row == 1)) + 1 if (row == 1).any() else len(row)  # up to EOS
    np.testing.assert_array_equal(row[:n], ref[:n])


def test_greedy_stops_writing_after_eos(converted):
  """Declare a token the model emits mid-sequence to be EOS: rows must end there, then pad."""
  config, model = converted
  ids, mask, _ = _batch()
  gen = nnx.jit(greedy_generate, static_argnames="max_new_tokens")
  free = np.asarray(gen(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=8))
  eos = int(free[0, 2])
  eos_model = T5(dataclasses.replace(config, eos_token_id=eos), rngs=nnx.Rngs(0))
  nnx.update(eos_model, nnx.state(model, nnx.Param))
  eos_model.eval()
  out = np.asarray(gen(eos_model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=8))
  for row, ref in zip(out, free, strict=True):
    hits = np.flatnonzero(ref == eos)
    n = hits[0] + 1 if len(hits) else len(ref)
    np.testing.assert_array_equal(row[:n], ref[:n])
    assert np.all(row[n:] == config.pad_token_id)
  assert np.all(out[0, 3:] == 0)


def test_train_eval_dropout_and_bf16():
  # 1+1 layers and an rbg key: threefry dropout masks are slow to compile on CPU
  config = T5Config.tiny(vocab_size=50, dropout_rate=0.5, num_layers=1, num_decoder_layers=1)
  rngs = lambda: nnx.Rngs(jax.random.key(0, impl="unsafe_rbg"))
  model = T5(config, rngs=rngs())
  fwd = nnx.jit(lambda m, x, mask, y: m(x, mask, y))
  ids = jnp.array([[3, 4, 5, 1]])
  mask = jnp.ones_like(ids)
  dec = jnp.array([[0, 7, 8]])
  a, b = fwd(model, ids, mask, dec), fwd(model, ids, mask, dec)  # train mode by default
  assert not np.allclose(a, b)
  model.eval()
  assert all(m.deterministic for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Dropout))
  np.testing.assert_array_equal(fwd(model, ids, mask, dec), fwd(model, ids, mask, dec))
  bf16 = T5(dataclasses.replace(config, dtype="bfloat16"), rngs=rngs())
  nnx.update(bf16, nnx.state(model, nnx.Param))
  bf16.eval()
  low = fwd(bf16, ids, mask, dec)
  assert low.dtype == jnp.float32
  assert nnx.eval_shape(lambda m: m.encode(ids, mask), bf16).dtype == jnp.bfloat16
  np.testing.assert_allclose(low, fwd(model, ids, mask, dec), atol=0.15, rtol=0.05)


def _dot_macs(jaxpr) -> int:
  """MACs of every dot_general in a jaxpr, recursing into sub-jaxprs (jnp.einsum is a pjit)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        inner = getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
          total += _dot_macs(getattr(inner, "jaxpr", inner))
        elif hasattr(sub, "eqns"):
          total += _dot_macs(sub)
  return total


def test_forward_flops_hand_count_and_jaxpr():
  c = T5Config.tiny(vocab_size=100)  # d=64, inner=4*16=64, ff=128, 2+2 layers
  b, s, t = 2, 10, 6
  enc = s * (4 * 64 * 64 + 2 * 64 * 128) + 2 * s * s * 64
  dec = (t * 4 * 64 * 64 + 2 * t * t * 64) + (2 * t * 64 * 64 + 2 * s * 64 * 64 + 2 * t * s * 64)
  dec += t * 2 * 64 * 128
  hand = 2 * b * (2 * enc + 2 * dec + t * 64 * 100)
  assert t5_forward_flops(c, b, s, t) == hand == 5_597_184
  # and the same number from the dot_generals XLA would run
  model = nnx.eval_shape(lambda: T5(c, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  ids_s = jax.ShapeDtypeStruct((b, s), jnp.int32)
  ids_t = jax.ShapeDtypeStruct((b, t), jnp.int32)
  fwd = lambda st, x, m, y: nnx.merge(graphdef, st)(x, m, y)
  macs = _dot_macs(jax.make_jaxpr(fwd)(state, ids_s, ids_s, ids_t).jaxpr)
  assert 2 * macs == hand


def test_load_t5_from_saved_directory(hf_model, converted, tmp_path):
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  assert (tmp_path / "model.safetensors").exists()
  config, model = load_t5(str(tmp_path))
  assert config.vocab_size == 100 and config.tie_word_embeddings
  model.eval()
  ids, mask, labels = _batch()
  dec_in = shift_right(jnp.asarray(labels))
  _, ref = converted
  np.testing.assert_allclose(model(ids, mask, dec_in), ref(ids, mask, dec_in), rtol=1e-6)


def test_state_dict_errors_list_keys(hf_model):
  config = T5Config.from_hf_config(hf_model.config)
  sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
  bad = dict(sd, **{"encoder.block.0.layer.9.foo.weight": np.zeros(1)})
  with pytest.raises(ValueError, match="layer.9.foo"):
    state_dict_to_nnx(bad, config)
  missing = {k: v for k, v in sd.items() if "final_layer_norm" not in k}
  with pytest.raises(ValueError, match="final_norm/scale"):
    state_dict_to_nnx(missing, config)


def test_offline_hub_name_fails_fast(monkeypatch, tmp_path, no_waiting):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(ModelUnavailableError, match="model.pretrained="):
    load_t5("t5-small", cache_dir=str(tmp_path))
  with pytest.raises(ModelUnavailableError):
    load_t5(str(tmp_path / "nope"))


def test_bfloat16_safetensors_read_without_torch(tmp_path, monkeypatch):
  """A checkpoint saved in bfloat16 (no numpy dtype: safetensors.numpy refuses it) reads as
  float32 through JAX, with torch not importable: the training install has no torch."""
  from safetensors.flax import save_file

  from models.t5_convert import read_state_dict

  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
  w = np.array([[1.5, -2.0, 3.140625], [0.0, 1e-3, -65280.0]], np.float32)
  save_file({"shared.weight": jnp.asarray(w, jnp.bfloat16)}, str(tmp_path / "model.safetensors"))
  got = read_state_dict(tmp_path)
  assert got["shared.weight"].dtype == np.float32
  want = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)  # w rounded to bfloat16
  np.testing.assert_array_equal(got["shared.weight"], want)


def test_pytorch_bin_without_torch_says_how_to_get_it(tmp_path, monkeypatch):
  from models.t5_convert import read_state_dict

  monkeypatch.setitem(sys.modules, "torch", None)
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(ModelUnavailableError, match="needs torch.*make venv TORCH=1"):
    read_state_dict(tmp_path)
