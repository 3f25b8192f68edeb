"""Long host-side work shows progress (image decoding, evaluation), and ``eval_examples``
evaluates on the first N examples of the evaluation split."""

from __future__ import annotations

import io
import logging
import types

import numpy as np
from omegaconf import OmegaConf
from PIL import Image

from data import images
from data.progress import Ticker
from training import evaluation, run_record


def _recording_log(lines):
  log = logging.getLogger("test_progress")
  log.info = lambda fmt, *args: lines.append(fmt % args)  # type: ignore[method-assign]
  return log


def test_a_ticker_prints_every_interval_and_at_the_end():
  lines, now = [], [0.0]
  ticker = Ticker(_recording_log(lines), "work", 100, "items", interval_s=10, clock=lambda: now[0])
  for done in range(1, 101):
    now[0] = done * 0.5  # 50 s in all
    ticker.tick(done)
  assert lines == [f"work: {d}/100 items ({d // 2} s)" for d in (20, 40, 60, 80, 100)]


def test_a_short_job_prints_nothing_unless_announced():
  lines = []
  ticker = Ticker(_recording_log(lines), "work", 3, "items", clock=lambda: 0.0)
  for done in (1, 2, 3):
    ticker.tick(done)
  assert lines == []
  Ticker(_recording_log(lines), "decoding", 3, "images", announce=True)
  assert lines == ["decoding: 3 images"]


def _jpeg() -> bytes:
  out = io.BytesIO()
  Image.new("RGB", (4, 4), (10, 20, 30)).save(out, format="JPEG")
  return out.getvalue()


def test_decoding_images_says_so(caplog, tmp_path):
  data = _jpeg()
  entries = [
    (split, cls, f"{i}.jpg", lambda: data)
    for split in ("train", "test")
    for cls in "ab"
    for i in (0, 1)
  ]
  with caplog.at_level(logging.INFO, logger="data.images"):
    images._decode_entries(entries, tmp_path)
  assert f"decoding the train images of {tmp_path} (cached afterwards): 4 images" in caplog.text


class _Task:
  num_val, eval_split = 1000, "test"

  def eval_metrics(self, sums):
    return {"val_accuracy": 100.0 * sums["correct"] / sums["count"]}

  def model_with(self, *args):
    return None

  def generation_metrics(self, model):
    return {}


def _evaluate(eval_examples):
  seen = []

  def eval_step(trainable, frozen, rest, arrays, idx):
    seen.append(idx)
    return {"correct": np.float32(np.sum(idx % 2 == 0)), "count": np.float32(len(idx))}

  rc = types.SimpleNamespace(eval_batch_size=300, eval_examples=eval_examples)
  state = types.SimpleNamespace(trainable=None, rest=None)
  metrics = evaluation.evaluate(_Task(), eval_step, state, None, None, rc)
  return np.concatenate(seen), metrics


def test_eval_examples_evaluates_the_first_n():
  every, _ = _evaluate(None)
  assert np.array_equal(every, np.arange(1000))
  first, metrics = _evaluate(450)
  assert np.array_equal(first, np.arange(450))
  assert metrics["val_accuracy"] == 100.0 * 225 / 450


def test_eval_examples_null_keeps_the_fingerprints_of_runs_made_before_the_key():
  base = {"name": "demo", "seed": 0, "optimizer": {"name": "adam"}, "model": {}, "data": {}}
  unset = run_record.fingerprint(OmegaConf.create(base))
  assert run_record.fingerprint(OmegaConf.create({**base, "eval_examples": None})) == unset
  assert run_record.fingerprint(OmegaConf.create({**base, "eval_examples": 100})) != unset
