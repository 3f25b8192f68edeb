"""One process per run dir: a second one is refused at once, naming the holder; a holder killed
with SIGKILL blocks nothing (the kernel drops its lock)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training import run_record

HOLD = (
  "import sys, time\n"
  "from training import run_record\n"
  "with run_record.exclusive(sys.argv[1]):\n"
  "  print('held', flush=True)\n"
  "  time.sleep(60)\n"
)


@pytest.fixture
def holder(tmp_path: Path):
  """Another process holding ``tmp_path`` (started, lock taken)."""
  root = Path(__file__).resolve().parents[1]
  proc = subprocess.Popen(
    [sys.executable, "-c", HOLD, str(tmp_path)],
    cwd=root,
    env={**os.environ, "PYTHONPATH": str(root)},
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == "held"
  yield proc
  proc.kill()
  proc.wait()


def test_second_process_is_refused_at_once_naming_the_holder(tmp_path: Path, holder) -> None:
  (tmp_path / ".hydra").mkdir()
  (tmp_path / ".hydra" / "config.yaml").write_text("lr: 0.1\n")  # the holder's, recorded
  (tmp_path / run_record.RECORD).write_text('{"hydra": {"config.yaml": "lr: 0.1\\n"}}')
  (tmp_path / ".hydra" / "config.yaml").write_text("lr: 0.5\n")  # Hydra's, for this attempt
  start = time.perf_counter()
  with pytest.raises(run_record.RunDirBusy, match=rf"pid {holder.pid}\b.*one process per run dir"):
    with run_record.exclusive(tmp_path):
      pytest.fail("entered a run dir another process holds")
  assert time.perf_counter() - start < 2
  assert (tmp_path / ".hydra" / "config.yaml").read_text() == "lr: 0.1\n"  # put back


def test_a_killed_holder_blocks_nothing(tmp_path: Path, holder) -> None:
  os.kill(holder.pid, signal.SIGKILL)
  holder.wait()
  with run_record.exclusive(tmp_path):
    assert f"pid {os.getpid()}" in (tmp_path / run_record.LOCK).read_text()
  with run_record.exclusive(tmp_path):  # released on leaving the block
    pass


def test_train_refuses_a_held_run_dir_before_writing(tmp_path: Path, holder) -> None:
  from hydra import compose, initialize_config_dir

  from training import loop

  configs = Path(__file__).resolve().parents[1] / "configs"
  with initialize_config_dir(config_dir=str(configs), version_base=None):
    cfg = compose(config_name="config", overrides=["experiment=demo", "logger=none"])
  with pytest.raises(run_record.RunDirBusy):
    loop.train(cfg, tmp_path, stop=lambda: None)
  assert sorted(p.name for p in tmp_path.iterdir()) == [run_record.LOCK]


def test_a_refused_train_py_leaves_the_holders_files_as_they_were(tmp_path: Path, holder) -> None:
  """train.py started into a held dir: exit status 1 with the holder named, every file of the
  holder's (its train.log, the .hydra/ files Hydra rewrote for this attempt) as it was."""
  root = Path(__file__).resolve().parents[1]
  (tmp_path / "train.log").write_text("the holder's line\n")
  (tmp_path / ".hydra").mkdir()
  hydra = {name: f"{name}: the holder's\n" for name in run_record.HYDRA_FILES}
  for name, text in hydra.items():
    (tmp_path / ".hydra" / name).write_text(text)
  (tmp_path / run_record.RECORD).write_text(json.dumps({"hydra": hydra}))
  before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  done = subprocess.run(
    [sys.executable, "train.py", "experiment=demo", "logger=none", f"hydra.run.dir={tmp_path}"],
    cwd=root,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 1, done.stdout + done.stderr
  assert f"pid {holder.pid}" in done.stdout + done.stderr
  after = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  assert after == before
