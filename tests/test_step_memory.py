"""summary.json's ``step_memory_bytes``: what the compiled training step keeps live on a device
(XLA's memory analysis: arguments + outputs - aliased + temporaries), beside the lifetime
high-water mark ``peak_memory_bytes``; and bench/train_step.py's table cells of both."""

import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hydra import compose, initialize_config_dir

from bench import train_step as bench
from training import compilation
from training import loop as train
from training.summary import step_memory_bytes, xla_memory

ROOT = Path(__file__).resolve().parents[1]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def analysis(argument, output, alias, temp):
  return {
    "argument_size_in_bytes": argument,
    "output_size_in_bytes": output,
    "alias_size_in_bytes": alias,
    "temp_size_in_bytes": temp,
  }


def test_step_memory_is_arguments_plus_outputs_minus_aliased_plus_temp():
  # A donated state of 100 bytes updated in place: counted once, not twice.
  assert step_memory_bytes([analysis(130, 100, 100, 7)]) == 137
  # Without donation the new state is a second buffer beside the old one.
  assert step_memory_bytes([analysis(130, 100, 0, 7)]) == 237


def test_step_memory_is_the_largest_of_the_compiled_steps():
  with_curvature, without = analysis(130, 100, 100, 50), analysis(130, 100, 100, 20)
  assert step_memory_bytes([with_curvature, without]) == 180
  assert step_memory_bytes([without, with_curvature]) == 180
  assert step_memory_bytes([with_curvature, None]) == 180  # K = 1: no second step


def test_step_memory_is_none_without_an_analysis():
  assert step_memory_bytes([None]) is None
  assert step_memory_bytes([{"temp_size_in_bytes": 3}]) is None  # incomplete: no guess


def test_xla_reports_a_donated_state_as_aliased_on_cpu():
  """The formula's alias term is what donation saves: a 4 MB state updated in place."""
  state, x = jnp.zeros((1000, 1000)), jnp.ones((500,))
  update = lambda s, x: s + x.sum()
  donated = xla_memory(jax.jit(update, donate_argnums=0).lower(state, x).compile())
  kept = xla_memory(jax.jit(update).lower(state, x).compile())
  assert donated["alias_size_in_bytes"] == state.nbytes
  # Buffers live across the step (XLA's temporaries differ between the two programs).
  held = lambda a: step_memory_bytes([a]) - a["temp_size_in_bytes"]
  assert held(kept) - held(donated) == state.nbytes
  assert held(donated) == state.nbytes + x.nbytes


@pytest.mark.parametrize(
  "every",
  [1, pytest.param(2, marks=pytest.mark.slow)],  # K = 2 adds a program (~12 s)
)
def test_summary_reports_the_steps_own_memory(tmp_path, monkeypatch, every):
  cfg = config(
    "experiment=demo",
    "optimizer=ginger",
    f"curvature_every={every}",
    "logger=none",
    "max_steps=2",
    "eval_every=2",
    "log_every=1",
    "checkpoint_every=2",
  )
  # The programs compile before the optimizer state exists: on a GPU, XLA's autotuning at
  # compile time takes scratch of the order of the programs' operands (T5-small + Ginger tau
  # 32: ~13 GB beside the 8 GB state); compiled first, the peak is the larger, not the sum.
  state = train.build(cfg, materialize=False).state  # the optimizer state's shapes only
  largest_param = max(x.size for x in jax.tree.leaves(state.trainable))
  bases = {(x.shape, x.dtype) for x in jax.tree.leaves(state.opt_state) if x.size > largest_param}
  assert bases  # Ginger's stacked U outgrows every parameter
  del state
  seen = []
  compile_all = compilation.compile_all

  def recording(lower, threads=None, times=None):
    gc.collect()
    seen.append({(x.shape, x.dtype) for x in jax.live_arrays()})
    return compile_all(lower, threads, times)

  monkeypatch.setattr(compilation, "compile_all", recording)
  summary = train.train(cfg, tmp_path)
  assert len(seen) == 1 and not bases & seen[0]
  step = summary["step_memory_bytes"]
  analyses = [summary["xla_memory_analysis"], summary["xla_memory_analysis_precondition"]]
  assert (analyses[1] is None) == (every == 1)
  assert step == step_memory_bytes(analyses)
  # At least the parameters (float32), which the state holds, and the data resident beside them.
  assert step >= 4 * summary["parameters"] + summary["train_data_bytes_per_device"]
  assert summary["train_data_bytes_per_device"] > 0
  assert "memory_analysis()" in summary["step_memory_method"]
  # CPU reports no device memory statistics: null, never a fake 0.
  assert summary["peak_memory_bytes"] is None
  assert summary["memory_in_use_before_training_bytes"] is None
  assert summary["peak_memory_before_training_bytes"] is None


def test_bench_table_has_both_memory_columns():
  header = bench.TABLE_HEADER
  assert "step GB (XLA)" in header and "high-water GB" in header
  summary = {
    "step_memory_bytes": 1_234_000_000,
    "peak_memory_bytes": 2_500_000_000,
    "optimizer_state_bytes_per_device": 45_600_000,
  }
  assert bench.memory_cells(summary) == "1.23 | 2.50 | 45.6"
  assert bench.memory_cells({}) == " |  | "  # CPU or an old summary: blank, never 0
  # One cell per column, in a row as main() prints it.
  row = f"| name | 1 | 2.0 | 3 | 1.00 | {bench.memory_cells(summary)} | 9 |"
  assert row.count("|") == header.count("|")
