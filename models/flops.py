"""Analytic FLOP counts: every number summary.json's ``flops_per_iter.analytic`` is made of.

XLA's ``cost_analysis`` is unreliable for convolutions on GPU, so the training loop reports
FLOPs from these counts instead: the model's forward pass per example (ResNets traced from the
real module, T5 from its shapes), how many forward-pass equivalents a training step costs
(:func:`train_step_flops`) and the parts of an optimizer's own update (element-wise work,
:func:`ginger_update_flops`, :func:`qng_update_flops`, :func:`soap_update_flops`,
:func:`newton_schulz_flops`), which each optimizer's entry in training/registry.py adds up from
the trained parameters' shapes.
Conventions (the usual ones in papers that quote "GFLOPs" for ResNets):
  * Only convolutions (``k*k*cin/groups*cout*Hout*Wout`` MACs) and dense layers / matmuls
    (``in*out`` MACs per example) are counted. BatchNorm, ReLU, pooling, residual adds and the
    loss are ignored: they are O(activations), not O(activations * fan-in).
  * One MAC = 2 FLOPs (a multiply and an add).
  * Training (forward + backward) = 3x forward: the backward pass computes the gradient with
    respect to both the activations and the weights, each costing about one forward pass. The
    curvature optimizers' d-pass adds a backward (2x) when it shares the training forward, or
    a forward and a backward (3x) when it runs its own in inference mode.

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
  1,298,014,208 MACs. Built abstractly (no arrays) and traced once per (name, num_classes,
  image_shape), then cached.
  """
  return _resnet_forward_macs(name, int(num_classes), tuple(int(d) for d in image_shape))


@functools.cache
def _resnet_forward_macs(name: str, num_classes: int, image_shape: tuple[int, ...]) -> int:
  model = nnx.eval_shape(
    lambda: build_resnet(name, num_classes, in_channels=image_shape[-1], rngs=nnx.Rngs(0))
  )
  return forward_macs(model, image_shape)


def forward_macs(model: nnx.Module, image_shape: tuple[int, ...]) -> int:
  """Forward-pass MACs per example of the image model ``model`` (its arrays or their shapes) on
  ``image_shape`` images, traced in inference mode on a copy: ``model`` keeps its mode and
  state. A network already built costs only the trace (a ResNet-18's abstract build for
  :func:`resnet_forward_macs` takes about 1 s more on 2 CPU cores)."""
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

  def forward(state: nnx.State, x: jax.Array) -> jax.Array:
    copy = nnx.merge(graphdef, state)
    copy.eval()  # train-mode BatchNorm would write running statistics from inside the trace
    return copy(x)

  return count_macs(forward, state, jax.ShapeDtypeStruct((1, *image_shape), jnp.float32))


def train_step_flops(
  forward_flops: float, *, fisher_forward: str | None, fisher_fraction: float = 1.0
) -> float:
  """FLOPs of one training step's passes, from one forward pass over the batch.

  Forward x3 for the loss gradient; a sampled-Fisher d-pass (``fisher_forward`` of the
  curvature optimizers; None for the others) adds one backward (2x) when it shares the
  training forward ("shared"), or its own forward and backward (3x) in inference mode ("eval").
  ``fisher_fraction`` < 1: the d-pass runs on that fraction of the batch (``fisher_batch``),
  with a forward and a backward of its own in either mode (3x the fraction).
  """
  d_pass = {None: 0, "shared": 2, "eval": 3}[fisher_forward]
  if fisher_forward is not None and fisher_fraction < 1:
    d_pass = 3 * fisher_fraction
  return (TRAIN_FORWARD_MULTIPLIER + d_pass) * forward_flops


# Ginger's and QNG's pass structure per update: it belongs with ginger/, which does not expose
# it yet, so it is kept here, the one place FLOPs are counted.
ELEMENTWISE_FLOPS_PER_PARAM = 10.0  # momentum, Adam moments, weight decay, the update itself


def ginger_update_flops(sizes: list[int], tau: int, block: str) -> float:
  """Ginger's curvature work per update, for blocks of size n at rank k = min(tau, n).

  U^T v and its re-orthogonalisation (4 n k multiply-adds), the rotation [U p] V (n k (k+1)),
  preconditioning (2 n k), plus the (k+1)^3 eigensolve (~9 (k+1)^3 FLOPs for a symmetric
  tridiagonal QR). ``block="global"`` is one block of all parameters, else one per tensor.
  """
  blocks = [sum(sizes)] if block == "global" else sizes
  total = 0.0
  for n in blocks:
    k = min(tau, n)
    total += FLOPS_PER_MAC * (4 * n * k + n * k * (k + 1) + 2 * n * k) + 9.0 * (k + 1) ** 3
  return total


def ginger_precondition_flops(sizes: list[int], tau: int, block: str) -> float:
  """Ginger's update on a step without a curvature update (``curvature_every > 1``):
  ``G^{-1} g`` with the current ``G``, i.e. ``U^T g`` and ``U z`` (2 n k multiply-adds per
  block of size n at rank k = min(tau, n))."""
  blocks = [sum(sizes)] if block == "global" else sizes
  return sum(FLOPS_PER_MAC * 2 * n * min(tau, n) for n in blocks)


def qng_update_flops(sizes: list[int], tau: int) -> float:
  """QNG's curvature work per update: 3 tau sequential rank-one applications of 2 n each."""
  return 3 * tau * 2.0 * FLOPS_PER_MAC * sum(sizes)


def soap_update_flops(
  shapes: list[tuple[int, ...]],
  *,
  precondition_frequency: int,
  max_precond_dim: int,
  merge_dims: bool,
  precondition_1d: bool,
) -> float:
  """SOAP's work per update beyond Adam's element-wise part (``ginger.scale_by_soap``),
  amortised over ``precondition_frequency`` steps, for leaves of ``shapes``.

  A leaf of n entries whose factors have sizes d_i (the axes of at most ``max_precond_dim``;
  read from the state ``ginger.scale_by_soap(...).init`` makes, traced with ``jax.eval_shape``)
  costs every step n d_i multiply-adds per factor three times: the gradient rotated into the
  eigenbasis, the update rotated back, and ``G_(i) G_(i)^T`` for the factor's moving average
  (3 d_i^2 FLOPs). Every ``precondition_frequency`` steps each basis is refreshed: ``F Q``
  (d^3 multiply-adds), a Householder QR with ``Q`` formed (8/3 d^3 FLOPs: 4/3 d^3 each),
  ``Q_old^T Q_new`` (d^3) and the first moment rotated into the new basis (n d). The first
  update's ``eigh`` of each factor runs once per run and is not counted.
  """
  import ginger  # the library's own layout of the factors (merge_dims, 1-D leaves)

  tx = ginger.scale_by_soap(
    max_precond_dim=int(max_precond_dim),
    merge_dims=bool(merge_dims),
    precondition_1d=bool(precondition_1d),
  )
  state = jax.eval_shape(tx.init, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
  total = 0.0
  for shape, factors in zip(shapes, state.factors, strict=True):
    n = math.prod(shape)
    for d in (f.shape[0] for f in factors if f is not None):
      every_step = FLOPS_PER_MAC * 3 * n * d + 3 * d * d
      refresh = FLOPS_PER_MAC * (2 * d**3 + n * d) + 8 / 3 * d**3
      total += every_step + refresh / precondition_frequency
  return total


def newton_schulz_flops(rows: int, columns: int) -> float:
  """One Newton-Schulz iteration of Muon on a ``rows x columns`` matrix X, done on the side
  with m = min(rows, columns) <= n = max(...): ``A = X X^T`` (m^2 n multiply-adds),
  ``B = b A + c A A`` (m^3) and ``a X + B X`` (m^2 n): 4 m^2 n + 2 m^3 FLOPs; the
  element-wise terms are left to the element-wise count."""
  m, n = sorted((rows, columns))
  return FLOPS_PER_MAC * (2 * m * m * n + m**3)


def t5_forward_flops(config: Any, batch: int, src_len: int, tgt_len: int) -> int:
  """Matmul FLOPs of one teacher-forced T5 forward pass (2 FLOPs per multiply-accumulate).

  Counted: every projection (q, k, v, o, wi, wo), the attention score (QK^T) and value (AV)
  matmuls over the full padded lengths (causal masking saves nothing in a dense kernel, so the
  decoder's self-attention counts all T x T entries), cross-attention (keys/values projected from
  the S encoder positions once per layer) and the LM head. Not counted: embedding gathers,
  norms, softmax, relative-bias lookups, residual adds (all O(T*d), well under 1%).
  ``config`` is a :class:`models.t5.T5Config`.
  """
  c = config
  d, inner, ff, v = c.d_model, c.inner_dim, c.d_ff, c.vocab_size
  s, t = src_len, tgt_len
  proj = 4 * d * inner  # q, k, v, o per token
  mlp = 2 * d * ff
  enc_layer = s * (proj + mlp) + 2 * s * s * inner
  dec_self = t * proj + 2 * t * t * inner
  dec_cross = t * 2 * d * inner + s * 2 * d * inner + 2 * t * s * inner
  dec_layer = dec_self + dec_cross + t * mlp
  macs = c.num_layers * enc_layer + c.num_decoder_layers * dec_layer + t * d * v
  return int(FLOPS_PER_MAC * batch * macs)
