"""Lowering for a GPU on a machine without one: Pallas builds a kernel's Triton module for the
GPU that JAX's device says, so without a card it needs an abstract one named (jax >= 0.11)."""

from __future__ import annotations

import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def abstract_h200() -> jax.sharding.use_abstract_mesh:
  """A context in which ``.lower(lowering_platforms=("cuda",))`` targets an H200."""
  mesh = jax.sharding.AbstractMesh(
    (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=H200
  )
  return jax.sharding.use_abstract_mesh(mesh)
