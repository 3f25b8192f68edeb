"""Image classification datasets as whole in-memory arrays, plus on-device augmentation.

The training loop puts a whole split on the device and augments inside the jitted step, so
loaders return plain numpy arrays: uint8 NHWC images and int32 labels.

Sources (``source=``):
  * ``"local"``: ``path`` is the official CIFAR python-pickle tarball (md5-verified), its
    extracted folder, a folder laid out as ``train/<class>/*.jpg|png`` and
    ``test/<class>/*.jpg|png``, or a ``.tar.xz`` / ``.tar.gz`` of such a folder.
  * ``"hf"`` (the default): the Hugging Face Hub (``uoft-cs/cifar100``, ``uoft-cs/cifar10``)
    through ``datasets``, which requirements.txt pins.
  * ``"tfds"``: TensorFlow Datasets. Not pinned: it needs TensorFlow itself (a ~570 MB wheel)
    to download and prepare CIFAR (its builder encodes images with ``tf.image``) and to read
    it (``tfds.load`` returns a ``tf.data`` pipeline).
  * ``digits`` (scikit-learn's bundled 8x8 digits) ignores ``source`` and ``path``: it is
    always available offline.

A dataset that cannot be had raises :class:`DatasetUnavailableError` saying how to provide it;
there is never a silent fallback to other data.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import lzma
import os
import pickle
import tarfile
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from data import cache, hub
from data.progress import Ticker

log = logging.getLogger(__name__)

DATASETS: tuple[str, ...] = ("cifar100", "cifar10", "digits")
SOURCES: tuple[str, ...] = ("hf", "tfds", "local")
NUM_CLASSES: dict[str, int] = {"cifar100": 100, "cifar10": 10, "digits": 10}
IMAGE_CHANNELS: dict[str, int] = {"cifar100": 3, "cifar10": 3, "digits": 1}

OFFICIAL_URLS: dict[str, str] = {
  "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
  "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
}
OFFICIAL_MD5: dict[str, str] = {
  "cifar100": "eb9058c3a382ffc7106e4002c42a8d85",
  "cifar10": "c58f30108f718f92721af3b95e74349a",
}
# Folder inside the official tarball, pickle file names (train, test) and the label key.
PICKLE_LAYOUT: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], bytes]] = {
  "cifar100": ("cifar-100-python", ("train",), ("test",), b"fine_labels"),
  "cifar10": (
    "cifar-10-batches-py",
    tuple(f"data_batch_{i}" for i in range(1, 6)),
    ("test_batch",),
    b"labels",
  ),
}
HF_REPOS: dict[str, tuple[str, str, str]] = {  # repo, image field, label field
  "cifar100": ("uoft-cs/cifar100", "img", "fine_label"),
  "cifar10": ("uoft-cs/cifar10", "img", "label"),
}
IMAGE_SUFFIXES: tuple[str, ...] = (".jpg", ".jpeg", ".png")
TAR_SUFFIXES: tuple[str, ...] = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2")
DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0  # fixed, so the digits test split never depends on the run's seed
_CACHE_VERSION = "1"


class DatasetUnavailableError(RuntimeError):
  """The requested data cannot be loaded here; the message says how to provide it."""


# What a truncated or corrupt archive raises while it is read (xz, gzip, bz2, tar).
_ARCHIVE_ERRORS = (EOFError, tarfile.TarError, lzma.LZMAError, zlib.error, OSError)


@contextlib.contextmanager
def _reading(archive: Path) -> Iterator[None]:
  """Turns a truncated or corrupt archive's error into one naming the file and the cause."""
  try:
    yield
  except _ARCHIVE_ERRORS as e:
    cause = str(e) or type(e).__name__
    if isinstance(e, EOFError):
      cause = f"it ends early ({cause})"
    raise DatasetUnavailableError(
      f"{str(archive)!r} cannot be read to its end: {cause}. The file is truncated or corrupt "
      "(an interrupted download or copy?): download or build it again."
    ) from None


class ImageDataset(NamedTuple):
  """A classification dataset held in host memory.

  ``mean`` and ``std`` are per-channel float32 statistics in [0, 1] pixel units, computed
  exactly from ``train_images`` (the images actually trained on, i.e. after any holdout is
  removed). For CIFAR-100 they reproduce the usual constants (0.507, 0.487, 0.441) /
  (0.267, 0.256, 0.276).
  """

  train_images: np.ndarray  # uint8 (N, H, W, C)
  train_labels: np.ndarray  # int32 (N,)
  val_images: np.ndarray  # uint8 (M, H, W, C)
  val_labels: np.ndarray  # int32 (M,)
  num_classes: int
  mean: np.ndarray  # float32 (C,)
  std: np.ndarray  # float32 (C,)
  name: str
  val_split_name: str  # "test" or "holdout"


class _Splits(NamedTuple):
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int


def load_image_dataset(
  name: str,
  source: str = "hf",
  path: str | os.PathLike | None = None,
  *,
  holdout: int = 0,
  seed: int = 0,
) -> ImageDataset:
  """Loads a whole dataset into memory.

  Args:
    name: "cifar100", "cifar10" or "digits".
    source: "hf", "tfds" or "local" (ignored for "digits").
    path: for "local", the tarball or folder to read; for "hf"/"tfds", an optional cache or
      data directory.
    holdout: if > 0, the last ``holdout`` examples of a ``seed``-permutation of the training
      set become the validation set (``val_split_name="holdout"``), so learning rates can be
      tuned without touching the test split. Otherwise validation is the test split.
    seed: seed of the holdout permutation.
  """
  if name not in DATASETS:
    raise ValueError(f"Unknown dataset name {name!r}; allowed names: {list(DATASETS)}.")
  if source not in SOURCES:
    raise ValueError(f"Unknown data source {source!r}; allowed sources: {list(SOURCES)}.")
  if holdout < 0:
    raise ValueError(f"holdout must be >= 0, got {holdout}.")
  if name == "digits":
    splits = _load_digits()
  elif source == "local":
    splits = _load_local(name, path)
  elif source == "hf":
    splits = _load_hf(name, path)
  else:
    splits = _load_tfds(name, path)
  return _finalise(name, splits, holdout=holdout, seed=seed)


def _finalise(name: str, splits: _Splits, *, holdout: int, seed: int) -> ImageDataset:
  """Applies the holdout split, fixes dtypes and computes normalisation statistics."""
  train_x, train_y = splits.train_images, splits.train_labels
  if holdout:
    train_idx, val_idx = holdout_indices(len(train_y), holdout, seed)
    val_x, val_y = train_x[val_idx], train_y[val_idx]
    train_x, train_y = train_x[train_idx], train_y[train_idx]
    val_split_name = "holdout"
  else:
    val_x, val_y = splits.test_images, splits.test_labels
    val_split_name = "test"
  mean, std = channel_stats(train_x)
  return ImageDataset(
    train_images=np.ascontiguousarray(train_x, np.uint8),
    train_labels=np.ascontiguousarray(train_y, np.int32),
    val_images=np.ascontiguousarray(val_x, np.uint8),
    val_labels=np.ascontiguousarray(val_y, np.int32),
    num_classes=splits.num_classes,
    mean=mean,
    std=std,
    name=name,
    val_split_name=val_split_name,
  )


def holdout_indices(n: int, holdout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(train, holdout) indices: the holdout is the tail of a seeded permutation (both sorted)."""
  if not 0 < holdout < n:
    raise ValueError(f"holdout must be in (0, {n}) for a training set of {n}, got {holdout}.")
  perm = np.random.default_rng(seed).permutation(n)
  return np.sort(perm[:-holdout]), np.sort(perm[-holdout:])


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Exact per-channel mean and (population) std in [0, 1] units of uint8 NHWC images.

  Uses a 256-bin histogram per channel, so it needs no float copy of the dataset.
  """
  flat = images.reshape(-1, images.shape[-1])
  levels = np.arange(256, dtype=np.float64) / 255.0
  means, stds = [], []
  for ch in range(flat.shape[1]):
    counts = np.bincount(flat[:, ch], minlength=256).astype(np.float64)
    mean = counts @ levels / counts.sum()
    means.append(mean)
    stds.append(np.sqrt(counts @ (levels - mean) ** 2 / counts.sum()))
  return np.asarray(means, np.float32), np.asarray(stds, np.float32)


# ----------------------------------------------------------------------------------- digits


def _digits_table() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's bundled digits: ``(images (1797, 8, 8) of 0..16, labels)``.

  Read from the package's own data file, ``sklearn/datasets/data/digits.csv.gz`` (what
  ``sklearn.datasets.load_digits`` reads: 64 pixels then the label per row), found without
  importing scikit-learn, whose import takes ~2.5 s of every run's start-up; where the file
  is not there (another scikit-learn's layout), ``load_digits`` itself.
  """
  spec = importlib.util.find_spec("sklearn")
  folders = list(spec.submodule_search_locations or []) if spec else []
  table = [Path(f) / "datasets" / "data" / "digits.csv.gz" for f in folders]
  if table and table[0].is_file():
    rows = np.loadtxt(table[0], delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
  from sklearn.datasets import load_digits

  digits = load_digits()
  return digits.images, digits.target


def _load_digits() -> _Splits:
  """scikit-learn's bundled 8x8 digits (16 grey levels scaled to 0..255), 80/20 split."""
  images, labels = _digits_table()
  images = np.round(images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  labels = labels.astype(np.int32)
  perm = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(labels))
  n_test = int(len(labels) * DIGITS_TEST_FRACTION)
  train, test = perm[:-n_test], perm[-n_test:]
  return _Splits(images[train], labels[train], images[test], labels[test], 10)


# ------------------------------------------------------------------------------------ local


def _how_to_get(name: str, failed: str | None = None) -> str:
  """How to get ``name``'s data, suggesting every source but the one that just ``failed``."""
  others = {
    "hf": "data.source=hf (Hugging Face datasets, pinned)",
    "tfds": "data.source=tfds (pip install tensorflow-datasets tensorflow)",
  }
  others = [text for source, text in others.items() if source != failed]
  return (
    f"Download the official tarball from {OFFICIAL_URLS[name]} and pass "
    f"data.source=local data.path=/path/to/{Path(OFFICIAL_URLS[name]).name} (or its "
    "extracted folder, or a train/<class>/*.jpg + test/<class>/*.jpg folder or .tar.xz of "
    f"one), or use {' or '.join(others)} on a machine with network access."
  )


def _load_local(name: str, path: str | os.PathLike | None) -> _Splits:
  if path is None:
    raise DatasetUnavailableError(f"data.source=local needs data.path. {_how_to_get(name)}")
  root = Path(path).expanduser()
  if not root.exists():
    raise DatasetUnavailableError(
      f"Local {name} data not found at {str(root)!r}. " + _how_to_get(name)
    )
  if root.is_dir():
    pickle_dir = _find_pickle_dir(name, root)
    if pickle_dir is not None:
      return _read_pickle_splits(name, lambda f: (pickle_dir / f).read_bytes(), pickle_dir)
    if (root / "train").is_dir() and (root / "test").is_dir():
      return _load_image_folder(name, root)
    raise DatasetUnavailableError(
      f"{str(root)!r} holds neither the {name} python pickles "
      f"({', '.join(PICKLE_LAYOUT[name][1] + PICKLE_LAYOUT[name][2])}) nor train/ and test/ "
      f"class folders. {_how_to_get(name)}"
    )
  with _reading(root):
    is_tar = tarfile.is_tarfile(root)
  if is_tar or root.name.endswith(TAR_SUFFIXES):  # a named archive: say why it is unreadable
    return _load_archive(name, root)
  raise DatasetUnavailableError(
    f"{str(root)!r} is not a folder or a tar archive. " + _how_to_get(name)
  )


def _find_pickle_dir(name: str, root: Path) -> Path | None:
  """The folder holding the pickles: ``root`` itself or its official sub-folder."""
  subdir, train_files, test_files, _ = PICKLE_LAYOUT[name]
  for candidate in (root, root / subdir):
    if all((candidate / f).is_file() for f in train_files + test_files):
      return candidate
  return None


# What CIFAR python batches hold: dicts of bytes, lists, ints and numpy arrays.
# Anything else in a local file (a tampered pickle can name any callable) is refused.
_PICKLE_GLOBALS = {
  (f"numpy.{core}.{module}", name)
  for core in ("core", "_core")
  for module, name in (
    ("multiarray", "_reconstruct"),
    ("multiarray", "scalar"),
    ("numeric", "_frombuffer"),
  )
} | {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}  # bytes at protocol 2


class _BatchUnpickler(pickle.Unpickler):
  """An unpickler that builds only what :data:`_PICKLE_GLOBALS` admits."""

  def find_class(self, module: str, name: str):
    if (module, name) not in _PICKLE_GLOBALS:
      raise pickle.UnpicklingError(
        f"global {module}.{name} is not allowed in a CIFAR batch (only numpy arrays)"
      )
    return super().find_class(module, name)


def _loads(data: bytes):
  return _BatchUnpickler(io.BytesIO(data), encoding="bytes").load()


def _read_pickle_splits(name: str, read: Callable[[str], bytes], where: Path) -> _Splits:
  """Reads the official pickle format: dicts with b"data" (N, 3072) in CHW order."""
  _, train_files, test_files, label_key = PICKLE_LAYOUT[name]

  def unpickle(file: str) -> dict:
    try:
      batch = _loads(read(file))
      if not (isinstance(batch, dict) and b"data" in batch and label_key in batch):
        raise ValueError(f"no {b'data'!r} and {label_key!r} entries")
      return batch
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
      raise DatasetUnavailableError(
        f"{where}/{file} is not a {name} python pickle ({type(e).__name__}: {e}). "
        + _how_to_get(name)
      ) from None

  def read_split(files: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    batches = [unpickle(f) for f in files]
    data = np.concatenate([np.asarray(b[b"data"], np.uint8) for b in batches])
    labels = np.concatenate([np.asarray(b[label_key], np.int64) for b in batches])
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels.astype(np.int32)

  return _Splits(*read_split(train_files), *read_split(test_files), NUM_CLASSES[name])


def _file_md5(path: Path) -> str:
  digest = hashlib.md5()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _load_archive(name: str, archive: Path) -> _Splits:
  """The official pickle tarball (md5-checked) or a tar of a class-folder image tree."""
  md5 = _file_md5(archive)
  official = {digest: ds for ds, digest in OFFICIAL_MD5.items()}
  if md5 in official:
    if official[md5] != name:
      raise DatasetUnavailableError(
        f"{str(archive)!r} is the official {official[md5]} tarball, not {name}."
      )
    wanted = set(PICKLE_LAYOUT[name][1] + PICKLE_LAYOUT[name][2])
    with _reading(archive), tarfile.open(archive) as tar:  # one pass: no seeking
      files = {
        PurePosixPath(m.name).name: tar.extractfile(m).read()
        for m in tar
        if m.isfile() and PurePosixPath(m.name).name in wanted
      }
    return _read_pickle_splits(name, files.__getitem__, archive)
  official_names = {Path(url).name: ds for ds, url in OFFICIAL_URLS.items()}
  if archive.name in official_names:
    ds = official_names[archive.name]
    raise DatasetUnavailableError(
      f"Checksum mismatch for {str(archive)!r}: md5 {md5}, expected {OFFICIAL_MD5[ds]}. "
      f"The file is corrupt or incomplete; download it again from {OFFICIAL_URLS[ds]}."
    )
  cache_key = f"{archive.name}-{md5[:16]}"
  paths = [cache.cache_root() / f"{cache_key}.npz"]
  return _cached_decode(name, cache_key, paths, lambda: _archive_entries(archive), archive)


# Image-folder decoding. An entry is (split, class name, file name, bytes reader).
_Entry = tuple[str, str, str, Callable[[], bytes]]


def _is_image(file_name: str) -> bool:
  return not file_name.startswith(".") and file_name.lower().endswith(IMAGE_SUFFIXES)


def _archive_entries(archive: Path) -> list[_Entry]:
  """Reads every ``.../{train,test}/<class>/<image>`` member in one sequential pass."""
  entries = []
  with _reading(archive), tarfile.open(archive) as tar:
    for member in tar:
      parts = PurePosixPath(member.name).parts
      if member.isfile() and len(parts) >= 3 and parts[-3] in ("train", "test"):
        if _is_image(parts[-1]):
          data = tar.extractfile(member).read()
          entries.append((parts[-3], parts[-2], parts[-1], lambda d=data: d))
  return entries


def _folder_entries(root: Path) -> list[_Entry]:
  entries = []
  for split in ("train", "test"):
    for class_dir in sorted(p for p in (root / split).iterdir() if p.is_dir()):
      for f in sorted(class_dir.iterdir()):
        if f.is_file() and _is_image(f.name):
          entries.append((split, class_dir.name, f.name, f.read_bytes))
  return entries


def _folder_fingerprint(root: Path) -> str:
  """Hash of the image files' names, sizes and mtimes: a changed folder invalidates its cache."""
  digest = hashlib.sha1(_CACHE_VERSION.encode())
  for split in ("train", "test"):
    for dirpath, dirnames, filenames in sorted(os.walk(root / split)):
      dirnames.sort()
      for f in sorted(filenames):
        if _is_image(f):
          st = os.stat(os.path.join(dirpath, f))
          rel = os.path.relpath(os.path.join(dirpath, f), root)
          digest.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\n".encode())
  return digest.hexdigest()


def decoded_cache_paths(root: str | os.PathLike) -> list[Path]:
  """Where the decoded arrays of image folder ``root`` are cached, in order of preference.

  Next to the folder (``<root>.decoded.npz``), or in the cache directory when that is not
  writable.
  """
  root = Path(root).resolve()
  path_hash = hashlib.sha1(str(root).encode()).hexdigest()[:12]
  return [
    root.parent / f"{root.name}.decoded.npz",
    cache.cache_root() / f"{root.name}-{path_hash}.decoded.npz",
  ]


def _load_image_folder(name: str, root: Path) -> _Splits:
  key = _folder_fingerprint(root)
  return _cached_decode(name, key, decoded_cache_paths(root), lambda: _folder_entries(root), root)


def _cached_decode(
  name: str, key: str, cache_paths: list[Path], entries: Callable[[], list[_Entry]], where: Path
) -> _Splits:
  """Loads decoded arrays from the first valid cache, else decodes and writes the cache.

  Decoding 60k JPEGs takes ~10 s; a cache hit is a single uncompressed ``np.load``.
  """
  for path in cache_paths:
    splits = _read_cache(path, key)
    if splits is not None:
      _check_class_count(name, splits.num_classes, path)
      return splits
  splits = _decode_entries(entries(), where)
  _check_class_count(name, splits.num_classes, cache_paths[0].parent)
  for path in cache_paths:
    if _write_cache(path, key, splits):
      break
  return splits


def _check_class_count(name: str, num_classes: int, where: Path) -> None:
  if num_classes != NUM_CLASSES[name]:
    warnings.warn(
      f"{name} image folder ({where}) has {num_classes} classes, expected "
      f"{NUM_CLASSES[name]}; using {num_classes}.",
      stacklevel=3,
    )


def _read_cache(path: Path, key: str) -> _Splits | None:
  arrays = cache.load_arrays(path)
  if arrays is None or str(arrays.get("key")) != key:
    return None  # absent, unreadable, or decoded from other files: decode again
  try:
    images = (arrays[f] for f in ("train_images", "train_labels", "test_images", "test_labels"))
    return _Splits(*images, int(arrays["num_classes"]))
  except KeyError:
    return None


def _write_cache(path: Path, key: str, splits: _Splits) -> bool:
  """False if ``path`` is not writable (the next candidate is tried)."""
  return cache.save_arrays(path, {"key": np.asarray(key), **splits._asdict()})


def _decode_image(data: bytes) -> np.ndarray:
  from PIL import Image

  with Image.open(io.BytesIO(data)) as image:
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _decode_entries(entries: list[_Entry], where: Path) -> _Splits:
  """Decodes class-folder images; class index = sorted order of training class folders."""
  classes = sorted({cls for split, cls, _, _ in entries if split == "train"})
  if not classes:
    raise DatasetUnavailableError(f"{str(where)!r}: no training images under train/<class>/.")

  def decode(split: str, cls: str, file: str, read: Callable[[], bytes]) -> np.ndarray:
    try:
      return _decode_image(read())
    except OSError as e:  # PIL's UnidentifiedImageError, truncated image data
      raise DatasetUnavailableError(
        f"{str(where)!r}: {split}/{cls}/{file} is not a readable image ({e})."
      ) from None

  index = {cls: i for i, cls in enumerate(classes)}
  arrays: list[np.ndarray] = []
  for split in ("train", "test"):
    items = sorted((e for e in entries if e[0] == split), key=lambda e: (e[1], e[2]))
    unknown = {cls for _, cls, _, _ in items} - set(index)
    if unknown:
      raise ValueError(f"{split}/ has classes missing from train/: {sorted(unknown)}")
    what = f"decoding the {split} images of {where} (cached afterwards)"
    ticker = Ticker(log, what, len(items), "images", announce=True)
    images = []
    for item in items:
      images.append(decode(*item))
      ticker.tick(len(images))
    if len({im.shape for im in images}) > 1:
      shapes = sorted({im.shape for im in images})
      raise ValueError(f"{split}/ images differ in size: {shapes}")
    empty = np.zeros((0, *arrays[0].shape[1:]) if arrays else (0, 0, 0, 3), np.uint8)
    arrays.append(np.stack(images) if images else empty)
    arrays.append(np.asarray([index[cls] for _, cls, _, _ in items], np.int32))
  return _Splits(*arrays, len(classes))


# --------------------------------------------------------------------------------------- hf


def _load_hf(name: str, cache_dir: str | os.PathLike | None) -> _Splits:
  """Hugging Face ``datasets`` (pinned); offline (flags set or Hub unreachable) the cache only."""
  repo, image_field, label_field = HF_REPOS[name]
  try:
    dataset = hub.load_dataset(repo, cache_dir)
  except hub.HubLoadError as e:
    raise DatasetUnavailableError(f"{e}. {_how_to_get(name, failed='hf')}") from e

  def split(s: str) -> tuple[np.ndarray, np.ndarray]:
    ds = dataset[s]
    images = np.stack([np.asarray(im.convert("RGB"), np.uint8) for im in ds[image_field]])
    return images, np.asarray(ds[label_field], np.int32)

  return _Splits(*split("train"), *split("test"), NUM_CLASSES[name])


# ------------------------------------------------------------------------------------- tfds


def _load_tfds(name: str, data_dir: str | os.PathLike | None) -> _Splits:
  """TensorFlow Datasets, imported lazily since it is an optional dependency (with TensorFlow)."""
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise DatasetUnavailableError(
      "data.source=tfds needs TensorFlow Datasets and TensorFlow, which are not pinned here "
      f"(`pip install tensorflow-datasets tensorflow`). {_how_to_get(name, failed='tfds')}"
    ) from e

  def split(s: str) -> tuple[np.ndarray, np.ndarray]:
    data = tfds.as_numpy(
      tfds.load(
        name,
        split=s,
        batch_size=-1,
        download=True,
        data_dir=None if data_dir is None else str(data_dir),
      )
    )
    return np.asarray(data["image"], np.uint8), np.asarray(data["label"], np.int32)

  try:
    return _Splits(*split("train"), *split("test"), NUM_CLASSES[name])
  except Exception as e:  # download/preparation errors of many types
    raise DatasetUnavailableError(
      f"tfds could not load {name}: {e}. {_how_to_get(name, failed='tfds')}"
    ) from e


# ----------------------------------------------------------------------- augmentation (JAX)


def normalize(images: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
  """uint8 NHWC -> float32, scaled to [0, 1] and normalised per channel (for evaluation)."""
  mean = jnp.asarray(mean, jnp.float32)
  std = jnp.asarray(std, jnp.float32)
  return (jnp.asarray(images, jnp.float32) / 255.0 - mean) / std


def augment(
  rng: jax.Array,
  images: jax.Array,
  mean: jax.Array,
  std: jax.Array,
  *,
  pad: int = 4,
  flip: bool = True,
) -> jax.Array:
  """Standard CIFAR augmentation, jittable and deterministic given ``rng``.

  Reflect-pads by ``pad``, crops back to HxW at a random per-example offset (a vmapped
  ``dynamic_slice``, so no gather over the whole padded batch), flips each example
  horizontally with probability 1/2, then normalises. Works on uint8 until the end so the
  crop moves a quarter of the bytes.
  """
  n, h, w, c = images.shape
  crop_key, flip_key = jax.random.split(rng)
  x = jnp.asarray(images)
  if pad > 0:
    x = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    offsets = jax.random.randint(crop_key, (n, 2), 0, 2 * pad + 1)

    def crop(image: jax.Array, offset: jax.Array) -> jax.Array:
      return jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (h, w, c))

    x = jax.vmap(crop)(x, offsets)
  if flip:
    flips = jax.random.bernoulli(flip_key, 0.5, (n,))
    x = jnp.where(flips[:, None, None, None], x[:, :, ::-1, :], x)
  return normalize(x, mean, std)


__all__ = [
  "DATASETS",
  "SOURCES",
  "DatasetUnavailableError",
  "ImageDataset",
  "augment",
  "channel_stats",
  "decoded_cache_paths",
  "holdout_indices",
  "load_image_dataset",
  "normalize",
]
