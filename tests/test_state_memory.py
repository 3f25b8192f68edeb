"""An optimizer state that cannot fit a device is refused before anything is placed or
compiled, naming the bytes it needs, the device's bytes and the largest tau that fits; a
signal while the run is built stops it at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from training import memory, run_setup
from training.config_check import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("available", [0, 7, 50, 99, 100, 101, 500, 2999, 10**6])
def test_largest_fitting_is_the_brute_force_answer(available):
  """A piecewise linear need (a rank that saturates at 20 and at 40), as a state's bytes are."""

  def needed(t):
    return 5 + 3 * min(t, 20) + 2 * min(t, 40) + t

  tau = 1000
  fits = [t for t in range(1, tau) if needed(t) <= available]
  assert memory.largest_fitting(needed, tau, available) == (max(fits) if fits else None)


def test_the_refusal_names_bytes_device_and_largest_tau():
  with pytest.raises(ConfigError) as info:
    memory.check_state_fits(lambda t: 100 * (t or 64), 10, 64, available=(1000, "GPU 0"))
  message = str(info.value)
  assert "tau=64" in message and "12,810 bytes" in message  # 2 x 6400 + 10
  assert "GPU 0 has 1,000 bytes" in message
  assert "The largest tau that fits is 4." in message  # 2 x 400 + 10 <= 1000 < 2 x 500 + 10


def test_a_state_that_fits_passes():
  assert memory.check_state_fits(lambda t: 100, 10, 8, available=(1000, "GPU 0")) == 210


def test_sharded_leaves_count_their_shard():
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  split = NamedSharding(mesh, PartitionSpec("data"))
  leaf = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=split)
  assert memory.tree_bytes({"a": leaf, "b": jax.ShapeDtypeStruct((3,), np.int32)}) == 140


@pytest.mark.parametrize(
  "overrides",
  [("tau=1000000000",), ("optimizer=qng", "tau=1000000000"), ("block=global", "tau=100000000")],
)
def test_check_refuses_before_data_or_model(overrides, monkeypatch):
  """The state's size comes from shapes alone: no data read, no model initialised."""
  from data import images
  from models import tasks

  def forbidden(*args, **kwargs):
    raise AssertionError("the check loaded data or built the model")

  monkeypatch.setattr(images, "load_image_dataset", forbidden)
  monkeypatch.setattr(tasks, "init_model", forbidden)
  with pytest.raises(ConfigError, match=r"bytes .* per device.*The largest tau that fits is \d+"):
    run_setup.check(config("experiment=demo", "logger=none", *overrides))


def test_train_py_refuses_a_tau_that_cannot_fit(tmp_path):
  """The command line: exit status 1, one line naming the bytes, nothing of the run written."""
  run_dir = tmp_path / "run"
  done = subprocess.run(
    [sys.executable, "train.py", "experiment=demo", "tau=1000000000", f"hydra.run.dir={run_dir}"],
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=120,  # without the check the run compiles for minutes, then runs out of memory
  )
  out = done.stdout + done.stderr
  assert done.returncode == 1, out[-3000:]
  (line,) = [x for x in out.splitlines() if "ConfigError" in x]
  assert "tau=1000000000" in line and "bytes" in line and "largest tau that fits" in line
  assert not (run_dir / "run.json").exists() and not (run_dir / "checkpoints").exists()


def test_a_signal_while_the_run_is_built_stops_it_at_once(tmp_path):
  """SIGTERM while the programs compile (nothing to save yet) ends the process there, as
  without a handler: no step runs, no checkpoint is written."""
  run_dir = tmp_path / "run"
  command = [
    sys.executable,
    "train.py",
    "experiment=demo",
    "optimizer=adam",
    "compilation_cache_dir=null",  # a cold compilation: seconds to send the signal in
    f"hydra.run.dir={run_dir}",
  ]
  proc = subprocess.Popen(
    command,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  seen = []
  for line in proc.stdout:  # "model ...: N parameters" comes after the build, before compiling
    seen.append(line)
    if "parameters" in line:
      proc.send_signal(signal.SIGTERM)
      break
  rest = proc.communicate(timeout=300)[0]
  out = "".join(seen) + rest
  assert proc.returncode == -signal.SIGTERM, out[-3000:]
  assert "saving a checkpoint" not in out
  assert not list((run_dir / "checkpoints").glob("*"))
