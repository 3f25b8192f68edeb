"""Image datasets: offline digits, local CIFAR formats, unavailable sources, augmentation."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import tarfile
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from data import images as image_data
from data.images import (
  DatasetUnavailableError,
  augment,
  channel_stats,
  decoded_cache_paths,
  holdout_indices,
  load_image_dataset,
  normalize,
)


@pytest.fixture(scope="module")
def digits():
  return load_image_dataset("digits")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("GINGER_CACHE_DIR", str(tmp_path / "ginger-cache"))


# ---------------------------------------------------------------------------------- digits


def test_digits_offline_shapes_and_dtypes(digits):
  assert digits.train_images.shape == (1438, 8, 8, 1) and digits.train_images.dtype == np.uint8
  assert digits.val_images.shape == (359, 8, 8, 1) and digits.val_images.dtype == np.uint8
  assert digits.train_labels.dtype == np.int32 and digits.val_labels.dtype == np.int32
  assert digits.num_classes == 10 and set(np.unique(digits.train_labels)) == set(range(10))
  assert digits.train_images.max() == 255 and digits.train_images.min() == 0
  assert digits.name == "digits" and digits.val_split_name == "test"
  assert digits.mean.shape == digits.std.shape == (1,) and digits.mean.dtype == np.float32
  assert 0 < digits.mean[0] < 1 and 0 < digits.std[0] < 1


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
  """The table read from scikit-learn's data file is ``load_digits()``'s, and reading it does
  not import scikit-learn (``import sklearn.datasets`` fails inside; ~2.5 s a process)."""
  from sklearn.datasets import load_digits

  with monkeypatch.context() as patched:
    patched.setitem(sys.modules, "sklearn.datasets", None)
    pixels, labels = image_data._digits_table()
  expected = load_digits()
  np.testing.assert_array_equal(pixels, expected.images)
  np.testing.assert_array_equal(labels, expected.target)


def test_digits_ignores_source_and_is_deterministic(digits):
  again = load_image_dataset("digits", source="hf", seed=123)
  np.testing.assert_array_equal(again.val_images, digits.val_images)
  np.testing.assert_array_equal(again.train_labels, digits.train_labels)


def test_unknown_name_and_source():
  with pytest.raises(ValueError, match=r"'mnist'.*cifar100.*digits"):
    load_image_dataset("mnist")
  with pytest.raises(ValueError, match=r"'gcs'.*hf.*tfds.*local"):
    load_image_dataset("cifar10", source="gcs")


# ------------------------------------------------------------------------------ holdout


def test_holdout_split_sizes_and_disjointness(digits):
  ds = load_image_dataset("digits", holdout=200, seed=3)
  assert ds.val_split_name == "holdout"
  assert len(ds.val_labels) == 200 and len(ds.train_labels) == 1438 - 200
  train, held = holdout_indices(1438, 200, seed=3)
  assert set(train).isdisjoint(held) and set(train) | set(held) == set(range(1438))
  np.testing.assert_array_equal(ds.val_images, digits.train_images[held])
  np.testing.assert_array_equal(ds.train_labels, digits.train_labels[train])
  np.testing.assert_allclose(ds.mean, channel_stats(ds.train_images)[0])  # from train part
  other = holdout_indices(1438, 200, seed=4)[1]
  assert not np.array_equal(held, other)
  with pytest.raises(ValueError, match="holdout"):
    load_image_dataset("digits", holdout=1438)


# --------------------------------------------------------------------- local: image folder


def _write_image(path: Path, value: int, fmt: str) -> None:
  pixels = np.full((4, 5, 3), value, np.uint8)
  pixels[0, 0] = (255 - value, 0, value)  # not constant, so orientation matters
  Image.fromarray(pixels).save(path, format=fmt, quality=95)


def _make_image_folder(root: Path) -> Path:
  """train/ as PNG (exact pixels), test/ as JPEG; classes written in reverse name order."""
  for split, suffix, fmt in (("train", "png", "PNG"), ("test", "jpg", "JPEG")):
    for label, cls in [(1, "zebra"), (0, "ant")]:
      (root / split / cls).mkdir(parents=True)
      for i in range(3):
        _write_image(root / split / cls / f"{i}.{suffix}", 40 * label + 10 * i, fmt)
  return root


def test_local_image_folder_and_cache(tmp_path, monkeypatch):
  root = _make_image_folder(tmp_path / "tiny")
  with pytest.warns(UserWarning, match="2 classes, expected 10"):
    ds = load_image_dataset("cifar10", "local", root)
  assert ds.train_images.shape == (6, 4, 5, 3) and ds.train_images.dtype == np.uint8
  assert ds.num_classes == 2 and ds.val_split_name == "test"
  np.testing.assert_array_equal(ds.train_labels, [0, 0, 0, 1, 1, 1])  # ant=0, zebra=1
  np.testing.assert_array_equal(ds.train_images[:, 1, 1, 0], [0, 10, 20, 40, 50, 60])
  np.testing.assert_array_equal(ds.train_images[4, 0, 0], [205, 0, 50])
  np.testing.assert_array_equal(ds.val_labels, [0, 0, 0, 1, 1, 1])
  assert np.abs(ds.val_images[:, 2, 2, 1].astype(int) - [0, 10, 20, 40, 50, 60]).max() <= 8

  cache = decoded_cache_paths(root)[0]
  assert cache.is_file() and cache.parent == tmp_path  # next to the folder

  def no_decoding(data):
    raise AssertionError("decoded although the cache is valid")

  monkeypatch.setattr(image_data, "_decode_image", no_decoding)
  with pytest.warns(UserWarning):
    cached = load_image_dataset("cifar10", "local", root)
  np.testing.assert_array_equal(cached.train_images, ds.train_images)
  np.testing.assert_array_equal(cached.val_images, ds.val_images)

  _write_image(root / "train" / "ant" / "3.png", 30, "PNG")  # changed folder: stale cache
  with pytest.raises(AssertionError, match="decoded although"):
    load_image_dataset("cifar10", "local", root)


def test_local_image_archive(tmp_path):
  root = _make_image_folder(tmp_path / "src" / "tiny")
  archive = tmp_path / "tiny.tar.xz"
  with tarfile.open(archive, "w:xz") as tar:
    tar.add(root, arcname="tiny")
  with pytest.warns(UserWarning):
    from_folder = load_image_dataset("cifar10", "local", root)
    from_archive = load_image_dataset("cifar10", "local", archive)
  np.testing.assert_array_equal(from_archive.train_images, from_folder.train_images)
  np.testing.assert_array_equal(from_archive.val_labels, from_folder.val_labels)
  assert list((tmp_path / "ginger-cache").glob("tiny.tar.xz-*.npz"))


@pytest.mark.parametrize("mode, keep", [("w:xz", 0.6), ("w:gz", 0.6), ("w:xz", 0.02)])
def test_truncated_archive_names_the_file_and_the_cause(tmp_path, mode, keep):
  root = _make_image_folder(tmp_path / "src" / "tiny")
  archive = tmp_path / ("tiny.tar.xz" if mode == "w:xz" else "tiny.tar.gz")
  with tarfile.open(archive, mode) as tar:
    tar.add(root, arcname="tiny")
  data = archive.read_bytes()
  archive.write_bytes(data[: int(len(data) * keep)])  # an interrupted download
  with pytest.raises(DatasetUnavailableError) as info:  # was a 46-line EOFError traceback
    load_image_dataset("cifar10", "local", archive)
  message = str(info.value)
  assert str(archive) in message and "truncated or corrupt" in message
  assert info.value.__cause__ is None and info.value.__suppress_context__


def test_unreadable_image_names_the_file(tmp_path):
  root = _make_image_folder(tmp_path / "tiny")
  (root / "train" / "ant" / "1.png").write_bytes(b"not a png")
  with pytest.raises(DatasetUnavailableError, match=r"train/ant/1\.png is not a readable image"):
    load_image_dataset("cifar10", "local", root)


def test_corrupt_pickle_names_the_file(tmp_path):
  folder = tmp_path / "cifar-100-python"
  folder.mkdir()
  _write_pickle(folder / "train", _cifar_pickle(5, b"fine_labels", 0))
  (folder / "test").write_bytes(pickle.dumps(_cifar_pickle(3, b"fine_labels", 1))[:100])
  with pytest.raises(DatasetUnavailableError, match=r"cifar-100-python/test is not a cifar100"):
    load_image_dataset("cifar100", "local", folder)
  _write_pickle(folder / "test", {b"labels": [1]})  # a CIFAR-10 batch in a CIFAR-100 folder
  with pytest.raises(DatasetUnavailableError, match=r"test is not a cifar100 python pickle"):
    load_image_dataset("cifar100", "local", folder)


class _Payload:
  """What a tampered pickle holds: a call of any function on load."""

  def __reduce__(self):
    return (os.system, ("touch pwned",))


def test_a_pickle_naming_other_globals_is_refused_not_run(tmp_path, monkeypatch):
  """CIFAR batches are read with an unpickler that admits only numpy arrays: a pickle that
  calls a function on load (here os.system) is refused, naming the file, and nothing runs."""
  monkeypatch.chdir(tmp_path)
  folder = tmp_path / "cifar-100-python"
  folder.mkdir()
  _write_pickle(folder / "train", _cifar_pickle(5, b"fine_labels", 0))
  _write_pickle(folder / "test", {**_cifar_pickle(3, b"fine_labels", 1), b"x": _Payload()})
  with pytest.raises(DatasetUnavailableError, match=r"test is not a cifar100 python pickle.*os"):
    load_image_dataset("cifar100", "local", folder)
  assert not (tmp_path / "pwned").exists()


# The repo's shared/ folder, or the one beside the checkout (not part of the product).
SHARED_JPEG = next(
  (
    p / "shared" / "data" / "cifar10-jpeg.tar.xz"
    for p in Path(__file__).resolve().parents[1:3]
    if (p / "shared" / "data" / "cifar10-jpeg.tar.xz").is_file()
  ),
  Path("/nonexistent"),
)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_JPEG.is_file(), reason="no JPEG copy of CIFAR-10 here")
def test_real_cifar10_jpeg_archive():
  """The full JPEG CIFAR-10 archive (~10 s to decode once, then cached)."""
  ds = load_image_dataset("cifar10", "local", SHARED_JPEG)
  assert ds.train_images.shape == (50000, 32, 32, 3) and ds.val_images.shape == (10000, 32, 32, 3)
  assert np.bincount(ds.train_labels).tolist() == [5000] * 10
  np.testing.assert_allclose(ds.mean, [0.4914, 0.4822, 0.4465], atol=3e-3)


# -------------------------------------------------------------------- local: pickles


def _cifar_pickle(n: int, label_key: bytes, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {
    b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
    label_key: rng.integers(0, 10, n).tolist(),
    b"filenames": [b"x.png"] * n,
  }


def _write_pickle(path: Path, obj: dict) -> None:
  path.write_bytes(pickle.dumps(obj, protocol=2))


def test_local_cifar100_pickle_folder(tmp_path):
  folder = tmp_path / "cifar-100-python"
  folder.mkdir()
  train, test = _cifar_pickle(5, b"fine_labels", 0), _cifar_pickle(3, b"fine_labels", 1)
  _write_pickle(folder / "train", train)
  _write_pickle(folder / "test", test)
  _write_pickle(folder / "meta", {b"fine_label_names": [b"x"] * 100})
  for path in (folder, tmp_path):  # the pickle folder itself or its parent
    ds = load_image_dataset("cifar100", "local", path)
    assert ds.train_images.shape == (5, 32, 32, 3) and ds.val_images.shape == (3, 32, 32, 3)
    assert ds.num_classes == 100
    np.testing.assert_array_equal(ds.train_labels, train[b"fine_labels"])
    # rows are channel-major (1024 R, 1024 G, 1024 B), row-major within a channel
    np.testing.assert_array_equal(
      ds.train_images[2, :, :, 1], train[b"data"][2, 1024:2048].reshape(32, 32)
    )
    np.testing.assert_array_equal(ds.val_images[0, 0, 5], test[b"data"][0, [5, 1029, 2053]])


def test_local_cifar10_pickle_folder(tmp_path):
  folder = tmp_path / "cifar-10-batches-py"
  folder.mkdir()
  batches = [_cifar_pickle(2, b"labels", i) for i in range(6)]
  for i, batch in enumerate(batches[:5]):
    _write_pickle(folder / f"data_batch_{i + 1}", batch)
  _write_pickle(folder / "test_batch", batches[5])
  ds = load_image_dataset("cifar10", "local", tmp_path)
  assert ds.train_images.shape == (10, 32, 32, 3) and ds.num_classes == 10
  np.testing.assert_array_equal(ds.train_labels, sum((b[b"labels"] for b in batches[:5]), []))
  np.testing.assert_array_equal(ds.val_labels, batches[5][b"labels"])


def test_official_tarball_checksum_is_verified(tmp_path, monkeypatch):
  archive = tmp_path / "cifar-100-python.tar.gz"
  splits = {
    "train": _cifar_pickle(4, b"fine_labels", 0),
    "test": _cifar_pickle(2, b"fine_labels", 1),
  }
  with tarfile.open(archive, "w:gz") as tar:
    for name, obj in splits.items():
      payload = pickle.dumps(obj)
      info = tarfile.TarInfo(f"cifar-100-python/{name}")
      info.size = len(payload)
      tar.addfile(info, io.BytesIO(payload))
  with pytest.raises(DatasetUnavailableError, match="Checksum mismatch.*eb9058c3"):
    load_image_dataset("cifar100", "local", archive)
  # With a matching checksum the pickles are read straight from the tarball.
  md5 = hashlib.md5(archive.read_bytes()).hexdigest()
  monkeypatch.setitem(image_data.OFFICIAL_MD5, "cifar100", md5)
  ds = load_image_dataset("cifar100", "local", archive)
  np.testing.assert_array_equal(ds.train_labels, splits["train"][b"fine_labels"])
  assert ds.val_images.shape == (2, 32, 32, 3)
  with pytest.raises(DatasetUnavailableError, match="official cifar100 tarball, not cifar10"):
    load_image_dataset("cifar10", "local", archive)


# ------------------------------------------------------------------ unavailable sources


def test_missing_local_path_error(tmp_path):
  missing = tmp_path / "nowhere" / "cifar-100-python.tar.gz"
  with pytest.raises(DatasetUnavailableError) as info:
    load_image_dataset("cifar100", "local", missing)
  message = str(info.value)
  assert str(missing) in message
  assert "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz" in message
  assert "data.source=hf" in message and "data.source=tfds" in message
  with pytest.raises(DatasetUnavailableError, match="data.path"):
    load_image_dataset("cifar100", "local", None)
  assert issubclass(DatasetUnavailableError, RuntimeError)


def test_hf_offline_fails_fast(tmp_path, monkeypatch, no_waiting):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(DatasetUnavailableError, match=r"data\.source=local data\.path="):
    load_image_dataset("cifar100", "hf", tmp_path / "empty-hf-cache")


def test_hf_unreachable_network_forces_offline(tmp_path, monkeypatch, no_waiting):
  import datasets.config
  import huggingface_hub.constants

  monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
  monkeypatch.setattr(image_data.hub, "hub_reachable", lambda timeout=2.0: False)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as if imported online
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
  with pytest.raises(DatasetUnavailableError, match="unreachable"):
    load_image_dataset("cifar10", "hf", tmp_path / "empty-hf-cache")
  # the offline switch was scoped to the load
  assert datasets.config.HF_HUB_OFFLINE is False
  assert huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_hf_conversion(monkeypatch):
  import datasets

  def fake_load_dataset(repo, cache_dir=None):
    assert repo == "uoft-cs/cifar100"

    def split(n):
      images = [Image.fromarray(np.full((32, 32, 3), i, np.uint8)) for i in range(n)]
      return {"img": images, "fine_label": list(range(n)), "coarse_label": [0] * n}

    return {"train": split(4), "test": split(2)}

  monkeypatch.setattr(image_data.hub, "hub_reachable", lambda timeout=2.0: True)
  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  ds = load_image_dataset("cifar100", "hf")
  assert ds.train_images.shape == (4, 32, 32, 3) and ds.train_images.dtype == np.uint8
  np.testing.assert_array_equal(ds.train_labels, [0, 1, 2, 3])
  np.testing.assert_array_equal(ds.val_images[:, 0, 0, 0], [0, 1])
  assert ds.num_classes == 100


def test_tfds_installed_path(monkeypatch):
  calls = []

  def load(name, split, batch_size, download, data_dir):
    calls.append((name, split, batch_size))
    n = 3 if split == "train" else 2
    return {"image": np.zeros((n, 32, 32, 3), np.uint8), "label": np.arange(n)}

  fake = type(sys)("tensorflow_datasets")
  fake.load, fake.as_numpy = load, lambda tree: tree
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
  ds = load_image_dataset("cifar10", "tfds")
  assert calls == [("cifar10", "train", -1), ("cifar10", "test", -1)]
  assert ds.train_images.shape == (3, 32, 32, 3) and ds.val_labels.tolist() == [0, 1]


def test_tfds_missing_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
  with pytest.raises(DatasetUnavailableError, match="pip install tensorflow-datasets"):
    load_image_dataset("cifar10", "tfds")


# ------------------------------------------------------------------------- augmentation


@pytest.fixture(scope="module")
def batch():
  return np.random.default_rng(0).integers(0, 256, (64, 8, 8, 3), dtype=np.uint8)


MEAN = np.array([0.5, 0.4, 0.3], np.float32)
STD = np.array([0.25, 0.2, 0.3], np.float32)


def test_augment_deterministic_shape_dtype_and_jittable(batch):
  key = jax.random.key(0)
  out = augment(key, batch, MEAN, STD)
  assert out.shape == batch.shape and out.dtype == np.float32
  np.testing.assert_array_equal(out, augment(key, batch, MEAN, STD))
  assert not np.array_equal(out, augment(jax.random.key(1), batch, MEAN, STD))
  jitted = jax.jit(augment, static_argnames=("pad", "flip"))
  np.testing.assert_allclose(jitted(key, batch, MEAN, STD), out, rtol=1e-6, atol=1e-6)


def test_augment_identity_without_pad_and_flip(batch):
  out = augment(jax.random.key(0), batch, MEAN, STD, pad=0, flip=False)
  np.testing.assert_allclose(out, normalize(batch, MEAN, STD), rtol=1e-6, atol=1e-6)


def test_augment_flips_some_examples(batch):
  out = np.asarray(augment(jax.random.key(0), batch, MEAN, STD, pad=0, flip=True))
  plain = np.asarray(normalize(batch, MEAN, STD))
  mirrored = plain[:, :, ::-1]
  is_plain = np.all(np.isclose(out, plain, atol=1e-5), axis=(1, 2, 3))
  is_mirrored = np.all(np.isclose(out, mirrored, atol=1e-5), axis=(1, 2, 3))
  assert np.all(is_plain | is_mirrored)
  assert 10 < is_mirrored.sum() < 54  # about half, per example


def test_augment_crops_per_example(batch):
  pad = 2
  same = np.repeat(batch[:1], 64, axis=0)  # identical images: any difference is the crop
  out = np.asarray(augment(jax.random.key(0), same, MEAN, STD, pad=pad, flip=False))
  padded = np.pad(same[0], ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
  crops = {
    (dy, dx): np.asarray(normalize(padded[None, dy : dy + 8, dx : dx + 8], MEAN, STD))[0]
    for dy in range(2 * pad + 1)
    for dx in range(2 * pad + 1)
  }
  offsets = []
  for image in out:
    matches = [o for o, crop in crops.items() if np.allclose(image, crop, atol=1e-5)]
    assert matches, "output is not a crop of the reflect-padded image"
    offsets.append(matches[0])
  assert len(set(offsets)) > 5  # offsets differ between examples
  assert (pad, pad) in crops and any(o != (pad, pad) for o in offsets)


def test_normalisation_statistics(batch):
  mean, std = channel_stats(batch)
  flat = batch.reshape(-1, 3).astype(np.float64) / 255
  np.testing.assert_allclose(mean, flat.mean(0), rtol=1e-6)
  np.testing.assert_allclose(std, flat.std(0), rtol=1e-6)
  normed = np.asarray(normalize(batch, mean, std)).reshape(-1, 3)
  np.testing.assert_allclose(normed.mean(0), 0, atol=1e-5)
  np.testing.assert_allclose(normed.std(0), 1, atol=1e-5)
