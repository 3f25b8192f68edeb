"""Builds the optax optimizer and learning-rate schedule from a run's checked config.

The optimizers themselves (their keys, builders, FLOPs) are training/registry.py's entries.
``rc`` is the run's :class:`~training.run_config.RunConfig`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import ginger
from training import registry
from training.choices import SCHEDULES
from training.run_config import RunConfig


def clip_bound(rc: RunConfig) -> float | None:
  """The bound whose exceedances the training log counts (metric ``clip_fraction``): a
  curvature optimizer's element-wise clip ``rho``, or 1 where it runs unclipped (the share the
  authors' clip would change); None for the others."""
  if not registry.keeps_curvature(rc.optimizer.name):
    return None
  return 1.0 if rc.optimizer.rho is None else rc.optimizer.rho


def reorthonormalise_every(rc: RunConfig) -> int:
  """Curvature updates between the training loop's re-orthonormalisations of the optimizer's
  bases (its registry entry's ``reorthonormalise_every``: Ginger's is
  ``ginger.default_reorthonormalise_every`` of ``optimizer.state_dtype``); 0 for an optimizer
  without one. The loop runs them as a program of their own (``training.steps.make_steps``),
  so Ginger's registry entry builds it with ``reorthonormalise_every=0``."""
  period = registry.get(rc.optimizer.name).reorthonormalise_every
  return 0 if period is None else period(rc.optimizer)


def learning_rate(rc: RunConfig, steps_per_epoch: int, total_steps: int) -> optax.Schedule:
  """The schedule of ``rc.schedule`` peaking at ``rc.lr``: constant (the paper's),
  warmup_constant (a linear warm-up over ``warmup_epochs``, as the authors' code), cosine
  (decay to 0 over the run) or warmup_cosine (the linear warm-up, then the cosine decay to 0 at
  the run's last step: the recipe most training code uses)."""
  lr = rc.lr
  if not lr > 0:
    raise ValueError(f"lr must be > 0, got {rc.lr}.")
  warmup = max(1, int(rc.warmup_epochs * steps_per_epoch))
  if rc.schedule == "constant":
    return optax.constant_schedule(lr)
  if rc.schedule == "warmup_constant":
    return optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
    )
  if rc.schedule == "cosine":
    return optax.cosine_decay_schedule(lr, max(1, total_steps))
  if rc.schedule == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(warmup + 1, total_steps))
  raise ValueError(f"schedule must be one of {SCHEDULES}, got {rc.schedule!r}.")


def build_optimizer(
  rc: RunConfig,
  schedule: optax.Schedule,
  sharding: ginger.sharding.StateSharding | None = None,
  loss=None,
) -> optax.GradientTransformationExtraArgs:
  """The optimizer named by ``rc.optimizer.name`` (its registry entry's ``build``) with
  ``weight_decay`` where that is set: as an L2 term added to the gradient before it
  (``weight_decay_mode=l2``, :func:`optax.add_decayed_weights` chained first), or decoupled
  (``decoupled``: :func:`decoupled_weight_decay` chained after it, AdamW's; an entry with
  ``own_decoupled_decay`` applies it itself, from ``rc.optimizer.weight_decay``).
  ``sharding``: where the optimizer state's big arrays are split (``Plan.optimizer_sharding``),
  for Ginger to pin its step's stacked vectors to the same rows; None when not split.
  ``loss``: the run's ``training.steps.TrainingLoss``, which an optimizer that traces the loss
  (registry ``Optimizer.traces_loss``: K-FAC) is built with; None builds it for its checks
  only."""
  entry = registry.get(rc.optimizer.name)
  if entry.traces_loss:
    tx = entry.build(rc.optimizer, schedule, sharding, loss)
  else:
    tx = entry.build(rc.optimizer, schedule, sharding)
  if rc.weight_decay and rc.weight_decay_mode == "l2":
    tx = optax.chain(optax.add_decayed_weights(rc.weight_decay), tx)
  elif rc.weight_decay and not entry.own_decoupled_decay:
    tx = optax.chain(tx, decoupled_weight_decay(rc.weight_decay, schedule))
  return optax.with_extra_args_support(tx)


def decoupled_weight_decay(
  weight_decay: float,
  schedule: optax.Schedule,
) -> optax.GradientTransformation:
  """Decoupled weight decay (Loshchilov & Hutter 2019, AdamW's) beside any optimizer's update,
  chained after it:

    u_t <- u_t - lr_t * weight_decay * params_t

  with ``lr_t`` the run's schedule at the step, so that ``optax.chain(optax.adam(schedule),
  decoupled_weight_decay(wd, schedule))`` is ``optax.adamw(schedule, weight_decay=wd)``: the
  decay shrinks the weights whatever the optimizer does to the gradient, instead of being
  preconditioned with it as an L2 term is.

  Args:
    weight_decay: the decay per unit of learning rate, >= 0.
    schedule: the learning rate ``lr_t`` the optimizer before it is built with.
  """

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("decoupled_weight_decay needs the params (optax's params argument).")
    step = -schedule(state.count) * weight_decay
    updates = jax.tree.map(lambda u, p: u + (step * p).astype(u.dtype), updates, params)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def divergence_advice(rc: RunConfig) -> str:
  """What to change when the loss of this optimizer's run became NaN/Inf: the learning rate,
  the optimizer's own knobs (its registry entry's ``advice``), the gradient clip where it is
  off."""
  advice = registry.get(rc.optimizer.name).advice
  own = "" if advice is None else f", {advice(rc.optimizer)}"
  clip = "" if rc.grad_clip else ", or clip the gradient (grad_clip=1.0)"
  return f"lower lr (now {rc.lr}){own}{clip}"


__all__ = [
  "build_optimizer",
  "clip_bound",
  "decoupled_weight_decay",
  "divergence_advice",
  "learning_rate",
  "reorthonormalise_every",
]
