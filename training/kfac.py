"""K-FAC (Martens & Grosse 2015) from kfac-jax (its source vendored in third_party/kfac_jax),
as the optax transformation train.py runs.

K-FAC preconditions the gradient with a block-diagonal Fisher, one block per layer, each a
Kronecker product of two small matrices. For a dense or conv layer with inputs ``a`` (a conv's
patches) and output cotangents ``g = d log p(y_hat | x) / d s`` of its pre-activations ``s``,
``y_hat ~ softmax(logits)`` (kfac-jax's ``estimation_mode="fisher_gradients"``: the sampled
Fisher)::

    F_l ~ A_l (x) G_l,   A_l = E[a a^T],   G_l = E[g g^T]   (moving averages, decay curvature_ema)
    update_l = (A_l + pi_l sqrt(lambda) I)^{-1} grad_l (G_l + sqrt(lambda) / pi_l I)^{-1}

for the layer's kernel gradient ``grad_l`` as an (inputs, outputs) matrix, with ``lambda`` the
damping and ``pi_l = sqrt((tr A_l / dim A_l) / (tr G_l / dim G_l))`` (kfac-jax's pi-adjusted
factored damping: the Tikhonov damping ``F_l + lambda I`` approximated per factor).
BatchNorm's scale and shift get a diagonal block. The inverses are recomputed every
``inverse_update_period`` steps (the first on step 0) and reused in between; the factors are
updated every step. The preconditioned gradient ``p_t`` is then applied with heavy-ball
momentum as kfac-jax's own optimizer does it::

    delta_t = b1 delta_{t-1} - lr_t p_t,    theta_{t+1} = theta_t + delta_t

kfac-jax finds the layers by tracing the loss as a function of the parameters and matching
dense, conv2d and scale-and-shift patterns in its jaxpr, and it draws ``y_hat`` and runs its
own forward and backward to read ``a`` and ``g`` at each layer. The framework's d-pass (the
sampled-Fisher vector ``d_t = J^T s / sqrt(N)`` of ginger.fisher) cannot stand in for that
pass: ``d_t`` is summed over the batch in parameter space, from which the per-layer factors
``A_l`` and ``G_l`` cannot be recovered. So the transformation takes the training loss
(:class:`training.steps.TrainingLoss`) when it is built and, every step, the batch and a key
(the step's ``fisher_key``): ``update(grads, state, params, batch=..., key=...)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import kfac_jax
import optax

from ginger.fisher import cross_entropy


class KfacState(NamedTuple):
  """The preconditioner's state: kfac-jax's ``OptaxPreconditionState`` (its step count and
  the estimator's per-layer factors and cached inverses)."""

  preconditioner: Any


def _batch_size(batch) -> int:
  """Examples in a :class:`training.steps.LossBatch` (kfac-jax normalises its factors by it)."""
  return batch.labels.shape[0]


def registered_loss(loss):
  """The training loss as kfac-jax traces it, ``value(params, batch)``: the framework's
  cross-entropy of ``loss.logits(params, batch)``, its logits and labels registered as a
  softmax cross-entropy (the mean over the batch: weight 1)."""

  def value(params, batch):
    logits, labels, mask = loss.logits(params, batch)
    if mask is not None:
      # kfac-jax normalises by the batch size; a masked loss (T5's tokens) is normalised by the
      # count of its predictions, and T5 is refused by the config check anyway.
      raise ValueError("K-FAC here registers unmasked classification losses only.")
    kfac_jax.register_softmax_cross_entropy_loss(logits, labels)
    return cross_entropy(logits, labels)

  return value


def unmatched_parameters(preconditioner, params) -> list[str]:
  """The paths of the parameters kfac-jax found in no dense, conv2d or scale-and-shift layer
  (it gives them a "generic" diagonal block), once it has traced the loss."""
  estimator = preconditioner.estimator
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  unmatched = []
  for tag, indices in zip(estimator.jaxpr.layer_tags, estimator.jaxpr.layer_indices, strict=True):
    if tag.params["meta"].variant == "generic":
      unmatched += [paths[i] for i in indices]
  return unmatched


def scale_by_kfac(
  loss,
  *,
  damping: float,
  inverse_update_period: int,
  curvature_ema: float,
  norm_constraint: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The K-FAC preconditioner ``p_t = F_hat^{-1} g_t`` (module docstring), kfac-jax's
  ``OptaxPreconditioner`` with a fixed damping.

  ``loss``: the training loss (:class:`training.steps.TrainingLoss`), traced at ``init``
  (``loss.batch``: a batch's shapes) to find the layers; None builds the transformation for
  its arguments' checks only (``init`` then refuses). ``update(updates, state, params, *,
  batch, key)``: ``batch`` a :class:`training.steps.LossBatch` of this step, ``key`` the key
  its Fisher labels are drawn with. Each update first updates the factors with this batch,
  then (every ``inverse_update_period`` steps, from step 0) the inverses, then preconditions.
  ``norm_constraint``: kfac-jax's bound on ``p^T F_hat p`` (None: none, its default).
  """
  preconditioner = kfac_jax.OptaxPreconditioner(
    registered_loss(loss),
    damping=damping,
    norm_constraint=norm_constraint,
    estimation_mode="fisher_gradients",
    curvature_ema=curvature_ema,
    inverse_update_period=inverse_update_period,
    batch_size_extractor=_batch_size,
    # Its distributed variants split the work over a pmap axis; the training step is one jit
    # over the mesh (GSPMD), where each device computes every inverse, as on one device.
    distributed_inverses=False,
    distributed_precon_apply=False,
  )

  def init(params) -> KfacState:
    if loss is None:
      raise ValueError("K-FAC needs the training loss to find the model's layers.")
    batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), loss.batch)
    # The key seeds nothing here: the factors start at zero, the inverses at the identity.
    state = preconditioner.init((params, batch), jax.random.key(0))
    unmatched = unmatched_parameters(preconditioner, params)
    if unmatched:
      raise ValueError(
        f"K-FAC found no dense, conv2d or scale-and-shift layer for {', '.join(unmatched)} in "
        "the model's trace (a bfloat16 model hides them behind its casts): it would only "
        "scale them by a diagonal."
      )
    return KfacState(state)

  def update(updates, state: KfacState, params=None, *, batch, key, **extra):
    del extra
    precondition = preconditioner.maybe_update(state.preconditioner, (params, batch), key)
    updates = preconditioner.apply(updates, precondition)
    return updates, KfacState(preconditioner.increment_count(precondition))

  return optax.GradientTransformationExtraArgs(init, update)


def kfac(
  learning_rate: optax.ScalarOrSchedule,
  loss,
  *,
  b1: float,
  damping: float,
  inverse_update_period: int,
  curvature_ema: float,
  norm_constraint: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with momentum: :func:`scale_by_kfac`, then ``delta_t = b1 delta_{t-1} - lr_t p_t``
  (kfac-jax's ``Optimizer`` with fixed learning rate, momentum and damping, and no burn-in:
  the first step's factors are its own batch's)."""
  return optax.chain(
    scale_by_kfac(
      loss,
      damping=damping,
      inverse_update_period=inverse_update_period,
      curvature_ema=curvature_ema,
      norm_constraint=norm_constraint,
    ),
    optax.scale_by_learning_rate(learning_rate),
    optax.trace(decay=b1),
  )
