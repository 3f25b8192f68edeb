"""train.py's quick refusals, answered before JAX is imported: a misspelled top-level key (with
the nearest keys, not Hydra's advice to add it with +) and a run dir another process holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_lock import HOLD

from training.config_check import ConfigError, check_command_line_keys

ROOT = Path(__file__).resolve().parents[1]
# train.py as `python train.py ARGS`, then whether JAX was imported by the time it exited.
RUN = (
  "import runpy, sys\n"
  "sys.argv = ['train.py', *sys.argv[1:]]\n"
  "try:\n"
  "  runpy.run_path('train.py', run_name='__main__')\n"
  "finally:\n"
  "  print('jax imported:', 'jax' in sys.modules, flush=True)\n"
)


def train_py(*arguments: str) -> tuple[int, str]:
  done = subprocess.run(
    [sys.executable, "-c", RUN, *arguments],
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    capture_output=True,
    text=True,
    timeout=120,
  )
  return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(
  "arguments, named",
  [
    (["optimzer=adam"], "optimzer=adam: optimzer is not a config key; did you mean optimizer?"),
    (["tua=8"], "tua=8: tua is not a config key; did you mean tau?"),
    (["optimizer=adam", "dat.source=local"], "dat.source=local: dat is not a config key"),
  ],
)
def test_a_misspelled_top_level_key_names_the_nearest(arguments, named):
  with pytest.raises(ConfigError, match=named.replace("?", r"\?")):
    check_command_line_keys(arguments)


def test_what_the_config_has_passes():
  check_command_line_keys(
    [
      "-m",
      "--config-name",
      "config",
      "+sweep=table1",
      "scale=smoke",  # a key the sweep adds
      "seed=0,1",
      "optimizer=adam",
      "data.source=local",
      "hydra.run.dir=x",
      "hydra/launcher=submitit_local",
      "+tua=8",  # check_added_keys' to refuse, once composed
      "~logger",
    ]
  )


def test_train_py_refuses_a_misspelled_key_before_jax():
  returncode, out = train_py("optimzer=adam")
  assert returncode == 1, out[-3000:]
  assert "did you mean optimizer?" in out and "+optimzer" not in out, out[-3000:]
  assert "jax imported: False" in out


def test_train_py_refuses_a_held_run_dir_before_jax(tmp_path):
  proc = subprocess.Popen(
    [sys.executable, "-c", HOLD, str(tmp_path)],
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert proc.stdout.readline().strip() == "held"
    returncode, out = train_py("experiment=demo", "logger=none", f"hydra.run.dir={tmp_path}")
  finally:
    proc.kill()
    proc.wait()
  assert returncode == 1, out[-3000:]
  assert f"pid {proc.pid}" in out and "jax imported: False" in out, out[-3000:]
