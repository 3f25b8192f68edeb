"""Analytic multiply-accumulate (MAC) and FLOP counts for conv and dense layers.

XLA's ``cost_analysis`` is unreliable for convolutions on GPU, so the training loop reports
FLOPs from these counts instead.

Conventions (the usual ones in papers that quote "GFLOPs" for ResNets):
  * Only convolutions (``k*k*cin/groups*cout*Hout*Wout`` MACs) and dense layers / matmuls
    (``in*out`` MACs per example) are counted. BatchNorm, ReLU, pooling, residual adds and the
    loss are ignored: they are O(activations), not O(activations * fan-in).
  * One MAC = 2 FLOPs (a multiply and an add).
  * Training (forward + backward) = 3x forward: the backward pass computes the gradient with
    respect to both the activations and the weights, each costing about one forward pass.

ResNet counts come from tracing the real NNX module (``models.resnet``) with ``jax.make_jaxpr``
on abstract shapes and counting its ``conv_general_dilated`` and ``dot_general`` equations, so
there is one source of truth for the architecture. Nothing is allocated or compiled.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jex_core

from models.resnet import build_resnet

FLOPS_PER_MAC = 2
TRAIN_FORWARD_MULTIPLIER = 3


def conv2d_macs(
  kernel: int | tuple[int, int], cin: int, cout: int, out_hw: tuple[int, int], groups: int = 1
) -> int:
  """MACs of one 2-D convolution for one example."""
  kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
  return kh * kw * (cin // groups) * cout * out_hw[0] * out_hw[1]


def dense_macs(din: int, dout: int) -> int:
  """MACs of one dense layer for one example."""
  return din * dout


def _conv_eqn_macs(eqn: Any) -> int:
  """MACs of a ``conv_general_dilated``: each output element costs prod(kernel) / cout."""
  out_shape = eqn.outvars[0].aval.shape
  rhs_shape = eqn.invars[1].aval.shape
  out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
  per_output = math.prod(rhs_shape) // rhs_shape[out_feature_dim]
  return math.prod(out_shape) * per_output


def _dot_eqn_macs(eqn: Any) -> int:
  """MACs of a ``dot_general``: each output element costs prod(contracting dims)."""
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  out_shape = eqn.outvars[0].aval.shape
  return math.prod(out_shape) * math.prod(lhs_shape[d] for d in lhs_contract)


def jaxpr_macs(jaxpr: Any) -> int:
  """Counts conv and matmul MACs in a (closed) jaxpr, recursing into sub-jaxprs.

  A ``scan`` body counts ``length`` times; a ``cond`` counts its most expensive branch;
  ``while`` bodies count once (their trip count is not static).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "conv_general_dilated":
      total += _conv_eqn_macs(eqn)
    elif name == "dot_general":
      total += _dot_eqn_macs(eqn)
    subs = [jaxpr_macs(sub) for sub in jex_core.jaxprs_in_params(eqn.params)]
    if not subs:
      continue
    if name == "cond":
      total += max(subs)
    elif name == "scan":
      total += eqn.params["length"] * sum(subs)
    else:
      total += sum(subs)
  return total


def count_macs(fn: Callable[..., Any], *args: Any) -> int:
  """MACs of ``fn(*args)``; ``args`` may be arrays or ``jax.ShapeDtypeStruct``s."""
  return jaxpr_macs(jax.make_jaxpr(fn)(*args))


def resnet_forward_macs(
  name: str, num_classes: int, image_shape: tuple[int, int, int] = (32, 32, 3)
) -> int:
  """Forward-pass MACs per example of ``build_resnet(name, num_classes)`` on HxWxC images.

  ResNet-18 on 32x32x3 with 100 classes: 555,468,800 MACs (1.11 GFLOPs); ResNet-50:
  1,298,014,208 MACs. Traced once per (name, num_classes, image_shape), then cached.
  """
  return _resnet_forward_macs(name, int(num_classes), tuple(int(d) for d in image_shape))


@functools.cache
def _resnet_forward_macs(name: str, num_classes: int, image_shape: tuple[int, ...]) -> int:
  model = nnx.eval_shape(
    lambda: build_resnet(name, num_classes, in_channels=image_shape[-1], rngs=nnx.Rngs(0))
  )
  model.eval()  # train-mode BatchNorm would write running statistics from inside the trace
  graphdef, state = nnx.split(model)

  def forward(state: nnx.State, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(x)

  return count_macs(forward, state, jax.ShapeDtypeStruct((1, *image_shape), jnp.float32))


def resnet_forward_flops_per_example(
  name: str, num_classes: int, image_shape: tuple[int, int, int] = (32, 32, 3)
) -> int:
  """Forward FLOPs per example (2 FLOPs per MAC)."""
  return FLOPS_PER_MAC * resnet_forward_macs(name, num_classes, image_shape)


def resnet_train_flops_per_example(
  name: str, num_classes: int, image_shape: tuple[int, int, int] = (32, 32, 3)
) -> int:
  """Training FLOPs per example: forward + backward = 3x forward, 2 FLOPs per MAC.

  Multiply by the batch size for FLOPs per iteration (optimizer cost not included).
  """
  return TRAIN_FORWARD_MULTIPLIER * resnet_forward_flops_per_example(name, num_classes, image_shape)
