"""XSUM data pipeline: sources, offline errors, on-the-fly tokenizer, token cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from data import xsum
from data.xsum import (
  DatasetUnavailableError,
  SentencePieceTokenizer,
  TokenizerUnavailableError,
  load_tokenizer,
  load_xsum,
  tokenize_split,
  train_sentencepiece,
)

REPO = Path(__file__).resolve().parents[1]
REAL_SAMPLE = [p / "data" / "xsum-1000.jsonl" for p in (REPO.parent / "shared", REPO / "shared")]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("ginger-cache")


@pytest.fixture(scope="module")
def demo_tok(cache) -> SentencePieceTokenizer:
  return load_tokenizer("demo", cache_dir=cache)


def _rows(n: int) -> list[dict]:
  return [
    {"document": f"Document number {i}. It has two sentences.", "summary": f"Summary {i}."}
    for i in range(n)
  ]


def test_demo_corpus_is_deterministic_and_learnable():
  a = load_xsum("demo", splits=("train", "validation", "test"))
  b = load_xsum("demo", splits=("train", "validation", "test"))
  assert a == b
  assert {k: len(v) for k, v in a.items()} == xsum.DEMO_SIZES
  assert a["train"][0] != a["validation"][0]
  for ex in a["train"][:40]:  # the summary's capitalised names all appear in the document
    names = [w.strip(".,") for w in ex["summary"].split()[1:] if w[:1].isupper()]
    assert all(n in ex["document"] for n in names), ex
  assert len(load_xsum("demo", limit=7)["train"]) == 7


def test_demo_tokenizer_conventions_and_cache(cache, demo_tok, monkeypatch):
  assert (demo_tok.pad_id, demo_tok.eos_id, demo_tok.sp.unk_id()) == (0, 1, 2)
  assert 512 <= demo_tok.vocab_size <= 1000
  assert demo_tok.sp.bos_id() == -1
  text = "Ashford Rovers beat Stoneby United 2-1."
  assert demo_tok.decode(demo_tok.encode([text])[0] + [1, 0, 0]) == text
  import sentencepiece

  def no_training(*a, **k):
    raise AssertionError("retrained although cached")

  monkeypatch.setattr(sentencepiece.SentencePieceTrainer, "train", no_training)
  again = load_tokenizer("demo", cache_dir=cache)
  assert again.fingerprint == demo_tok.fingerprint
  assert len(list((cache / "spm").glob("*.model"))) == 1


def test_tokenize_split_shapes_masks_eos(cache, demo_tok, monkeypatch):
  examples = load_xsum("demo", splits=("validation",))["validation"][:16]
  arrays = tokenize_split(examples, demo_tok, max_source_len=48, max_target_len=40, cache_dir=cache)
  assert set(arrays) == {"input_ids", "attention_mask", "labels", "decoder_attention_mask"}
  assert arrays["input_ids"].shape == arrays["attention_mask"].shape == (16, 48)
  assert arrays["labels"].shape == arrays["decoder_attention_mask"].shape == (16, 40)
  pairs = (("input_ids", "attention_mask"), ("labels", "decoder_attention_mask"))
  for ids_key, mask_key in pairs:
    ids, mask = arrays[ids_key], arrays[mask_key]
    assert ids.dtype == mask.dtype == np.int32
    lengths = mask.sum(1)
    assert np.all(ids[np.arange(16), lengths - 1] == 1)  # EOS closes every row
    assert np.all((ids == 0) == (mask == 0))  # pad exactly where masked (no pad inside)
    assert np.all(np.diff(mask, axis=1) <= 0)  # masks are prefixes
  assert np.all(arrays["attention_mask"].sum(1) == 48)  # documents were truncated (+EOS)
  assert demo_tok.decode(arrays["labels"][0]) == examples[0]["summary"]
  src = demo_tok.decode(arrays["input_ids"][0])
  assert src.startswith("summarize: ") and src[11:40] == examples[0]["document"][:29]

  def no_encoding(*a, **k):
    raise AssertionError("re-tokenized although cached")

  monkeypatch.setattr(demo_tok, "encode", no_encoding)
  cached = tokenize_split(examples, demo_tok, max_source_len=48, max_target_len=40, cache_dir=cache)
  assert all(np.array_equal(cached[k], arrays[k]) for k in arrays)


def test_pad_to_longest():
  tok = xsum.HFTokenizer.__new__(xsum.HFTokenizer)  # a stand-in with the same interface
  tok.encode = lambda texts: [[5] * len(t) for t in texts]
  tok.pad_id, tok.eos_id, tok.fingerprint = 0, 1, "fake"
  out = tokenize_split(
    [{"document": "abc", "summary": "x"}], tok, prefix="", cache=False, pad_to_longest=True
  )
  np.testing.assert_array_equal(out["input_ids"], [[5, 5, 5, 1]])
  np.testing.assert_array_equal(out["labels"], [[5, 1]])


def test_local_jsonl_file_and_folder(tmp_path):
  file = tmp_path / "all.jsonl"
  file.write_text("\n".join(json.dumps(r) for r in _rows(20)) + "\n\n")
  data = load_xsum("local", file)
  assert [len(data["train"]), len(data["validation"])] == [18, 2]
  assert data["validation"][0]["summary"] == "Summary 18."  # last 10%, file order
  assert load_xsum("local", str(file), limit=5)["train"] == _rows(5)
  with pytest.raises(DatasetUnavailableError, match="single file"):
    load_xsum("local", file, splits=("test",))
  folder = tmp_path / "xsum"
  folder.mkdir()
  for split, n in (("train", 6), ("validation", 3)):
    (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in _rows(n)))
  data = load_xsum("local", folder)
  assert [len(data["train"]), len(data["validation"])] == [6, 3]
  with pytest.raises(DatasetUnavailableError, match="test.jsonl"):
    load_xsum("local", folder, splits=("train", "test"))
  with pytest.raises(DatasetUnavailableError):
    load_xsum("local", tmp_path / "missing.jsonl")
  with pytest.raises(DatasetUnavailableError):
    load_xsum("local", None)
  (tmp_path / "bad.jsonl").write_text('{"text": "no summary"}\n')
  with pytest.raises(DatasetUnavailableError, match="bad.jsonl:1: expected an object with"):
    load_xsum("local", tmp_path / "bad.jsonl")
  with pytest.raises(ValueError):
    load_xsum("nope")


@pytest.mark.parametrize(
  "content, cause",
  [
    (b"", r"holds no examples \(the file is empty or blank\)"),  # said "batch_size 16 is larger"
    (b"\n\n  \n", r"holds no examples"),
    (b"<html>502 Bad Gateway</html>\n", r":1: not valid JSON \(Expecting value at column 1\)"),
    (b'{"document": "d", "summary": "s"}\n{"document": "d", "summ', r":2: not valid JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", r"not UTF-8 text near line 1"),
    (b'["document", "summary"]\n', r":1: expected an object with 'document' and 'summary'"),
  ],
)
def test_bad_jsonl_names_the_file_and_the_cause(tmp_path, content, cause):
  file = tmp_path / "xsum-sample.jsonl"
  file.write_bytes(content)
  for path in (file, tmp_path):  # one file, or a folder's train.jsonl
    if path == tmp_path:
      file.rename(tmp_path / "train.jsonl")
      (tmp_path / "validation.jsonl").write_text(json.dumps(_rows(1)[0]))
      file = tmp_path / "train.jsonl"
    with pytest.raises(DatasetUnavailableError, match=re.escape(str(file)) + ".*" + cause):
      load_xsum("local", path)


def test_single_file_too_small_for_a_validation_split(tmp_path):
  file = tmp_path / "two.jsonl"
  file.write_text("\n".join(json.dumps(r) for r in _rows(2)))
  with pytest.raises(DatasetUnavailableError, match=r"2 example\(s\): its last 10%.*empty"):
    load_xsum("local", file)


@pytest.mark.skipif(not any(p.exists() for p in REAL_SAMPLE), reason="shared XSUM sample absent")
def test_real_xsum_sample(demo_tok):
  path = next(p for p in REAL_SAMPLE if p.exists())
  data = load_xsum("local", path)
  assert [len(data["train"]), len(data["validation"])] == [900, 100]
  assert all(ex["document"] and ex["summary"] for ex in data["train"])
  arrays = tokenize_split(data["validation"][:8], demo_tok, cache=False)
  assert arrays["input_ids"].shape == (8, 512) and arrays["labels"].shape == (8, 128)
  assert np.all(arrays["labels"][np.arange(8), arrays["decoder_attention_mask"].sum(1) - 1] == 1)


def test_offline_sources_fail_fast_and_clearly(monkeypatch, tmp_path, no_waiting):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(DatasetUnavailableError, match="data.source=local"):
    load_xsum("hf", tmp_path / "hf-cache")
  with pytest.raises(TokenizerUnavailableError, match="not available"):
    load_tokenizer("ginger-tests/no-such-tokenizer")
  try:
    import tensorflow_datasets  # noqa: F401
  except ImportError:
    with pytest.raises(DatasetUnavailableError, match="tensorflow-datasets"):
      load_xsum("tfds")


def test_hf_tokenizer_directory_matches_sentencepiece(tmp_path, cache):
  """A local T5-style tokenizer dir (spiece.model) goes through transformers' AutoTokenizer."""
  texts = [ex["document"] for ex in load_xsum("demo", splits=("validation",))["validation"]]
  model = train_sentencepiece(texts, vocab_size=300, model_type="unigram", cache_dir=cache)
  folder = tmp_path / "tok"
  folder.mkdir()
  (folder / "spiece.model").write_bytes(model.read_bytes())
  (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))
  (folder / "tokenizer_config.json").write_text(
    json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0})
  )
  hf = load_tokenizer(str(folder))
  sp = load_tokenizer(str(model))
  assert isinstance(hf, xsum.HFTokenizer) and (hf.pad_id, hf.eos_id) == (0, 1)
  assert hf.encode(texts[:4]) == sp.encode(texts[:4])
  assert hf.decode(hf.encode(texts[:1])[0] + [1, 0]) == texts[0]
