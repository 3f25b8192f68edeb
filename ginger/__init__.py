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
# (A non-finite fisher_grads alone is skipped by the curvature update: state.skipped counts it.)
tx = optax.apply_if_finite(ginger.ginger(1e-3, tau=8), max_consecutive_errors=5)

The API is what ``__all__`` names: the optimizers (:func:`ginger`, :func:`qng`, and SOAP,
:func:`soap`, a Kronecker-factored baseline) and their preconditioners alone
(:func:`scale_by_ginger`, :func:`scale_by_qng`, :func:`scale_by_soap`), their states, the
helpers that read or rewrite a state holding Ginger's (:func:`curvature_spectrum`,
:func:`kappa_eps`, :func:`reorthonormalise`, :func:`checkpoint_state`,
:func:`restore_checkpoint_state`) and
the types of its bucket-stacked arrays, and two submodules: :mod:`ginger.fisher` (the
sampled-Fisher vector ``d_t``) and :mod:`ginger.sharding` (where a state's arrays live on a
device mesh). ``ginger._src`` holds the implementation (the passes over ``U`` and their Pallas
kernels, Brand's eigen-update, the secular solver, the bucket layout); its modules and names
are private and may change.
"""

from ginger import fisher, sharding
from ginger._src.ginger_state import (
  checkpoint_state,
  curvature_spectrum,
  kappa_eps,
  restore_checkpoint_state,
)
from ginger._src.ginger_transform import (
  ScaleByGingerState,
  default_reorthonormalise_every,
  ginger,
  reorthonormalise,
  scale_by_ginger,
)
from ginger._src.qng_transform import ScaleByQNGState, qng, scale_by_qng
from ginger._src.soap import ScaleBySoapState, scale_by_soap, soap
from ginger._src.stacked import StackedBasis, StackedRows, StackedSigma
from ginger._src.tuning import Tuning

__all__ = [
  "ScaleByGingerState",
  "ScaleByQNGState",
  "ScaleBySoapState",
  "StackedBasis",
  "StackedRows",
  "StackedSigma",
  "Tuning",
  "checkpoint_state",
  "curvature_spectrum",
  "default_reorthonormalise_every",
  "fisher",
  "ginger",
  "kappa_eps",
  "qng",
  "reorthonormalise",
  "restore_checkpoint_state",
  "scale_by_ginger",
  "scale_by_qng",
  "scale_by_soap",
  "sharding",
  "soap",
]
__version__ = "0.1.0"
