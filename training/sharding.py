"""Data parallelism for train.py: the device mesh, multi-host start-up and array placement.

One jitted step runs on all devices (GSPMD, no pmap): the batch's index vector, hence the
gathered batch, is split along the mesh's ``data`` axis; parameters, model state and the
dataset are replicated; the optimizer state's big arrays (Ginger's ``U``, QNG's factors,
momenta) are split over all mesh axes (``data`` x ``model``), the small ones replicated
(:mod:`ginger.sharding`); in a Ginger state only ``U`` is split, and Ginger's step is told
where (``Plan.optimizer_sharding``) so that each device slices its rows of ``g`` and ``d``.
XLA inserts the gradient all-reduce, the all-reduces of the ``tau``-vectors of the passes
over ``U`` and the all-gather of the update.

Multi-host: every process loads the whole dataset and computes the same global permutation;
each builds only its own devices' shards of a global array (``jax.make_array_from_callback``),
so a host feeds exactly its slice of the global batch and no host-to-host data moves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ginger import sharding as state_sharding

log = logging.getLogger("train")


def launch_arguments(env=os.environ) -> dict[str, Any] | None:
  """``jax.distributed.initialize`` keyword arguments from the launcher's environment, or
  None for a single-process run.

  - ``JAX_COORDINATOR_ADDRESS`` or ``COORDINATOR_ADDRESS`` (``host:port``), with
    ``[JAX_]NUM_PROCESSES`` and ``[JAX_]PROCESS_ID``: any launcher.
  - torchrun style: ``MASTER_ADDR``, ``WORLD_SIZE``, ``RANK`` (and with
    ``LOCAL_WORLD_SIZE > 1`` processes per host, ``LOCAL_RANK`` picks the process's GPU); the
    coordinator listens on ``MASTER_PORT + 1`` (torchrun's agent holds ``MASTER_PORT``) or
    on ``JAX_COORDINATOR_PORT``.
  - SLURM job steps (``srun``) of more than one task: JAX detects everything itself
    (``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``).
  """

  def get(*names):
    return next((env[n] for n in names if env.get(n)), None)

  address = get("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
  if address:
    kwargs: dict[str, Any] = {"coordinator_address": address}
    if (n := get("JAX_NUM_PROCESSES", "NUM_PROCESSES")) is not None:
      kwargs["num_processes"] = int(n)
    if (i := get("JAX_PROCESS_ID", "PROCESS_ID")) is not None:
      kwargs["process_id"] = int(i)
    return kwargs
  if get("MASTER_ADDR") and int(get("WORLD_SIZE") or 1) > 1:
    # torchrun's own agent store listens on MASTER_PORT, so JAX's coordinator takes the next.
    port = get("JAX_COORDINATOR_PORT") or int(get("MASTER_PORT") or 29500) + 1
    kwargs = {
      "coordinator_address": f"{env['MASTER_ADDR']}:{port}",
      "num_processes": int(env["WORLD_SIZE"]),
      "process_id": int(env.get("RANK", 0)),
    }
    if int(get("LOCAL_WORLD_SIZE") or 1) > 1:
      kwargs["local_device_ids"] = [int(env.get("LOCAL_RANK", 0))]
    return kwargs
  if int(get("SLURM_STEP_NUM_TASKS") or 1) > 1:  # set by srun, not in the batch script
    return {}
  return None


def initialize_distributed(mode: str | bool = "auto") -> None:
  """Calls ``jax.distributed.initialize`` (once, before any JAX computation) when ``mode`` is
  true, or ``"auto"`` and the environment describes a multi-process launch."""
  if mode is False or mode == "false" or jax.distributed.is_initialized():
    return
  kwargs = launch_arguments()
  if kwargs is None and mode == "auto":
    return
  kwargs = kwargs or {}
  if "num_processes" in kwargs and "process_id" in kwargs:
    # Fully given: JAX must not fill local_device_ids from a SLURM job around the launcher
    # (one GPU per process); unset, each process drives all GPUs it sees.
    kwargs["cluster_detection_method"] = "deactivate"
  jax.distributed.initialize(**kwargs)
  log.info(
    "process %d of %d, %d local of %d devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )


def make_mesh(data: int = -1, model: int = 1) -> Mesh:
  """A ``(data, model)`` mesh; ``data=-1`` takes all devices ``model`` leaves. A single process
  may use fewer devices than it has (the first ``data * model``), e.g. to measure scaling."""
  model = int(model)
  count = jax.device_count()
  if model < 1 or count % model:
    raise ValueError(f"mesh.model must be >= 1 and divide the device count {count}, got {model}.")
  data = count // model if int(data) == -1 else int(data)
  if data < 1 or data * model > count:
    raise ValueError(
      f"mesh.data x mesh.model = {data} x {model} needs more than the "
      f"{count} devices there are (mesh.data=-1 takes all)."
    )
  if data * model < count and jax.process_count() > 1:
    raise ValueError(f"a multi-host mesh must use all {count} devices, got {data} x {model}.")
  return jax.make_mesh(
    (data, model),
    ("data", "model"),
    axis_types=(AxisType.Auto,) * 2,
    devices=jax.devices()[: data * model],
  )


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where every array of a run lives on ``mesh``."""

  mesh: Mesh
  shard_optimizer_state: bool = True
  min_shard_size: int = state_sharding.MIN_SIZE

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  @property
  def batch(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec("data"))

  @property
  def data_size(self) -> int:
    return self.mesh.shape["data"]

  @property
  def optimizer_sharding(self) -> state_sharding.StateSharding | None:
    """Where the optimizer state's big arrays are split (over all mesh axes), for the
    optimizer to pin its step's temporaries to (``ginger.ginger(sharding=...)``); None when
    the state is replicated or the mesh has one device (nothing to pin)."""
    if not self.shard_optimizer_state or self.mesh.size == 1:
      return None
    return self._optimizer_split

  @property
  def _optimizer_split(self) -> state_sharding.StateSharding:
    return state_sharding.StateSharding(self.mesh, ("data", "model"), self.min_shard_size)

  def optimizer_state(self, opt_state):
    """Shardings of an optimizer state split as :meth:`state` splits it."""
    return self._optimizer_split.shardings(opt_state)

  def state(self, state):
    """Shardings of a ``TrainState``: everything replicated except the optimizer state (its
    big arrays split, see ``ginger.sharding.StateSharding.shardings``)."""
    shardings = jax.tree.map(lambda _: self.replicated, state)
    if self.shard_optimizer_state:
      shardings = shardings._replace(opt_state=self._optimizer_split.shardings(state.opt_state))
    return shardings

  def indices(self, idx) -> jax.Array:
    """A global index vector, split along ``data`` (replicated when it does not divide)."""
    idx = np.asarray(idx)
    return put(idx, self.batch if len(idx) % self.data_size == 0 else self.replicated)

  def describe(self) -> dict[str, Any]:
    return {
      "shape": dict(self.mesh.shape),
      "devices": int(self.mesh.size),
      "processes": jax.process_count(),
      "shard_optimizer_state": self.shard_optimizer_state,
    }


def plan_from_config(mesh) -> Plan:
  """The plan of a run's ``mesh`` (``training.run_config.MeshConfig``)."""
  return Plan(
    make_mesh(mesh.data, mesh.model),
    mesh.shard_optimizer_state,
    state_sharding.MIN_SIZE if mesh.min_shard_size is None else mesh.min_shard_size,
  )


def put(tree, shardings):
  """``jax.device_put`` that also works across hosts: there every process passes the same
  host value (or a process-local array) and builds only its addressable shards."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)
  return jax.tree.map(_put_global, tree, shardings)


def _put_global(x, sharding):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _put_global(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def bytes_per_device(tree) -> int:
  """The most bytes any one device holds of ``tree``'s arrays (a replicated array counts in
  full on every device, a sharded one by its shard)."""
  held: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    for shard in getattr(x, "addressable_shards", ()):
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values(), default=0)


def sync(name: str) -> None:
  """Waits until every process got here (a no-op in a single process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
