"""The shared d-pass's backward with the batch split over devices, three ways.

    python -m bench.dpass_backward --devices 1 4                       # GPUs: ResNet-18
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m bench.dpass_backward --devices 4 --model resnet_tiny --per-device-batch 4

One forward pass, then the loss gradient ``g`` and the Fisher vector ``d``
(:func:`ginger.fisher.value_grad_and_fisher`) for a ResNet (random weights and CIFAR-shaped
random images, ``--per-device-batch`` each, BatchNorm statistics per device as train.py's
``batchnorm=per_device``), on a data mesh of the first N devices, computed as:

* ``sequential``: GSPMD, two backward passes (the training loop's ``fisher_backward=auto``
  wherever the batch is split and the model draws randomness);
* ``batched``: GSPMD, one backward over the pair of cotangents (``auto`` on one device; on
  several, a convolution's batching rule folds the pair into the batch axis outside the
  split and XLA all-gathers);
* ``local``: :func:`ginger.fisher.value_grad_and_fisher_per_device`, one backward over the
  pair inside ``jax.shard_map``: every device pulls both cotangents back through its own
  examples (the model with one BatchNorm group: the same statistics), then ``g`` and ``d``
  are summed over the devices (``fisher_backward=local`` in train.py, which ``auto`` takes
  wherever the batch is split and the model allows it).

Columns: median ms per call (jitted, host-timed with ``block_until_ready`` after a warm-up),
the collectives of the compiled program (:func:`bench.collectives.collectives`: count and MB),
and the largest difference of ``g``, ``d`` and the updated BatchNorm running statistics from
``sequential`` relative to their largest entry. The Fisher labels are the true ones
(``fisher="empirical"``) so that the three compute the same vectors; sampling them is the same
small work in each. The question this answers for data-parallel scaling: does the multi-GPU
step lose its time in the d-pass's backward?
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench.collectives import collectives
from ginger.fisher import value_grad_and_fisher, value_grad_and_fisher_per_device
from models.resnet import build_resnet

BACKWARDS = ("sequential", "batched", "local")
HEADER = (
  "| devices | backward | ms | collectives (count, MB) | g rel. diff | d rel. diff "
  "| BN stats rel. diff |"
)


def split_model(name: str, groups: int, num_classes: int = 10):
  """``(graphdef, params, rest)`` of a ResNet in training mode with ``groups`` BatchNorm
  groups; the variables do not depend on ``groups`` (models.resnet.GroupedBatchNorm)."""
  model = build_resnet(name, num_classes, rngs=nnx.Rngs(0), batchnorm_groups=groups)
  model.train()
  return nnx.split(model, nnx.Param, ...)


def forward(graphdef, params, images, rest):
  """``(logits, updated rest)`` of the model ``graphdef`` in training mode."""
  model = nnx.merge(graphdef, params, rest, copy=True)
  logits = model(images)
  return logits, nnx.split(model, nnx.Param, ...)[2]


def grads_and_fisher(graphdef, params, rest, images, labels, backward: str):
  """``(loss, rest, g, d)`` of one forward pass (``backward``: ginger.fisher's)."""
  (loss, new_rest), g, d = value_grad_and_fisher(
    lambda p: forward(graphdef, p, images, rest),
    params,
    labels,
    jax.random.key(0),
    has_aux=True,
    fisher="empirical",
    backward=backward,
  )
  return loss, new_rest, g, d


def step_fn(backward: str, mesh, graphdefs: dict):
  """The jitted ``(params, rest, images, labels) -> (loss, rest, g, d)`` of one way."""
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  if backward != "local":
    fn = functools.partial(grads_and_fisher, graphdefs["grouped"], backward=backward)
    return jax.jit(
      fn,
      in_shardings=(replicated, replicated, batch, batch),
      out_shardings=replicated,
    )

  def local(params, rest, images, labels):
    (loss, new_rest), g, d = value_grad_and_fisher_per_device(
      functools.partial(forward, graphdefs["one group"]),
      params,
      images,
      labels,
      jax.random.key(0),
      mesh=mesh,
      has_aux=True,
      fisher="empirical",
      constants=(rest,),
    )
    return loss, new_rest, g, d

  return jax.jit(local, in_shardings=(replicated, replicated, batch, batch))


def rel_diff(xs, ys) -> float:
  xs, ys = jax.tree.leaves(xs), jax.tree.leaves(ys)
  scale = max(float(jnp.max(jnp.abs(y))) for y in ys)
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(xs, ys, strict=True)) / scale


def inputs(mesh, params, rest, per_device_batch: int):
  """``(params, rest, images, labels)`` placed where the steps take them (the model
  replicated, the batch split over ``data``): an argument left on one device would be copied
  to the others inside every timed call, and the copies would be timed."""
  devices = mesh.shape["data"]
  kx, ky = jax.random.split(jax.random.key(1))
  images = jax.random.normal(kx, (devices * per_device_batch, 32, 32, 3))
  labels = jax.random.randint(ky, (devices * per_device_batch,), 0, 10)
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  return (*jax.device_put((params, rest), replicated), *jax.device_put((images, labels), batch))


def measure(model: str, devices: int, per_device_batch: int, steps: int) -> list[dict]:
  """One row per way of computing (g, d) on the first ``devices`` devices."""
  mesh = jax.make_mesh(
    (devices,), ("data",), devices=jax.devices()[:devices], axis_types=(jax.sharding.AxisType.Auto,)
  )
  graphdef, params, rest = split_model(model, devices)
  graphdefs = {"grouped": graphdef, "one group": split_model(model, 1)[0]}
  params, rest, images, labels = inputs(mesh, params, rest, per_device_batch)
  rows, reference = [], None
  for backward in BACKWARDS:
    compiled = step_fn(backward, mesh, graphdefs).lower(params, rest, images, labels).compile()
    out = jax.block_until_ready(compiled(params, rest, images, labels))  # warm-up
    times = []
    for _ in range(steps):
      began = time.perf_counter()
      jax.block_until_ready(compiled(params, rest, images, labels))
      times.append(time.perf_counter() - began)
    reference = out if reference is None else reference
    sent = collectives(compiled.as_text())
    rows.append(
      {
        "devices": devices,
        "backward": backward,
        "ms": 1e3 * statistics.median(times),
        "collectives": {k: (c, b / 1e6) for (k, _), (c, b) in sorted(sent.items())},
        "g": rel_diff(out[2], reference[2]),
        "d": rel_diff(out[3], reference[3]),
        "rest": rel_diff(out[1], reference[1]),
      }
    )
  return rows


def format_row(row: dict) -> str:
  sent = ", ".join(f"{k} {c} ({mb:.1f})" for k, (c, mb) in row["collectives"].items()) or "none"
  return (
    f"| {row['devices']} | {row['backward']} | {row['ms']:.2f} | {sent} | {row['g']:.1e} "
    f"| {row['d']:.1e} | {row['rest']:.1e} |"
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 4])
  parser.add_argument("--model", default="resnet18")
  parser.add_argument("--per-device-batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=30, help="timed calls per way")
  args = parser.parse_args(argv)
  available = len(jax.devices())
  if any(not 1 <= n <= available for n in args.devices):
    parser.error(f"--devices {args.devices}: each must be between 1 and {available} (available)")
  print(
    f"# {datetime.date.today()} {args.model}, batch {args.per_device_batch} per device, "
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
  )
  print(HEADER)
  print("|---" * (HEADER.count("|") - 1) + "|", flush=True)
  for n in args.devices:
    for row in measure(args.model, n, args.per_device_batch, args.steps):
      print(format_row(row), flush=True)


if __name__ == "__main__":
  main()
