"""train.py says where it computes and warns when JAX runs on the CPU beside a GPU
(training/backend.py), with ``nvidia-smi`` faked; ``deterministic=true`` sets XLA's flags before
the backend starts, and refuses once it has started without them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from training import backend
from training.config_check import ConfigError

ROOT = Path(__file__).resolve().parents[1]
H200 = "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def _fake_nvidia_smi(folder: Path, out: str, status: int = 0) -> Path:
  """A folder holding an ``nvidia-smi`` that prints ``out`` and exits with ``status``."""
  folder.mkdir(parents=True, exist_ok=True)
  script = folder / "nvidia-smi"
  script.write_text(f"#!/bin/sh\necho '{out}'\nexit {status}\n")  # echo: a shell builtin
  script.chmod(0o755)
  return folder


def test_nvidia_gpus_reads_the_listing(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path / "ok", H200)))
  assert backend.nvidia_gpus() == [H200]
  monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path / "bad", "No devices were found", 6)))
  assert backend.nvidia_gpus() == []
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  assert backend.nvidia_gpus() == []


def test_cpu_fallback_warning_only_when_a_gpu_is_left_idle():
  warning = backend.cpu_fallback_warning("cpu", [H200], None)
  assert "runs on the CPU" in warning and "NVIDIA H200" in warning
  assert f'make venv GPU=1 (or pip install "jax[cuda13]=={jax.__version__}")' in warning
  assert backend.cpu_fallback_warning("cpu", [H200], "") == warning
  assert backend.cpu_fallback_warning("cpu", [H200], "cpu") is None  # asked for
  assert backend.cpu_fallback_warning("cpu", [H200], "cuda,cpu") == warning
  assert backend.cpu_fallback_warning("cpu", [], None) is None
  assert backend.cpu_fallback_warning("gpu", [H200], None) is None


def test_report_says_the_backend_and_warns_with_a_faked_probe(caplog):
  with caplog.at_level(logging.INFO, logger="train"):
    backend.report(probe=lambda: [H200], platforms="")
  lines = [r.getMessage() for r in caplog.records]
  assert lines[0].startswith(f"JAX {jax.__version__} on cpu: ")
  assert any("make venv GPU=1" in line for line in lines[1:])
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="train"):
    backend.report(probe=lambda: 1 / 0, platforms="cpu")  # the CPU asked for: no probe
    backend.report(probe=lambda: [], platforms="")
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_with_flags_replaces_the_same_flag_and_keeps_others():
  got = backend.with_flags(
    "--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=false", backend.DETERMINISTIC_XLA_FLAGS
  )
  assert got.split() == ["--xla_dump_to=/tmp/x", "--xla_gpu_deterministic_ops=true"]
  assert backend.with_flags("", ["--a=1"]) == "--a=1"


def test_deterministic_refused_once_the_backend_started_without_its_flags(monkeypatch):
  jax.devices()  # this process's backend: started
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  with pytest.raises(ConfigError, match="deterministic=true: JAX's backend started before"):
    backend.use_deterministic(True)
  backend.use_deterministic(False)  # nothing asked, nothing to refuse
  monkeypatch.setenv("XLA_FLAGS", " ".join(backend.DETERMINISTIC_XLA_FLAGS))
  backend.use_deterministic(True)  # started with them: a second run in this process


def test_train_says_cpu_fallback_and_runs_deterministic(tmp_path):
  """train.py in a fresh process beside a faked nvidia-smi, JAX_PLATFORMS unset (so the CPU
  was not asked for): the backend line, the one-line warning naming the GPU install, and a run
  with deterministic=true, whose XLA flags this jaxlib knows (XLA aborts on an unknown one;
  the suite's own flags, kept, are known ones)."""
  fake = _fake_nvidia_smi(tmp_path / "bin", H200)
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env.update(PATH=f"{fake}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT))
  cmd = [
    sys.executable,
    "train.py",
    "experiment=demo",
    "optimizer=momentum",
    "max_steps=2",
    "logger=none",
    "deterministic=true",
    "compilation_cache_dir=null",
    f"hydra.run.dir={tmp_path / 'run'}",
  ]
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  out = done.stdout + done.stderr
  assert done.returncode == 0, out[-3000:]
  assert f"JAX {jax.__version__} on cpu: 1 device(s)" in out
  assert "nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H200" in out and "make venv GPU=1" in out
  assert "Unknown flag" not in out
