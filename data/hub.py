"""Hugging Face hub reachability and offline mode, shared by every loader that may use it.

Offline, the hub clients retry for minutes before failing; these helpers let a loader decide
within seconds and, when offline, read only the local cache.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

_TRUE_VALUES = ("1", "true", "yes", "on")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_requested() -> bool:
  """Whether the environment asks for offline mode (any of the HF offline variables)."""
  return any(os.environ.get(v, "").strip().lower() in _TRUE_VALUES for v in OFFLINE_VARIABLES)


def hub_reachable(timeout: float = 2.0) -> bool:
  """TCP connect to the hub (or the HTTPS proxy) within ``timeout`` s, DNS included.

  False at once when offline mode is requested. The probe runs in a daemon thread because
  ``getaddrinfo`` ignores socket timeouts, so a hanging resolver costs at most ``timeout``.
  """
  if offline_requested():
    return False
  proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
  url = urllib.parse.urlsplit(proxy or os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
  host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
  if host is None:
    return False
  result: list[bool] = []

  def probe() -> None:
    try:
      with socket.create_connection((host, port), timeout=timeout):
        result.append(True)
    except OSError:
      result.append(False)

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout)
  return bool(result and result[0])


@contextlib.contextmanager
def forced_offline() -> Iterator[None]:
  """Offline mode for one load, even if ``datasets`` was imported before.

  ``datasets`` and ``huggingface_hub`` read their offline flags into module constants at
  import time; patching them (and restoring afterwards) makes a load use only the local cache
  and fail at once instead of retrying the network.
  """
  import datasets.config
  import huggingface_hub.constants

  targets = [
    (datasets.config, "HF_HUB_OFFLINE"),
    (datasets.config, "HF_DATASETS_OFFLINE"),
    (huggingface_hub.constants, "HF_HUB_OFFLINE"),
  ]
  saved = [(m, a, getattr(m, a)) for m, a in targets if hasattr(m, a)]
  try:
    for m, a, _ in saved:
      setattr(m, a, True)
    yield
  finally:
    for m, a, v in saved:
      setattr(m, a, v)


PARQUET_REVISION = "refs/convert/parquet"  # the Hub's own Parquet export of every dataset


class HubLoadError(RuntimeError):
  """A Hugging Face dataset could not be loaded; the message says why (offline or the error)."""


def load_dataset(repo: str, cache_dir: str | os.PathLike | None = None) -> Any:
  """``datasets.load_dataset(repo)``, deciding within seconds whether the Hub can be reached.

  Offline (a flag set, or the Hub unreachable) it reads only the local cache. A repository
  that still ships a loading script (XSUM's ``EdinburghNLP/xsum``), which ``datasets`` >= 4 no
  longer runs, is read from the Hub's Parquet export of the same data instead.

  Raises:
    HubLoadError: ``datasets`` is missing, or the load failed (message says why).
  """
  offline = not hub_reachable()
  try:
    import datasets
  except ImportError as e:
    raise HubLoadError("the `datasets` package is not installed") from e
  cache = None if cache_dir is None else str(cache_dir)
  try:
    with forced_offline() if offline else contextlib.nullcontext():
      try:
        return datasets.load_dataset(repo, cache_dir=cache)
      except Exception as first:
        # Offline, the export may be what an earlier online load cached.
        if not (offline or "scripts are no longer supported" in str(first)):
          raise
        try:
          return datasets.load_dataset(repo, cache_dir=cache, revision=PARQUET_REVISION)
        except Exception as second:
          raise (first if offline else second) from None
  except Exception as e:  # noqa: BLE001 - datasets raises many types (ConnectionError, ...)
    if offline:
      why = (
        "offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set, or huggingface.co unreachable) "
        "and not in the local Hugging Face cache"
      )
    else:
      why = f"{type(e).__name__}: {e}"
    raise HubLoadError(f"could not load {repo} from the Hugging Face Hub: {why}") from e
