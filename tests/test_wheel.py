"""The library stands alone: its wheel holds `ginger/` and nothing else of the repository, and a
fresh virtual environment with only that wheel and its declared dependencies (resolved by pip
from the package index) runs the README's library snippet.

Both need the package index (the build's setuptools, then jax, optax, chex and numpy): without
it they are skipped, saying so. The build takes ~8 s on 2 cores; the new environment is slow
(~50 s with the packages on a local mirror, more when pip downloads them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import numpy as np
import pytest

from data.images import _digits_table

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "ginger-optax"
DEPENDENCIES = {"jax", "optax", "chex", "numpy"}


def _pip_env() -> dict[str, str]:
  """The environment for the new environment's processes: pip's settings (index, proxies)
  kept, nothing that would put the framework's packages or caches on their path."""
  drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "JAX_COMPILATION_CACHE_DIR")
  return {k: v for k, v in os.environ.items() if k not in drop}


def _run(command: list, timeout: int, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run(
    [str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kwargs
  )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
  """The wheel `pip wheel` builds from a copy of the checkout (its tracked files and the
  untracked ones git does not ignore, as `pip install .` would see them), in an isolated
  build environment as `pip install .` does."""
  pip = [sys.executable, "-m", "pip"]
  probe = _run([*pip, "index", "versions", "optax", "--retries", "1", "--timeout", "10"], 120)
  if probe.returncode != 0:
    reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    pytest.skip(f"the package index is unreachable (pip index versions optax: {reason})")
  files = _run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60, cwd=ROOT
  )
  assert files.returncode == 0, files.stderr
  work = tmp_path_factory.mktemp("wheel")
  source = work / "source"
  for name in filter(None, files.stdout.split("\0")):
    if (ROOT / name).is_file():  # a tracked file deleted in the working tree is left out
      (source / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / name, source / name)
  built = _run([*pip, "wheel", "--no-deps", source, "-w", work / "dist"], 600)
  assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
  (path,) = (work / "dist").glob("*.whl")
  return path


@pytest.mark.slow  # builds the wheel (~20 s)
def test_wheel_holds_only_the_library(wheel: Path) -> None:
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
  assert {n.split("/")[0] for n in names} == {"ginger", info}, sorted(names)
  modules = {n for n in names if n.startswith("ginger/")}
  assert modules == {p.relative_to(ROOT).as_posix() for p in (ROOT / "ginger").rglob("*.py")}
  assert metadata["Name"] == DISTRIBUTION
  requires = metadata.get_all("Requires-Dist")
  assert {re.match(r"[A-Za-z0-9._-]+", r).group() for r in requires} == DEPENDENCIES, requires


@pytest.mark.slow
def test_wheel_alone_runs_readme_snippet(wheel: Path, tmp_path: Path) -> None:
  env_dir = tmp_path / "env"
  venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
  python = env_dir / "bin" / "python"
  installed = _run([python, "-m", "pip", "install", wheel], 900, env=_pip_env(), cwd=tmp_path)
  assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
  # Nothing of the framework is importable there: only the wheel and its dependencies.
  absent = "import importlib.util as u; print([m for m in {} if u.find_spec(m)])"
  framework = ["flax", "hydra", "orbax", "training", "models", "data"]
  found = _run([python, "-I", "-c", absent.format(framework)], 60, env=_pip_env(), cwd=tmp_path)
  assert found.returncode == 0 and found.stdout.strip() == "[]", found.stdout + found.stderr

  pixels, labels = _digits_table()
  np.savez(tmp_path / "digits.npz", pixels=pixels, labels=labels)
  script = shutil.copy(ROOT / "tests" / "readme_snippet.py", tmp_path)
  env = dict(_pip_env(), JAX_PLATFORMS="cpu")
  readme = ROOT / "README.md"
  ran = _run([python, "-I", script, readme, "digits.npz"], 600, env=env, cwd=tmp_path)
  assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
  where = "import sysconfig; print(sysconfig.get_path('purelib'))"
  site = _run([python, "-I", "-c", where], 60, env=env, cwd=tmp_path)
  assert f"ginger from {Path(site.stdout.strip()) / 'ginger'};" in ran.stdout, ran.stdout
