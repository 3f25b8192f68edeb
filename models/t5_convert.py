"""Hugging Face T5 v1.0 checkpoints -> ``models.t5.T5``.

``load_t5("path/to/dir")`` reads ``config.json`` and ``model.safetensors`` (or sharded
safetensors, or ``pytorch_model.bin``); ``load_t5("t5-small")`` fetches that from the hub when it
is reachable, or takes it from the local Hugging Face cache. Offline with nothing cached it raises
``ModelUnavailableError`` within seconds (a 2 s reachability probe, no retry loops).

Key mapping (``{i}``: block index, ``{s}``: ``encoder`` or ``decoder``; "(T)": a torch ``Linear``
weight, [out, in], transposed to flax's [in, out] kernel; everything else is copied as it is)::

    shared.weight
        -> shared/embedding
    {s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight
        -> {s}/relative_attention_bias/embedding
    {s}.block.{i}.layer.0.SelfAttention.{q,k,v,o}.weight
        -> {s}/blocks/{i}/self_attention/{q,k,v,o}/kernel (T)
    {s}.block.{i}.layer.0.layer_norm.weight
        -> {s}/blocks/{i}/self_attention_norm/scale
    encoder.block.{i}.layer.1.DenseReluDense.{wi,wo}.weight
        -> encoder/blocks/{i}/mlp/{wi,wo}/kernel (T)
    encoder.block.{i}.layer.1.layer_norm.weight
        -> encoder/blocks/{i}/mlp_norm/scale
    decoder.block.{i}.layer.1.EncDecAttention.{q,k,v,o}.weight
        -> decoder/blocks/{i}/cross_attention/{q,k,v,o}/kernel (T)
    decoder.block.{i}.layer.1.layer_norm.weight
        -> decoder/blocks/{i}/cross_attention_norm/scale
    decoder.block.{i}.layer.2.DenseReluDense.{wi,wo}.weight
        -> decoder/blocks/{i}/mlp/{wi,wo}/kernel (T)
    decoder.block.{i}.layer.2.layer_norm.weight
        -> decoder/blocks/{i}/mlp_norm/scale
    {s}.final_layer_norm.weight
        -> {s}/final_norm/scale
    lm_head.weight
        -> tied: must equal shared.weight; untied: lm_head/kernel (T)
    {s}.embed_tokens.weight
        -> tied alias: must equal shared.weight
    decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight
        -> ignored (legacy, unused; HF ignores it too)

Any other key, or a parameter the checkpoint lacks, is an error that lists them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import hub
from models.t5 import T5, T5Config

# (regex over the HF key, NNX path template, transpose?)
_RULES: list[tuple[re.Pattern[str], str, bool]] = [
  (re.compile(p), t, tr)
  for p, t, tr in [
    (r"shared\.weight", "shared/embedding", False),
    (
      r"(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
      "{0}/relative_attention_bias/embedding",
      False,
    ),
    (
      r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkvo])\.weight",
      "{0}/blocks/{1}/self_attention/{2}/kernel",
      True,
    ),
    (
      r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.layer_norm\.weight",
      "{0}/blocks/{1}/self_attention_norm/scale",
      False,
    ),
    (
      r"(encoder)\.block\.(\d+)\.layer\.1\.DenseReluDense\.(wi|wo)\.weight",
      "{0}/blocks/{1}/mlp/{2}/kernel",
      True,
    ),
    (
      r"(encoder)\.block\.(\d+)\.layer\.1\.layer_norm\.weight",
      "{0}/blocks/{1}/mlp_norm/scale",
      False,
    ),
    (
      r"(decoder)\.block\.(\d+)\.layer\.1\.EncDecAttention\.([qkvo])\.weight",
      "{0}/blocks/{1}/cross_attention/{2}/kernel",
      True,
    ),
    (
      r"(decoder)\.block\.(\d+)\.layer\.1\.layer_norm\.weight",
      "{0}/blocks/{1}/cross_attention_norm/scale",
      False,
    ),
    (
      r"(decoder)\.block\.(\d+)\.layer\.2\.DenseReluDense\.(wi|wo)\.weight",
      "{0}/blocks/{1}/mlp/{2}/kernel",
      True,
    ),
    (
      r"(decoder)\.block\.(\d+)\.layer\.2\.layer_norm\.weight",
      "{0}/blocks/{1}/mlp_norm/scale",
      False,
    ),
    (r"(encoder|decoder)\.final_layer_norm\.weight", "{0}/final_norm/scale", False),
  ]
]
_TIED_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
_WEIGHT_PATTERNS = [
  "config.json",
  "*.safetensors",
  "model.safetensors.index.json",
  "pytorch_model.bin",
]


class ModelUnavailableError(RuntimeError):
  """The requested weights cannot be had here (offline and not cached, or a bad path)."""


def _map_key(key: str) -> tuple[tuple[str | int, ...], bool] | None:
  for pattern, template, transpose in _RULES:
    m = pattern.fullmatch(key)
    if m:
      path = template.format(*m.groups()).split("/")
      return tuple(int(p) if p.isdigit() else p for p in path), transpose
  return None


def _set_path(tree: dict, path: tuple[str | int, ...], value: np.ndarray) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _flat_paths(tree: Mapping, prefix: tuple = ()) -> dict[tuple, Any]:
  out: dict[tuple, Any] = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flat_paths(v, (*prefix, k)))
    else:
      out[(*prefix, k)] = v
  return out


def _fmt(paths: Any) -> str:
  return ", ".join(sorted("/".join(map(str, p)) if isinstance(p, tuple) else p for p in paths))


def _check_tied(state_dict: Mapping[str, np.ndarray], config: T5Config) -> list[str]:
  """Tied aliases must be the shared embedding itself; returns the keys they consumed."""
  aliases = list(_TIED_ALIASES) + (["lm_head.weight"] if config.tie_word_embeddings else [])
  used = [k for k in aliases if k in state_dict]
  shared = state_dict.get("shared.weight")
  for k in used:
    if shared is None or not np.array_equal(np.asarray(state_dict[k]), np.asarray(shared)):
      raise ValueError(f"{k} should be tied to shared.weight but differs from it")
  return used


def state_dict_to_nnx(state_dict: Mapping[str, np.ndarray], config: T5Config) -> nnx.State:
  """HF T5 state dict (numpy arrays) -> ``nnx.State`` of ``nnx.Param`` for ``T5(config)``.

  Raises ``ValueError`` listing unknown keys, missing parameters or shape mismatches, so a wrong
  config or a T5 v1.1 checkpoint fails loudly instead of loading half the weights.
  """
  consumed = set(_check_tied(state_dict, config)) | {k for k in _IGNORED if k in state_dict}
  pure: dict = {}
  unknown = []
  for key, value in state_dict.items():
    if key in consumed:
      continue
    if key == "lm_head.weight":
      mapped: tuple | None = (("lm_head", "kernel"), True)
    else:
      mapped = _map_key(key)
    if mapped is None:
      unknown.append(key)
      continue
    path, transpose = mapped
    arr = np.asarray(value)
    _set_path(pure, path, arr.T if transpose else arr)
  if unknown:
    raise ValueError(f"unknown T5 state-dict keys: {_fmt(unknown)}")

  abstract = nnx.state(nnx.eval_shape(lambda: T5(config, rngs=nnx.Rngs(0))), nnx.Param)
  expected = _flat_paths(nnx.to_pure_dict(abstract))
  got = _flat_paths(pure)
  missing, extra = set(expected) - set(got), set(got) - set(expected)
  if missing or extra:
    raise ValueError(f"missing parameters: [{_fmt(missing)}]; unexpected: [{_fmt(extra)}]")
  bad = [p for p in expected if tuple(expected[p].shape) != got[p].shape]
  if bad:
    detail = ", ".join(
      f"{'/'.join(map(str, p))}: {got[p].shape} vs {expected[p].shape}" for p in bad
    )
    raise ValueError(f"shape mismatch (checkpoint vs config): {detail}")
  param_dtype = jnp.dtype(config.param_dtype)
  cast = {p: jnp.asarray(v, dtype=param_dtype) for p, v in got.items()}
  pure_cast: dict = {}
  for p, v in cast.items():
    _set_path(pure_cast, p, v)
  nnx.replace_by_pure_dict(abstract, pure_cast)
  return abstract


def _unavailable(name: str, why: str) -> ModelUnavailableError:
  return ModelUnavailableError(
    f"T5 weights {name!r} are not available: {why}. Provide a local directory with config.json "
    "and model.safetensors (or pytorch_model.bin), e.g. saved elsewhere with "
    "`T5ForConditionalGeneration.from_pretrained(name).save_pretrained(dir)`, and pass it as "
    "model.pretrained=/that/dir."
  )


def resolve_model_dir(name_or_dir: str, *, cache_dir: str | None = None) -> Path:
  """A local directory holding config.json + weights for ``name_or_dir``.

  Local paths are used as they are; hub names come from the HF cache, or are downloaded if the
  hub is reachable; anything else raises ``ModelUnavailableError`` quickly.
  """
  path = Path(name_or_dir).expanduser()
  if path.is_dir():
    return path
  if path.is_absolute() or name_or_dir.startswith((".", "~")) or path.exists():
    raise _unavailable(name_or_dir, f"{path} is not a directory")
  try:
    from huggingface_hub import snapshot_download
  except ImportError as e:  # pragma: no cover - transformers always brings it
    raise _unavailable(name_or_dir, "huggingface_hub is not installed") from e
  kw = dict(repo_id=name_or_dir, allow_patterns=_WEIGHT_PATTERNS, cache_dir=cache_dir)
  try:
    return Path(snapshot_download(local_files_only=True, **kw))
  except Exception:  # noqa: BLE001 - any cache miss means "try the network"
    pass
  if not hub.hub_reachable():
    raise _unavailable(
      name_or_dir, "offline (HF_HUB_OFFLINE or no network) and not in the local Hugging Face cache"
    )
  try:
    return Path(snapshot_download(**kw))
  except Exception as e:  # noqa: BLE001
    raise _unavailable(name_or_dir, f"download failed ({type(e).__name__}: {e})") from e


def read_state_dict(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
  """Float32 numpy state dict from safetensors (single or sharded) or pytorch_model.bin."""
  d = Path(model_dir)
  index = d / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (d / "model.safetensors").exists():
    files = ["model.safetensors"]
  elif (d / "pytorch_model.bin").exists():
    try:
      import torch
    except ImportError as e:
      raise ModelUnavailableError(
        f"{d / 'pytorch_model.bin'}: reading a torch checkpoint needs torch, which the "
        "framework's install leaves out: `make venv TORCH=1` (or pip install -r "
        "requirements-torch.txt), or save the model as model.safetensors."
      ) from e

    sd = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {k: v.float().numpy() for k, v in sd.items()}
  else:
    raise ModelUnavailableError(f"no model.safetensors or pytorch_model.bin in {d}")
  out: dict[str, np.ndarray] = {}
  for f in files:
    out.update(_read_safetensors(d / f))
  return out


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
  try:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(file).items()}
  except (TypeError, ValueError):  # bfloat16 has no numpy dtype here: read it as JAX arrays
    from safetensors.flax import load_file as load_jax

    return {k: np.asarray(v, np.float32) for k, v in load_jax(file).items()}


def load_t5(
  name_or_dir: str,
  *,
  dtype: str = "float32",
  param_dtype: str = "float32",
  dropout_rate: float | None = None,
  seed: int = 0,
  cache_dir: str | None = None,
) -> tuple[T5Config, T5]:
  """(config, model) with pre-trained weights; ``dtype`` is the compute dtype.

  ``seed`` only seeds the dropout streams (all weights come from the checkpoint). The model is
  returned in train mode (dropout on, as nnx's default); call ``model.eval()`` for inference.
  """
  model_dir = resolve_model_dir(name_or_dir, cache_dir=cache_dir)
  config_file = model_dir / "config.json"
  if not config_file.exists():
    raise _unavailable(name_or_dir, f"no config.json in {model_dir}")
  overrides: dict[str, Any] = dict(dtype=dtype, param_dtype=param_dtype)
  if dropout_rate is not None:
    overrides["dropout_rate"] = dropout_rate
  config = T5Config.from_hf_config(json.loads(config_file.read_text()), **overrides)
  params = state_dict_to_nnx(read_state_dict(model_dir), config)
  model = T5(config, rngs=nnx.Rngs(seed))
  nnx.update(model, params)
  return config, model
