"""The sampled-Fisher vector ``d_t`` from a model's logits, sharing one forward pass.

For a softmax model with ``N`` predictions (examples, or non-padding target tokens)::

    y_hat_i ~ softmax(logits_i)
    d = sum_i grad_theta log p(y_hat_i | x_i) / sqrt(N)

so that ``E[d d^T]`` is the per-prediction Fisher (= the GGN for softmax cross-entropy).
Both the loss gradient and ``d`` are vector-Jacobian products of the *same* logits, so
:func:`value_grad_and_fisher` runs the forward pass once (``jax.vjp``) and pulls back two
cotangents: the d-pass costs one extra backward pass, not a second forward. By default the two
pull-backs are one backward pass over a stacked pair of cotangents (``jax.vmap`` of the
pull-back: every layer's backward sees both at once, e.g. a convolution's twice the batch),
which is one program of the backward's size, not two, and runs the same arithmetic.
:func:`fisher_vector` is the d-pass alone, for a forward of its own (e.g. BatchNorm in
inference mode). :func:`value_grad_and_fisher_per_device` is the batched pull-back with the
batch split over devices, each device's own shard in one backward pass (``jax.shard_map``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _upcast(x: jax.Array) -> jax.Array:
  """bf16/fp16 logits are reduced in float32 (softmax of low-precision logits is lossy)."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _weights(
  labels: jax.Array, mask: jax.Array | None, count: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Per-prediction weights (1 where counted) and their total ``N`` (at least 1); ``count``:
  ``N`` given (a shard of a batch is normalised by the whole batch's count)."""
  if mask is not None and jnp.shape(mask) != labels.shape:
    # Broadcasting would weight the wrong axis: a (B,) mask for (B, T) labels masks time steps.
    raise ValueError(
      f"mask shape {jnp.shape(mask)} does not match labels shape {labels.shape} (one weight "
      "per prediction)."
    )
  dtype = jnp.promote_types(jnp.result_type(float), jnp.float32)
  weights = jnp.ones(labels.shape, dtype) if mask is None else mask.astype(dtype)
  return weights, jnp.maximum(jnp.sum(weights), 1.0) if count is None else count


def cross_entropy(
  logits: jax.Array,
  labels: jax.Array,
  mask: jax.Array | None = None,
  *,
  count: jax.Array | None = None,
) -> jax.Array:
  """Mean softmax cross-entropy over the counted predictions (padding masked out); with
  ``count``, the sum divided by it instead."""
  weights, count = _weights(labels, mask, count)
  logp = jax.nn.log_softmax(_upcast(logits))
  logp_y = jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  # 0 - x, not -x: a saturated prediction (log p = 0) is a loss of +0, not -0 (which XLA keeps
  # through the sum, and a summary then shows as a negative minimum training loss).
  return jnp.sum((0.0 - logp_y) * weights) / count


def loss_cotangent(
  logits: jax.Array,
  labels: jax.Array,
  mask: jax.Array | None = None,
  *,
  count: jax.Array | None = None,
) -> jax.Array:
  """``d loss / d logits`` of :func:`cross_entropy`: ``(softmax - onehot(y)) w / N``."""
  weights, count = _weights(labels, mask, count)
  probs = jax.nn.softmax(_upcast(logits))
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=probs.dtype)
  return ((probs - onehot) * (weights / count)[..., None]).astype(logits.dtype)


def fisher_cotangent(
  logits: jax.Array,
  rng: jax.Array,
  mask: jax.Array | None = None,
  *,
  labels: jax.Array | None = None,
  noise: jax.Array | None = None,
  count: jax.Array | None = None,
) -> jax.Array:
  """``d/d logits`` of ``sum_i log p(y_hat_i) / sqrt(N)`` with ``y_hat_i ~ softmax(logits_i)``.

  Pulling this cotangent back through the model gives the sampled-Fisher vector ``d_t``.
  Passing ``labels`` (the true labels) instead gives the *empirical* Fisher, a different
  method, offered only when asked for by name. ``noise``: Gumbel noise like ``logits`` to
  sample with (``argmax(logits + noise)``, the draw ``jax.random.categorical`` makes from
  ``rng``), e.g. a shard of the noise drawn for a whole batch; ``count``: ``N`` given.
  """
  weights, count = _weights(logits[..., 0], mask, count)
  logits_up = _upcast(logits)
  if labels is None and noise is not None:
    labels = jnp.argmax(logits_up + noise, axis=-1)
  elif labels is None:
    labels = jax.random.categorical(rng, logits_up, axis=-1)
  probs = jax.nn.softmax(logits_up)
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=probs.dtype)
  scale = weights / jnp.sqrt(count)
  return ((onehot - probs) * scale[..., None]).astype(logits.dtype)


BACKWARDS = ("batched", "sequential")


def _fisher_labels(labels, fisher: str):
  """The labels ``fisher_cotangent`` is given: None (sample them) or the true ones."""
  if fisher not in ("sampled", "empirical"):
    raise ValueError(f"fisher must be 'sampled' or 'empirical', got {fisher!r}.")
  return labels if fisher == "empirical" else None


def _check_logits(logits, labels):
  if logits.shape[:-1] != labels.shape:
    raise ValueError(
      f"logits shape {logits.shape} does not match labels shape "
      f"{labels.shape} (expected labels.shape + (num_classes,))."
    )


def fisher_vector(
  logits_fn: Callable[[Any], jax.Array],
  params: Any,
  labels: jax.Array,
  rng: jax.Array,
  *,
  mask: jax.Array | None = None,
  fisher: str = "sampled",
) -> Any:
  """The sampled-Fisher vector ``d_t`` alone: one forward of ``logits_fn`` and one backward.

  For a d-pass with a forward of its own (e.g. BatchNorm in inference mode, as the authors
  compute it); the arguments are those of :func:`value_grad_and_fisher` (``labels`` only
  give the shape and, with ``fisher="empirical"``, the labels).
  """
  given = _fisher_labels(labels, fisher)
  logits, vjp_fn = jax.vjp(logits_fn, params)
  _check_logits(logits, labels)
  (d,) = vjp_fn(fisher_cotangent(logits, rng, mask, labels=given))
  return d


def value_grad_and_fisher(
  logits_fn: Callable[[Any], Any],
  params: Any,
  labels: jax.Array,
  rng: jax.Array,
  *,
  mask: jax.Array | None = None,
  has_aux: bool = False,
  fisher: str = "sampled",
  backward: str = "batched",
) -> tuple[tuple[jax.Array, Any], Any, Any]:
  r"""Loss, loss gradient and sampled-Fisher vector from one forward pass.

  For ``N`` counted predictions (examples, or non-padding target tokens) of a softmax model::

    loss = -sum_i log p(y_i | x_i) / N
    d = sum_i grad log p(y_hat_i | x_i) / sqrt(N),   y_hat_i ~ softmax(logits_i)

  so that ``E[d d^T]`` is the Fisher, the generalized Gauss-Newton matrix of softmax
  cross-entropy: the ``d_t`` that :func:`ginger.scale_by_ginger` folds into its curvature.
  Both are vector-Jacobian products of the same logits, so the forward runs once
  (``jax.vjp``) and the d-pass costs one extra backward pass. ``backward="batched"`` pulls
  the pair of cotangents back in one pass (``jax.vmap``: one program, each layer's backward on
  both); ``"sequential"`` in two, holding one cotangent's intermediates at a time (less peak
  memory), and gathers nothing under GSPMD with the batch split over devices, where a
  convolution's batching rule folds the pair into the batch axis, outside the split. The two
  agree to float summation order. For ``d`` alone use :func:`fisher_vector`.

  Args:
    logits_fn: ``params -> logits`` of shape ``labels.shape + (num_classes,)``.
    params: the parameters to differentiate.
    labels: integer targets (``(B,)`` for classification, ``(B, T)`` for sequences).
    rng: PRNG key the Fisher labels ``y_hat`` are drawn with.
    mask: optional 0/1 weights like ``labels`` (padding: 0); ``N = sum(mask)``.
    has_aux: whether ``logits_fn`` returns ``(logits, aux)`` (e.g. BatchNorm statistics).
    fisher: ``"sampled"`` (``y_hat`` drawn from the model) or ``"empirical"`` (the labels).
    backward: ``"batched"`` (one backward pass) or ``"sequential"`` (two).

  Returns:
    ``((loss, aux), grads, fisher_grads)``; ``aux`` is None without ``has_aux``.

  Examples:
    Zero weights predict uniformly: the loss is ``log 2``.

    >>> import jax, jax.numpy as jnp
    >>> from ginger.fisher import value_grad_and_fisher
    >>> x, y = jnp.ones((4, 3)), jnp.array([0, 1, 0, 1])
    >>> params = {"w": jnp.zeros((3, 2))}
    >>> (loss, _), grads, d = value_grad_and_fisher(
    ...   lambda p: x @ p["w"], params, y, jax.random.key(0))
    >>> print(f"{float(loss):.4f}", d["w"].shape == grads["w"].shape == (3, 2))
    0.6931 True

  References:
    Yongchang Hao, Yanshuai Cao and Lili Mou, `Ginger: An Efficient Curvature Approximation
    with Linear Complexity for General Neural Networks <https://arxiv.org/abs/2402.03295>`_,
    2024
  """
  given = _fisher_labels(labels, fisher)
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}.")
  return _pull_back_pair(logits_fn, params, labels, mask, has_aux, backward, rng=rng, given=given)


def _pull_back_pair(
  logits_fn,
  params,
  labels,
  mask,
  has_aux,
  backward,
  *,
  rng=None,
  given=None,
  noise=None,
  count=None,
):
  """One forward of ``logits_fn``, then the loss and both cotangents (loss, Fisher) pulled
  back: ``((loss, aux), grads, fisher_grads)``. The Fisher labels: ``given``, else drawn with
  ``noise``, else from ``rng`` (:func:`fisher_cotangent`); ``count``: ``N`` given."""
  if has_aux:
    logits, vjp_fn, aux = jax.vjp(logits_fn, params, has_aux=True)
  else:
    (logits, vjp_fn), aux = jax.vjp(logits_fn, params), None
  _check_logits(logits, labels)
  loss = cross_entropy(logits, labels, mask, count=count)
  cts = (
    loss_cotangent(logits, labels, mask, count=count),
    fisher_cotangent(logits, rng, mask, labels=given, noise=noise, count=count),
  )
  if backward == "sequential":
    (grads,), (fisher_grads,) = vjp_fn(cts[0]), vjp_fn(cts[1])
  else:
    (both,) = jax.vmap(vjp_fn)(jnp.stack(cts))
    grads, fisher_grads = jax.tree.map(lambda x: x[0], both), jax.tree.map(lambda x: x[1], both)
  return (loss, aux), grads, fisher_grads


def value_grad_and_fisher_per_device(
  logits_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  labels: jax.Array,
  rng: jax.Array,
  *,
  mesh: jax.sharding.Mesh,
  axis: str = "data",
  mask: jax.Array | None = None,
  has_aux: bool = False,
  fisher: str = "sampled",
  constants: tuple = (),
) -> tuple[tuple[jax.Array, Any], Any, Any]:
  """:func:`value_grad_and_fisher` with the batch split over ``mesh``'s ``axis``: every device
  pulls both cotangents back through its own examples in one backward pass (``jax.shard_map``),
  then the gradients, Fisher vectors and losses are summed over the devices and ``aux`` is
  averaged (e.g. BatchNorm's running statistics, one update per device).

  Why: under GSPMD the batched pull-back's convolutions fold the pair of cotangents into the
  batch axis outside the device split, and XLA all-gathers the activations' gradients
  (``backward="batched"``); two pull-backs gather nothing but run the backward twice. Here the
  pair is folded into each device's own shard.

  The values are :func:`value_grad_and_fisher`'s up to float summation order, provided
  ``logits_fn`` computes each example's logits from the examples of its own shard alone (a
  model whose BatchNorm statistics are per device, or reduced over ``axis`` inside it) and
  draws no randomness of its own (dropout would draw the same on every device). The Fisher
  labels are drawn for the whole batch before the split (Gumbel noise of the whole logits'
  shape, as ``jax.random.categorical`` draws them from ``rng``) and the loss and ``d`` are
  normalised by the whole batch's count ``N``.

  Args:
    logits_fn: ``(params, batch, *constants) -> logits`` (``(logits, aux)`` with
      ``has_aux``) for one device's shard of ``batch``.
    batch: arrays with the batch as axis 0 (split over ``axis``), as ``labels`` and ``mask``.
    constants: inputs of ``logits_fn`` that are not differentiated (frozen parameters,
      BatchNorm statistics), the same on every device.
    The others: as :func:`value_grad_and_fisher`.

  Returns:
    ``((loss, aux), grads, fisher_grads)``, replicated.
  """
  given = _fisher_labels(labels, fisher)
  _, count = _weights(labels, mask)
  sharded = {"batch": batch, "labels": labels}
  if mask is not None:
    sharded["mask"] = mask
  if given is None:
    sharded["noise"] = _gumbel_noise(logits_fn, params, batch, constants, rng, mesh, axis, has_aux)
  per_device = functools.partial(
    _pull_back_on_device, logits_fn, has_aux, empirical=given is not None, axis=axis
  )
  whole = P()
  return jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(whole, whole, whole, P(axis)),
    out_specs=whole,
    check_vma=False,
  )(params, tuple(constants), count, sharded)


def _gumbel_noise(logits_fn, params, batch, constants, rng, mesh, axis, has_aux) -> jax.Array:
  """Gumbel noise of the whole batch's logits' shape, drawn from ``rng`` as
  ``jax.random.categorical`` draws it, to sample the Fisher labels with before the batch is
  split. The shape is traced per device (the model may reduce over ``axis``)."""
  shard_logits = lambda p, b, c: logits_fn(p, b, *c)[0] if has_aux else logits_fn(p, b, *c)
  whole = P()
  logits = jax.eval_shape(
    jax.shard_map(
      shard_logits,
      mesh=mesh,
      in_specs=(whole, P(axis), whole),
      out_specs=P(axis),
      check_vma=False,
    ),
    params,
    batch,
    tuple(constants),
  )
  dtype = jnp.promote_types(logits.dtype, jnp.float32)
  return jax.random.gumbel(rng, logits.shape, dtype)


def _pull_back_on_device(logits_fn, has_aux, params, constants, count, sharded, *, empirical, axis):
  """Inside ``shard_map``: one device's loss, gradient and ``d`` from its shard ``sharded``
  (:func:`_pull_back_pair`, batched, normalised by the whole batch's ``count``), summed over
  ``axis``; ``aux`` averaged over it."""
  labels = sharded["labels"]
  (loss, aux), grads, fisher_grads = _pull_back_pair(
    lambda p: logits_fn(p, sharded["batch"], *constants),
    params,
    labels,
    sharded.get("mask"),
    has_aux,
    "batched",
    given=labels if empirical else None,
    noise=sharded.get("noise"),
    count=count,
  )
  loss, grads, fisher_grads = jax.lax.psum((loss, grads, fisher_grads), axis)
  return (loss, jax.lax.pmean(aux, axis)), grads, fisher_grads
