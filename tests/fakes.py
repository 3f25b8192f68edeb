"""Small on-disk stand-ins for real data and checkpoints, built by the tests themselves."""

from __future__ import annotations

import json
import pickle
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
  """A random tiny T5 saved by transformers (config.json + model.safetensors)."""
  import torch
  import transformers

  torch.manual_seed(0)
  config = transformers.T5Config(
    vocab_size=vocab_size,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=1,
    num_decoder_layers=1,
    num_heads=2,
    feed_forward_proj="relu",
    tie_word_embeddings=True,
    decoder_start_token_id=0,
  )
  transformers.T5ForConditionalGeneration(config).save_pretrained(root, safe_serialization=True)
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
