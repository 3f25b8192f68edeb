"""The training loop, for any task of models/tasks.py and any optimizer of training/optimizers.py.

:func:`train` runs (or resumes) one run in a run dir; :func:`build` makes everything a run
needs from its config (evaluate.py uses it too); :func:`evaluate` scores a state on the task's
evaluation split. The loop knows nothing of the task's kind: the task loads its data, orders
the examples of an epoch, forms batches, scores evaluations (generation included), says which
evaluation is the best and counts its forward FLOPs.

A run stops early in four ways, each leaving a summary.json: a NaN/Inf loss (status
"failed", :class:`NonFiniteLossError`), a full disk (a checkpoint or the metrics could not be
written: status "failed", a :class:`~training.errors.DiskFullError` of one line naming the
last good checkpoint, which a rerun resumes from; summary.json only where it still fits),
SIGTERM or SIGINT (a checkpoint at the current step, status "interrupted",
:class:`Interrupted`; a rerun continues bit for bit), or a bug (raised as is).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

import ginger
from models import flops
from models.tasks import Task, build_task, per_shard_model
from training import logs, profiling, program_cache, run_record, sharding
from training.checkpoints import Checkpointer, CheckpointError, last_good_in
from training.config_check import ConfigError, check_config
from training.errors import DiskFullError, Interrupted, NonFiniteLossError, disk_full, no_space
from training.optimizers import (
  build_optimizer,
  clip_bound,
  curvature_every,
  divergence_advice,
  learning_rate,
  passes,
  reorthonormalise_every,
)
from training.registry import keeps_curvature, update_flops

REPO = Path(__file__).resolve().parents[1]  # the checkout (train.py's folder)
log = logging.getLogger("train")

# A stop request: called with the number of steps done, returns the signal that asks the run
# to stop (checkpoint and exit), or None to go on.
StopRequest = Callable[[int], "int | None"]


class TrainState(NamedTuple):
  step: jax.Array
  trainable: Any  # what the optimizer updates (all params, or the LoRA adapters)
  rest: Any  # non-parameter model state: BatchNorm statistics, dropout RNG counts
  opt_state: Any
  rng: jax.Array
  stats: dict  # device-side running loss statistics (no host sync per step)


# ----------------------------------------------------------------------------- steps


def initial_stats(bound: float | None = None):
  """The running statistics the step keeps; ``clip_fraction`` where ``clip_bound`` is set
  (``bound``: :func:`training.optimizers.clip_bound`)."""
  stats = {
    "loss_min": jnp.asarray(jnp.inf, jnp.float32),
    "loss_sum": jnp.zeros([], jnp.float32),
    "loss_count": jnp.zeros([], jnp.int32),
    "nonfinite": jnp.zeros([], bool),
    "last_loss": jnp.zeros([], jnp.float32),
    "grad_norm": jnp.zeros([], jnp.float32),
  }
  if bound is not None:
    stats["clip_fraction"] = jnp.zeros([], jnp.float32)
  return stats


def clip_fraction(updates, lr: jax.Array, rho: float) -> jax.Array:
  """The fraction of the entries of the preconditioned update ``u = updates / -lr`` with
  ``|u| >= rho``: those an element-wise clip to ``[-rho, rho]`` changed, or would change in a
  run without the clip. A clipped entry leaves the optimizer as exactly ``-lr * rho * sign``,
  so the test reads ``updates`` (the cut sits 1e-6 below, under the product's rounding).
  0 while the learning rate is 0."""
  leaves = jax.tree.leaves(updates)
  total = sum(x.size for x in leaves)
  if not total:
    return jnp.zeros([], jnp.float32)
  cut = jnp.abs(lr).astype(jnp.float32) * (rho * (1.0 - 1e-6))
  count = sum(jnp.sum(jnp.abs(x.astype(jnp.float32)) >= cut, dtype=jnp.int32) for x in leaves)
  return jnp.where(lr != 0, count.astype(jnp.float32) / total, 0.0)


def fisher_backward(cfg, plan: sharding.Plan, model: nnx.Module | None = None) -> str:
  """The shared d-pass's backward (config ``fisher_backward``). ``auto`` is ``batched`` where
  the batch is on one device; where it is split over several, ``local`` if ``model`` allows it
  (no state but parameters and BatchNorm statistics: :func:`_per_shard_refusal`), else
  ``sequential``.

  The batched pull-back vmaps the backward over the pair of cotangents, and a convolution's
  batching rule folds that pair into the batch dimension, outside the device split: GSPMD then
  all-gathers the activations' gradients, which costs more than the backward itself
  (``python -m bench.collectives`` shows the gathers, also on CPU devices). ``sequential`` runs
  two backwards instead (no gathers, the backward's convolutions twice). ``local``: the batched
  pull-back inside ``jax.shard_map``, each device on its own shard
  (:func:`ginger.fisher.value_grad_and_fisher_per_device`): one backward and no gathers, the
  fastest where the model allows it."""
  value = cfg.get("fisher_backward") or "auto"
  if value != "auto":
    return value
  if plan.data_size == 1:
    return "batched"
  if model is not None and _per_shard_refusal(model) is None:
    return "local"
  return "sequential"


def device_shared() -> bool:
  """Whether this run shares its device with other processes (``GINGER_DEVICE_SHARED=1``, set
  by whoever starts several runs on one GPU): its step times, wall-clock and memory are then
  not its own."""
  return os.environ.get("GINGER_DEVICE_SHARED", "") not in ("", "0")


def shared_d_pass(cfg) -> bool:
  """Whether the training step's d-pass reuses its forward (a curvature optimizer with
  ``fisher_forward=shared``), the only case ``fisher_backward`` applies to."""
  return keeps_curvature(cfg.optimizer.name) and cfg.fisher_forward != "eval"


def make_steps(
  task,
  graphdef_train,
  graphdef_eval,
  tx,
  cfg,
  plan: sharding.Plan,
  state_shardings,
  backward: str | None = None,
  graphdef_per_shard=None,
  schedule: optax.Schedule | None = None,
):
  """The jitted training and evaluation steps, written once for any number of devices: the
  batch indices are split along the mesh's ``data`` axis, the state is placed as
  ``state_shardings`` says, and XLA (GSPMD) adds the collectives.

  Returns ``(train_step, eval_step, precondition_step, reorthonormalise_step)``.
  ``train_step`` is the step of the paper (with a curvature optimizer: the d-pass and a
  curvature update). With
  ``curvature_every`` K > 1, ``precondition_step`` is the step for the K - 1 steps between
  curvature updates: the same code without the d-pass (no sampled-Fisher backward, no
  inference-mode forward) and without ``fisher_grads``, which the optimizer takes as "no
  curvature update, precondition with the current G". The two are separate programs, so that
  nothing of the d-pass is computed and discarded behind a ``cond``; both take and return the
  same state, so a run moves between them (and resumes at any step). None when K = 1.

  ``reorthonormalise_step`` (Ginger only, else None): the state with ``U`` re-orthonormalised
  (``ginger.reorthonormalise``), which the loop runs after every
  ``optimizers.reorthonormalise_every(cfg)``-th curvature update
  (:meth:`Setup.reorthonormalises_after`). Ginger's update is built without its own
  (``reorthonormalise_every=0``): that one is a ``lax.cond`` in every step, and on a GPU an
  XLA conditional stops the host until the device has caught up, so the kernels after it
  are launched while the GPU waits.

  ``backward``: the shared d-pass's backward as :func:`fisher_backward` resolved it for this
  mesh and model (``build`` resolves it once); None where the step has no shared d-pass.
  ``graphdef_per_shard``: the training model for one device's shard
  (``models.tasks.per_shard_model``), for ``backward="local"``. ``schedule``: the learning
  rate, for the ``clip_fraction`` statistic (:func:`clip_fraction`), which the step keeps
  where the state's statistics have it (:func:`initial_stats`).
  """
  from ginger.fisher import (
    cross_entropy,
    fisher_vector,
    value_grad_and_fisher,
    value_grad_and_fisher_per_device,
  )

  clip = optax.clip_by_global_norm(float(cfg.grad_clip)) if cfg.grad_clip else None
  rho = clip_bound(cfg)
  separate_d_pass = cfg.fisher_forward == "eval"
  per_shard = backward == "local"
  if per_shard and graphdef_per_shard is None:
    raise ValueError("fisher_backward=local needs graphdef_per_shard (see build).")

  # A function of its own under jit: a run's programs (the training step with and without the
  # curvature update, their gradients) trace the model once, then reuse JAX's cached jaxpr and
  # its derivatives; XLA inlines the call, so the compiled steps are unchanged.
  @functools.partial(jax.jit, static_argnums=0)
  def apply(graphdef, trainable, frozen, rest, inputs):
    model = nnx.merge(graphdef, task.full_params(trainable, frozen), rest, copy=True)
    logits = task.forward(model, inputs)
    return logits, nnx.split(model, nnx.Param, ...)[2]

  def step(state: TrainState, frozen, arrays, idx, *, needs_fisher: bool):
    # Split as on every step, also where fisher_key goes unused: the batch's randomness and
    # the next key do not depend on whether this step updated the curvature.
    rng, batch_key, fisher_key = jax.random.split(state.rng, 3)
    inputs, labels, mask = task.train_batch(arrays, idx, batch_key)
    forward = lambda p: apply(graphdef_train, p, frozen, state.rest, inputs)
    extra = {}
    if needs_fisher and per_shard:
      # One forward pass per device's shard, both cotangents in one backward pass there.
      (loss, rest), grads, extra["fisher_grads"] = value_grad_and_fisher_per_device(
        lambda p, x, fr, r: apply(graphdef_per_shard, p, fr, r, x),
        state.trainable,
        inputs,
        labels,
        fisher_key,
        mesh=plan.mesh,
        mask=mask,
        has_aux=True,
        fisher=cfg.fisher,
        constants=(frozen, state.rest),
      )
    elif needs_fisher and not separate_d_pass:
      # One forward pass, two cotangents: loss gradient and sampled-Fisher vector d_t.
      (loss, rest), grads, extra["fisher_grads"] = value_grad_and_fisher(
        forward,
        state.trainable,
        labels,
        fisher_key,
        mask=mask,
        has_aux=True,
        fisher=cfg.fisher,
        backward=backward,
      )
    else:

      def loss_fn(p):
        logits, rest = forward(p)
        return cross_entropy(logits, labels, mask), rest

      (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
      if needs_fisher:
        # The authors' d-pass: its own forward in inference mode (BatchNorm running stats).
        eval_forward = lambda p: apply(graphdef_eval, p, frozen, state.rest, inputs)[0]
        extra["fisher_grads"] = fisher_vector(
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
    if "clip_fraction" in state.stats:  # initial_stats(clip_bound(cfg)) decides
      stats["clip_fraction"] = clip_fraction(updates, schedule(state.step), rho)
    return TrainState(state.step + 1, trainable, rest, opt_state, rng, stats)

  def eval_step(trainable, frozen, rest, arrays, idx):
    model = nnx.merge(graphdef_eval, task.full_params(trainable, frozen), rest, copy=True)
    return task.eval_sums(model, arrays, idx)

  replicated = plan.replicated

  def jitted(needs_fisher: bool):
    return jax.jit(
      functools.partial(step, needs_fisher=needs_fisher),
      donate_argnums=0,
      in_shardings=(state_shardings, replicated, replicated, plan.batch),
      out_shardings=state_shardings,
    )

  curvature = keeps_curvature(cfg.optimizer.name)
  precondition_step = jitted(False) if curvature and curvature_every(cfg) > 1 else None
  train_step = jitted(curvature)
  reorthonormalise_step = None
  if reorthonormalise_every(cfg):

    def reorthonormalise(state: TrainState) -> TrainState:
      opt_state = ginger.reorthonormalise(
        state.opt_state, passes=passes(cfg), sharding=plan.optimizer_sharding
      )
      return state._replace(opt_state=opt_state)

    reorthonormalise_step = jax.jit(
      reorthonormalise,
      donate_argnums=0,
      in_shardings=(state_shardings,),
      out_shardings=state_shardings,
    )
  eval_jitted = EvalStep(jax.jit(eval_step, out_shardings=replicated), plan)
  return train_step, eval_jitted, precondition_step, reorthonormalise_step


class EvalStep(NamedTuple):
  """The jitted evaluation step on host indices: ``(trainable, frozen, rest, arrays, idx)``
  -> the task's additive statistics of the batch ``idx`` (numpy indices into ``arrays``, which
  the caller places once, replicated; only the indices move per batch).

  ``compiled`` maps a batch size to an executable compiled ahead of time (:meth:`lower`, then
  :meth:`with_compiled`; the training loop does this beside the training steps); batches of
  other sizes, and every batch before that, go through the jitted function, which compiles
  at the first call. Either way the same program runs.
  """

  jitted: Any
  plan: sharding.Plan
  compiled: dict = {}

  def __call__(self, trainable, frozen, rest, arrays, idx):
    run = self.compiled.get(len(idx), self.jitted)
    return run(*self.arguments(trainable, frozen, rest, arrays, idx))

  def arguments(self, trainable, frozen, rest, arrays, idx) -> tuple:
    """The jitted function's arguments for host indices ``idx`` (placed on the mesh)."""
    return trainable, frozen, rest, arrays, self.plan.indices(idx)

  def lower(self, trainable, frozen, rest, arrays, idx):
    return self.jitted.lower(*self.arguments(trainable, frozen, rest, arrays, idx))

  def with_compiled(self, compiled: dict) -> EvalStep:
    return self._replace(compiled={**self.compiled, **compiled})


def eval_batch_sizes(num_val: int, batch_size: int) -> list[int]:
  """The batch sizes :func:`evaluate` runs: ``batch_size`` and the remainder, if any."""
  sizes = [min(batch_size, num_val)] if num_val else []
  return sizes + ([num_val % batch_size] if num_val > batch_size and num_val % batch_size else [])


def programs(setup, state, frozen, train_arrays, val_arrays, indices, cfg) -> dict:
  """The lowerings of every program a run needs, to pass to :func:`compile_all`: ``True``,
  the training step (with the curvature update, if any); ``False``, the step without it
  (``curvature_every`` > 1 only); ``("eval", n)``, the evaluation step on batches of ``n``
  (:func:`eval_batch_sizes`); ``"reorthonormalise"``, Ginger's ``reorthonormalise_step``.
  ``indices``: a training batch's, placed (``plan.indices``).

  The first is the one :func:`compile_all` compiles alone: with ``curvature_every`` > 1 the
  step without the curvature update, which lowers much faster than the training step and
  autotunes the convolutions both share; the training step, lowered meanwhile, then compiles
  reading them, so the run starts sooner than with the training step first."""
  steps = {False: setup.precondition_step} if setup.curvature_every > 1 else {}
  steps[True] = setup.train_step
  jobs = {key: (fn, (state, frozen, train_arrays, indices), (0,)) for key, fn in steps.items()}
  for size in eval_batch_sizes(setup.task.num_val, int(cfg.eval_batch_size)):
    args = setup.eval_step.arguments(
      state.trainable, frozen, state.rest, val_arrays, np.arange(size)
    )
    jobs["eval", size] = (setup.eval_step.jitted, args, ())
  if setup.reorthonormalise_step is not None:
    jobs["reorthonormalise"] = (setup.reorthonormalise_step, (state,), (0,))
  if not cfg.get("compilation_cache_dir"):
    return {key: functools.partial(fn.lower, *args) for key, (fn, args, _) in jobs.items()}
  # With a compilation cache, the lowered programs are kept beside it (program_cache).
  folder = program_cache.folder_of(cfg.compilation_cache_dir)
  config = OmegaConf.to_container(cfg, resolve=True)
  data = program_cache.data_digest(setup.task)

  def cached(key, fn, args, donate):
    lowered, how = program_cache.lower(
      fn,
      args,
      name=program_name(key),
      donate_argnums=donate,
      config=config,
      folder=folder,
      data=data,
    )
    return Lowering(lowered, how)

  return {key: functools.partial(cached, key, *job) for key, job in jobs.items()}


class Lowering(NamedTuple):
  """A program lowered through :mod:`training.program_cache`: ``how`` it was (see
  :func:`training.program_cache.lower`); :func:`compile_all` records it."""

  lowered: Any
  how: str

  def compile(self):
    return self.lowered.compile()


# Threads that compile a run's programs (None: one per program; 1: one after the other).
COMPILE_THREADS: int | None = None
# Programs a run first needs many steps in (Ginger's re-orthonormalisation: after
# ginger.default_reorthonormalise_every curvature updates): compiled in a thread of their own
# while the run trains (compile_later), not beside the others before the first step, where
# they would slow the others' compilations and delay the first step; and only by a run that
# gets that far (Setup.first_reorthonormalisation).
LATER = ("reorthonormalise",)


def compile_later(lowering: Callable[[], Any]) -> Future:
  """``lowering().compile()`` in a thread of its own, started now: the executable's future
  (:meth:`~concurrent.futures.Future.result` waits for it where it is first needed)."""
  pool = ThreadPoolExecutor(1, thread_name_prefix="compile-later")
  try:
    return pool.submit(lambda: lowering().compile())
  finally:
    pool.shutdown(wait=False)  # the thread ends when its compilation does


def compile_all(
  lower: dict[Any, Callable[[], Any]], threads: int | None = None, times: dict | None = None
) -> dict:
  """``{key: lower[key]().compile()}``: the first program's compilation alone, then the
  others' at once, in threads.

  Lowering (tracing Python) holds the GIL and runs here, one program after the other; XLA's
  compilation releases it, so the others are lowered while the first (a training step:
  :func:`programs`) compiles. Their compilations start once it is done: on a GPU, XLA's
  autotuner keeps the kernels it timed for the rest of the process, and the other programs
  share most of the first's convolutions, so they read its choices instead of each autotuning
  them again beside the others on the same GPU, where the autotuners' timings slow one
  another. The executables are those that compiling one after the other gives (the same
  programs, the same compiler options).

  ``threads``: at most this many compilations at once (default: all of them; 1: one after the
  other). ``times``: if given, filled with ``{key: {"lower": s, "compile": s}}`` (wall-clock
  seconds of each program's lowering and of its compilation, which overlap the others').
  """
  times = {} if times is None else times

  def lowered(key):
    began = time.perf_counter()
    out = lower[key]()
    times[key] = {"lower": time.perf_counter() - began}
    if isinstance(out, Lowering):
      times[key]["program"] = out.how
    return out

  def compiled(key, program):
    began = time.perf_counter()
    out = program.compile()
    times[key]["compile"] = time.perf_counter() - began
    return out

  threads = len(lower) if threads is None else int(threads)
  if threads < 2 or len(lower) < 2:
    return {key: compiled(key, lowered(key)) for key in lower}
  first, *others = lower
  with ThreadPoolExecutor(min(threads, len(lower)), thread_name_prefix="compile") as pool:
    future = pool.submit(compiled, first, lowered(first))
    programs = {key: lowered(key) for key in others}  # while the first compiles
    out = {first: future.result()}
    futures = {key: pool.submit(compiled, key, program) for key, program in programs.items()}
    return out | {key: future.result() for key, future in futures.items()}


def program_name(key) -> str:
  """A :func:`programs` key as the run record names it."""
  if isinstance(key, bool):
    return "train_step" if key else "precondition_step"
  if key == "reorthonormalise":
    return "reorthonormalise_step"
  return f"eval_step[{key[1]}]"


# ----------------------------------------------------------------------------- building


class Setup(NamedTuple):
  """Everything built from a config before the first step (shared with evaluate.py)."""

  task: Task
  # The initial state (the template for restoring checkpoints); with build(materialize=False)
  # its optimizer state is shapes and shardings only (init_state builds it).
  state: TrainState
  frozen: Any  # frozen parameters (LoRA's base model), never checkpointed
  train_step: Any
  eval_step: Any
  schedule: optax.Schedule
  steps_per_epoch: int
  total_steps: int
  sizes: list[int]  # sizes of the trained leaves
  n_model: int  # all model parameters
  plan: sharding.Plan  # the device mesh and where arrays live on it
  # curvature_every = K > 1: the step between curvature updates (train_step runs on steps
  # 0, K, 2K, ...; see make_steps); None for K = 1.
  precondition_step: Any = None
  curvature_every: int = 1
  # The initial state on the devices (a fresh one each call); build(materialize=False)
  # leaves it to the caller, to compile before the optimizer state takes device memory.
  init_state: Callable[[], TrainState] | None = None
  # Ginger: the program that re-orthonormalises U, run after every reorthonormalise_every-th
  # curvature update (see make_steps); None (and 0) otherwise.
  reorthonormalise_step: Any = None
  reorthonormalise_every: int = 0
  # The shared d-pass's backward as fisher_backward resolved it for this mesh and model
  # (batched, sequential or local); None where the step has no shared d-pass.
  fisher_backward: str | None = None

  def updates_curvature(self, step: int) -> bool:
    """Whether step ``step`` (0-based) runs ``train_step`` (else ``precondition_step``).
    Decided on the host from the step index alone, so a resumed run picks as the
    uninterrupted one did."""
    return step % self.curvature_every == 0

  def reorthonormalises_after(self, step: int) -> bool:
    """Whether ``reorthonormalise_step`` runs after step ``step`` (0-based): after the
    ``reorthonormalise_every``-th, ``2 x``-th... curvature update, as the update's own
    ``reorthonormalise_every`` counts them. From the step index alone, like
    :meth:`updates_curvature`."""
    if not self.reorthonormalise_every or not self.updates_curvature(step):
      return False
    return (step // self.curvature_every + 1) % self.reorthonormalise_every == 0

  def first_reorthonormalisation(self, start: int) -> int | None:
    """The first step ``>= start`` after which ``reorthonormalise_step`` runs (None: never):
    steps ``K (N m - 1)``, ``m >= 1``, for ``K = curvature_every`` and ``N =
    reorthonormalise_every``."""
    if not self.reorthonormalise_every:
      return None
    every, n = self.curvature_every, self.reorthonormalise_every
    m = max(1, -(-(-(-start // every) + 1) // n))
    return every * (n * m - 1)


def check(cfg: DictConfig) -> sharding.Plan:
  """Everything about ``cfg`` that can be checked without data or compiling; the mesh."""
  sharding.initialize_distributed(cfg.get("distributed", "auto"))  # before any JAX work
  check_config(cfg)
  use_compilation_cache(cfg.get("compilation_cache_dir"))  # before the first compilation
  build_optimizer(cfg, learning_rate(cfg, 1, 1))  # the library's own checks of its arguments
  if cfg.optimizer.name == "ginger" and passes(cfg) == "pallas" and jax.default_backend() != "gpu":
    log.warning(
      "passes=pallas on %s: the Pallas kernels run in JAX's interpreter there, a test harness "
      "(the demo on 2 CPU cores: 2.5 steps/s against 52 with passes=jnp); passes=auto takes the "
      "kernels on GPUs and the jnp passes elsewhere.",
      jax.default_backend(),
    )
  plan = sharding.plan_from_config(cfg.get("mesh"))
  if int(cfg.batch_size) % plan.data_size:
    raise ConfigError(
      f"batch_size {cfg.batch_size} must be divisible by the {plan.data_size} "
      "devices of the mesh's data axis (mesh.data)."
    )
  return plan


def use_compilation_cache(folder: str | None) -> None:
  """Points JAX's persistent compilation cache at ``folder`` (config ``compilation_cache_dir``;
  None leaves JAX's own setting: off unless ``JAX_COMPILATION_CACHE_DIR`` is set).

  Every program that takes longer to compile than ``jax_persistent_cache_min_compile_time_secs``
  (JAX's default: 1 s; the training and evaluation steps) is written there, keyed by the
  program, its devices and the compiler's version and options, and a later process that
  compiles the same program reads the executable back instead of compiling it: another seed
  of a sweep (the seed is an argument of the step, not part of the program) or a resumed run.
  A change of lr, tau, K, batch size or code is another program and compiles anew. On GPUs
  JAX also keeps XLA's per-fusion autotuning results there, which other programs of the same
  shapes reuse. The executable read back is what this program compiled to before (on a CPU
  the very code a fresh compilation gives; on a GPU with the autotuner's choices of that
  compilation, which a fresh one may make differently, as two fresh ones may): it changes
  start-up time, not the program (compare start-up times only between runs that both hit, or
  both missed, the cache). JAX decides whether to use the cache at a process's first compilation:
  set it before (train.py and evaluate.py do, in :func:`check`).
  """
  if folder is None:
    return
  path = Path(folder).expanduser().resolve()
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  # A Pallas kernel's Triton module carries its source locations, file paths included, into
  # the program the cache keys on: keep them relative to the repository, or every other copy
  # of the checkout (another clone, a sweep's copy) compiles the Ginger step anew.
  jax.config.update("jax_hlo_source_file_canonicalization_regex", "^" + re.escape(f"{REPO}/"))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _per_shard_refusal(model) -> str | None:
  """Why ``model`` cannot pull back per device (``fisher_backward=local``), or None: state
  other than parameters and BatchNorm statistics (dropout's keys and counts) would be drawn or
  updated alike on every device's shard."""
  other = nnx.split(model, nnx.Param, nnx.BatchStat, ...)[3]
  if not jax.tree.leaves(other):
    return None
  kinds = sorted({type(v).__name__ for v in jax.tree.leaves(other, is_leaf=_is_variable)})
  return (
    f"the model keeps state other than parameters and BatchNorm statistics ({', '.join(kinds)}), "
    "which every device would draw or update alike on its shard"
  )


def _per_shard_graphdef(model, batch_size: int, devices: int):
  """The training model's graph for one device's shard (``fisher_backward=local``)."""
  if batch_size % devices:
    raise ConfigError(
      f"fisher_backward=local: batch_size={batch_size} must split evenly over the {devices} "
      "devices of mesh.data (each device pulls back its own shard of the batch)."
    )
  refusal = _per_shard_refusal(model)
  if refusal:
    raise ConfigError(
      f"fisher_backward=local: {refusal}; use fisher_backward=auto (which takes sequential "
      "for such a model)."
    )
  return nnx.split(per_shard_model(model, "data"), nnx.Param, ...)[0]


def build(cfg: DictConfig, plan: sharding.Plan | None = None, materialize: bool = True) -> Setup:
  """Checks ``cfg``, loads the task's data, builds model, optimizer and the jitted steps.

  ``materialize=False``: ``Setup.state``'s optimizer state is shapes and shardings only
  (``jax.ShapeDtypeStruct``), enough to compile every program; ``Setup.init_state()`` builds
  it on the devices. :func:`train` compiles first, so that on a GPU the autotuner's scratch
  (of the order of the programs' operands) and the optimizer state (Ginger's U) are never on
  the device at once: together they would set the run's memory high-water mark far above the
  state's own size.
  """
  plan = check(cfg) if plan is None else plan
  task = build_task(cfg)
  model = task.model
  model.train()
  graphdef_train, params, rest = nnx.split(model, nnx.Param, ...)
  model.eval()
  graphdef_eval = nnx.split(model, nnx.Param, ...)[0]
  model.train()
  # The shared d-pass's backward, resolved once for this mesh and model (None: no shared d-pass).
  backward = fisher_backward(cfg, plan, model) if shared_d_pass(cfg) else None
  graphdef_per_shard = None
  if backward == "local":
    graphdef_per_shard = _per_shard_graphdef(model, int(cfg.batch_size), plan.data_size)
  trainable = task.trainable_params(params)
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(trainable)]
  n_model = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))

  steps_per_epoch = task.num_train // int(cfg.batch_size)
  if steps_per_epoch < 1:
    raise ConfigError(
      f"batch_size {cfg.batch_size} is larger than the training set ({task.num_train})."
    )
  total_steps = int(cfg.max_steps) if cfg.max_steps else int(cfg.epochs) * steps_per_epoch
  schedule = learning_rate(cfg, steps_per_epoch, total_steps)
  tx = build_optimizer(cfg, schedule, plan.optimizer_sharding)
  state = TrainState(
    jnp.zeros([], jnp.int32),
    trainable,
    rest,
    jax.eval_shape(tx.init, trainable),  # shapes only: built by init_state
    jax.random.key(int(cfg.seed)),
    initial_stats(clip_bound(cfg)),
  )
  state_shardings = plan.state(state)
  # Everything but the optimizer state on the devices now (small next to it).
  placed = sharding.put(state._replace(opt_state=None), state_shardings._replace(opt_state=None))

  def init_state() -> TrainState:
    """The initial state on the devices, the optimizer's built where its shardings put it
    (one program: run op by op, Ginger's init compiles dozens of small ones, a reshape per
    tensor, a basis per bucket, several seconds of start-up; the values, zeros and unit
    vectors, are exact either way)."""
    init = jax.jit(tx.init, out_shardings=state_shardings.opt_state)
    return placed._replace(opt_state=init(placed.trainable))

  if materialize:
    state = init_state()
  else:
    state = placed._replace(
      opt_state=jax.tree.map(
        lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
        state.opt_state,
        state_shardings.opt_state,
      )
    )
  frozen = sharding.put(task.frozen_params(params), plan.replicated)
  train_step, eval_step, precondition_step, reorthonormalise_step = make_steps(
    task,
    graphdef_train,
    graphdef_eval,
    tx,
    cfg,
    plan,
    state_shardings,
    backward,
    graphdef_per_shard,
    schedule,
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
    precondition_step,
    curvature_every(cfg) if precondition_step is not None else 1,
    init_state,
    reorthonormalise_step,
    reorthonormalise_every(cfg),
    backward,
  )


def analytic_flops(task: Task, cfg, sizes: list[int]) -> float:
  """One training step: the task's forward FLOPs times the step's passes, plus the update.

  With ``curvature_every`` K > 1 the mean over K steps: one with the d-pass and the curvature
  update, K - 1 with neither (they only precondition).
  """
  name = cfg.optimizer.name
  curvature = keeps_curvature(name)
  forward = task.forward_flops_per_example() * int(cfg.batch_size)

  def step(update: bool) -> float:
    pass_flops = flops.train_step_flops(
      forward, fisher_forward=cfg.fisher_forward if curvature and update else None
    )
    return pass_flops + update_flops(
      name, sizes, tau=cfg.tau, block=cfg.block, curvature_update=update
    )

  every = curvature_every(cfg)
  return step(True) if every == 1 else (step(True) + (every - 1) * step(False)) / every


# ---------------------------------------------------------------------------- evaluation


def evaluate(task: Task, eval_step, state: TrainState, frozen, arrays, cfg) -> dict:
  """The task's metrics of ``state`` on its evaluation split (``arrays``, placed on the
  devices), in batches of ``cfg.eval_batch_size``; generation-based metrics included."""
  batch_size = int(cfg.eval_batch_size)
  sums: dict[str, float] = {}
  for start in range(0, task.num_val, batch_size):
    idx = np.arange(start, min(start + batch_size, task.num_val))
    batch = jax.device_get(eval_step(state.trainable, frozen, state.rest, arrays, idx))
    for k, v in batch.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  metrics = {k: float(v) for k, v in task.eval_metrics(sums).items()}
  model = functools.partial(task.model_with, state.trainable, frozen, state.rest)
  return metrics | task.generation_metrics(model)


# ------------------------------------------------------------------------------ stopping


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT)) -> Iterator[StopRequest]:
  """A stop request that SIGTERM or SIGINT sets (the first one; a second one stops at once).

  Clusters preempt with SIGTERM: the run then saves a checkpoint after the step in flight and
  exits, and a rerun continues it. Outside the main thread (where Python cannot install
  handlers) nothing is installed and the request never fires.
  """
  received: list[int] = []
  if threading.current_thread() is not threading.main_thread():
    yield lambda step: None
    return

  def handler(signum, frame):
    del frame
    if received:  # asked twice: stop now, as if no handler were installed
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    received.append(signum)
    log.warning(
      "%s: saving a checkpoint after this step, then stopping (send it again to stop at once)",
      signal.Signals(signum).name,
    )

  previous = {s: signal.signal(s, handler) for s in signals}
  try:
    yield lambda step: received[0] if received else None
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def _agreed(signum: int | None) -> int | None:
  """The stop request of any process (all must stop at the same step of a multi-host run)."""
  if jax.process_count() == 1:
    return signum
  from jax.experimental import multihost_utils

  every = multihost_utils.process_allgather(np.int32(signum or 0))
  return next((int(s) for s in np.ravel(every) if s), None)


def _preempted(step: int) -> bool:
  """Multi-host: whether every process has reached the step at which to stop after a SIGTERM.

  JAX's distributed runtime takes SIGTERM for itself (its preemption notifier), so Python's
  handler never sees it; the runtime instead agrees on a step at which all processes stop,
  which every process must ask about at every step.
  """
  from jax.experimental import multihost_utils

  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # launched without the runtime's preemption service
    return False


# ------------------------------------------------------------------------------ the run


def claim_run_dir(run_dir: Path, cfg: DictConfig) -> None:
  """Records ``cfg`` as the run of ``run_dir``, or refuses (a run of another config is there)."""
  run_record.claim(run_dir, cfg, fresh=not cfg.resume, write=jax.process_index() == 0)


def train(cfg: DictConfig, run_dir: Path, *, stop: StopRequest | None = None) -> dict[str, Any]:
  """Runs (or resumes) one training run in ``run_dir``; returns its summary.

  ``stop`` is asked after every step whether to stop early (default: on SIGTERM/SIGINT).
  """
  if stop is None:
    with stop_on_signals() as on_signal:
      return train(cfg, run_dir, stop=on_signal)
  run_dir = Path(run_dir)
  plan = check(cfg)
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() != 0:  # process 0 holds the dir for a multi-host run
      return _train(cfg, run_dir, plan, stop)
    with run_record.exclusive(run_dir):
      return _train(cfg, run_dir, plan, stop)
  except OSError as e:  # a write outside the loop's (run.json, a resume's cut of the metrics)
    if not no_space(e):
      raise
    checkpoints = Checkpointer.folder(run_dir)
    raise disk_full(e.filename or run_dir, None, last_good_in(checkpoints), checkpoints) from e


def _train(cfg: DictConfig, run_dir: Path, plan, stop: StopRequest) -> dict[str, Any]:
  """:func:`train` once the run dir is this process's."""
  claim_run_dir(run_dir, cfg)
  began = time.perf_counter()
  setup = build(cfg, plan, materialize=False)  # the optimizer state after compiling (_run)
  build_s = time.perf_counter() - began
  log.info(
    "model %s: %s parameters (%s trained)",
    cfg.model.name,
    f"{setup.n_model:,}",
    f"{sum(setup.sizes):,}",
  )
  if setup.fisher_backward is not None:
    log.info("d-pass: shared forward, %s backward", setup.fisher_backward)
  checkpointer = Checkpointer(run_dir)
  resume_from = checkpointer.latest_step()
  if resume_from is not None and cfg.resume:
    finished = run_record.finished_summary(run_dir, resume_from, setup.total_steps)
    if finished is not None:
      log.info("run already complete (%d steps): keeping its summary.json", resume_from)
      return finished
  elif resume_from is not None:
    log.info("resume=false: removing old checkpoints in %s", checkpointer.directory)
    if jax.process_index() == 0:
      shutil.rmtree(checkpointer.directory)
    sharding.sync("removed old checkpoints")
    checkpointer = Checkpointer(run_dir)
    resume_from = None
  start = resume_from or 0

  def initial_state() -> TrainState:
    """The state the first step starts from: built, or restored from the latest checkpoint."""
    if resume_from is None:
      return setup.init_state()
    # Given the builder, restore drops the fresh U before it reads the saved one.
    state = checkpointer.restore(setup.init_state, resume_from)
    if int(state.step) != resume_from:
      raise CheckpointError(
        f"checkpoint {resume_from} in {checkpointer.directory} holds step {int(state.step)}"
      )
    log.info("resumed from %s at step %d", checkpointer.directory, resume_from)
    return state

  config = OmegaConf.to_container(cfg, resolve=True)
  metrics = logs.MetricsLog(run_dir, cfg.logger, config, resume_step=start if start else None)
  try:
    return _run(
      cfg, run_dir, setup, initial_state, start, checkpointer, metrics, config, stop, build_s
    )
  finally:
    metrics.close()


def _run(
  cfg, run_dir, setup: Setup, initial_state, start, checkpointer, metrics, config, stop, build_s
):
  task, frozen, plan, schedule = setup.task, setup.frozen, setup.plan, setup.schedule
  steps_per_epoch, total_steps = setup.steps_per_epoch, setup.total_steps
  batch_size = int(cfg.batch_size)
  eval_every = steps_per_epoch if cfg.eval_every == "epoch" else int(cfg.eval_every)
  evals = (
    [e for e in run_record.read_events(run_dir, strict=True) if e["event"] == "eval"]
    if metrics.writer
    else []
  )

  # The whole dataset on every device; each step gathers its batch by index on the devices.
  train_arrays = sharding.put(task.train_arrays, plan.replicated)
  val_arrays = sharding.put(task.val_arrays, plan.replicated)
  # One shuffle per epoch, not per step (the order is a pure function of seed and epoch).
  order = functools.lru_cache(maxsize=2)(lambda epoch: task.batch_order(int(cfg.seed), epoch))

  def batch_indices(step):
    epoch, i = divmod(step, steps_per_epoch)
    return plan.indices(order(epoch)[i * batch_size : (i + 1) * batch_size])  # split on `data`

  # Compile once, ahead of time: the same executable gives XLA's cost/memory analysis and
  # runs every step (calling the jitted function would compile a second time). With
  # curvature_every = K > 1 two executables, with and without the curvature update. The
  # evaluation step too, so that the first evaluation does not stop training to compile.
  # In threads (compile_all): the first of programs() alone (the step without the curvature
  # update, else the training step), the others lowered meanwhile and compiled at once after
  # it, reading its autotuned kernels; the LATER ones while it trains.
  every = setup.curvature_every
  began = time.perf_counter()
  lower = programs(setup, setup.state, frozen, train_arrays, val_arrays, batch_indices(start), cfg)
  later = {key: lower.pop(key) for key in LATER if key in lower}
  program_s: dict = {}
  executables = compile_all(lower, COMPILE_THREADS, program_s)
  compile_s = time.perf_counter() - began
  first = setup.first_reorthonormalisation(start)
  compiling = {
    key: compile_later(lowering)
    for key, lowering in later.items()
    if first is not None and first < total_steps
  }
  # Only now the optimizer state (build(materialize=False)): compile-time scratch and the
  # state (Ginger's U) are never on the device at once.
  state = initial_state()
  compiled = {key: c for key, c in executables.items() if isinstance(key, bool)}
  eval_step = setup.eval_step.with_compiled(
    {key[1]: c for key, c in executables.items() if isinstance(key, tuple)}
  )
  xla = {update: _xla_flops(c) for update, c in compiled.items()}  # with the update, without
  memory = {update: _xla_memory(c) for update, c in compiled.items()}
  flops_per_iter = {
    "analytic": analytic_flops(task, cfg, setup.sizes),
    # The mean over K steps, as the analytic count (K = 1: the one step's count).
    "xla": None
    if None in xla.values()
    else (xla[True] + (every - 1) * xla.get(False, xla[True])) / every,
  }
  summary_base = {
    "run": run_record.identity(config),
    "config": config,
    "versions": logs.versions(),
    "device": logs.device_info(),
    "mesh": plan.describe(),
    "fisher_backward": setup.fisher_backward,  # as resolved for this mesh and model
    "git_commit": logs.git_commit(),
    "parameters": setup.n_model,
    "trained_parameters": sum(setup.sizes),
    "optimizer_state_bytes_per_device": sharding.bytes_per_device(state.opt_state),
    "steps_per_epoch": steps_per_epoch,
    "flops_per_iter": flops_per_iter,
    "flops_method": {
      "analytic": "conv/dense (or transformer matmul) count: 3x forward "
      "for loss grad, +2x (shared) or +3x (eval) forward for the "
      "d-pass, plus the optimizer's own update; with curvature_every=K the mean over K "
      "steps (one with the d-pass and curvature update, K-1 without)",
      "xla": "compiled train step cost_analysis() (mean over K steps as above); unreliable on GPU",
    },
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
      "lower_and_compile": compile_s,
      "programs": len(lower),
      "per_program": {
        program_name(key): {k: v if isinstance(v, str) else round(v, 3) for k, v in t.items()}
        for key, t in program_s.items()
      },
    },
  }
  log.info(
    "built in %.1f s; %d programs lowered and compiled in %.1f s", build_s, len(lower), compile_s
  )
  log.info(
    "%d steps (%d per epoch), batch %d; FLOPs/iter analytic %.3g, XLA %s",
    total_steps,
    steps_per_epoch,
    batch_size,
    flops_per_iter["analytic"],
    flops_per_iter["xla"],
  )
  if every > 1:
    log.info("curvature update on every %d-th step (steps 0, %d, %d, ...)", every, every, 2 * every)

  # What is resident before the first step (state, data, compiled code) and the high-water
  # mark so far (compilation and autotuning): the end's peak_memory_bytes above this one
  # means the training steps or the evaluations raised it.
  before = logs.device_memory()
  summary_base["memory_in_use_before_training_bytes"] = before.get("bytes_in_use")
  summary_base["peak_memory_before_training_bytes"] = before.get("peak_bytes_in_use")
  progress = logs.Progress(total_steps, start)
  step_times: list[float] = []
  interval_start, interval_steps = time.perf_counter(), 0
  last_good = checkpointer.latest_step()  # None: no checkpoint yet
  status, error, stopped_by = "completed", None, _agreed(stop(start))
  failure: NonFiniteLossError | DiskFullError | None = None  # what ends the run as "failed"
  done = start
  single = jax.process_count() == 1
  trace = profiling.StepTrace(
    run_dir / profiling.FOLDER, cfg.get("profile_start") or 0, cfg.get("profile_steps") or 0
  )
  try:
    try:
      for step in range(start, total_steps if stopped_by is None else start):
        run_step = compiled[setup.updates_curvature(step)]
        trace.before(step, state)
        state = run_step(state, frozen, train_arrays, batch_indices(step))
        if setup.reorthonormalises_after(step):
          state = compiling["reorthonormalise"].result()(state)
        interval_steps += 1
        done = step + 1
        trace.after(done, state)
        at_eval = done % eval_every == 0 or done == total_steps
        at_ckpt = done % int(cfg.checkpoint_every) == 0 or done == total_steps
        at_log = done % int(cfg.log_every) == 0 or at_eval or at_ckpt
        if done < total_steps and not single and _preempted(done):
          stopped_by = signal.SIGTERM
        elif done < total_steps and (single or at_log):  # multi-host: agree at the log steps
          stopped_by = _agreed(stop(done))
        if at_log or stopped_by:
          stats = jax.device_get(state.stats)
          if stats["nonfinite"]:
            raise NonFiniteLossError(_nonfinite_message(cfg, done, stats, last_good, checkpointer))
        if at_log:
          elapsed = time.perf_counter() - interval_start
          if interval_steps and step + 1 - interval_steps > start:  # skip the compile interval
            step_times.append(elapsed / interval_steps)
          metrics.write(
            "train",
            done,
            train_loss=stats["last_loss"],
            min_train_loss=stats["loss_min"],
            grad_norm=stats["grad_norm"],
            **{k: stats[k] for k in ("clip_fraction",) if k in stats},
            lr=schedule(done - 1),
            epoch=done / steps_per_epoch,
            step_time_s=elapsed / max(interval_steps, 1),
            examples_per_s=batch_size * interval_steps / max(elapsed, 1e-9),
          )
          progress.update(done, loss=float(stats["last_loss"]))
          if cfg.spectrum_every and done % int(cfg.spectrum_every) == 0:
            spectrum = jax.device_get(ginger.curvature_spectrum(state.opt_state))
            if spectrum:
              metrics.write("spectrum", done, sigma={k: v.tolist() for k, v in spectrum.items()})
        elif progress.due():  # no terminal, log steps far apart: a line with rate and ETA
          progress.update(done, loss=float(jax.device_get(state.stats["last_loss"])))
        if at_eval:
          result = evaluate(task, eval_step, state, frozen, val_arrays, cfg)
          epoch_mean = float(stats["loss_sum"] / max(int(stats["loss_count"]), 1))
          record = metrics.write("eval", done, **result, train_loss_mean=epoch_mean)
          evals.append(record)
          progress.line(
            f"step {done}/{total_steps} "
            + " ".join(f"{k}={v:.4g}" for k, v in result.items() if isinstance(v, float))
          )
        if single and at_log:
          # A failed save stops the run at the log step that finds it failed (a write fails
          # while the loop waits for the device, which it does at log steps), not at the next
          # save; the steps between log steps stay free of host work.
          checkpointer.check()
        if at_ckpt or stopped_by:
          checkpointer.save(done, state)
          last_good = done
        if stopped_by:
          break
        if at_log:
          interval_start, interval_steps = time.perf_counter(), 0
    finally:
      trace.close()
      progress.close()
      # No compilation outlives the run (a sweep runs the next one in this process).
      futures.wait(compiling.values())
      for key, future in compiling.items():
        if future.exception() is not None:
          log.warning("compiling %s failed: %r", program_name(key), future.exception())
      checkpointer.wait()  # a failed save raises here at the latest
  except (NonFiniteLossError, DiskFullError) as e:
    failure = e
  except OSError as e:  # metrics.jsonl or spectrum.jsonl.gz (named by MetricsLog.write)
    if not no_space(e):
      raise
    failure = disk_full(
      e.filename or run_dir, f"step {done}", checkpointer.last_good(), checkpointer.directory
    )
  if failure is not None:
    status, error = "failed", str(failure)
  elif stopped_by:
    status = "interrupted"
    error = (
      f"stopped by {signal.Signals(stopped_by).name} at step {int(state.step)} of {total_steps}"
      + (
        f"; checkpoint saved in {checkpointer.directory}"
        if last_good is not None
        else " (no checkpoint yet)"
      )
      + ". Rerun the same command to continue."
    )

  stats = jax.device_get(state.stats)
  mean_loss = float(stats["loss_sum"] / max(int(stats["loss_count"]), 1))
  summary = (
    summary_base
    | {
      "status": status,
      "error": error,
      "steps": int(state.step),
      "total_steps": total_steps,
      "min_train_loss": _finite(stats["loss_min"]),
      "final_train_loss": _finite(stats["last_loss"]),
      "step_time_s": statistics.median(step_times) if step_times else None,
      "examples_per_s": batch_size / statistics.median(step_times) if step_times else None,
      "peak_memory_bytes": logs.peak_memory_bytes(),
      "peak_memory_method": "device memory_stats()['peak_bytes_in_use'] of this process "
      "(includes compilation/autotuning; see step_memory_bytes for the step's own); null where "
      "not reported",
      # Runs whose accuracy alone counts may share a GPU with others (GINGER_DEVICE_SHARED=1):
      # their times and memory are not the optimizer's, and results/ leaves them out of those.
      "device_shared": device_shared(),
    }
    | task.best_of(evals)
    | task.train_summary(mean_loss)
  )
  if jax.process_index() == 0:
    try:
      run_record.write_summary(run_dir, summary)
    except OSError as e:  # a failed run's summary is left out where it does not fit
      if not no_space(e):
        raise
      if failure is None and not stopped_by:
        path = run_dir / run_record.SUMMARY
        failure = disk_full(path, None, checkpointer.last_good(), checkpointer.directory)
  if failure is not None:
    raise failure
  if stopped_by:
    raise Interrupted(error, stopped_by)
  return summary


def _nonfinite_message(cfg, done: int, stats, last_good: int | None, checkpointer) -> str:
  where = (
    f"The last good checkpoint is step {last_good} in {checkpointer.directory}."
    if last_good is not None
    else f"No checkpoint was saved before it (checkpoint_every={cfg.checkpoint_every})."
  )
  return (
    f"the training loss became NaN/Inf at or before step {done} (last loss "
    f"{stats['last_loss']}); {divergence_advice(cfg)}. {where}"
  )


def _xla_flops(compiled) -> float | None:
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
    "peak_memory_in_bytes",  # as XLA reports it (newer JAX); step_memory_bytes does not use it
  )
  return {k: int(getattr(mem, k)) for k in keys if hasattr(mem, k)}


def _finite(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None
