"""Train any model of models/ with any optimizer, configured by Hydra (configs/).

    python train.py optimizer=ginger tau=8                    # CIFAR-100 / ResNet-18 (Table 1)
    python train.py experiment=demo                           # offline: digits, tiny ResNet
    python train.py -m optimizer=ginger,qng tau=1,2,4         # one run dir per combination
    python train.py experiment=xsum_t5_lora optimizer=ginger tau=8

Each run writes to its own dir (outputs/<name>/<overrides>/): ``.hydra/config.yaml``,
``metrics.jsonl``, ``summary.json`` and orbax ``checkpoints/``. Rerunning the same command
continues from the last checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import hydra
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import ginger
from training import logs, sharding
from training.checkpoints import Checkpointer, CheckpointError
from training.optimizers import CURVATURE, build_optimizer, learning_rate, optimizer_flops

log = logging.getLogger("train")
OmegaConf.register_new_resolver("run_name", lambda overrides: overrides or "default", replace=True)


class NonFiniteLossError(RuntimeError):
  """The training loss became NaN or Inf."""


class TrainState(NamedTuple):
  step: jax.Array
  trainable: Any  # what the optimizer updates (all params, or the LoRA adapters)
  rest: Any  # non-parameter model state: BatchNorm statistics, dropout RNG counts
  opt_state: Any
  rng: jax.Array
  stats: dict  # device-side running loss statistics (no host sync per step)


# ----------------------------------------------------------------------------- building


def build_task(cfg):
  """The model family's task (see models/tasks.py) with its data loaded."""
  from models import tasks

  if cfg.model.family == "resnet":
    from data.images import load_image_dataset

    dataset = load_image_dataset(
      cfg.data.name,
      cfg.data.source,
      cfg.data.path,
      holdout=int(cfg.data.holdout),
      seed=int(cfg.seed),
    )
    return tasks.ImageClassification(
      cfg.model,
      dataset,
      precision=cfg.precision,
      seed=int(cfg.seed),
      augment=bool(cfg.data.augment),
    )
  if cfg.model.family == "t5":
    from data import xsum

    tokenizer = xsum.load_tokenizer(cfg.data.tokenizer)
    # The evaluated split is "validation" unless data.eval_split says otherwise (evaluate.py
    # data.eval_split=test); the task sees it under the name "validation" either way.
    eval_split = cfg.data.get("eval_split") or "validation"
    raw = xsum.load_xsum(
      cfg.data.source, cfg.data.path, splits=("train", eval_split), limit=cfg.data.limit
    )
    arrays = {
      name: xsum.tokenize_split(
        raw[split],
        tokenizer,
        prefix=cfg.data.prefix,
        max_source_len=cfg.data.max_source_len,
        max_target_len=cfg.data.max_target_len,
      )
      for name, split in (("train", "train"), ("validation", eval_split))
    }
    return tasks.Seq2Seq(cfg.model, arrays, tokenizer, precision=cfg.precision, seed=int(cfg.seed))
  raise ValueError(f"model.family must be resnet or t5, got {cfg.model.family!r}.")


def fisher_forward(cfg) -> str:
  if cfg.fisher_forward not in ("shared", "eval"):
    raise ValueError(f"fisher_forward must be 'shared' or 'eval', got {cfg.fisher_forward!r}.")
  return cfg.fisher_forward


def make_steps(task, graphdef_train, graphdef_eval, tx, cfg, plan: sharding.Plan, state_shardings):
  """The jitted training and evaluation steps, written once for any number of devices: the
  batch indices are split along the mesh's ``data`` axis, the state is placed as
  ``state_shardings`` says, and XLA (GSPMD) adds the collectives."""
  from ginger.fisher import cross_entropy, value_grad_and_fisher

  needs_fisher = cfg.optimizer.name in CURVATURE
  clip = optax.clip_by_global_norm(float(cfg.grad_clip)) if cfg.grad_clip else None
  separate_d_pass = fisher_forward(cfg) == "eval"

  def apply(graphdef, trainable, frozen, rest, inputs):
    model = nnx.merge(graphdef, task.full_params(trainable, frozen), rest, copy=True)
    logits = task.forward(model, inputs)
    return logits, nnx.split(model, nnx.Param, ...)[2]

  def train_step(state: TrainState, frozen, arrays, idx):
    rng, batch_key, fisher_key = jax.random.split(state.rng, 3)
    inputs, labels, mask = task.train_batch(arrays, idx, batch_key)
    forward = lambda p: apply(graphdef_train, p, frozen, state.rest, inputs)
    extra = {}
    if needs_fisher and not separate_d_pass:
      # One forward pass, two cotangents: loss gradient and sampled-Fisher vector d_t.
      (loss, rest), grads, extra["fisher_grads"] = value_grad_and_fisher(
        forward, state.trainable, labels, fisher_key, mask=mask, has_aux=True, fisher=cfg.fisher
      )
    else:

      def loss_fn(p):
        logits, rest = forward(p)
        return cross_entropy(logits, labels, mask), rest

      (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
      if needs_fisher:
        # The authors' d-pass: its own forward in inference mode (BatchNorm running stats).
        eval_forward = lambda p: apply(graphdef_eval, p, frozen, state.rest, inputs)[0]
        _, _, extra["fisher_grads"] = value_grad_and_fisher(
          eval_forward, state.trainable, labels, fisher_key, mask=mask, fisher=cfg.fisher
        )
    # Pin gradients (and d_t) replicated: otherwise GSPMD propagates the sharded optimizer
    # state's layout back into the model's backward pass (hundreds of small all-gathers).
    grads, extra = jax.lax.with_sharding_constraint((grads, extra), plan.replicated)
    grad_norm = optax.global_norm(grads)
    if clip is not None:
      grads, _ = clip.update(grads, clip.init(grads))
    updates, opt_state = tx.update(grads, state.opt_state, state.trainable, **extra)
    trainable = optax.apply_updates(state.trainable, updates)
    stats = {
      "loss_min": jnp.minimum(state.stats["loss_min"], loss),
      "loss_sum": state.stats["loss_sum"] + loss,
      "loss_count": state.stats["loss_count"] + 1,
      "nonfinite": state.stats["nonfinite"] | ~jnp.isfinite(loss),
      "last_loss": loss,
      "grad_norm": grad_norm,
    }
    return TrainState(state.step + 1, trainable, rest, opt_state, rng, stats)

  def eval_step(trainable, frozen, rest, arrays, idx):
    model = nnx.merge(graphdef_eval, task.full_params(trainable, frozen), rest, copy=True)
    return task.eval_sums(model, arrays, idx)

  replicated = plan.replicated
  train_step = jax.jit(
    train_step,
    donate_argnums=0,
    in_shardings=(state_shardings, replicated, replicated, plan.batch),
    out_shardings=state_shardings,
  )
  eval_on_mesh = jax.jit(eval_step, out_shardings=replicated)

  def eval_step_on_host_indices(trainable, frozen, rest, arrays, idx):
    # `arrays` are placed once by the caller (replicated); only the indices move per batch.
    return eval_on_mesh(trainable, frozen, rest, arrays, plan.indices(idx))

  return train_step, eval_step_on_host_indices


def initial_stats():
  return {
    "loss_min": jnp.asarray(jnp.inf, jnp.float32),
    "loss_sum": jnp.zeros([], jnp.float32),
    "loss_count": jnp.zeros([], jnp.int32),
    "nonfinite": jnp.zeros([], bool),
    "last_loss": jnp.zeros([], jnp.float32),
    "grad_norm": jnp.zeros([], jnp.float32),
  }


def ginger_spectrum(opt_state) -> dict[str, list[float]] | None:
  """Ginger's sigma per block from the optimizer state, keyed by parameter path."""
  found = [
    s
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ginger.ScaleByGingerState))
    if isinstance(s, ginger.ScaleByGingerState)
  ]
  if not found:
    return None
  sigma = found[0].sigma
  if isinstance(sigma, jax.Array):
    return {"global": np.asarray(sigma).tolist()}
  return {
    jax.tree_util.keystr(path): np.asarray(leaf).tolist()
    for path, leaf in jax.tree_util.tree_leaves_with_path(sigma)
  }


# ---------------------------------------------------------------------------- evaluation


def evaluate(task, eval_step, state: TrainState, frozen, arrays, cfg) -> dict[str, float]:
  n = len(next(iter(task.val_arrays.values())))
  size = int(cfg.eval_batch_size)
  sums: dict[str, float] = {}
  for start in range(0, n, size):
    idx = np.arange(start, min(start + size, n))
    batch = jax.device_get(eval_step(state.trainable, frozen, state.rest, arrays, idx))
    for k, v in batch.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  metrics = {k: float(v) for k, v in task.eval_metrics(sums).items()}
  if task.kind == "seq2seq" and cfg.data.rouge_examples:
    model = task.model
    nnx.update(model, task.full_params(state.trainable, frozen), state.rest)
    metrics |= task.generation_metrics(
      model,
      examples=int(cfg.data.rouge_examples),
      batch_size=int(cfg.eval_batch_size),
      max_new_tokens=int(cfg.data.max_new_tokens),
    )
  return metrics


def best_of(evals: list[dict], kind: str) -> dict[str, Any]:
  """Best evaluation: highest accuracy (images) or ROUGE-L (seq2seq)."""
  if not evals:
    return {}
  if kind == "classification":
    best = max(evals, key=lambda e: e["val_accuracy"])
    return {
      "best_val_accuracy": best["val_accuracy"],
      "val_loss_at_best": best["val_loss"],
      "best_step": best["step"],
    }
  if "rougeL" in evals[0]:
    best = max(evals, key=lambda e: e["rougeL"])
  else:
    best = min(evals, key=lambda e: e["val_loss"])
  return {
    "rouge1": best.get("rouge1"),
    "rouge2": best.get("rouge2"),
    "rougeL": best.get("rougeL"),
    "rougeLsum": best.get("rougeLsum"),
    "val_loss": best["val_loss"],
    "best_step": best["step"],
  }


# ------------------------------------------------------------------------------ the run


def run_identity(cfg) -> dict[str, Any]:
  curvature = cfg.optimizer.name in CURVATURE
  setting = None
  if cfg.model.family == "t5":
    setting = "lora" if cfg.model.get("lora") else "full"
  return {
    "experiment": cfg.name,
    "optimizer": cfg.optimizer.name,
    "tau": cfg.tau if curvature else None,
    "alpha": cfg.alpha if curvature else None,
    "gamma": cfg.gamma if cfg.optimizer.name == "ginger" else None,
    "rho": cfg.rho if cfg.optimizer.name == "ginger" else None,
    "block": cfg.block if curvature else None,
    "lr": float(cfg.lr),
    "seed": int(cfg.seed),
    "model": cfg.model.name,
    "dataset": cfg.data.name,
    "setting": setting,
    "sweep": cfg.get("sweep"),
    "fisher": cfg.fisher if curvature else None,
    "fisher_forward": cfg.fisher_forward if curvature else None,
  }


class Setup(NamedTuple):
  """Everything built from a config before the first step (shared with evaluate.py)."""

  task: Any
  state: TrainState  # the initial state: also the template for restoring checkpoints
  frozen: Any  # frozen parameters (LoRA's base model), never checkpointed
  train_step: Any
  eval_step: Any
  schedule: optax.Schedule
  steps_per_epoch: int
  total_steps: int
  sizes: list[int]  # sizes of the trained leaves
  n_model: int  # all model parameters
  plan: sharding.Plan  # the device mesh and where arrays live on it


def build(cfg: DictConfig) -> Setup:
  sharding.initialize_distributed(cfg.get("distributed", "auto"))  # before any JAX work
  # Check the cheap things first, so a bad value fails before data and model are loaded.
  fisher_forward(cfg)
  build_optimizer(cfg, learning_rate(cfg, 1, 1))
  plan = sharding.plan_from_config(cfg.get("mesh"))
  if int(cfg.batch_size) % plan.data_size:
    raise ValueError(
      f"batch_size {cfg.batch_size} must be divisible by the {plan.data_size} "
      "devices of the mesh's data axis (mesh.data)."
    )
  task = build_task(cfg)
  model = task.model
  model.train()
  graphdef_train, params, rest = nnx.split(model, nnx.Param, ...)
  model.eval()
  graphdef_eval = nnx.split(model, nnx.Param, ...)[0]
  model.train()
  trainable = task.trainable_params(params)
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(trainable)]
  n_model = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))

  n_train = len(next(iter(task.train_arrays.values())))
  steps_per_epoch = n_train // int(cfg.batch_size)
  if steps_per_epoch < 1:
    raise ValueError(f"batch_size {cfg.batch_size} is larger than the training set ({n_train}).")
  total_steps = int(cfg.max_steps) if cfg.max_steps else int(cfg.epochs) * steps_per_epoch
  schedule = learning_rate(cfg, steps_per_epoch, total_steps)
  tx = build_optimizer(cfg, schedule)
  state = TrainState(
    jnp.zeros([], jnp.int32),
    trainable,
    rest,
    tx.init(trainable),
    jax.random.key(int(cfg.seed)),
    initial_stats(),
  )
  state_shardings = plan.state(state)
  state = sharding.put(state, state_shardings)
  frozen = sharding.put(task.frozen_params(params), plan.replicated)
  train_step, eval_step = make_steps(
    task, graphdef_train, graphdef_eval, tx, cfg, plan, state_shardings
  )
  return Setup(
    task,
    state,
    frozen,
    train_step,
    eval_step,
    schedule,
    steps_per_epoch,
    total_steps,
    sizes,
    n_model,
    plan,
  )


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
  """Runs (or resumes) one training run in ``run_dir``; returns its summary."""
  run_dir.mkdir(parents=True, exist_ok=True)
  setup = build(cfg)
  task, state, frozen, train_step = setup.task, setup.state, setup.frozen, setup.train_step
  sizes, steps_per_epoch, total_steps = setup.sizes, setup.steps_per_epoch, setup.total_steps
  log.info(
    "model %s: %s parameters (%s trained)", cfg.model.name, f"{setup.n_model:,}", f"{sum(sizes):,}"
  )
  n_train = len(next(iter(task.train_arrays.values())))
  batch_size = int(cfg.batch_size)
  eval_every = steps_per_epoch if cfg.eval_every == "epoch" else int(cfg.eval_every)
  schedule, eval_step, plan = setup.schedule, setup.eval_step, setup.plan
  checkpointer = Checkpointer(run_dir)
  start = 0
  if checkpointer.latest_step() is not None:
    if cfg.resume:
      state = checkpointer.restore(state)
      start = int(state.step)
      log.info("resumed from %s at step %d", checkpointer.directory, start)
      finished = _finished_summary(run_dir, start, total_steps)
      if finished is not None:
        log.info("run already complete (%d steps): keeping its summary.json", start)
        return finished
    else:
      log.info("resume=false: removing old checkpoints in %s", checkpointer.directory)
      if jax.process_index() == 0:
        shutil.rmtree(checkpointer.directory)
      sharding.sync("removed old checkpoints")
      checkpointer = Checkpointer(run_dir)
  config = OmegaConf.to_container(cfg, resolve=True)
  metrics = logs.MetricsLog(run_dir, cfg.logger, config, resume_step=start if start else None)
  evals = [e for e in _read_events(metrics.path) if e["event"] == "eval"] if metrics.writer else []

  # The whole dataset on every device; each step gathers its batch by index on the devices.
  train_arrays = sharding.put(task.train_arrays, plan.replicated)
  val_arrays = sharding.put(task.val_arrays, plan.replicated)
  from data.images import epoch_permutation

  # One shuffle per epoch, not per step (the permutation is a pure function of seed and epoch).
  permutation = functools.lru_cache(maxsize=2)(
    lambda epoch: epoch_permutation(int(cfg.seed), epoch, n_train)
  )

  def batch_indices(step):
    epoch, i = divmod(step, steps_per_epoch)
    perm = permutation(epoch)
    return plan.indices(perm[i * batch_size : (i + 1) * batch_size])  # split along `data`

  # Compile once, ahead of time: the same executable gives XLA's cost/memory analysis and
  # runs every step (calling the jitted function would compile a second time).
  compiled = train_step.lower(state, frozen, train_arrays, batch_indices(start)).compile()
  flops = {"analytic": analytic_flops(task, cfg, sizes, batch_size), "xla": _xla_flops(compiled)}
  summary_base = {
    "run": run_identity(cfg),
    "config": config,
    "versions": logs.versions(),
    "device": logs.device_info(),
    "mesh": plan.describe(),
    "git_commit": logs.git_commit(),
    "parameters": setup.n_model,
    "trained_parameters": sum(sizes),
    "optimizer_state_bytes_per_device": sharding.bytes_per_device(state.opt_state),
    "steps_per_epoch": steps_per_epoch,
    "flops_per_iter": flops,
    "flops_method": {
      "analytic": "conv/dense (or transformer matmul) count: 3x forward "
      "for loss grad, +2x (shared) or +3x (eval) forward for the "
      "d-pass, plus the optimizer's own update",
      "xla": "compiled train step cost_analysis(); unreliable on GPU",
    },
    "xla_memory_analysis": _xla_memory(compiled),
  }
  log.info(
    "%d steps (%d per epoch), batch %d; FLOPs/iter analytic %.3g, XLA %s",
    total_steps,
    steps_per_epoch,
    batch_size,
    flops["analytic"],
    flops["xla"],
  )

  progress = logs.Progress(total_steps, start)
  step_times: list[float] = []
  interval_start, interval_steps = time.perf_counter(), 0
  last_good = start
  status, error = "completed", None
  try:
    for step in range(start, total_steps):
      state = compiled(state, frozen, train_arrays, batch_indices(step))
      interval_steps += 1
      done = step + 1
      at_eval = done % eval_every == 0 or done == total_steps
      at_ckpt = done % int(cfg.checkpoint_every) == 0 or done == total_steps
      at_log = done % int(cfg.log_every) == 0 or at_eval or at_ckpt
      if at_log:
        stats = jax.device_get(state.stats)
        elapsed = time.perf_counter() - interval_start
        if interval_steps and step + 1 - interval_steps > start:  # skip the compile interval
          step_times.append(elapsed / interval_steps)
        if stats["nonfinite"]:
          raise NonFiniteLossError(
            f"the training loss became NaN/Inf at or before step {done} "
            f"(last loss {stats['last_loss']}); lower lr or raise gamma. The last good "
            f"checkpoint is step {last_good} in {checkpointer.directory}."
          )
        metrics.write(
          "train",
          done,
          train_loss=stats["last_loss"],
          min_train_loss=stats["loss_min"],
          grad_norm=stats["grad_norm"],
          lr=schedule(done - 1),
          epoch=done / steps_per_epoch,
          step_time_s=elapsed / max(interval_steps, 1),
          examples_per_s=batch_size * interval_steps / max(elapsed, 1e-9),
        )
        progress.update(done, loss=float(stats["last_loss"]))
        if cfg.spectrum_every and done % int(cfg.spectrum_every) == 0:
          spectrum = ginger_spectrum(state.opt_state)
          if spectrum is not None:
            metrics.write("spectrum", done, sigma=spectrum)
      if at_eval:
        result = evaluate(task, eval_step, state, frozen, val_arrays, cfg)
        epoch_mean = float(stats["loss_sum"] / max(int(stats["loss_count"]), 1))
        record = metrics.write("eval", done, **result, train_loss_mean=epoch_mean)
        evals.append(record)
        progress.line(
          f"step {done}/{total_steps} "
          + " ".join(f"{k}={v:.4g}" for k, v in result.items() if isinstance(v, float))
        )
      if at_ckpt:
        checkpointer.save(done, state)
        last_good = done
      if at_log:
        interval_start, interval_steps = time.perf_counter(), 0
  except NonFiniteLossError as e:
    status, error = "failed", str(e)
  finally:
    progress.close()
    checkpointer.wait()

  stats = jax.device_get(state.stats)
  final_step = int(state.step)
  mean_loss = float(stats["loss_sum"] / max(int(stats["loss_count"]), 1))
  summary = (
    summary_base
    | {
      "status": status,
      "error": error,
      "steps": final_step,
      "total_steps": total_steps,
      "min_train_loss": _finite(stats["loss_min"]),
      "final_train_loss": _finite(stats["last_loss"]),
      "step_time_s": statistics.median(step_times) if step_times else None,
      "examples_per_s": batch_size / statistics.median(step_times) if step_times else None,
      "peak_memory_bytes": logs.peak_memory_bytes(),
      "peak_memory_method": "device memory_stats()['peak_bytes_in_use'] of this process "
      "(includes compilation/autotuning); null where not reported",
    }
    | best_of(evals, task.kind)
  )
  if task.kind == "seq2seq":
    summary["train_perplexity"] = math.exp(mean_loss) if math.isfinite(mean_loss) else None
  if jax.process_index() == 0:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
  metrics.close()
  if error:
    raise NonFiniteLossError(error)
  return summary


def analytic_flops(task, cfg, sizes, batch_size) -> float:
  """Forward x3 for the loss gradient; the d-pass adds one backward (2x) when it shares the
  forward, or a forward and a backward (3x) when it runs in eval mode; plus the update."""
  forward = task.forward_flops_per_example() * batch_size
  passes = 3.0
  if cfg.optimizer.name in CURVATURE:
    passes += 2.0 if cfg.fisher_forward == "shared" else 3.0
  return passes * forward + optimizer_flops(cfg, sizes)


def _xla_flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None
  except Exception:  # noqa: BLE001 - backends differ in what they report
    return None


def _xla_memory(compiled) -> dict[str, int] | None:
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
  )
  return {k: int(getattr(mem, k)) for k in keys if hasattr(mem, k)}


def _finite(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None


def _finished_summary(run_dir: Path, step: int, total_steps: int) -> dict | None:
  """The summary of a run that already reached ``total_steps``, so a rerun changes nothing."""
  path = run_dir / "summary.json"
  if step < total_steps or not path.exists():
    return None
  summary = json.loads(path.read_text())
  return summary if summary.get("status") == "completed" else None


def _read_events(path: Path) -> list[dict]:
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
  for noisy in ("absl", "orbax", "jax._src"):  # checkpoint/compile chatter at INFO
    logging.getLogger(noisy).setLevel(logging.WARNING)
  run_dir = Path(HydraConfig.get().runtime.output_dir)
  from data.images import DatasetUnavailableError
  from models.t5_convert import ModelUnavailableError

  try:
    summary = train(cfg, run_dir)
  except (
    ValueError,
    DatasetUnavailableError,
    ModelUnavailableError,
    CheckpointError,
    NonFiniteLossError,
  ) as e:
    log.error("%s: %s", type(e).__name__, e)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
      return  # one failed job (e.g. a diverged lr in lr_tune) must not end the whole sweep
    sys.exit(1)
  shown = {
    k: summary.get(k)
    for k in (
      "best_val_accuracy",
      "val_loss_at_best",
      "rouge1",
      "rouge2",
      "rougeL",
      "train_perplexity",
      "min_train_loss",
      "final_train_loss",
      "steps",
      "step_time_s",
    )
    if summary.get(k) is not None
  }
  log.info("done: %s -> %s", json.dumps(shown), run_dir / "summary.json")


if __name__ == "__main__":
  main()
