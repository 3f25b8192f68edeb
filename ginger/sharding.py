"""Shardings for optimizer state: split the big arrays (Ginger's ``U``, QNG's factors) across a
device mesh, replicate the small ones (``sigma``, counts, Brand's ``(k+1) x (k+1)`` cores).

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    state = jax.device_put(state, ginger.sharding.state_shardings(state, mesh, "data"))
    tx = ginger.ginger(..., sharding=ginger.sharding.StateSharding(mesh, "data"))

An array of at least ``min_size`` (:data:`MIN_SIZE`) elements is split along its largest axis
that the mesh axis divides, never a basis's rank; :class:`StateSharding` also tells Ginger's
step where the state lives, so that its temporaries follow the rows of ``U`` (docs/multi-gpu.md).
"""

from ginger._src.sharding import (
  MIN_SIZE,
  StateSharding,
  partition_spec,
  state_partition_specs,
  state_shardings,
)

__all__ = [
  "MIN_SIZE",
  "StateSharding",
  "partition_spec",
  "state_partition_specs",
  "state_shardings",
]
