"""The jitted programs a run executes: the training step (with or without the d-pass and the
curvature update), the evaluation step and Ginger's re-orthonormalisation.

:func:`make_steps` builds them for any task of models/tasks.py and any optimizer of
training/optimizers.py, written once for any number of devices: the batch indices are split
along the mesh's ``data`` axis and XLA (GSPMD) adds the collectives. The d-pass (the
sampled-Fisher vector ``d_t`` the curvature optimizers take beside the gradient) has four
forms, each a function of its own: :func:`d_pass_shared` (one forward, two cotangents),
:func:`d_pass_per_device` (the same inside ``jax.shard_map``, each device on its shard),
:func:`d_pass_separate` (the authors' own forward in inference mode) and
:func:`d_pass_sub_batch` (a forward and a backward of its own on the batch's first
``fisher_batch`` examples).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ginger
from models.tasks import per_shard_model
from training import registry, sharding
from training.config_check import ConfigError
from training.optimizers import clip_bound
from training.optimizers import reorthonormalise_every as reorthonormalise_every_of
from training.registry import keeps_curvature, traces_loss


class TrainState(NamedTuple):
  step: jax.Array
  trainable: Any  # what the optimizer updates (all params, or the LoRA adapters)
  rest: Any  # non-parameter model state: BatchNorm statistics, dropout RNG counts
  opt_state: Any
  rng: jax.Array
  stats: dict  # device-side running loss statistics (no host sync per step)


class Steps(NamedTuple):
  """What :func:`make_steps` returns (see there)."""

  train_step: Any
  eval_step: EvalStep
  precondition_step: Any
  reorthonormalise_step: Any
  eval_weights: Any = None


class LossBatch(NamedTuple):
  """One training batch as an optimizer that traces the loss takes it (:class:`TrainingLoss`):
  the model's inputs, the labels and their mask (None: every prediction counts), and what the
  model needs beside its trainable parameters, the frozen ones (LoRA's base model, else None)
  and its other state (BatchNorm statistics)."""

  inputs: Any
  labels: Any
  mask: Any
  frozen: Any
  rest: Any


class TrainingLoss(NamedTuple):
  """The training loss as a function of the trainable parameters and a batch, for an optimizer
  that traces the model itself (registry ``Optimizer.traces_loss``: K-FAC finds the model's
  layers in the trace and draws its own Fisher labels).

  Attributes:
    logits: ``logits(trainable, batch) -> (logits, labels, mask)``: the model in training mode
      on ``batch`` (a :class:`LossBatch`), the forward of the training step but not wrapped in
      a jit of its own, so that a tracer sees the model's operations; the loss of those
      logits is ``ginger.fisher.cross_entropy(logits, labels, mask)``.
    batch: a :class:`LossBatch` of ``jax.ShapeDtypeStruct`` s, a training batch's shapes (what
      the optimizer's ``init`` traces the model with).
  """

  logits: Any
  batch: LossBatch


def model_logits(task, graphdef_train):
  """The training forward as a function of the trainable parameters and a :class:`LossBatch`:
  :attr:`TrainingLoss.logits`, the model's new non-parameter state dropped."""

  def logits(trainable, batch: LossBatch):
    params = task.full_params(trainable, batch.frozen)
    model = nnx.merge(graphdef_train, params, batch.rest, copy=True)
    return task.forward(model, batch.inputs), batch.labels, batch.mask

  return logits


def training_loss(task, graphdef_train, frozen, rest, batch_size: int) -> TrainingLoss:
  """The :class:`TrainingLoss` of ``task``'s model (``graphdef_train``, the graph in training
  mode) on batches of ``batch_size`` examples; ``frozen``, ``rest``: the arrays (or shapes)
  of its frozen parameters and its other state."""
  idx = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  key = jax.eval_shape(jax.random.key, 0)
  inputs, labels, mask = jax.eval_shape(task.train_batch, task.train_arrays, idx, key)
  shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  batch = LossBatch(inputs, labels, mask, shapes(frozen), shapes(rest))
  return TrainingLoss(model_logits(task, graphdef_train), batch)


def initial_stats(bound: float | None = None):
  """The running statistics the step keeps; ``clip_fraction`` where ``clip_bound`` is set
  (``bound``: :func:`training.optimizers.clip_bound`). Host values (numpy): placing them
  compiles nothing, where ``jnp.zeros`` would compile a program per dtype for the device."""
  stats = {
    "loss_min": np.array(np.inf, np.float32),
    "loss_sum": np.zeros((), np.float32),
    "loss_count": np.zeros((), np.int32),
    "nonfinite": np.zeros((), bool),
    "last_loss": np.zeros((), np.float32),
    "grad_norm": np.zeros((), np.float32),
  }
  if bound is not None:
    stats["clip_fraction"] = np.zeros((), np.float32)
  return stats


def next_stats(stats: dict, loss: jax.Array, grad_norm: jax.Array) -> dict:
  """:func:`initial_stats`' running statistics after a step of loss ``loss`` (all but
  ``clip_fraction``, which the step sets itself)."""
  return {
    "loss_min": jnp.minimum(stats["loss_min"], loss),
    "loss_sum": stats["loss_sum"] + loss,
    "loss_count": stats["loss_count"] + 1,
    "nonfinite": stats["nonfinite"] | ~jnp.isfinite(loss),
    "last_loss": loss,
    "grad_norm": grad_norm,
  }


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


# ---------------------------------------------------------------------------- the d-pass


def shared_d_pass(rc) -> bool:
  """Whether the training step's d-pass reuses its forward (a curvature optimizer with
  ``fisher_forward=shared`` and the d-pass on the whole batch), the only case
  ``fisher_backward`` applies to. ``rc``: the run's ``training.run_config.RunConfig``, as
  everywhere here."""
  return (
    keeps_curvature(rc.optimizer.name)
    and rc.fisher_forward != "eval"
    and fisher_sub_batch(rc) is None
  )


def fisher_sub_batch(rc) -> int | None:
  """``m``, where the d-pass runs on the batch's first ``m`` examples only (a curvature
  optimizer with ``fisher_batch`` = m < ``batch_size``: :func:`d_pass_sub_batch`); None where
  it runs on the whole batch (``fisher_batch`` null, or the batch size: the same step)."""
  m = rc.fisher_batch
  if not keeps_curvature(rc.optimizer.name) or m is None or m >= rc.batch_size:
    return None
  return m


def fisher_backward(rc, plan: sharding.Plan, model: nnx.Module | None = None) -> str:
  """The shared d-pass's backward (config ``fisher_backward``). ``auto`` is ``batched`` where
  the batch is on one device; where it is split over several, ``local`` if ``model`` allows it
  (no state but parameters and BatchNorm statistics: :func:`per_shard_refusal`), else
  ``sequential``.

  The batched pull-back vmaps the backward over the pair of cotangents, and a convolution's
  batching rule folds that pair into the batch dimension, outside the device split: GSPMD then
  all-gathers the activations' gradients, which costs more than the backward itself
  (``python -m bench.collectives`` shows the gathers, also on CPU devices). ``sequential`` runs
  two backwards instead (no gathers, the backward's convolutions twice). ``local``: the batched
  pull-back inside ``jax.shard_map``, each device on its own shard
  (:func:`ginger.fisher.value_grad_and_fisher_per_device`): one backward and no gathers, the
  fastest where the model allows it."""
  value = rc.fisher_backward
  if value != "auto":
    return value
  if plan.data_size == 1:
    return "batched"
  if model is not None and per_shard_refusal(model) is None:
    return "local"
  return "sequential"


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def per_shard_refusal(model) -> str | None:
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


def per_shard_graphdef(model, batch_size: int, devices: int):
  """The training model's graph for one device's shard (``fisher_backward=local``)."""
  if batch_size % devices:
    raise ConfigError(
      f"fisher_backward=local: batch_size={batch_size} must split evenly over the {devices} "
      "devices of mesh.data (each device pulls back its own shard of the batch)."
    )
  refusal = per_shard_refusal(model)
  if refusal:
    raise ConfigError(
      f"fisher_backward=local: {refusal}; use fisher_backward=auto (which takes sequential "
      "for such a model)."
    )
  return nnx.split(per_shard_model(model, "data"), nnx.Param, ...)[0]


def loss_and_grads(forward, trainable, labels, mask):
  """No d-pass: ``((loss, rest), grads)`` of the masked cross-entropy of ``forward(trainable)``
  (``forward``: trainable -> ``(logits, rest)``, ``rest`` the model's new non-parameter
  state)."""

  def loss_fn(p):
    logits, rest = forward(p)
    return ginger.fisher.cross_entropy(logits, labels, mask), rest

  return jax.value_and_grad(loss_fn, has_aux=True)(trainable)


def d_pass_shared(forward, trainable, labels, key, mask, *, fisher: str, backward: str):
  """One forward pass, two cotangents: ``((loss, rest), grads, d_t)``, the loss gradient and
  the sampled-Fisher vector ``d_t`` pulled back together (``backward``:
  :func:`fisher_backward`)."""
  return ginger.fisher.value_grad_and_fisher(
    forward, trainable, labels, key, mask=mask, has_aux=True, fisher=fisher, backward=backward
  )


def d_pass_per_device(
  shard_forward, trainable, inputs, labels, key, mask, constants, *, mesh, fisher: str
):
  """:func:`d_pass_shared` per device (``fisher_backward=local``): one forward pass per
  device's shard, both cotangents in one backward pass there. ``shard_forward(trainable,
  inputs, *constants)``: the model on one shard."""
  return ginger.fisher.value_grad_and_fisher_per_device(
    shard_forward,
    trainable,
    inputs,
    labels,
    key,
    mesh=mesh,
    mask=mask,
    has_aux=True,
    fisher=fisher,
    constants=constants,
  )


def d_pass_separate(forward, eval_forward, trainable, labels, key, mask, *, fisher: str):
  """The authors' d-pass (``fisher_forward=eval``): the loss gradient as without a d-pass,
  then ``d_t`` from a forward of its own in inference mode (``eval_forward``: trainable ->
  logits, with BatchNorm's running statistics)."""
  (loss, rest), grads = loss_and_grads(forward, trainable, labels, mask)
  d = ginger.fisher.fisher_vector(eval_forward, trainable, labels, key, mask=mask, fisher=fisher)
  return (loss, rest), grads, d


def d_pass_sub_batch(d_forward, trainable, inputs, labels, key, mask, m: int, *, fisher: str):
  """``d_t`` from the batch's first ``m`` examples (``fisher_batch``): a forward of their own
  (``d_forward(trainable, inputs) -> logits``, in the mode ``fisher_forward`` names) and one
  backward, both on ``m`` examples instead of the batch's ``B``; the loss gradient is computed
  as without a d-pass.

  :func:`ginger.fisher.fisher_vector` divides ``d = sum_i grad log p(y_hat_i | x_i) / sqrt(N)``
  by the root of the sub-batch's own count ``N`` of predictions, so that ``E[d d^T]`` is the same
  per-prediction Fisher as from the whole batch (each sampled label's gradient has mean zero, so
  the cross terms vanish), with the noise of ``m`` examples. The empirical Fisher (true labels)
  has cross terms: its ``d d^T`` holds ``N`` times the outer product of the mean gradient, which
  the sub-batch weighs ``m / B`` as much."""
  sub = jax.tree.map(lambda x: x[:m], inputs)
  return ginger.fisher.fisher_vector(
    lambda p: d_forward(p, sub),
    trainable,
    labels[:m],
    key,
    mask=None if mask is None else mask[:m],
    fisher=fisher,
  )


# ----------------------------------------------------------------------------- the steps


def make_steps(
  task,
  graphdef_train,
  graphdef_eval,
  tx,
  rc,
  plan: sharding.Plan,
  state_shardings,
  backward: str | None = None,
  graphdef_per_shard=None,
  schedule: optax.Schedule | None = None,
) -> Steps:
  """The jitted training and evaluation steps, written once for any number of devices: the
  batch indices are split along the mesh's ``data`` axis, the state is placed as
  ``state_shardings`` says, and XLA (GSPMD) adds the collectives.

  Returns ``(train_step, eval_step, precondition_step, reorthonormalise_step)``.
  ``train_step`` is the step of the paper (with a curvature optimizer: the d-pass and a
  curvature update). With ``curvature_every`` K > 1, ``precondition_step`` is the step for
  the K - 1 steps between curvature updates: the same code without the d-pass and without
  ``fisher_grads``, which the optimizer takes as "no curvature update, precondition with the
  current G". The two are separate programs, so that nothing of the d-pass is computed and
  discarded behind a ``cond``; both take and return the same state, so a run moves between
  them (and resumes at any step). None when K = 1.

  ``reorthonormalise_step`` (Ginger only, else None): :func:`reorthonormalise_step`.

  ``backward``: the shared d-pass's backward as :func:`fisher_backward` resolved it for this
  mesh and model; None where the step has no shared d-pass. ``graphdef_per_shard``: the
  training model for one device's shard (:func:`per_shard_graphdef`), for
  ``backward="local"``. ``schedule``: the learning rate, for the ``clip_fraction`` statistic
  (:func:`clip_fraction`), which the step keeps where the state's statistics have it
  (:func:`initial_stats`).
  """
  if backward == "local" and graphdef_per_shard is None:
    raise ValueError("fisher_backward=local needs graphdef_per_shard (see run_setup.build).")

  # A function of its own under jit: a run's programs (the training step with and without the
  # curvature update, their gradients) trace the model once, then reuse JAX's cached jaxpr and
  # its derivatives; XLA inlines the call, so the compiled steps are unchanged.
  @functools.partial(jax.jit, static_argnums=0)
  def apply(graphdef, trainable, frozen, rest, inputs):
    model = nnx.merge(graphdef, task.full_params(trainable, frozen), rest, copy=True)
    logits = task.forward(model, inputs)
    return logits, nnx.split(model, nnx.Param, ...)[2]

  graphdefs = (graphdef_train, graphdef_eval, graphdef_per_shard)
  step = _train_step_fn(task, apply, graphdefs, tx, rc, plan, backward, schedule)

  def jitted(needs_fisher: bool):
    return jax.jit(
      functools.partial(step, needs_fisher=needs_fisher),
      donate_argnums=0,
      in_shardings=(state_shardings, plan.replicated, plan.replicated, plan.batch),
      out_shardings=state_shardings,
    )

  curvature = keeps_curvature(rc.optimizer.name)
  precondition_step = jitted(False) if curvature and rc.optimizer.curvature_every > 1 else None
  train_step = jitted(curvature)
  reorthonormalise = None
  if reorthonormalise_every_of(rc):
    reorthonormalise = reorthonormalise_step(rc, plan, state_shardings)
  eval_step = make_eval_step(task, graphdef_eval, plan)
  eval_weights = None
  eval_params = registry.get(rc.optimizer.name).eval_params
  if eval_params is not None:
    eval_weights = make_eval_weights(task, apply, graphdef_train, eval_params, rc.batch_size)
  return Steps(train_step, eval_step, precondition_step, reorthonormalise, eval_weights)


def _train_step_fn(
  task, apply, graphdefs, tx, rc, plan: sharding.Plan, backward: str | None, schedule
):
  """The training step as a Python function ``step(state, frozen, arrays, idx, *,
  needs_fisher)``: the batch, the loss gradient (with ``needs_fisher`` and the d-pass: one of
  :func:`d_pass_sub_batch`, :func:`d_pass_per_device`, :func:`d_pass_shared`,
  :func:`d_pass_separate`), the optimizer's update (for an optimizer that traces the loss,
  registry ``Optimizer.traces_loss``, with the step's :class:`LossBatch` as ``batch`` and its
  ``fisher_key`` as ``key``), the running statistics. ``apply``: the jitted model,
  ``apply(graphdef, trainable,
  frozen, rest, inputs) -> (logits, rest)``; ``graphdefs``: the training, evaluation and
  per-shard graphs (:func:`make_steps`)."""
  graphdef_train, graphdef_eval, graphdef_per_shard = graphdefs
  clip = optax.clip_by_global_norm(rc.grad_clip) if rc.grad_clip else None
  rho = clip_bound(rc)
  separate = rc.fisher_forward == "eval"
  sub_batch = fisher_sub_batch(rc)
  loss_traced = traces_loss(rc.optimizer.name)

  def step(state: TrainState, frozen, arrays, idx, *, needs_fisher: bool):
    # Split as on every step, also where fisher_key goes unused: the batch's randomness and
    # the next key do not depend on whether this step updated the curvature.
    rng, batch_key, fisher_key = jax.random.split(state.rng, 3)
    inputs, labels, mask = task.train_batch(arrays, idx, batch_key)
    forward = lambda p: apply(graphdef_train, p, frozen, state.rest, inputs)
    extra = {}
    if needs_fisher and sub_batch is not None:
      (loss, rest), grads = loss_and_grads(forward, state.trainable, labels, mask)
      graphdef_d = graphdef_eval if separate else graphdef_train  # its new statistics dropped
      extra["fisher_grads"] = d_pass_sub_batch(
        lambda p, x: apply(graphdef_d, p, frozen, state.rest, x)[0],
        state.trainable,
        inputs,
        labels,
        fisher_key,
        mask,
        sub_batch,
        fisher=rc.fisher,
      )
    elif needs_fisher and backward == "local":
      (loss, rest), grads, extra["fisher_grads"] = d_pass_per_device(
        lambda p, x, fr, r: apply(graphdef_per_shard, p, fr, r, x),
        state.trainable,
        inputs,
        labels,
        fisher_key,
        mask,
        (frozen, state.rest),
        mesh=plan.mesh,
        fisher=rc.fisher,
      )
    elif needs_fisher and not separate:
      (loss, rest), grads, extra["fisher_grads"] = d_pass_shared(
        forward, state.trainable, labels, fisher_key, mask, fisher=rc.fisher, backward=backward
      )
    elif needs_fisher:
      eval_forward = lambda p: apply(graphdef_eval, p, frozen, state.rest, inputs)[0]
      (loss, rest), grads, extra["fisher_grads"] = d_pass_separate(
        forward, eval_forward, state.trainable, labels, fisher_key, mask, fisher=rc.fisher
      )
    else:
      (loss, rest), grads = loss_and_grads(forward, state.trainable, labels, mask)
    # Pin gradients (and d_t) replicated: otherwise GSPMD propagates the sharded optimizer
    # state's layout back into the model's backward pass (hundreds of small all-gathers).
    grads, extra = jax.lax.with_sharding_constraint((grads, extra), plan.replicated)
    if loss_traced:  # the batch keeps its split over the mesh's data axis
      extra["batch"] = LossBatch(inputs, labels, mask, frozen, state.rest)
      extra["key"] = fisher_key
    grad_norm = optax.global_norm(grads)
    if clip is not None:
      grads, _ = clip.update(grads, clip.init(grads))
    updates, opt_state = tx.update(grads, state.opt_state, state.trainable, **extra)
    trainable = optax.apply_updates(state.trainable, updates)
    stats = next_stats(state.stats, loss, grad_norm)
    if "clip_fraction" in state.stats:  # initial_stats(clip_bound(rc)) decides
      stats["clip_fraction"] = clip_fraction(updates, schedule(state.step), rho)
    return TrainState(state.step + 1, trainable, rest, opt_state, rng, stats)

  return step


def reorthonormalise_step(rc, plan: sharding.Plan, state_shardings):
  """The state with Ginger's ``U`` re-orthonormalised (``ginger.reorthonormalise``), which the
  loop runs after every ``optimizers.reorthonormalise_every(rc)``-th curvature update
  (``Setup.reorthonormalises_after``). Ginger's update is built without its own
  (``reorthonormalise_every=0``): that one is a ``lax.cond`` in every step, and on a GPU an
  XLA conditional stops the host until the device has caught up, so the kernels after it
  are launched while the GPU waits."""

  def reorthonormalise(state: TrainState) -> TrainState:
    opt_state = ginger.reorthonormalise(
      state.opt_state, passes=rc.optimizer.passes, sharding=plan.optimizer_sharding
    )
    return state._replace(opt_state=opt_state)

  return jax.jit(
    reorthonormalise,
    donate_argnums=0,
    in_shardings=(state_shardings,),
    out_shardings=state_shardings,
  )


# ----------------------------------------------------------------------------- evaluation

# Training batches whose forward passes recompute BatchNorm's running statistics at the weights
# an evaluation scores (:func:`make_eval_weights`): the schedule-free authors' recipe (50
# batches in training mode before each evaluation). With the models' BatchNorm momentum 0.9,
# what the statistics held before weighs 0.9^50 < 0.6 % after them.
RECALIBRATION_BATCHES = 50


def has_batchnorm(rest) -> bool:
  """Whether a model's non-parameter state holds BatchNorm statistics (``nnx.BatchStat``)."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return any(isinstance(v, nnx.BatchStat) for v in jax.tree.leaves(rest, is_leaf=is_variable))


def recalibration_indices(num_train: int, batch_size: int) -> np.ndarray:
  """The training examples of the :data:`RECALIBRATION_BATCHES` batches that recompute
  BatchNorm's statistics, ``(RECALIBRATION_BATCHES, batch_size)``: a fixed random
  permutation of the training set, repeated where the set is smaller than the batches. Not
  the set's first examples: an image folder is read class by class, and statistics of a few
  classes are not the data's."""
  count = RECALIBRATION_BATCHES * batch_size
  order = np.random.default_rng(0).permutation(num_train)
  return np.resize(order, count).reshape(RECALIBRATION_BATCHES, batch_size).astype(np.int32)


def make_eval_weights(task, apply, graphdef_train, eval_params, batch_size: int):
  """The jitted ``eval_weights(state, frozen, train_arrays) -> (trainable, rest)``: the
  weights an evaluation scores, ``eval_params(opt_state, trainable)`` (the registry entry's),
  and the model's other state with BatchNorm's running statistics recomputed at them:
  :data:`RECALIBRATION_BATCHES` forward passes in training mode over fixed training batches
  (:func:`recalibration_indices`, with a fixed augmentation key: every evaluation of a run
  sees the same batches). Running statistics the training steps kept belong to the trained
  weights; scored at other weights they would not match. The state itself is left as it is:
  training, its checkpoints and a resume are unchanged. A model without BatchNorm keeps its
  state."""
  key = jax.random.key(0)
  batches = recalibration_indices(task.num_train, batch_size)

  def eval_weights(state: TrainState, frozen, train_arrays):
    trainable = eval_params(state.opt_state, state.trainable)
    if not has_batchnorm(state.rest):
      return trainable, state.rest

    def forward(rest, idx):
      inputs, _, _ = task.train_batch(train_arrays, idx, key)
      return apply(graphdef_train, trainable, frozen, rest, inputs)[1], None

    rest, _ = jax.lax.scan(forward, state.rest, jnp.asarray(batches))
    return trainable, rest

  return jax.jit(eval_weights)


def make_eval_step(task, graphdef_eval, plan: sharding.Plan) -> EvalStep:
  """The jitted evaluation step (:class:`EvalStep`): the task's additive statistics of a
  batch, with the model in inference mode."""

  def eval_step(trainable, frozen, rest, arrays, idx):
    model = nnx.merge(graphdef_eval, task.full_params(trainable, frozen), rest, copy=True)
    return task.eval_sums(model, arrays, idx)

  return EvalStep(jax.jit(eval_step, out_shardings=plan.replicated), plan)


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
  """The batch sizes an evaluation runs: ``batch_size`` and the remainder, if any."""
  sizes = [min(batch_size, num_val)] if num_val else []
  return sizes + ([num_val % batch_size] if num_val > batch_size and num_val % batch_size else [])
