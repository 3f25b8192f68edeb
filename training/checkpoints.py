"""Orbax checkpoints of the whole training state, so a killed run continues bit-for-bit."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from training.errors import TrainingError


class CheckpointError(TrainingError):
  """A checkpoint that is missing or cannot be read."""


def _to_saveable(tree):
  """Typed PRNG keys are stored as their raw uint32 data (orbax saves plain arrays)."""
  return jax.tree.map(
    lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
    tree,
  )


def _from_saveable(saved, like):
  return jax.tree.map(
    lambda s, x: (
      jax.random.wrap_key_data(s, impl=jax.random.key_impl(x))
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else s
    ),
    saved,
    like,
  )


class Checkpointer:
  """Keeps the last ``keep`` checkpoints of a run dir's ``checkpoints/`` folder."""

  def __init__(self, run_dir: str | Path, keep: int = 2):
    self.directory = Path(run_dir).absolute() / "checkpoints"
    self.manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    """The steps that have a checkpoint, ascending."""
    return sorted(self.manager.all_steps())

  def check_step(self, step: int | None) -> int:
    """``step`` (default: the latest) if it has a checkpoint, else a :class:`CheckpointError`
    listing those that exist, before anything is built or read."""
    steps = self.steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}: was the run started?")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"no checkpoint {step} in {self.directory}; available: {steps}")
    return step

  def save(self, step: int, state) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(_to_saveable(state)), force=True)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def restore(self, like, step: int | None = None):
    """Restores the checkpoint at ``step`` (default: latest) into the structure of ``like``."""
    step = self.check_step(step)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_saveable(like))
    try:
      saved = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax raises many types for truncated/corrupt files
      raise CheckpointError(
        f"checkpoint {step} in {self.directory} cannot be read ({type(e).__name__}: {e}); "
        "it may be corrupt or from a different configuration"
      ) from e
    return _from_saveable(saved, like)
