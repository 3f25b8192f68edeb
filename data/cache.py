"""The on-disk cache of decoded data, shared by every loader (images, XSUM tokens, tokenizers).

Decoding 60k JPEGs or tokenizing 200k XSUM documents takes a while; the result is cached as
files under :func:`cache_root`. Every write is atomic (a temporary file, then ``os.replace``),
so a crash or a concurrent run never leaves a half-written file under the final name, and an
unreadable file is treated as a miss and rebuilt.
"""

from __future__ import annotations

import contextlib
import io
import os
import zipfile
from pathlib import Path

import numpy as np

ENV_VARIABLE = "GINGER_CACHE_DIR"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
  """``cache_dir`` if given, else ``$GINGER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ginger``, else
  ``~/.cache/ginger``."""
  if cache_dir is not None:
    return Path(cache_dir).expanduser()
  if os.environ.get(ENV_VARIABLE):
    return Path(os.environ[ENV_VARIABLE]).expanduser()
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ginger"


def atomic_write(path: Path, data: bytes) -> bool:
  """Writes ``data`` to ``path`` atomically; False (and nothing left behind) if not writable."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True
  except OSError:
    with contextlib.suppress(OSError):
      tmp.unlink()
    return False


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> bool:
  """Saves named arrays as an uncompressed ``.npz`` (a cache hit is one ``np.load``)."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  return atomic_write(path, buf.getvalue())


def load_arrays(path: Path) -> dict[str, np.ndarray] | None:
  """The arrays of an ``.npz`` written by :func:`save_arrays`; None if absent or unreadable."""
  if not path.is_file():
    return None
  try:
    with np.load(path) as z:
      return {k: z[k] for k in z.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile):
    return None  # partial or corrupt cache file: rebuild it
