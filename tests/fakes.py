"""Small on-disk stand-ins for real data and checkpoints, built by the tests themselves."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np


def cifar_pickle_folder(root: Path, name: str, n_train: int = 48, n_test: int = 24) -> Path:
  """A folder in the official CIFAR python-pickle layout (cifar10 or cifar100)."""
  rng = np.random.default_rng(0)
  folder = root / ("cifar-100-python" if name == "cifar100" else "cifar-10-batches-py")
  folder.mkdir(parents=True)
  key, classes = (b"fine_labels", 100) if name == "cifar100" else (b"labels", 10)

  def split(n):
    return {
      b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
      key: rng.integers(0, classes, n).tolist(),
      b"filenames": [b"x.png"] * n,
    }

  def write(path, obj):
    path.write_bytes(pickle.dumps(obj, protocol=2))

  if name == "cifar100":
    write(folder / "train", split(n_train))
    write(folder / "test", split(n_test))
    write(folder / "meta", {b"fine_label_names": [b"x"] * 100})
  else:
    for i in range(5):
      write(folder / f"data_batch_{i + 1}", split(n_train // 5))
    write(folder / "test_batch", split(n_test))
  return folder


def tiny_hf_t5_dir(root: Path, vocab_size: int) -> Path:
  """A random tiny T5 v1.0 in Hugging Face's layout (config.json + model.safetensors, the keys
  and [out, in] shapes transformers saves), written with numpy: no torch or transformers import
  (~9 s on 2 cores). tests/test_t5.py checks the port against transformers' own model."""
  import safetensors.numpy

  d_model, d_kv, d_ff, heads, buckets = 32, 8, 64, 2, 32
  inner = heads * d_kv
  config = {
    "model_type": "t5",
    "vocab_size": vocab_size,
    "d_model": d_model,
    "d_kv": d_kv,
    "d_ff": d_ff,
    "num_layers": 1,
    "num_decoder_layers": 1,
    "num_heads": heads,
    "relative_attention_num_buckets": buckets,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
  }
  rng = np.random.default_rng(0)
  normal = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
  ones = lambda n: np.ones(n, np.float32)  # noqa: E731

  def attention(prefix: str) -> dict[str, np.ndarray]:
    out = {f"{prefix}.{w}.weight": normal(inner, d_model) for w in "qkv"}
    return {**out, f"{prefix}.o.weight": normal(d_model, inner)}

  def mlp(prefix: str) -> dict[str, np.ndarray]:
    return {
      f"{prefix}.wi.weight": normal(d_ff, d_model),
      f"{prefix}.wo.weight": normal(d_model, d_ff),
    }

  tensors = {"shared.weight": normal(vocab_size, d_model)}
  for side in ("encoder", "decoder"):
    block = f"{side}.block.0.layer"
    tensors |= attention(f"{block}.0.SelfAttention")
    tensors[f"{block}.0.SelfAttention.relative_attention_bias.weight"] = normal(buckets, heads)
    tensors[f"{block}.0.layer_norm.weight"] = ones(d_model)
    tensors[f"{side}.final_layer_norm.weight"] = ones(d_model)
  tensors |= mlp("encoder.block.0.layer.1.DenseReluDense")
  tensors["encoder.block.0.layer.1.layer_norm.weight"] = ones(d_model)
  tensors |= attention("decoder.block.0.layer.1.EncDecAttention")
  tensors["decoder.block.0.layer.1.layer_norm.weight"] = ones(d_model)
  tensors |= mlp("decoder.block.0.layer.2.DenseReluDense")
  tensors["decoder.block.0.layer.2.layer_norm.weight"] = ones(d_model)
  root.mkdir(parents=True, exist_ok=True)
  (root / "config.json").write_text(json.dumps(config, indent=2))
  safetensors.numpy.save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
  return root


def xsum_jsonl(path: Path, n: int = 40) -> Path:
  """Document/summary rows in XSUM's jsonl layout."""
  towns = ["Aberdeen", "Bristol", "Cardiff", "Dundee", "Exeter"]
  with path.open("w") as f:
    for i in range(n):
      town = towns[i % len(towns)]
      doc = (
        f"The council of {town} met on day {i}. Members discussed the new bridge and "
        f"agreed to fund it. Residents of {town} welcomed the decision."
      )
      f.write(
        json.dumps({"document": doc, "summary": f"{town} will fund a new bridge.", "id": str(i)})
        + "\n"
      )
  return path


# What tensorstore raises (a ValueError) when a write of an orbax checkpoint finds the disk full.
TENSORSTORE_NO_SPACE = (
  'RESOURCE_EXHAUSTED: Error writing "{name}" in OCDBT database at local file "{path}": '
  "Failed to write 2944780 bytes to file 5: No space left on device [os_error_code='28']"
)


def disk_full_from(step: int, raised: str = "tensorstore", setattr=setattr) -> None:
  """Makes orbax's checkpoints of ``step`` and later meet a full disk: the first array write
  of each fails as on a full filesystem, the others are written (still running when it fails,
  as on a real one). ``raised``: ``"tensorstore"`` (the ValueError tensorstore raises for
  ENOSPC, which orbax passes on) or ``"oserror"`` (``OSError(ENOSPC)``, as a Python write
  raises it). ``setattr``: ``monkeypatch.setattr`` in a test (the default patches for good, in
  a process of its own)."""
  import orbax.checkpoint as ocp

  handler = ocp.type_handlers.NumpyHandler
  write = handler._open_and_write
  failed: set[int] = set()

  async def full(self, value, tspec, ts_context):
    where = json.dumps(tspec)
    found = re.search(r"/checkpoints/(\d+)\.orbax-checkpoint-tmp", where)
    saved = int(found.group(1)) if found else -1
    if saved >= step and saved not in failed:
      failed.add(saved)
      path = re.search(r'"(/[^"]*)"', where).group(1)
      if raised == "oserror":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
      name = tspec.get("kvstore", {}).get("path", "")
      raise ValueError(TENSORSTORE_NO_SPACE.format(name=name, path=path))
    return await write(self, value, tspec, ts_context)

  setattr(handler, "_open_and_write", full)
