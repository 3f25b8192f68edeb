"""ResNet v1 (CIFAR variant) in Flax NNX.

The architecture follows torchvision's ResNet (v1.5: the stride of a bottleneck block sits on its
3x3 conv) with the usual CIFAR stem: a 3x3 stride-1 conv and no max-pool, so 32x32 inputs reach
the last stage at 4x4. ResNet-18 with 100 classes has 11,220,132 parameters and ResNet-50 has
23,705,252, the figures quoted for CIFAR-100 in the Ginger paper (11M / 24M).

``ARCHS`` is the single architecture table: ``models.flops`` counts MACs by tracing the module
built from it, so the FLOP report can never drift from the model that is trained.

BatchNorm mode follows the NNX convention: ``model.train()`` uses batch statistics and updates
the running averages, ``model.eval()`` uses the running averages.

BatchNorm statistics (``batchnorm_groups``): with 1 (the default, ``batchnorm=sync`` in train.py's
config) every BatchNorm is flax's ``nnx.BatchNorm``, whose statistics are over the whole batch the
module sees; under SPMD data parallelism that is the global batch, and XLA inserts an all-reduce
per BatchNorm in the forward and one in the backward. With G > 1 (``batchnorm=per_device``, G the
size of the mesh's data axis) they are :class:`GroupedBatchNorm` s: statistics over each of the G
consecutive slices of the batch, i.e. over each device's share, with no collective.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# nnx.BatchNorm's private helpers (flax pinned in requirements.txt), so that GroupedBatchNorm
# computes exactly what nnx.BatchNorm does per group; tests/test_batchnorm_groups.py compares
# the two, so a flax upgrade that changes them fails there.
from flax.nnx.nn import normalization as _flax_norm

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


class GroupedBatchNorm(nnx.BatchNorm):
  """``nnx.BatchNorm`` whose training statistics are per group of the batch (axis 0).

  The batch of B examples is taken as ``groups`` = G consecutive slices of B / G examples
  (under data parallelism: the slices the G devices of the data axis hold). In training mode
  slice g is normalised with its own statistics, over its examples and the spatial axes (all
  axes but the batch and the feature axis):

    mu_g = E_g[x],   var_g = max(0, E_g[x^2] - mu_g^2),
    y = (x - mu_g) * rsqrt(var_g + epsilon) * scale + bias     for x in slice g,

  exactly what ``nnx.BatchNorm`` computes on slice g alone (flax's own ``_compute_stats`` and
  ``_normalize``: statistics in at least float32, the fast variance, the same dtype promotion).
  The reductions run over the axes within a group only, so with the batch split over the G
  devices neither the forward nor the backward needs a collective for them.

  The running statistics take the mean over the groups of the per-group statistics:
  ``mean <- momentum * mean + (1 - momentum) * mean_g(mu_g)`` and likewise ``var`` with
  ``mean_g(var_g)``, i.e. the mean of what G separate ``nnx.BatchNorm`` s would hold. (The mean
  of the mu_g is the batch mean; the mean of the var_g is the within-device variance, without
  the spread of the mu_g between devices. PyTorch DDP without SyncBN keeps rank 0's running
  statistics instead.) Evaluation mode (``use_running_average``) is ``nnx.BatchNorm``'s.

  Variables, their names and types are ``nnx.BatchNorm``'s (``scale``/``bias``: ``nnx.Param``;
  ``mean``/``var``: ``nnx.BatchStat``), so checkpoints and optimizer partitioning do not depend
  on G. ``train()``/``eval()`` act on it as on ``nnx.BatchNorm``.
  """

  def __init__(self, num_features: int, *, groups: int, rngs: nnx.Rngs, **kwargs):
    if not (isinstance(groups, int) and groups >= 1):
      raise ValueError(f"groups must be an integer >= 1, got {groups!r}.")
    if kwargs.get("axis_name") is not None:
      raise ValueError("GroupedBatchNorm takes no axis_name: its statistics are per group.")
    super().__init__(num_features, rngs=rngs, **kwargs)
    self.groups = groups

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_running_average = (
      self.use_running_average if use_running_average is None else use_running_average
    )
    if use_running_average is None or use_running_average or self.groups == 1:
      # nnx.BatchNorm's own path: running averages, one group, or its error when no mode is set.
      return super().__call__(x, use_running_average, mask=mask)
    g = self.groups
    if x.ndim < 2 or x.shape[0] % g:
      raise ValueError(
        f"GroupedBatchNorm with groups={g} needs a batch (axis 0) divisible by {g}, got input "
        f"shape {tuple(x.shape)}: with batchnorm=per_device the batch must split evenly over "
        "the devices of the mesh's data axis."
      )
    feature_axes = _flax_norm._canonicalize_axes(x.ndim, self.axis)
    if 0 in feature_axes:
      raise ValueError("GroupedBatchNorm groups the batch axis 0, which cannot be a feature axis.")
    # The grouped view (G, B / G, ...): the group axis in front, every other axis shifted by 1.
    xg = x.reshape(g, x.shape[0] // g, *x.shape[1:])
    feature_axes = tuple(a + 1 for a in feature_axes)
    reduction_axes = tuple(a for a in range(1, xg.ndim) if a not in feature_axes)
    if mask is not None:
      mask = jnp.broadcast_to(mask, x.shape).reshape(xg.shape)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    xg, mean, var, scale, bias = self.promote_dtype(
      (xg, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
    )
    # (G, features) each: the statistics of each group.
    mean, var = _flax_norm._compute_stats(
      xg,
      reduction_axes,
      dtype=self.dtype,
      use_fast_variance=self.use_fast_variance,
      mask=mask,
    )
    # As nnx.BatchNorm: stop_gradient only where the variables are array refs.
    if self.mean._can_update or self.var._can_update:
      stop_gradient = jax.lax.stop_gradient
    else:
      stop_gradient = lambda v: v
    m = self.momentum
    self.mean[...] = stop_gradient(m * self.mean[...] + (1 - m) * jnp.mean(mean, axis=0))
    self.var[...] = stop_gradient(m * self.var[...] + (1 - m) * jnp.mean(var, axis=0))
    # Statistics of shape (G, features) reshape to (G, 1, .., features) inside _normalize.
    y = _flax_norm._normalize(
      xg, mean, var, scale, bias, reduction_axes, feature_axes, self.dtype, self.epsilon
    )
    return y.reshape(x.shape)


def batchnorm(
  features: int,
  *,
  groups: int = 1,
  rngs: nnx.Rngs,
  dtype: Dtype,
  param_dtype: Dtype,
) -> nnx.BatchNorm:
  """BatchNorm with torch's defaults (torch momentum 0.1 == flax momentum 0.9): flax's
  ``nnx.BatchNorm`` itself for ``groups`` = 1, else :class:`GroupedBatchNorm`."""
  kwargs = dict(momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
  if groups == 1:
    return nnx.BatchNorm(features, **kwargs)
  return GroupedBatchNorm(features, groups=groups, **kwargs)


def per_shard_batchnorm(model: nnx.Module, axis_name: str) -> nnx.Module:
  """A copy of ``model`` for one device's shard of the batch inside ``jax.shard_map`` over
  ``axis_name``, with the BatchNorm statistics ``model`` has on the whole split batch: a
  :class:`GroupedBatchNorm` (statistics per device) becomes one group, the shard; an
  ``nnx.BatchNorm`` (statistics over the whole batch) reduces its statistics over
  ``axis_name`` (``lax.pmean``). The variables are the same, so the copy's graph runs on the
  model's state (``ginger.fisher.value_grad_and_fisher_per_device``, which averages the
  devices' running statistics: a group's, as :class:`GroupedBatchNorm` averages them, or the
  same on every device)."""
  copy = nnx.clone(model)
  for _, module in nnx.iter_modules(copy):
    if isinstance(module, GroupedBatchNorm):
      module.groups = 1
    elif isinstance(module, nnx.BatchNorm):
      module.axis_name = axis_name
  return copy


class Projection(nnx.Module):
  """Projection shortcut (1x1 conv + BN) used where a block changes shape."""

  def __init__(
    self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs, bn_groups: int = 1, **dtypes
  ):
    self.conv = _conv(cin, cout, 1, stride, rngs=rngs, **dtypes)
    self.bn = batchnorm(cout, groups=bn_groups, rngs=rngs, **dtypes)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.bn(self.conv(x))


def _shortcut(cin: int, cout: int, stride: int, *, rngs: nnx.Rngs, bn_groups: int, **dtypes):
  """Identity (None) when shapes match, else a projection."""
  if stride == 1 and cin == cout:
    return None
  return Projection(cin, cout, stride, rngs=rngs, bn_groups=bn_groups, **dtypes)


class BasicBlock(nnx.Module):
  """Two 3x3 convs; used by ResNet-18/34."""

  expansion = 1

  def __init__(
    self, cin: int, planes: int, stride: int, *, rngs: nnx.Rngs, bn_groups: int = 1, **dtypes
  ):
    self.conv1 = _conv(cin, planes, 3, stride, rngs=rngs, **dtypes)
    self.bn1 = batchnorm(planes, groups=bn_groups, rngs=rngs, **dtypes)
    self.conv2 = _conv(planes, planes, 3, 1, rngs=rngs, **dtypes)
    self.bn2 = batchnorm(planes, groups=bn_groups, rngs=rngs, **dtypes)
    self.shortcut = _shortcut(cin, planes, stride, rngs=rngs, bn_groups=bn_groups, **dtypes)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    residual = x if self.shortcut is None else self.shortcut(x)
    return nnx.relu(y + residual)


class Bottleneck(nnx.Module):
  """1x1 reduce, 3x3 (strided), 1x1 expand by 4; used by ResNet-50."""

  expansion = 4

  def __init__(
    self, cin: int, planes: int, stride: int, *, rngs: nnx.Rngs, bn_groups: int = 1, **dtypes
  ):
    cout = planes * self.expansion
    self.conv1 = _conv(cin, planes, 1, 1, rngs=rngs, **dtypes)
    self.bn1 = batchnorm(planes, groups=bn_groups, rngs=rngs, **dtypes)
    self.conv2 = _conv(planes, planes, 3, stride, rngs=rngs, **dtypes)
    self.bn2 = batchnorm(planes, groups=bn_groups, rngs=rngs, **dtypes)
    self.conv3 = _conv(planes, cout, 1, 1, rngs=rngs, **dtypes)
    self.bn3 = batchnorm(cout, groups=bn_groups, rngs=rngs, **dtypes)
    self.shortcut = _shortcut(cin, cout, stride, rngs=rngs, bn_groups=bn_groups, **dtypes)

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
  the compute ``dtype``. ``batchnorm_groups`` = G > 1 makes every BatchNorm a
  :class:`GroupedBatchNorm` of G groups (training batches must then be divisible by G).
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
    batchnorm_groups: int = 1,
  ):
    dtypes = dict(dtype=dtype, param_dtype=param_dtype)
    block_cls = BLOCKS[spec.block]
    width = spec.base_width
    bn_groups = batchnorm_groups
    self.conv1 = _conv(in_channels, width, 3, 1, rngs=rngs, **dtypes)
    self.bn1 = batchnorm(width, groups=bn_groups, rngs=rngs, **dtypes)
    blocks = []
    cin = width
    for num_blocks, stride, mult in zip(
      spec.blocks, STAGE_STRIDES, STAGE_WIDTH_MULTIPLIERS, strict=True
    ):
      planes = width * mult
      for i in range(num_blocks):
        stride_i = stride if i == 0 else 1
        blocks.append(block_cls(cin, planes, stride_i, rngs=rngs, bn_groups=bn_groups, **dtypes))
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
  batchnorm_groups: int = 1,
) -> ResNet:
  """Builds a ResNet from ``ARCHS`` by name.

  Args:
    name: one of ``ARCHS`` ("resnet18", "resnet34", "resnet50", "resnet_tiny").
    num_classes: output logits.
    rngs: parameter initialisation randomness.
    dtype: compute dtype (e.g. ``jnp.bfloat16``); logits are always float32.
    param_dtype: storage dtype of the parameters.
    in_channels: image channels (3 for CIFAR, 1 for digits).
    batchnorm_groups: 1 (default): every BatchNorm is ``nnx.BatchNorm``, statistics over the
      whole batch; G > 1: :class:`GroupedBatchNorm` s, statistics over each of G slices of the
      batch (train.py's ``batchnorm=per_device``: G = the devices of the mesh's data axis).
  """
  if name not in ARCHS:
    raise ValueError(f"Unknown ResNet name {name!r}; allowed names: {sorted(ARCHS)}.")
  if not (isinstance(batchnorm_groups, int) and batchnorm_groups >= 1):
    raise ValueError(f"batchnorm_groups must be an integer >= 1, got {batchnorm_groups!r}.")
  return ResNet(
    ARCHS[name],
    num_classes,
    in_channels=in_channels,
    rngs=rngs,
    dtype=dtype,
    param_dtype=param_dtype,
    batchnorm_groups=batchnorm_groups,
  )


def count_params(model: nnx.Module) -> int:
  """Number of trainable parameters (``nnx.Param``; BN running statistics excluded).

  Works on abstract models from ``nnx.eval_shape`` too, so large nets can be counted
  without allocating them.
  """
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return int(sum(math.prod(leaf.shape) for leaf in leaves))
