"""Run-dir, logging, checkpoint and optimizer-building helpers for train.py / evaluate.py.

Importing the package puts ``third_party/kfac_jax`` (kfac-jax's source, vendored: no kfac-jax
release runs on the pinned JAX; its README.md says which commit) first on ``sys.path``, so that
``import kfac_jax`` (``optimizer=kfac``) finds that copy before any kfac-jax installed in the
environment, in train.py, evaluate.py and the tests alike.
"""

import sys
from pathlib import Path

KFAC_JAX_DIR = Path(__file__).resolve().parents[1] / "third_party" / "kfac_jax"

if str(KFAC_JAX_DIR) not in sys.path:
  sys.path.insert(0, str(KFAC_JAX_DIR))
