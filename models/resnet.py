"""ResNet v1 (CIFAR variant) in Flax NNX.

The architecture follows torchvision's ResNet (v1.5: the stride of a bottleneck block sits on its
3x3 conv) with the usual CIFAR stem: a 3x3 stride-1 conv and no max-pool, so 32x32 inputs reach
the last stage at 4x4. ResNet-18 with 100 classes has 11,220,132 parameters and ResNet-50 has
23,705,252, the figures quoted for CIFAR-100 in the Ginger paper (11M / 24M).

``ARCHS`` is the single architecture table: ``models.flops`` counts MACs by tracing the module
built from it, so the FLOP report can never drift from the model that is trained.

BatchNorm mode follows the NNX convention: ``model.train()`` uses batch statistics and updates
the running averages, ``model.eval()`` uses the running averages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Dtype = Any

STAGE_STRIDES: tuple[int, ...] = (1, 2, 2, 2)
STAGE_WIDTH_MULTIPLIERS: tuple[int, ...] = (1, 2, 4, 8)

# torchvision initialises convs with kaiming_normal_(mode="fan_out", nonlinearity="relu"): an
# untruncated normal with variance 2 / fan_out.
_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
# torch.nn.Linear's default init is U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
_DENSE_KERNEL_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True)
class ResNetSpec:
  """One row of the architecture table.

  Attributes:
    block: "basic" (two 3x3 convs) or "bottleneck" (1x1, 3x3, 1x1 with expansion 4).
    blocks: number of blocks in each of the four stages.
    base_width: channels of the stem and of the first stage; stage i has
      ``base_width * STAGE_WIDTH_MULTIPLIERS[i]`` planes (times the block expansion at its
      output).
  """

  block: str
  blocks: tuple[int, ...]
  base_width: int = 64


ARCHS: dict[str, ResNetSpec] = {
  "resnet18": ResNetSpec("basic", (2, 2, 2, 2)),
  "resnet34": ResNetSpec("basic", (3, 4, 6, 3)),
  "resnet50": ResNetSpec("bottleneck", (3, 4, 6, 3)),
  # A width-16, one-block-per-stage net for CPU demos and tests (also runs on 8x8 inputs).
  "resnet_tiny": ResNetSpec("basic", (1, 1, 1, 1), base_width=16),
}


def _conv(
  cin: int,
  cout: int,
  kernel: int,
  stride: int,
  *,
  rngs: nnx.Rngs,
  dtype: Dtype,
  param_dtype: Dtype,
) -> nnx.Conv:
  """Bias-free conv with torch-style symmetric padding (k // 2 on each side).

  Explicit padding (rather than "SAME") keeps strided convs aligned exactly as in torchvision.
  """
  pad = kernel // 2
  return nnx.Conv(
    cin,
    cout,
    (kernel, kernel),
    strides=stride,
    padding=((pad, pad), (pad, pad)),
    use_bias=False,
    kernel_init=_CONV_INIT,
    dtype=dtype,
    param_dtype=param_dtype,
    rngs=rngs,
  )


def _bn(features: int, *, rngs: nnx.Rngs, dtype: Dtype, param_dtype: Dtype) -> nnx.BatchNorm:
  """BatchNorm with torch's defaults (torch momentum 0.1 == flax momentum 0.9)."""
  return nnx.BatchNorm(
    features, momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=rngs
  )


class Projection(nnx.Module):
  """Projection shortcut (1x1 conv + BN) used where a block changes shape."""

  def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs, **dtypes: Dtype):
    self.conv = _conv(cin, cout, 1, stride, rngs=rngs, **dtypes)
    self.bn = _bn(cout, rngs=rngs, **dtypes)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.bn(self.conv(x))


def _shortcut(cin: int, cout: int, stride: int, *, rngs: nnx.Rngs, **dtypes: Dtype):
  """Identity (None) when shapes match, else a projection."""
  if stride == 1 and cin == cout:
    return None
  return Projection(cin, cout, stride, rngs=rngs, **dtypes)


class BasicBlock(nnx.Module):
  """Two 3x3 convs; used by ResNet-18/34."""

  expansion = 1

  def __init__(self, cin: int, planes: int, stride: int, *, rngs: nnx.Rngs, **dtypes: Dtype):
    self.conv1 = _conv(cin, planes, 3, stride, rngs=rngs, **dtypes)
    self.bn1 = _bn(planes, rngs=rngs, **dtypes)
    self.conv2 = _conv(planes, planes, 3, 1, rngs=rngs, **dtypes)
    self.bn2 = _bn(planes, rngs=rngs, **dtypes)
    self.shortcut = _shortcut(cin, planes, stride, rngs=rngs, **dtypes)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    residual = x if self.shortcut is None else self.shortcut(x)
    return nnx.relu(y + residual)


class Bottleneck(nnx.Module):
  """1x1 reduce, 3x3 (strided), 1x1 expand by 4; used by ResNet-50."""

  expansion = 4

  def __init__(self, cin: int, planes: int, stride: int, *, rngs: nnx.Rngs, **dtypes: Dtype):
    cout = planes * self.expansion
    self.conv1 = _conv(cin, planes, 1, 1, rngs=rngs, **dtypes)
    self.bn1 = _bn(planes, rngs=rngs, **dtypes)
    self.conv2 = _conv(planes, planes, 3, stride, rngs=rngs, **dtypes)
    self.bn2 = _bn(planes, rngs=rngs, **dtypes)
    self.conv3 = _conv(planes, cout, 1, 1, rngs=rngs, **dtypes)
    self.bn3 = _bn(cout, rngs=rngs, **dtypes)
    self.shortcut = _shortcut(cin, cout, stride, rngs=rngs, **dtypes)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = nnx.relu(self.bn2(self.conv2(y)))
    y = self.bn3(self.conv3(y))
    residual = x if self.shortcut is None else self.shortcut(x)
    return nnx.relu(y + residual)


BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck]] = {
  "basic": BasicBlock,
  "bottleneck": Bottleneck,
}


def _torch_dense_bias_init(fan_in: int):
  """U(-1/sqrt(fan_in), 1/sqrt(fan_in)), torch.nn.Linear's bias init."""
  bound = 1.0 / math.sqrt(fan_in)

  def init(key: jax.Array, shape: Sequence[int], dtype: Dtype = jnp.float32) -> jax.Array:
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


class ResNet(nnx.Module):
  """CIFAR ResNet: 3x3 stem, four stages, global average pool, linear classifier.

  Call with float NHWC images that are already normalised; returns float32 logits whatever
  the compute ``dtype``.
  """

  def __init__(
    self,
    spec: ResNetSpec,
    num_classes: int,
    *,
    in_channels: int = 3,
    rngs: nnx.Rngs,
    dtype: Dtype = jnp.float32,
    param_dtype: Dtype = jnp.float32,
  ):
    dtypes = dict(dtype=dtype, param_dtype=param_dtype)
    block_cls = BLOCKS[spec.block]
    width = spec.base_width
    self.conv1 = _conv(in_channels, width, 3, 1, rngs=rngs, **dtypes)
    self.bn1 = _bn(width, rngs=rngs, **dtypes)
    blocks = []
    cin = width
    for num_blocks, stride, mult in zip(
      spec.blocks, STAGE_STRIDES, STAGE_WIDTH_MULTIPLIERS, strict=True
    ):
      planes = width * mult
      for i in range(num_blocks):
        blocks.append(block_cls(cin, planes, stride if i == 0 else 1, rngs=rngs, **dtypes))
        cin = planes * block_cls.expansion
    self.blocks = nnx.List(blocks)
    self.fc = nnx.Linear(
      cin,
      num_classes,
      kernel_init=_DENSE_KERNEL_INIT,
      bias_init=_torch_dense_bias_init(cin),
      rngs=rngs,
      **dtypes,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.bn1(self.conv1(x)))
    for block in self.blocks:
      x = block(x)
    x = jnp.mean(x, axis=(1, 2))
    return self.fc(x).astype(jnp.float32)


def build_resnet(
  name: str,
  num_classes: int,
  *,
  rngs: nnx.Rngs,
  dtype: Dtype = jnp.float32,
  param_dtype: Dtype = jnp.float32,
  in_channels: int = 3,
) -> ResNet:
  """Builds a ResNet from ``ARCHS`` by name.

  Args:
    name: one of ``ARCHS`` ("resnet18", "resnet34", "resnet50", "resnet_tiny").
    num_classes: output logits.
    rngs: parameter initialisation randomness.
    dtype: compute dtype (e.g. ``jnp.bfloat16``); logits are always float32.
    param_dtype: storage dtype of the parameters.
    in_channels: image channels (3 for CIFAR, 1 for digits).
  """
  if name not in ARCHS:
    raise ValueError(f"Unknown ResNet name {name!r}; allowed names: {sorted(ARCHS)}.")
  return ResNet(
    ARCHS[name],
    num_classes,
    in_channels=in_channels,
    rngs=rngs,
    dtype=dtype,
    param_dtype=param_dtype,
  )


def count_params(model: nnx.Module) -> int:
  """Number of trainable parameters (``nnx.Param``; BN running statistics excluded).

  Works on abstract models from ``nnx.eval_shape`` too, so large nets can be counted
  without allocating them.
  """
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return int(sum(math.prod(leaf.shape) for leaf in leaves))
