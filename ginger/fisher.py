"""The sampled-Fisher vector ``d_t`` from a model's logits, sharing one forward pass.

:func:`value_grad_and_fisher` gives the loss, its gradient and ``d_t`` from one forward pass;
:func:`fisher_vector` is the d-pass alone (a forward of its own);
:func:`value_grad_and_fisher_per_device` splits the batch over devices. ``d_t`` is what
``tx.update(grads, state, params, fisher_grads=d_t)`` of :func:`ginger.ginger` and
:func:`ginger.qng` folds into the curvature (the math: docs/ginger-math.md, section 2).
"""

from ginger._src.fisher import (
  BACKWARDS,
  cross_entropy,
  fisher_cotangent,
  fisher_vector,
  loss_cotangent,
  value_grad_and_fisher,
  value_grad_and_fisher_per_device,
)

__all__ = [
  "BACKWARDS",
  "cross_entropy",
  "fisher_cotangent",
  "fisher_vector",
  "loss_cotangent",
  "value_grad_and_fisher",
  "value_grad_and_fisher_per_device",
]
