"""On an NVIDIA GPU (marked ``gpu``; skipped without one): the compiled Pallas kernels and the
whole update against float64, a bfloat16 state with directions partly outside span(U), and
``deterministic=true`` reruns bit for bit. Run them with JAX's CUDA build installed:

    JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest -m gpu tests

(the CPU backend beside the GPU: the float64 references run there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from bench import gpu_check, kernels_check, update_check
from training import run_record

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_compiled_kernels_within_their_bounds():
  assert kernels_check.main(["--tiny", "--taus", "4", "8", "--memory-rows", "65536"]) == 0


def test_compiled_update_against_float64():
  assert update_check.check("tiny", [4], 4) == 0


def test_bf16_state_out_of_span_compiled():
  assert gpu_check.check_bf16_state(1 << 16, 8, 24, "pallas", jax.devices()[0])


def _demo_run(run_dir: Path) -> list[dict]:
  """train.py's demo with Ginger, deterministic=true, no compilation cache: its logged events."""
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, PYTHONPATH=path, GINGER_COMPILATION_CACHE_DIR="none")
  for key in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):  # each run compiles (and tunes) anew
    env.pop(key, None)
  cmd = [
    sys.executable,
    "train.py",
    "experiment=demo",
    "max_steps=40",
    "eval_every=20",
    "logger=none",
    "deterministic=true",
    f"hydra.run.dir={run_dir}",
  ]
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return list(run_record.read_events(run_dir, strict=True))


def test_deterministic_reruns_bit_for_bit(tmp_path):
  """Two fresh processes of one config with deterministic=true on one GPU: every logged loss,
  gradient norm and evaluation the same bits (docs/training.md, "What is reproducible")."""
  first, second = _demo_run(tmp_path / "a"), _demo_run(tmp_path / "b")
  keys = ("step", "train_loss", "grad_norm", "val_loss", "val_accuracy")
  assert [{k: e.get(k) for k in keys} for e in first] == [
    {k: e.get(k) for k in keys} for e in second
  ]
