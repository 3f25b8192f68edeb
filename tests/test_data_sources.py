"""The README's commands get their data with the pinned requirements alone: the default source
of every dataset is Hugging Face ``datasets`` (pinned), tested here against a mocked Hub."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from PIL import Image

from data import hub, xsum
from data.images import DatasetUnavailableError, load_image_dataset

REPO = Path(__file__).resolve().parents[1]
# The experiments of the README's "Training" commands (no experiment: configs/config.yaml).
README_EXPERIMENTS = [
  None,
  "cifar100_resnet18",
  "cifar100_resnet50",
  "cifar10_resnet18",
  "xsum_t5_full",
  "xsum_t5_lora",
]
SOURCE_PACKAGE = {"hf": "datasets", "tfds": "tensorflow-datasets"}


def pinned() -> set[str]:
  lines = (REPO / "requirements.txt").read_text().splitlines()
  return {m.group(1).lower() for line in lines if (m := re.match(r"([A-Za-z0-9_.-]+)==", line))}


@pytest.mark.parametrize("experiment", README_EXPERIMENTS)
def test_default_source_of_every_readme_command_is_pinned(experiment):
  overrides = [] if experiment is None else [f"experiment={experiment}"]
  with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
    cfg = compose(config_name="config", overrides=overrides)
  assert cfg.data.source == "hf"
  assert SOURCE_PACKAGE[cfg.data.source] in pinned()


def test_tfds_stays_an_option_that_is_not_pinned():
  # tensorflow-datasets needs TensorFlow to prepare CIFAR; neither is pinned.
  assert not {"tensorflow-datasets", "tensorflow"} & pinned()


@pytest.fixture
def online(monkeypatch):
  """A reachable Hub whose ``datasets.load_dataset`` is the test's fake; records the calls."""
  import datasets

  calls: list[dict] = []
  for var in hub.OFFLINE_VARIABLES:
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as if imported online
  monkeypatch.setattr(hub, "hub_reachable", lambda timeout=2.0: True)

  def install(fake):
    def recorded(repo, **kwargs):
      calls.append({"repo": repo, "offline": datasets.config.HF_HUB_OFFLINE, **kwargs})
      return fake(repo, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recorded)
    return calls

  return install


def _cifar_split(n: int, offset: int = 0) -> dict:
  return {
    "img": [Image.fromarray(np.full((32, 32, 3), offset + i, np.uint8)) for i in range(n)],
    "fine_label": [(offset + i) % 100 for i in range(n)],
    "coarse_label": [0] * n,
  }


def test_cifar100_downloads_from_the_hub_by_default(online, tmp_path):
  calls = online(lambda repo, **kw: {"train": _cifar_split(6), "test": _cifar_split(3, 50)})
  ds = load_image_dataset("cifar100", path=tmp_path / "hf-cache")  # the default source
  assert calls == [
    {"repo": "uoft-cs/cifar100", "offline": False, "cache_dir": str(tmp_path / "hf-cache")}
  ]
  assert ds.train_images.shape == (6, 32, 32, 3) and ds.val_labels.tolist() == [50, 51, 52]
  assert ds.num_classes == 100 and ds.val_split_name == "test"


def test_xsum_repo_with_a_loading_script_is_read_from_the_parquet_export(online):
  rows = {
    s: [{"document": f"{s} doc {i}", "summary": f"{s} sum {i}", "id": str(i)} for i in range(3)]
    for s in ("train", "validation", "test")
  }

  def fake(repo, cache_dir=None, revision=None):
    if revision != hub.PARQUET_REVISION:  # what datasets >= 4 says of EdinburghNLP/xsum
      raise RuntimeError("Dataset scripts are no longer supported, but found xsum.py")
    return rows

  calls = online(fake)
  data = xsum.load_xsum("hf")
  assert [c.get("revision") for c in calls] == [None, hub.PARQUET_REVISION]
  assert calls[0]["repo"] == "EdinburghNLP/xsum"
  assert data["validation"][1] == {"document": "validation doc 1", "summary": "validation sum 1"}


def test_online_failure_names_the_repo_and_the_cause(online):
  def fake(repo, **kwargs):
    raise ConnectionError("502 Bad Gateway")

  online(fake)
  with pytest.raises(DatasetUnavailableError) as info:
    load_image_dataset("cifar10")
  message = str(info.value)
  assert "uoft-cs/cifar10" in message and "ConnectionError: 502 Bad Gateway" in message
  assert "data.source=local" in message  # how to provide it instead


def test_offline_tries_the_cached_parquet_export_too(monkeypatch):
  import datasets

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  seen = []

  def fake(repo, cache_dir=None, revision=None):
    seen.append(revision)
    if revision is None:
      raise ConnectionError("offline and not cached")
    return {"train": [{"document": "d", "summary": "s"}], "validation": []}

  monkeypatch.setattr(datasets, "load_dataset", fake)
  assert xsum.load_xsum("hf")["train"] == [{"document": "d", "summary": "s"}]
  assert seen == [None, hub.PARQUET_REVISION]
