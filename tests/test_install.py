"""One JAX everywhere: the library's declared lower bounds are the versions the suite runs on
(requirements.txt's pins), and the GPU requirement sets and extras name that same jax."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("jax", "optax", "chex", "numpy")


def _pins(path: Path) -> dict[str, str]:
  """``name -> version`` of a requirements file's ``name==version`` lines (extras dropped)."""
  pins = {}
  for line in path.read_text().splitlines():
    m = re.match(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==([^\s#]+)", line)
    if m:
      pins[m.group(1).lower()] = m.group(3)
  return pins


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_library_lower_bounds_are_the_tested_pins():
  pins = _pins(ROOT / "requirements.txt")
  bounds = {}
  for requirement in _pyproject()["dependencies"]:
    name, version = re.fullmatch(r"([A-Za-z0-9._-]+)>=([^,;\s]+)", requirement).groups()
    bounds[name] = version
  assert bounds == {name: pins[name] for name in LIBRARY}


@pytest.mark.parametrize("cuda", ["cuda12", "cuda13"])
def test_gpu_sets_pin_the_cpu_jax(cuda):
  """requirements-<cuda>.txt (``make venv GPU=...``) installs the CUDA build of the very jax
  of requirements.txt: jax with the extra, its plugin and PJRT at that version; the library's
  extra of that name asks for that jax or newer (jax pins its plugin to its own version)."""
  jax = _pins(ROOT / "requirements.txt")["jax"]
  text = (ROOT / f"requirements-{cuda}.txt").read_text()
  assert f"jax[{cuda}]=={jax}" in text.split()
  assert _pins(ROOT / f"requirements-{cuda}.txt") == {
    "jax": jax,
    f"jax-{cuda}-plugin": jax,
    f"jax-{cuda}-pjrt": jax,
  }
  assert _pyproject()["optional-dependencies"][cuda] == [f"jax[{cuda}]>={jax}"]


def test_torch_is_only_in_its_own_set():
  assert "torch" not in _pins(ROOT / "requirements.txt")
  assert list(_pins(ROOT / "requirements-torch.txt")) == ["torch"]


def _make(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_make_venv_gpu_installs_the_cuda_set_and_refuses_others():
  """``make venv GPU=1`` installs requirements.txt and the CUDA 13 set (its own stamp, so that a
  CPU venv gets the plugin added); an unknown GPU value is refused, naming the allowed ones.
  ``make -n``: printed, not run."""
  gpu = _make("venv", "GPU=1")
  assert gpu.returncode == 0, gpu.stderr
  assert "-r requirements.txt -r requirements-cuda13.txt" in gpu.stdout
  assert "touch .venv/.installed-cuda13" in gpu.stdout
  cpu = _make("venv")
  assert "requirements-cuda" not in cpu.stdout and "requirements-torch" not in cpu.stdout
  # -B: as on a fresh clone (here the venv and its torch may be installed and up to date).
  assert "requirements-torch.txt" in _make("-B", "test").stdout
  bad = _make("venv", "GPU=yes")
  assert bad.returncode != 0
  assert "GPU=yes: allowed are 1 (the same as cuda13), cuda13, cuda12" in bad.stderr


def test_gpu_tests_skip_with_the_command_that_runs_them():
  """`pytest -m gpu` on a machine without a GPU: every gpu test skipped, saying how to run them
  (JAX_PLATFORMS=cuda,cpu: their float64 references run on the CPU backend), never a crash."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["JAX_PLATFORMS"] = "cuda"  # no GPU here: JAX cannot start a backend at all
  done = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider"]
    + ["tests/test_gpu.py"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "INTERNALERROR" not in done.stdout + done.stderr
  assert "4 skipped" in done.stdout
  assert "JAX_PLATFORMS=cuda,cpu" in done.stdout
  for doc in ("README.md", "tests/test_gpu.py"):  # the command they show is the one that runs
    assert (
      "JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest -m gpu tests" in (ROOT / doc).read_text()
    )
