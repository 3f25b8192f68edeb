"""LoRA over any parameter pytree (Hu et al., 2021), kept apart from the model code.

The trainable state is a separate, small pytree ``lora_params`` keyed by the "/"-joined path of
each adapted leaf; the training loop differentiates with respect to it only, so the optimizer (and
Ginger's curvature state, whose dimension is the LoRA parameter count) never sees the frozen base.
Each forward merges ``W + (alpha / rank) * A @ B`` for every adapted 2-D kernel ``W`` of shape
[in, out]: A is [in, rank] ~ N(0, 0.01^2), B is [rank, out] = 0, so step 0 is exactly the base
model and only B moves on the first step (dL/dA = dL/dW B^T = 0).

Paths are built from the pytree keys (dict keys, sequence indices, attribute names), dropping the
trailing ``value`` of an ``nnx.Variable``: ``nnx.state(t5, nnx.Param)`` gives paths such as
``encoder/blocks/0/self_attention/q/kernel``. ``targets`` is a regex searched in those paths.

Typical use with an NNX model::

    graphdef, base, rest = nnx.split(model, nnx.Param, ...)
    lora = lora_init(base, key, rank=8)
    def loss_fn(lora, batch):
        params = lora_merge(base, lora, rank=8, alpha=16.0)
        return loss(nnx.merge(graphdef, params, rest), batch)
    grads = jax.grad(loss_fn)(lora, batch)   # only LoRA leaves
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
LoRAParams = dict[str, dict[str, jax.Array]]

# models/t5.py names: every attention projection of encoder self, decoder self and cross attention.
DEFAULT_TARGETS = r"(self_attention|cross_attention)/(q|k|v|o)/kernel$"
INIT_STD = 0.01


def _key_name(k: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(path: tuple) -> str:
  """'/'-joined pytree path, without the ``value`` attribute that wraps nnx.Variable leaves."""
  names = [_key_name(k) for k in path]
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
    names = names[:-1]
  return "/".join(names)


def named_leaves(params: PyTree) -> list[tuple[str, Any]]:
  """(path string, leaf) for every leaf of ``params``, in pytree order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return [(path_str(p), leaf) for p, leaf in flat]


def _check_rank(rank: Any) -> int:
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
  return rank


def _check_alpha(alpha: Any) -> float:
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
    raise ValueError(f"LoRA alpha must be a positive number, got {alpha!r}")
  return float(alpha)


def _matrix_key(key: jax.Array, path: str) -> jax.Array:
  """A distinct, reproducible key per adapted matrix: fold the path's CRC32 into ``key``."""
  return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def lora_init(
  params: PyTree,
  key: jax.Array,
  *,
  rank: int,
  targets: str = DEFAULT_TARGETS,
  train_1d: bool = False,
  init_std: float = INIT_STD,
) -> LoRAParams:
  """Adapters ``{path: {"a", "b"}}`` for every 2-D leaf whose path matches ``targets``.

  With ``train_1d`` every 1-D leaf (layer-norm scales, biases) is also trained directly: its entry
  ``{"w": copy}`` replaces the base value in ``lora_merge``. Raises ``ValueError`` for a bad rank
  (non-positive or above a matched matrix's smaller side) or a regex that matches no 2-D leaf.
  """
  rank = _check_rank(rank)
  pattern = re.compile(targets)
  out: LoRAParams = {}
  for path, leaf in named_leaves(params):
    shape = tuple(leaf.shape)
    if len(shape) == 2 and pattern.search(path):
      if rank > min(shape):
        raise ValueError(f"LoRA rank {rank} exceeds min{shape} of {path}")
      a = init_std * jax.random.normal(_matrix_key(key, path), (shape[0], rank), leaf.dtype)
      out[path] = {"a": a, "b": jnp.zeros((rank, shape[1]), leaf.dtype)}
    elif len(shape) == 1 and train_1d:
      out[path] = {"w": jnp.array(leaf, copy=True)}
  if not any("a" in v for v in out.values()):
    raise ValueError(f"LoRA targets {targets!r} match no 2-D parameter")
  return out


def lora_merge(base_params: PyTree, lora_params: LoRAParams, *, rank: int, alpha: float) -> PyTree:
  """Base params with adapters applied; same structure as ``base_params``. Pure and jittable.

  The base goes through ``stop_gradient`` so it stays frozen even if a caller differentiates
  through it; gradients reach ``lora_params`` only.
  """
  rank, scale = _check_rank(rank), _check_alpha(alpha) / rank
  seen: set[str] = set()

  def merge(path: tuple, w: jax.Array) -> jax.Array:
    name = path_str(path)
    w = jax.lax.stop_gradient(w)
    entry = lora_params.get(name)
    if entry is None:
      return w
    seen.add(name)
    if "w" in entry:
      return entry["w"]
    a, b = entry["a"], entry["b"]
    if a.shape[1] != rank:
      raise ValueError(f"{name}: adapter rank {a.shape[1]} != rank={rank}")
    return w + (scale * (a @ b)).astype(w.dtype)

  merged = jax.tree_util.tree_map_with_path(merge, base_params)
  unknown = set(lora_params) - seen
  if unknown:
    raise ValueError(f"LoRA entries for unknown parameters: {sorted(unknown)}")
  return merged


def lora_param_count(lora_params: LoRAParams) -> int:
  """Trainable scalars in the adapters (works on ``jax.eval_shape`` output too)."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(lora_params)))
