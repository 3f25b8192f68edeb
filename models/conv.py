"""A convolution whose weight gradient, in a backward pass over a stack of cotangents, is
computed one cotangent at a time (train.py's ``conv_weight_grads=per_cotangent``).

Why: the shared d-pass's batched pull-back (:func:`ginger.fisher.value_grad_and_fisher` with
``backward="batched"``) vmaps the model's backward over the pair of cotangents, the loss's and
the sampled Fisher's. A convolution's backward has two parts, and JAX's batching rule treats
them differently:

* the input gradient ``dx = conv(g, rot180(W))`` takes the cotangent ``g`` as its input
  operand: the stack folds into the batch axis, ``[2, N, H, W, C] -> [2N, H, W, C]``, a
  reshape that moves nothing;
* the weight gradient ``dW[kh, kw, i, o] = sum_{n,h,w} x[n, h+kh, w+kw, i] g[n, h, w, o]``
  takes ``g`` as its kernel operand: the stack folds into the output features,
  ``[2, N, H, W, C] -> [N, H, W, 2C]``, a transpose of every convolution's cotangent (the
  stack axis is the major one, the features the minor one).

:func:`conv_general_dilated` computes the same forward and the same gradients, but under a
vmap over at most :data:`MAX_STACK` cotangents (and nothing else batched) the weight gradient
is one convolution per cotangent, each on its contiguous slice of the stack: the same FLOPs in
as many launches, no transpose. Any other vmap (per-example gradients, a larger stack) takes
JAX's own rule. The values are those of ``jax.lax.conv_general_dilated``'s gradient: each
cotangent's weight gradient is the same sum, only computed in a convolution of its own.

Reverse mode only: the function is a ``jax.custom_vjp``, which ``jax.jvp`` / ``jax.jacfwd``
cannot differentiate (train.py differentiates in reverse mode only).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

# The largest stack of cotangents whose weight gradients are computed one at a time: the
# batched pull-back's pair (the loss gradient and d_t), with room for a few more. A larger
# vmap (a Jacobian's rows, per-example gradients) keeps JAX's folded convolution.
MAX_STACK = 4


def conv_general_dilated(
  lhs,
  rhs,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
):
  """``jax.lax.conv_general_dilated`` (same arguments, same result) whose weight gradient
  under a vmap over a stack of cotangents is one convolution per cotangent (module
  docstring). Pass it as ``nnx.Conv(..., conv_general_dilated=conv_general_dilated)``."""
  options = (
    ("window_strides", _hashable(window_strides)),
    ("padding", _hashable(padding)),
    ("lhs_dilation", _hashable(lhs_dilation)),
    ("rhs_dilation", _hashable(rhs_dilation)),
    ("dimension_numbers", _hashable(dimension_numbers)),
    ("feature_group_count", feature_group_count),
    ("batch_group_count", batch_group_count),
    ("precision", _hashable(precision)),
    ("preferred_element_type", preferred_element_type),
    ("out_sharding", out_sharding),
  )
  return _conv(options)(lhs, rhs)


def _hashable(value: Any) -> Any:
  """Lists (nnx.Conv's padding pairs, strides) as tuples, for the cache of :func:`_conv`."""
  if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
    return tuple(_hashable(v) for v in value)
  return value


@functools.cache
def _conv(options: tuple):
  """The convolution with ``options`` (``conv_general_dilated``'s keyword arguments) as a
  ``custom_vjp`` of ``(x, w)``, built once per distinct set of options."""
  conv = functools.partial(lax.conv_general_dilated, **dict(options))

  def weight_grad_of(x, w, g):
    return jax.vjp(lambda w_: conv(x, w_), w)[1](g)[0]  # XLA drops the primal convolution

  @jax.custom_batching.custom_vmap
  def weight_grad(x, w, g):
    return weight_grad_of(x, w, g)

  @weight_grad.def_vmap
  def _weight_grad_stack(axis_size, in_batched, x, w, g):
    x_batched, w_batched, g_batched = in_batched
    if x_batched or w_batched or not g_batched or axis_size > MAX_STACK:
      in_axes = tuple(0 if b else None for b in in_batched)
      return jax.vmap(weight_grad_of, in_axes=in_axes)(x, w, g), True
    return jnp.stack([weight_grad_of(x, w, g[i]) for i in range(axis_size)]), True

  @jax.custom_vjp
  def f(x, w):
    return conv(x, w)

  def f_fwd(x, w):
    return conv(x, w), (x, w)

  def f_bwd(residuals, g):
    x, w = residuals
    dx = jax.vjp(lambda x_: conv(x_, w), x)[1](g)[0]
    return dx, weight_grad(x, w, g)

  f.defvjp(f_fwd, f_bwd)
  return f


CONV_WEIGHT_GRADS = ("folded", "per_cotangent")


def use_conv_weight_grads(model, mode: str):
  """``model`` (in place, returned) with its ``nnx.Conv`` s computing weight gradients as
  ``mode`` says (train.py's ``conv_weight_grads``): ``folded`` keeps flax's
  ``jax.lax.conv_general_dilated``, ``per_cotangent`` takes :func:`conv_general_dilated`. The
  parameters and the forward are the same either way."""
  if mode not in CONV_WEIGHT_GRADS:
    raise ValueError(f"conv_weight_grads must be one of {list(CONV_WEIGHT_GRADS)}, got {mode!r}.")
  fn = conv_general_dilated if mode == "per_cotangent" else lax.conv_general_dilated
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.Conv):
      module.conv_general_dilated = fn
  return model
