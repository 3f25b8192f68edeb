"""Ginger: a damped low-rank Gauss-Newton preconditioner (and QNG) for optax.

import ginger, optax
tx = ginger.ginger(learning_rate=1e-3, tau=8)
state = tx.init(params)
(loss, _), grads, d = ginger.fisher.value_grad_and_fisher(logits_fn, params, y, rng)
updates, state = tx.update(grads, state, params, fisher_grads=d)
params = optax.apply_updates(params, updates)

# Hyperparameters as state (tau fixes array shapes, so it stays static):
tx = optax.inject_hyperparams(ginger.ginger, static_args=("tau",))(learning_rate=1e-3, tau=8)

# A NaN or Inf gradient would enter U and sigma for good (as any optax state): skip such steps.
tx = optax.apply_if_finite(ginger.ginger(1e-3, tau=8), max_consecutive_errors=5)
"""

from ginger import fisher, lowrank, sharding
from ginger._stacked import StackedBasis, StackedRows, StackedSigma
from ginger.ginger import (
  ScaleByGingerState,
  checkpoint_state,
  curvature_spectrum,
  default_reorthonormalise_every,
  ginger,
  reorthonormalise,
  restore_checkpoint_state,
  scale_by_ginger,
)
from ginger.qng import ScaleByQNGState, qng, scale_by_qng

__all__ = [
  "ScaleByGingerState",
  "ScaleByQNGState",
  "StackedBasis",
  "StackedRows",
  "StackedSigma",
  "checkpoint_state",
  "curvature_spectrum",
  "default_reorthonormalise_every",
  "fisher",
  "ginger",
  "lowrank",
  "qng",
  "reorthonormalise",
  "restore_checkpoint_state",
  "scale_by_ginger",
  "scale_by_qng",
  "sharding",
]
__version__ = "0.1.0"
