"""Offline, a run that needs a tokenizer, data and weights lists everything missing at once,
with config keys that work (issue: three reruns, one missing piece each, and `model.path`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from data import xsum
from data.images import DatasetUnavailableError

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
  """Offline, with Hugging Face caches that hold nothing (also on a machine that has t5-small)."""
  import datasets.config
  import huggingface_hub.constants

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def test_xsum_t5_full_offline_lists_tokenizer_data_and_weights(empty_hf_cache, no_waiting):
  from models.tasks import build_task

  with initialize_config_dir(config_dir=CONFIGS, version_base=None):
    cfg = compose(config_name="config", overrides=["experiment=xsum_t5_full"])
  with pytest.raises(xsum.MissingInputsError) as info:
    build_task(cfg)
  message = str(info.value)
  assert message.startswith("3 inputs of this run are not available here")
  for name, key in [
    ("tokenizer", "data.tokenizer="),
    ("data", "data.source=local data.path="),
    ("weights", "model.pretrained="),
  ]:
    line = next(line for line in message.splitlines() if line.startswith(f"  - {name}: "))
    assert key in line, line
  assert "model.path" not in message  # Hydra rejects that key
  assert isinstance(info.value, DatasetUnavailableError)  # a user error: message, no traceback


def test_one_missing_input_keeps_its_own_error():
  def missing():
    raise xsum.TokenizerUnavailableError("tokenizer 'x' is not available")

  with pytest.raises(xsum.TokenizerUnavailableError, match="'x'"):
    xsum.load_inputs({"tokenizer": missing, "data": lambda: 1})


def test_other_errors_are_bugs_and_raise_at_once():
  calls = []

  def bug():
    raise KeyError("a bug")

  with pytest.raises(KeyError):
    xsum.load_inputs({"data": bug, "weights": lambda: calls.append(1)})
  assert calls == []


def test_everything_available_returns_every_result():
  assert xsum.load_inputs({"a": lambda: 1, "b": lambda: None}) == {"a": 1, "b": None}


def test_a_failed_hub_load_does_not_suggest_the_hub_again(monkeypatch):
  """Offline, CIFAR-100 from Hugging Face fails fast; the message names the local route and
  tfds, not data.source=hf, the source that just failed."""
  from data import hub, images

  def offline(repo, cache_dir):
    raise hub.HubLoadError(f"{repo} is not in the cache and the Hub is offline")

  monkeypatch.setattr(hub, "load_dataset", offline)
  with pytest.raises(DatasetUnavailableError) as info:
    images.load_image_dataset("cifar100", "hf")
  message = str(info.value)
  assert "data.source=local data.path=" in message and "data.source=tfds" in message
  assert "data.source=hf" not in message
