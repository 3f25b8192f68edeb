"""Everything a run needs, built from its config: the task's data, the model, the optimizer,
the initial state and the jitted steps (:func:`build`, shared by the training loop and
evaluate.py), after the checks that need neither data nor compilation (:func:`check`), which
turn the raw config into the typed :class:`~training.run_config.RunConfig` that all of it reads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from omegaconf import DictConfig

from models.tasks import Task, abstract_trainable, build_task, host_cpu
from training import backend, sharding
from training.compilation import use_compilation_cache
from training.config_check import ConfigError
from training.memory import check_state_fits, tree_bytes
from training.optimizers import (
  build_optimizer,
  clip_bound,
  learning_rate,
  reorthonormalise_every,
)
from training.registry import traces_loss
from training.run_config import RunConfig, parse
from training.steps import (
  TrainState,
  fisher_backward,
  initial_stats,
  make_steps,
  per_shard_graphdef,
  shared_d_pass,
  training_loss,
)

log = logging.getLogger("train")


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
  # 0, K, 2K, ...; see training.steps.make_steps); None for K = 1.
  precondition_step: Any = None
  curvature_every: int = 1
  # The initial state on the devices (a fresh one each call); build(materialize=False)
  # leaves it to the caller, to compile before the optimizer state takes device memory.
  init_state: Callable[[], TrainState] | None = None
  # Ginger: the program that re-orthonormalises U, run after every reorthonormalise_every-th
  # curvature update (training.steps.reorthonormalise_step); None (and 0) otherwise.
  reorthonormalise_step: Any = None
  reorthonormalise_every: int = 0
  # The shared d-pass's backward as fisher_backward resolved it for this mesh and model
  # (batched, sequential or local); None where the step has no shared d-pass.
  fisher_backward: str | None = None
  rc: RunConfig | None = None  # the checked config it was built from
  # The weights evaluations score where the optimizer's are not the trained ones (schedule-free
  # AdamW), with BatchNorm's statistics recomputed there (training.steps.make_eval_weights):
  # eval_weights(state, frozen, train_arrays) -> (trainable, rest); None: the state's own.
  eval_weights: Any = None

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


def check(cfg: DictConfig) -> tuple[RunConfig, sharding.Plan]:
  """Everything about ``cfg`` that can be checked without data or compiling: the config
  itself, typed (:func:`training.run_config.parse`), the mesh (:func:`prepare`) and, where
  the model's shapes do not depend on the data (the ResNets), whether the optimizer state
  fits a device (:func:`check_state_fits_device`). An optimizer that traces the training loss
  (K-FAC) sizes its state from the loss, which needs the model: :func:`build` checks it."""
  rc = parse(cfg)  # reads the config only: before any JAX work
  plan = prepare(rc)
  params = abstract_trainable(rc)  # shapes only, where they do not depend on the data
  if params is not None and not traces_loss(rc.optimizer.name):
    check_state_fits_device(rc, plan, params, learning_rate(rc, 1, 1))
  return rc, plan


def prepare(rc: RunConfig) -> sharding.Plan:
  """The process's JAX set-up for a checked config (XLA's deterministic flags, multi-host
  start-up, the backend said, the compilation cache), the library's own checks of the
  optimizer's arguments, and the mesh."""
  backend.use_deterministic(rc.deterministic)  # XLA reads its flags when the backend starts
  sharding.initialize_distributed(rc.distributed)  # before any JAX work
  backend.report()  # starts the backend: the platform, devices and a CPU fallback, said
  use_compilation_cache(rc.compilation_cache_dir)  # before the first compilation
  build_optimizer(rc, learning_rate(rc, 1, 1))  # the library's own checks of its arguments
  if rc.optimizer.passes == "pallas" and jax.default_backend() != "gpu":
    log.warning(
      "passes=pallas on %s: the Pallas kernels run in JAX's interpreter there, a test harness "
      "(the demo on 2 CPU cores: 2.5 steps/s against 52 with passes=jnp); passes=auto takes the "
      "kernels on GPUs and the jnp passes elsewhere.",
      jax.default_backend(),
    )
  plan = sharding.plan_from_config(rc.mesh)
  if rc.batch_size % plan.data_size:
    raise ConfigError(
      f"batch_size {rc.batch_size} must be divisible by the {plan.data_size} "
      "devices of the mesh's data axis (mesh.data)."
    )
  return plan


class ModelGraphs(NamedTuple):
  """The model split for the steps (:func:`split_model`)."""

  train: Any  # the graph in training mode
  eval: Any  # in inference mode (BatchNorm's running statistics, no dropout)
  per_shard: Any  # the training graph for one device's shard (fisher_backward=local), or None
  params: Any
  rest: Any  # non-parameter state: BatchNorm statistics, dropout RNG counts
  # The shared d-pass's backward, resolved once for this mesh and model (None: no shared d-pass).
  backward: str | None


def split_model(model, rc: RunConfig, plan: sharding.Plan) -> ModelGraphs:
  """``model``'s graphs in training and inference mode, its parameters and its other state."""
  model.train()
  graphdef_train, params, rest = nnx.split(model, nnx.Param, ...)
  model.eval()
  graphdef_eval = nnx.split(model, nnx.Param, ...)[0]
  model.train()
  backward = fisher_backward(rc, plan, model) if shared_d_pass(rc) else None
  graphdef_per_shard = None
  if backward == "local":
    graphdef_per_shard = per_shard_graphdef(model, rc.batch_size, plan.data_size)
  return ModelGraphs(graphdef_train, graphdef_eval, graphdef_per_shard, params, rest, backward)


def schedule_length(task: Task, rc: RunConfig) -> tuple[int, int]:
  """``(steps_per_epoch, total_steps)`` of a run of ``rc`` on ``task``."""
  steps_per_epoch = task.num_train // rc.batch_size
  if steps_per_epoch < 1:
    raise ConfigError(
      f"batch_size {rc.batch_size} is larger than the training set ({task.num_train})."
    )
  total_steps = rc.max_steps if rc.max_steps else rc.epochs * steps_per_epoch
  return steps_per_epoch, total_steps


def initial_state(tx, trainable, rest, rc: RunConfig, plan: sharding.Plan, materialize: bool):
  """``(state, init_state, state_shardings)``: the initial state, with ``materialize=False``
  its optimizer state as shapes and shardings only; ``init_state()``, the initial state on
  the devices (a fresh one each call); where :class:`TrainState`'s leaves live."""
  # The counters are host values and the key is drawn on the host's CPU, as the model's was
  # (models.tasks.init_model: the same compiled program), so that none compiles a program for
  # the device; sharding.put places them.
  with jax.default_device(host_cpu()):
    key = jax.random.key(rc.seed)
  state = TrainState(
    np.zeros((), np.int32),
    trainable,
    rest,
    jax.eval_shape(tx.init, trainable),  # shapes only: built by init_state
    key,
    initial_stats(clip_bound(rc)),
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
    return init_state(), init_state, state_shardings
  shapes = jax.tree.map(
    lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
    state.opt_state,
    state_shardings.opt_state,
  )
  return placed._replace(opt_state=shapes), init_state, state_shardings


def optimizer_state_bytes(
  rc: RunConfig, plan: sharding.Plan, trainable, schedule, tau=None, loss=None
):
  """One device's bytes of the optimizer state of ``rc`` (with ``tau`` in place of the run's
  where given) for ``trainable``, from its shapes alone (nothing is allocated); ``loss``: the
  training loss of an optimizer that traces it (K-FAC)."""
  if tau is not None:
    optimizer = dataclasses.replace(rc.optimizer, tau=tau)
    rc = dataclasses.replace(rc, optimizer=optimizer)
  tx = build_optimizer(rc, schedule, plan.optimizer_sharding, loss)
  shapes = jax.eval_shape(tx.init, trainable)
  if plan.shard_optimizer_state and plan.mesh.size > 1:
    where = plan.optimizer_state(shapes)
    shapes = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, where
    )
  return tree_bytes(shapes)


def check_state_fits_device(
  rc: RunConfig, plan: sharding.Plan, trainable, schedule, loss=None
) -> None:
  """Refuses (:class:`ConfigError`) an optimizer state that cannot fit one device, naming the
  bytes, the device's bytes and the largest tau that fits (:mod:`training.memory`)."""
  check_state_fits(
    lambda tau: optimizer_state_bytes(rc, plan, trainable, schedule, tau, loss),
    tree_bytes(trainable),
    rc.optimizer.tau,
  )


def build(
  cfg: DictConfig | RunConfig, plan: sharding.Plan | None = None, materialize: bool = True
) -> Setup:
  """Checks ``cfg``, loads the task's data, builds model, optimizer and the jitted steps.

  ``cfg``: the raw config, checked and typed here (:func:`check`), or a config :func:`check`
  typed already; ``plan``: the mesh :func:`check` (:func:`prepare`) gave, else made here.

  ``materialize=False``: ``Setup.state``'s optimizer state is shapes and shardings only
  (``jax.ShapeDtypeStruct``), enough to compile every program; ``Setup.init_state()`` builds
  it on the devices. The training loop compiles first, so that on a GPU the autotuner's
  scratch (of the order of the programs' operands) and the optimizer state (Ginger's U) are
  never on the device at once: together they would set the run's memory high-water mark far
  above the state's own size.
  """
  rc = cfg if isinstance(cfg, RunConfig) else parse(cfg)
  plan = prepare(rc) if plan is None else plan
  task = build_task(rc)
  graphs = split_model(task.model, rc, plan)
  trainable = task.trainable_params(graphs.params)
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(trainable)]
  n_model = int(sum(np.prod(x.shape) for x in jax.tree.leaves(graphs.params)))
  steps_per_epoch, total_steps = schedule_length(task, rc)
  schedule = learning_rate(rc, steps_per_epoch, total_steps)
  loss = None
  if traces_loss(rc.optimizer.name):
    frozen_params = task.frozen_params(graphs.params)
    loss = training_loss(task, graphs.train, frozen_params, graphs.rest, rc.batch_size)
  tx = build_optimizer(rc, schedule, plan.optimizer_sharding, loss)
  check_state_fits_device(rc, plan, trainable, schedule, loss)  # before anything is placed
  state, init_state, state_shardings = initial_state(
    tx, trainable, graphs.rest, rc, plan, materialize
  )
  frozen = sharding.put(task.frozen_params(graphs.params), plan.replicated)
  steps = make_steps(
    task,
    graphs.train,
    graphs.eval,
    tx,
    rc,
    plan,
    state_shardings,
    graphs.backward,
    graphs.per_shard,
    schedule,
  )
  return Setup(
    task,
    state,
    frozen,
    steps.train_step,
    steps.eval_step,
    schedule,
    steps_per_epoch,
    total_steps,
    sizes,
    n_model,
    plan,
    steps.precondition_step,
    rc.optimizer.curvature_every if steps.precondition_step is not None else 1,
    init_state,
    steps.reorthonormalise_step,
    reorthonormalise_every(rc),
    graphs.backward,
    rc,
    steps.eval_weights,
  )
