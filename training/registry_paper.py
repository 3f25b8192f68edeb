"""The paper's optimizers: Ginger, QNG, Adam and momentum, each a registry entry with its
builder, its update FLOPs and its state bytes (training/registry_schema.py says what an entry
holds). The builders and FLOP counts import JAX, optax and the library when called only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from training.choices import BLOCKS, PASSES
from training.registry_costs import (
  elementwise_flops,
  leaf_sizes,
  moments_state_bytes,
  traced_state_bytes,
)
from training.registry_schema import (
  ALPHA,
  DECAY,
  RHO,
  Optimizer,
  OptimizerConfig,
  choice,
  integer,
  number,
  register,
  state_dtype,
  steps_between_curvature_updates,
)


def _build_ginger(opt: OptimizerConfig, schedule, sharding):
  import ginger

  return ginger.ginger(
    schedule,
    tau=opt.tau,
    alpha=opt.alpha,
    gamma=opt.gamma,
    b1=opt.b1,
    rho=opt.rho,
    block=opt.block,
    state_dtype=opt.state_dtype,
    # The loop re-orthonormalises as a program of its own (_ginger_reorthonormalise_every): a
    # lax.cond in every step would stop the host on GPUs.
    reorthonormalise_every=0,
    curvature_every=opt.curvature_every,
    passes=opt.passes,
    sharding=sharding,
  )


def _ginger_reorthonormalise_every(opt: OptimizerConfig) -> int:
  import ginger

  return ginger.default_reorthonormalise_every(opt.state_dtype or "float32")


def _ginger_advice(opt: OptimizerConfig) -> str:
  # Unclipped, directions outside span U are scaled by 1/gamma.
  rho = " or clip the update (rho=1)" if opt.rho is None else ""
  return f"raise gamma (now {opt.gamma}){rho}"


def _ginger_flops(params, opt: OptimizerConfig, *, curvature_update=True, **_) -> float:
  from models import flops

  sizes, tau = leaf_sizes(params), int(opt.tau)
  if not curvature_update:
    return elementwise_flops(params) + flops.ginger_precondition_flops(sizes, tau, opt.block)
  return elementwise_flops(params) + flops.ginger_update_flops(sizes, tau, opt.block)


def _ginger_lr_key(values: Mapping[str, Any]) -> str:
  # Unclipped, Ginger moves each direction outside span U by lr / gamma times the momentum:
  # its good lrs lie orders of magnitude below the clipped variant's, tuned separately.
  return "ginger_unclipped" if values.get("rho") is None else "ginger"


def _qng_lr_key(values: Mapping[str, Any]) -> str:
  # QNG's clip (Ginger's, as a control) bounds each entry by lr * rho: tuned separately.
  return "qng" if values.get("rho") is None else "qng_clipped"


def _build_qng(opt: OptimizerConfig, schedule, sharding):
  import ginger

  return ginger.qng(
    schedule,
    tau=opt.tau,
    alpha=opt.alpha,
    b1=opt.b1,
    block=opt.block,
    rho=opt.rho,
    state_dtype=opt.state_dtype,
  )


def _qng_flops(params, opt: OptimizerConfig, **_) -> float:
  from models import flops

  return elementwise_flops(params) + flops.qng_update_flops(leaf_sizes(params), int(opt.tau))


def _build_adam(opt: OptimizerConfig, schedule, sharding):
  import optax

  return optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)


def _build_momentum(opt: OptimizerConfig, schedule, sharding):
  import optax

  return optax.sgd(schedule, momentum=opt.b1)


register(
  Optimizer(
    name="ginger",
    display="Ginger",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.state_dtype": state_dtype(float16=False),
      "tau": integer(1),
      "alpha": ALPHA,
      "block": choice(BLOCKS),
      "gamma": number(0, closed=(False, True)),
      "rho": RHO,
      "curvature_every": steps_between_curvature_updates,
      "passes": choice(PASSES, optional=True),  # null: the library's default, jnp
    },
    build=_build_ginger,
    curvature=True,
    curvature_every=True,
    update_flops=_ginger_flops,
    state_bytes=traced_state_bytes,
    reorthonormalise_every=_ginger_reorthonormalise_every,
    advice=_ginger_advice,
    lr_key=_ginger_lr_key,
  )
)
register(
  Optimizer(
    name="qng",
    display="QNG",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.state_dtype": state_dtype(),
      "tau": integer(1),
      "alpha": ALPHA,
      "block": choice(BLOCKS),
      "rho": RHO,
      "curvature_every": steps_between_curvature_updates,
    },
    build=_build_qng,
    curvature=True,
    update_flops=_qng_flops,
    state_bytes=traced_state_bytes,
    lr_key=_qng_lr_key,
  )
)
register(
  Optimizer(
    name="adam",
    display="Adam",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.b2": DECAY,
      "optimizer.eps": number(0, closed=(False, True)),
    },
    build=_build_adam,
    update_flops=elementwise_flops,
    state_bytes=moments_state_bytes(2, counts=2),  # mu, nu; its and the schedule's counts
  )
)
register(
  Optimizer(
    name="momentum",
    display="Momentum",
    keys={"optimizer.b1": DECAY},
    build=_build_momentum,
    update_flops=elementwise_flops,
    state_bytes=moments_state_bytes(1, counts=1),  # the momentum; the schedule's count
  )
)
