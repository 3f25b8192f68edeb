"""Test-wide settings: CPU only, offline, and an opt-in float64 fixture for dense references."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
  """float64 inside the test only (other tests compare float32 models with PyTorch)."""
  with jax.enable_x64(True):
    yield
