"""bench/gpu_check.py on a machine without a GPU: it says so and exits 2, running nothing; its
bfloat16 case, with the jnp passes on the CPU, within its bound, whose verdicts fail an update
off by more than the bound or inputs not outside span(U). The compiled checks themselves:
tests/test_gpu.py (marked ``gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_so_and_exits_2():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  done = subprocess.run(
    [sys.executable, "-m", "bench.gpu_check"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 2, done.stdout + done.stderr
  assert f"gpu-check needs an NVIDIA GPU: JAX {jax.__version__} runs on cpu" in done.stdout
  assert "## kernels" not in done.stdout


def test_bf16_state_within_its_bound_on_the_cpu(capsys):
  assert gpu_check.check_bf16_state(2000, 8, 24, "jnp", jax.devices("cpu")[0])
  out = capsys.readouterr().out
  assert out.count("| pass |") == 24, out


def test_bf16_verdicts_fail_a_wrong_update_or_inputs_in_span():
  rng = np.random.default_rng(0)
  exact = [rng.standard_normal(50) for _ in range(3)]
  bound, rows = gpu_check.bf16_verdicts(exact, exact, [0.5, 0.5, 0.5], 0.25)
  assert bound == 8 * 2 * 2.0**-8  # kappa = (0.25 + 0.25) / 0.25, u = 2^-8
  assert [ok for *_, ok in rows] == [True] * 3
  off = [e + 2 * bound * np.linalg.norm(e) * rng.standard_normal(50) / np.sqrt(50) for e in exact]
  assert not any(ok for *_, ok in gpu_check.bf16_verdicts(off, exact, [0.5] * 3, 0.25)[1])
  in_span = gpu_check.bf16_verdicts(exact, exact, [0.5, 0.2, 0.5], 0.25)[1]  # 0.2 < 32 eps
  assert [ok for *_, ok in in_span] == [True, False, True]


def test_train_step_makes_synthetic_data_of_the_suites_shapes(monkeypatch, capsys):
  """``bench.train_step --data synthetic`` (gpu-check's step times, the deterministic cost):
  a CIFAR-10 pickle folder for the ResNet suites, an XSUM-layout jsonl for T5, handed to every
  run."""
  from bench import train_step

  paths = []
  monkeypatch.setattr(train_step, "run", lambda suite, name, data, *a: paths.append(data) or {})
  train_step.main(["--suite", "resnet18", "--data", "synthetic", "--only", "adam"])
  train_step.main(["--suite", "t5", "--data", "synthetic", "--only", "full adam"])
  cifar, xsum = map(Path, paths)
  assert (cifar / "data_batch_5").is_file() and (cifar / "test_batch").is_file()
  assert len(xsum.read_text().splitlines()) == 400
