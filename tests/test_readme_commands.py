"""The README's headline commands, as written: each `python train.py ...` line composes to a
config that train.py accepts (a multirun to the number of runs its comment says), each `make`
target of the tables exists and plans its sweep, and the offline ones train at smoke size."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sweeps.expand import compose_job, expand
from training.config_check import check_config

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def section_commands(title: str) -> list[str]:
  """The command lines of the ```bash blocks under the README's ``## title``."""
  text = README.read_text()
  body = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M).group(1)
  blocks = re.findall(r"```bash\n(.*?)```", body, re.S)
  return [line for block in blocks for line in block.splitlines() if line.strip()]


def train_lines() -> list[str]:
  return [line for line in section_commands("Training") if line.startswith("python train.py")]


def arguments(line: str) -> list[str]:
  return shlex.split(line.split("#", 1)[0])[2:]


def test_the_training_section_says_how_to_run_inside_the_environment():
  """Its `python` lines run in the environment that `make venv` makes, which it names."""
  text = README.read_text()
  body = re.search(r"^## Training\n(.*?)```bash", text, re.S | re.M).group(1)
  assert "source .venv/bin/activate" in body and ".venv/bin/python" in body, body
  assert (REPO / "Makefile").read_text().count(".venv") > 0  # the folder the Makefile makes


def test_the_training_section_has_the_headline_commands():
  lines = train_lines()
  assert any("-m" in arguments(line) for line in lines)
  assert any(line.startswith("python train.py optimizer=ginger tau=8") for line in lines)
  assert any(c.startswith("python evaluate.py run_dir=") for c in section_commands("Training"))


@pytest.mark.parametrize("line", [line for line in train_lines() if "--help" not in line])
def test_every_training_command_composes_to_a_config_train_py_accepts(line):
  args = arguments(line)
  if "-m" in args:
    args.remove("-m")
    jobs = expand(args)
    runs = re.search(r"#\s*(\d+) runs", line)
    assert runs and len(jobs) == int(runs.group(1)), (line, len(jobs))
    assert len({job.run_dir for job in jobs}) == len(jobs)  # one dir each
  else:
    jobs = [compose_job(args)]
  for job in jobs:
    check_config(OmegaConf.create(job.config), args)


@pytest.mark.parametrize(
  "line", [line for line in section_commands("Reproducing the paper's tables") if "make" in line]
)
def test_every_table_target_plans_its_sweep(line):
  targets = shlex.split(line.split("#", 1)[0])[1:]
  for target in targets:
    plan = subprocess.run(
      ["make", "-n", target, "SCALE=smoke", "STAMP="],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    assert "python" in plan.stdout, plan.stdout


@pytest.mark.slow  # two trainings in fresh processes (~2 min on 2 cores)
@pytest.mark.parametrize("line", [line for line in train_lines() if "experiment=demo" in line])
def test_the_offline_commands_train_as_written(line, tmp_path):
  args = arguments(line) + ["max_steps=2", "logger=none", f"hydra.run.dir={tmp_path}"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "train.py", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert (tmp_path / "summary.json").is_file()
