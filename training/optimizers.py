"""Builds the optax optimizer and learning-rate schedule from the Hydra config."""

from __future__ import annotations

import optax

import ginger

OPTIMIZERS = ("ginger", "qng", "adam", "momentum")
SCHEDULES = ("constant", "warmup_constant", "cosine")
CURVATURE = ("ginger", "qng")  # the optimizers that take a sampled-Fisher vector


def clip_bound(cfg) -> float | None:
  """The bound whose exceedances the training log counts (metric ``clip_fraction``): a
  curvature optimizer's element-wise clip ``rho``, or 1 where it runs unclipped (the share the
  authors' clip would change); None for the others."""
  if cfg.optimizer.name not in CURVATURE:
    return None
  return 1.0 if cfg.rho is None else float(cfg.rho)


def curvature_every(cfg) -> int:
  """Steps between curvature updates (``curvature_every``; 1 = every step, the paper).

  Only Ginger has it (config_check refuses another value for QNG and warns that Adam and
  Momentum ignore it); 1 for them, and where null. Returned as given otherwise:
  ``ginger.ginger`` refuses what is not an int >= 1 (no silent ``int(2.5)``).
  """
  value = cfg.curvature_every
  return 1 if value is None or cfg.optimizer.name != "ginger" else value


def reorthonormalise_every(cfg) -> int:
  """Curvature updates between the training loop's re-orthonormalisations of Ginger's ``U``
  (``ginger.default_reorthonormalise_every`` of ``optimizer.state_dtype``); 0 for the other
  optimizers. The loop runs them as a program of their own (``loop.make_steps``), so
  :func:`build_optimizer` builds Ginger with ``reorthonormalise_every=0``."""
  if cfg.optimizer.name != "ginger":
    return 0
  return ginger.default_reorthonormalise_every(cfg.optimizer.get("state_dtype") or "float32")


def passes(cfg) -> str:
  """How Ginger's passes over ``U`` run (``passes``: jnp | pallas | auto; null: the library's
  default, "jnp"). "auto" is left to the library (``ginger._src.kernels.resolve_impl``: the Pallas
  kernels on GPUs, the jnp passes elsewhere), also on an optimizer state split over several
  devices, where the kernels run per device under ``shard_map`` on each device's rows and are
  still faster than the jnp passes."""
  return cfg.passes or "jnp"


def learning_rate(cfg, steps_per_epoch: int, total_steps: int) -> optax.Schedule:
  """The schedule of ``cfg.schedule`` peaking at ``cfg.lr``: constant (the paper's),
  warmup_constant (a linear warm-up over ``warmup_epochs``, as the authors' code) or cosine
  (decay to 0 over the run)."""
  lr = float(cfg.lr)
  if not lr > 0:
    raise ValueError(f"lr must be > 0, got {cfg.lr}.")
  if cfg.schedule == "constant":
    return optax.constant_schedule(lr)
  if cfg.schedule == "warmup_constant":
    warmup = max(1, int(cfg.warmup_epochs * steps_per_epoch))
    return optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
    )
  if cfg.schedule == "cosine":
    return optax.cosine_decay_schedule(lr, max(1, total_steps))
  raise ValueError(f"schedule must be one of {SCHEDULES}, got {cfg.schedule!r}.")


def build_optimizer(
  cfg, schedule: optax.Schedule, sharding: ginger.sharding.StateSharding | None = None
) -> optax.GradientTransformationExtraArgs:
  """The optimizer named by ``cfg.optimizer.name`` with the top-level paper notation.
  ``sharding``: where the optimizer state's big arrays are split (``Plan.optimizer_sharding``),
  for Ginger to pin its step's stacked vectors to the same rows; None when not split."""
  name, opt = cfg.optimizer.name, cfg.optimizer
  if name == "ginger":
    tx = ginger.ginger(
      schedule,
      tau=int(cfg.tau),
      alpha=float(cfg.alpha),
      gamma=float(cfg.gamma),
      b1=float(opt.b1),
      rho=None if cfg.rho is None else float(cfg.rho),
      block=cfg.block,
      state_dtype=opt.state_dtype,
      # The loop re-orthonormalises as a program of its own (reorthonormalise_every above): a
      # lax.cond in every step would stop the host on GPUs.
      reorthonormalise_every=0,
      curvature_every=curvature_every(cfg),
      passes=passes(cfg),
      sharding=sharding,
    )
  elif name == "qng":
    tx = ginger.qng(
      schedule,
      tau=int(cfg.tau),
      alpha=float(cfg.alpha),
      b1=float(opt.b1),
      block=cfg.block,
      rho=None if cfg.rho is None else float(cfg.rho),
      state_dtype=opt.state_dtype,
    )
  elif name == "adam":
    tx = optax.adam(schedule, b1=float(opt.b1), b2=float(opt.b2), eps=float(opt.eps))
  elif name == "momentum":
    tx = optax.sgd(schedule, momentum=float(opt.b1))
  else:
    raise ValueError(f"optimizer.name must be one of {OPTIMIZERS}, got {name!r}.")
  if cfg.weight_decay:
    tx = optax.chain(optax.add_decayed_weights(float(cfg.weight_decay)), tx)
  return optax.with_extra_args_support(tx)


def divergence_advice(cfg) -> str:
  """What to change when the loss of this optimizer's run became NaN/Inf."""
  name = cfg.optimizer.name
  clip = "" if cfg.grad_clip else ", or clip the gradient (grad_clip=1.0)"
  if name == "ginger":
    # Unclipped, directions outside span U are scaled by 1/gamma.
    rho = " or clip the update (rho=1)" if cfg.rho is None else ""
    return f"lower lr (now {cfg.lr}), raise gamma (now {cfg.gamma}){rho}{clip}"
  return f"lower lr (now {cfg.lr}){clip}"
