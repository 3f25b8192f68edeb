"""What a run's summary.json records: its identity, set-up, cost and outcome.

:func:`startup_record` is written down once the programs are compiled (FLOPs, memory,
start-up times); :func:`end_record` adds how the run ended (status, losses, step time, peak
memory) and the task's best evaluation. The FLOPs and memory figures come from
:func:`analytic_flops` and from XLA's analyses of the compiled steps (:func:`xla_flops`,
:func:`xla_memory`, :func:`step_memory_bytes`).
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import jax

from models.tasks import Task
from training import logs, run_record, sharding
from training.compilation import CompiledRun
from training.registry import step_flops
from training.run_config import RunConfig
from training.steps import fisher_sub_batch

FLOPS_METHOD = {
  "analytic": "conv/dense (or transformer matmul) count: 3x forward "
  "for loss grad, +2x (shared) or +3x (eval) forward for the "
  "d-pass, plus the optimizer's own update; with curvature_every=K the mean over K "
  "steps (one with the d-pass and curvature update, K-1 without)",
  "xla": "compiled train step cost_analysis() (mean over K steps as above); unreliable on GPU",
}
PEAK_MEMORY_METHOD = (
  "device memory_stats()['peak_bytes_in_use'] of this process "
  "(includes compilation/autotuning; see step_memory_bytes for the step's own); null where "
  "not reported"
)


def device_shared() -> bool:
  """Whether this run shares its device with other processes (``GINGER_DEVICE_SHARED=1``, set
  by whoever starts several runs on one GPU): its step times, wall-clock and memory are then
  not its own."""
  return os.environ.get("GINGER_DEVICE_SHARED", "") not in ("", "0")


def flops_per_iter(task: Task, rc: RunConfig, params, steps: dict, every: int) -> dict:
  """One training step's FLOPs, counted (:func:`analytic_flops`, for the trained parameters
  ``params``) and as XLA reports them for the compiled ``steps`` (``CompiledRun.steps``; None
  where it does not); with ``curvature_every`` K = ``every`` > 1 both the mean over K steps."""
  xla = {update: xla_flops(c) for update, c in steps.items()}  # with the update, without
  return {
    "analytic": analytic_flops(task, rc, params),
    # The mean over K steps, as the analytic count (K = 1: the one step's count).
    "xla": None
    if None in xla.values()
    else (xla[True] + (every - 1) * xla.get(False, xla[True])) / every,
  }


def startup_record(
  config: dict, rc: RunConfig, setup, state, compiled: CompiledRun, train_arrays, build_s: float
) -> dict[str, Any]:
  """summary.json's keys known before the first step. ``config``: the run's resolved config
  (plain containers), which summary.json records; ``rc``: the same, checked and typed;
  ``setup``: the run's
  ``training.run_setup.Setup``; ``state``: its initial state, on the devices; ``build_s``:
  the seconds :func:`training.run_setup.build` took."""
  memory = {update: xla_memory(c) for update, c in compiled.steps.items()}
  return {
    "run": run_record.identity(config),
    "config": config,
    "versions": logs.versions(),
    "device": logs.device_info(),
    "mesh": setup.plan.describe(),
    "fisher_backward": setup.fisher_backward,  # as resolved for this mesh and model
    "git_commit": logs.git_commit(),
    "parameters": setup.n_model,
    "trained_parameters": sum(setup.sizes),
    "optimizer_state_bytes_per_device": sharding.bytes_per_device(state.opt_state),
    "steps_per_epoch": setup.steps_per_epoch,
    "flops_per_iter": flops_per_iter(
      setup.task, rc, state.trainable, compiled.steps, setup.curvature_every
    ),
    "flops_method": FLOPS_METHOD,
    "xla_memory_analysis": memory[True],  # the step with the curvature update
    "xla_memory_analysis_precondition": memory.get(False),  # curvature_every > 1: the other
    "step_memory_bytes": step_memory_bytes(memory.values()),
    "step_memory_method": STEP_MEMORY_METHOD,
    "train_data_bytes_per_device": sharding.bytes_per_device(train_arrays),
    # Start-up of this attempt (a resumed run's is its last attempt's): building (data, model,
    # optimizer state) and lowering + compiling every program (compile_all; much less where
    # compilation_cache_dir already holds them).
    # Per program, its lowering (one after the other) and its compilation (at once); with
    # compilation_cache_dir, "program": "read" (kept by an earlier run: no tracing), "exported"
    # (traced and kept) or "traced" (training/program_cache.py).
    "startup_s": {
      "build": build_s,
      "lower_and_compile": compiled.seconds,
      "programs": compiled.count,
      "per_program": compiled.startup_per_program(),
    },
  }


def end_record(
  task: Task,
  state,
  status: str,
  error: str | None,
  total_steps: int,
  batch_size: int,
  step_times: list[float],
  evals: list[dict],
) -> dict[str, Any]:
  """summary.json's keys known at the end: how the run ended (``status``: ``completed``,
  ``failed`` or ``interrupted``; ``error``: why, or None), its final state's losses, the
  median step time (``step_times``: seconds per step of each log interval), peak memory, and
  the task's best of ``evals`` (the run's evaluation records)."""
  stats = jax.device_get(state.stats)
  mean_loss = float(stats["loss_sum"] / max(int(stats["loss_count"]), 1))
  return (
    {
      "status": status,
      "error": error,
      "steps": int(state.step),
      "total_steps": total_steps,
      "min_train_loss": finite(stats["loss_min"]),
      "final_train_loss": finite(stats["last_loss"]),
      "step_time_s": statistics.median(step_times) if step_times else None,
      "examples_per_s": batch_size / statistics.median(step_times) if step_times else None,
      "peak_memory_bytes": logs.peak_memory_bytes(),
      "peak_memory_method": PEAK_MEMORY_METHOD,
      # Runs whose accuracy alone counts may share a GPU with others (GINGER_DEVICE_SHARED=1):
      # their times and memory are not the optimizer's, and results/ leaves them out of those.
      "device_shared": device_shared(),
    }
    | task.best_of(evals)
    | task.train_summary(mean_loss)
  )


def analytic_flops(task: Task, rc: RunConfig, params) -> float:
  """One training step: :func:`training.registry.step_flops` with the task's forward FLOPs
  over the batch and the run's d-pass, for the trained parameters ``params`` (arrays or
  shapes: the registry's count reads their shapes)."""
  return step_flops(
    rc.optimizer,
    params,
    forward_flops=task.forward_flops_per_example() * rc.batch_size,
    batch_size=rc.batch_size,
    fisher_forward=rc.fisher_forward,
    fisher_batch=fisher_sub_batch(rc),
  )


def xla_flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None
  except Exception:  # noqa: BLE001 - backends differ in what they report
    return None


STEP_MEMORY_METHOD = (
  "XLA's memory_analysis() of the compiled training step(s), per device: argument + output "
  "- alias (the donated state, updated in place) + temp bytes, the largest over the step "
  "with the curvature update and the one without (curvature_every > 1). What the step "
  "itself holds on a device: the state, the gradients and activations, the frozen "
  "parameters and the whole training set resident on the device (train_data_bytes_per_device "
  "of it); not compilation or autotuning scratch, not the evaluation step, not the allocator's "
  "fragmentation"
)


def step_memory_bytes(analyses) -> int | None:
  """Bytes one training step keeps live on a device, from XLA's memory analyses.

  ``arguments + outputs - aliased + temp``: the arguments (state, data) stay allocated for
  the whole step, the outputs are allocated beside them except where donation lets an output
  reuse its argument's buffer (``alias``), and the temporaries (activations, gradients, the
  optimizer's intermediates) are one allocation of ``temp`` bytes. The largest over
  ``analyses`` (one per compiled step; None entries are skipped); None if none reported.
  """
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
  totals = [
    a[keys[0]] + a[keys[1]] - a[keys[2]] + a["temp_size_in_bytes"]
    for a in analyses
    if a and all(k in a for k in (*keys, "temp_size_in_bytes"))
  ]
  return max(totals) if totals else None


def xla_memory(compiled) -> dict[str, int] | None:
  try:
    mem = compiled.memory_analysis()
  except Exception:  # noqa: BLE001
    return None
  if mem is None:
    return None
  keys = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "alias_size_in_bytes",
    "peak_memory_in_bytes",  # as XLA reports it (newer JAX); step_memory_bytes does not use it
  )
  return {k: int(getattr(mem, k)) for k in keys if hasattr(mem, k)}


def finite(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None
