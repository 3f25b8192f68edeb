"""Ginger's float32 edge in the training log: ``sigma_max * eps / gamma`` per block.

Above 1 a block's new direction lies outside the float32 error bound for gradients far from
``span U`` (docs/ginger-math.md, section 6): the train records carry the largest block's value
(``kappa_eps``) and the log warns once, naming the fixes (a larger ``gamma``, a wider state).
"""

from __future__ import annotations

import logging

import jax

import ginger
from training.run_config import RunConfig
from training.steps import TrainState

log = logging.getLogger("train")


def block_ratios(rc: RunConfig, state: TrainState) -> dict[str, float]:
  """``ginger.kappa_eps`` of a Ginger run's blocks (``sigma_max * eps / gamma``), from their
  ``sigma`` alone fetched to the host (``U`` and the momentum stay on the devices); {} for the
  other optimizers."""
  if rc.optimizer.name != "ginger":
    return {}
  is_ginger = lambda x: isinstance(x, ginger.ScaleByGingerState)  # noqa: E731
  small = jax.tree.map(
    lambda s: s._replace(u=None, mu=None) if is_ginger(s) else s,
    state.opt_state,
    is_leaf=is_ginger,
  )
  ratios = ginger.kappa_eps(jax.device_get(small), rc.optimizer.gamma)
  return {k: float(v) for k, v in ratios.items()}


def warn_once(rc: RunConfig, ratios: dict[str, float], done: int) -> bool:
  """Warns where a block's ``sigma_max * eps / gamma`` is above 1: there the direction of a
  state of ``state_dtype`` is outside its error bound for gradients far from ``span U``
  (docs/ginger-math.md, section 6). Returns whether it warned."""
  if not ratios or max(ratios.values()) <= 1:
    return False
  block = max(ratios, key=ratios.get)
  dtype, gamma = rc.optimizer.state_dtype or "float32", rc.optimizer.gamma
  eps = float(jax.numpy.finfo(jax.numpy.dtype(dtype)).eps)
  wider = (
    "state_dtype=float32"
    if dtype != "float32"
    else "a float64 state (the library's state_dtype='float64' under jax_enable_x64)"
  )
  log.warning(
    "step %d: Ginger's sigma_max * eps / gamma is %.3g in %s (sigma_max %.3g, gamma %g, "
    "state_dtype %s; %d of %d blocks above 1): above 1 the %s direction loses its error bound "
    "for gradients far from span U (docs/ginger-math.md, section 6). The fixes: raise gamma to "
    "at least %.2g, or store the state wider (%s). Logged once; the train records' kappa_eps "
    "holds the largest block's value at every log step.",
    done,
    ratios[block],
    block,
    ratios[block] * gamma / eps,
    gamma,
    dtype,
    sum(v > 1 for v in ratios.values()),
    len(ratios),
    dtype,
    ratios[block] * gamma,
    wider,
  )
  return True
