"""Orbax checkpoints of the whole training state, so a killed run continues bit-for-bit.

**Layout.** Ginger keeps its bases ``U`` stacked in buckets, planned for speed from a tuning
(``Tuning.bucket_overhead`` in ``ginger/_src/tuning.py``). A checkpoint holds the state as
:func:`ginger.checkpoint_state` gives it instead: each basis as a pytree like the params of
``(leaf.size, rank)`` arrays, which depends only on the model, ``tau`` and ``block``. So a
checkpoint restores, exactly, whatever the bucket plan of the code that reads it, and
:func:`ginger.restore_checkpoint_state` stacks it into the plan of the running code. Every
other state (Adam, Momentum, QNG, params, model state) is saved as it is.

Ginger's momentum (``mu``, kept stacked as ``U`` is) is saved per leaf the same way, as
``(leaf.size,)`` vectors. A checkpoint that does not fit the running state (another
configuration, or a layout this version does not write) is refused with a
:class:`CheckpointError` that quotes orbax's reason.

**A failed save** (a full disk) is raised once, naming the checkpoint whose write failed, also
where it surfaces later (in the next save, or in :meth:`Checkpointer.wait`); a disk full is a
:class:`~training.errors.DiskFullError` of one line that names the last good checkpoint. The
failed checkpoint's partial files are removed, and nothing more is saved. orbax's own reports
of it (a traceback from each of its threads the error passes through) are left out of the log.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import ginger
from training import sharding
from training.errors import TrainingError, disk_full, no_space

log = logging.getLogger("train")


class CheckpointError(TrainingError):
  """A checkpoint that is missing or cannot be read."""


def _has_skipped(x) -> bool:
  """Whether ``x`` is a Ginger or QNG state, whose ``skipped`` counter 0.1.0 did not save."""
  return isinstance(x, (ginger.ScaleByGingerState, ginger.ScaleByQNGState))


def _skipped_from_zero(saved, abstract, step: int):
  """``saved`` with the ``skipped`` counter of its Ginger and QNG states at 0 where the
  checkpoint has none (version 0.1.0 wrote none; orbax reads the missing entry as None)."""

  def fill(like, x):
    if not _has_skipped(like) or like.skipped is None or x.skipped is not None:
      return x
    log.warning("checkpoint %d predates the skipped-update counter: counting from 0", step)
    return x._replace(skipped=np.zeros(like.skipped.shape, like.skipped.dtype))

  return jax.tree.map(fill, abstract, saved, is_leaf=_has_skipped)


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


def _placed_like(tree, like):
  """``tree`` on the shardings of ``like`` (arrays, or the shapes and shardings that
  :func:`_bases_abstract` leaves): the restacked bases come out of eager ops, and the compiled
  training step takes its state only as it was placed."""

  def place(x, t):
    return sharding.put(x, t.sharding) if isinstance(t, jax.Array | jax.ShapeDtypeStruct) else x

  return jax.tree.map(place, tree, like)


def _bases_on_host(tree):
  """``tree`` with the buckets of Ginger's stacked state (bases, momentum, per-tensor
  ``sigma``) as host (numpy) copies, which :func:`ginger.checkpoint_state` then cuts per leaf
  as views, without a device copy (and without one small transfer per leaf).

  Bases spread over several processes cannot be read whole by one: they stay on the
  devices, and the per-leaf view is then a device copy of this process's part of ``U``.
  """

  def to_host(x):
    if not _is_stacked(x) or not all(s.is_fully_addressable for s in x.stacks):
      return x
    return type(x)([_host_copy(s) for s in x.stacks], x.layout)

  return jax.tree.map(to_host, tree, is_leaf=_is_stacked)


def _is_stacked(x) -> bool:
  """Ginger's state stacked by bucket (bases, momentum, per-tensor ``sigma``), which
  :func:`ginger.checkpoint_state` saves per leaf."""
  return isinstance(x, ginger.StackedBasis | ginger.StackedSigma)


def _host_copy(x: jax.Array) -> np.ndarray:
  """``x`` in host memory of its own. From an accelerator ``np.asarray`` is that copy; on a
  CPU it is a view of the device buffer, which would keep the buffer from being donated to
  the next step (a copy of ``U`` there, while orbax holds the view), so it is copied."""
  host = np.asarray(x)
  return host.copy() if any(d.platform == "cpu" for d in x.devices()) else host


def _start_host_copies(tree) -> None:
  """Starts the transfer to host memory of every accelerator array of ``tree`` (none is
  waited for), so that the copies :func:`_on_host` and :func:`_bases_on_host` then make run at
  once. (A CPU array is in host memory already: there :func:`_host_copy` is a memcpy.)"""
  for x in jax.tree.leaves(tree):
    if (
      isinstance(x, jax.Array)
      and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
      and all(d.platform != "cpu" for d in x.devices())
    ):
      x.copy_to_host_async()


def _on_host(x):
  """A ``jax.Array`` as a host (numpy) copy of its own; anything else as it is."""
  return _host_copy(x) if isinstance(x, jax.Array) else x


class _Background:
  """``fn()`` in a thread of its own; :meth:`join_all` waits for every one started and raises
  the first error one of them raised."""

  _started: list[_Background] = []
  _lock = threading.Lock()

  def __init__(self, name: str, fn):
    self.name, self.error = name, None

    def run():
      try:
        fn()
      except BaseException as e:  # noqa: BLE001 - handed to the thread that joins
        self.error = e

    self.thread = threading.Thread(target=run, name=f"save {name}", daemon=False)
    with self._lock:
      self._started.append(self)
    self.thread.start()

  @classmethod
  def busy(cls) -> bool:
    """Whether a thread started is still running."""
    with cls._lock:
      return any(background.thread.is_alive() for background in cls._started)

  @classmethod
  def join_all(cls) -> None:
    with cls._lock:
      started, cls._started[:] = list(cls._started), []
    for background in started:
      background.thread.join()
    for background in started:
      if isinstance(background.error, TrainingError):  # worded by Checkpointer
        raise background.error
      if background.error is not None:
        raise CheckpointError(
          f"saving {background.name} failed: {background.error!r}"
        ) from background.error


def _per_leaf_view(tree):
  """:func:`ginger.checkpoint_state` of a state on the devices, each stacked object's
  per-leaf view cut in one program (op by op, every leaf's slice would compile and dispatch a
  program of its own: seconds at every resume)."""
  view = lambda x: jax.jit(ginger.checkpoint_state)(x) if _is_stacked(x) else x  # noqa: E731
  return jax.tree.map(view, tree, is_leaf=_is_stacked)


def _bases_abstract(tree):
  """``tree`` with the arrays of Ginger's bases replaced by their shapes, dtypes and shardings
  (all that restoring into them reads); the rest, small, as it is."""

  def abstract(x):
    if not isinstance(x, ginger.StackedBasis):
      return x
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, x)

  return jax.tree.map(abstract, tree, is_leaf=lambda x: isinstance(x, ginger.StackedBasis))


# The tasks of the array writes of one `_NumpyHandler._background_serialize`.
_WRITES: contextvars.ContextVar[set] = contextvars.ContextVar("writes")


class _NumpyHandler(ocp.type_handlers.NumpyHandler):
  """orbax's writer of numpy arrays, which waits for all of a save's array writes before it
  raises the failure of one.

  orbax gathers the writes of a save's arrays (``asyncio.gather``) on an event loop of their
  own, and closes the loop as soon as the gather fails, at the first failed write: on a full
  disk the other writes then complete on a closed loop, and each prints a "RuntimeError: Event
  loop is closed" traceback (192 of them for a ResNet checkpoint). Here the first failure is
  raised once every write has ended.
  """

  async def _background_serialize(self, values, infos, args=None):
    writes: set[asyncio.Task] = set()
    token = _WRITES.set(writes)  # the gather's tasks, made in this context, copy it
    try:
      await super()._background_serialize(values, infos, args)
    except Exception:
      running = [task for task in writes if not task.done()]
      if running:
        await asyncio.wait(running)
      raise
    finally:
      _WRITES.reset(token)

  async def _open_and_write(self, value, tspec, ts_context):
    writes = _WRITES.get(None)
    if writes is not None:
      writes.add(asyncio.current_task())
    await super()._open_and_write(value, tspec, ts_context)


# How long a failed restore waits for its other array reads to end before it raises.
_READS_END_WITHIN_S = 300.0


class _ArrayHandler(ocp.type_handlers.ArrayHandler):
  """orbax's reader of jax.Arrays, which waits for all of a restore's array reads before it
  raises the failure of one.

  orbax gathers the reads of a restore's arrays on an event loop of its own and closes the loop
  when the gather fails, at the first array that cannot be read (a corrupt file, a shape of
  another configuration): each read still running then ends on the closed loop ("RuntimeError:
  Event loop is closed") or is collected unfinished ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put>"), a traceback on stderr for each, after the clear error.
  The reads are the tasks started while ``deserialize`` runs: none of them waits on it.
  """

  async def deserialize(self, infos, args=None):
    before = asyncio.all_tasks()
    try:
      return await super().deserialize(infos, args)
    except Exception:
      started = asyncio.all_tasks() - before - {asyncio.current_task()}
      running = [task for task in started if not task.done()]
      if running:  # bounded: a task of another coroutine that never ends must not hold it
        await asyncio.wait(running, timeout=_READS_END_WITHIN_S)
      for task in started:  # their failures are this one's: not logged again when collected
        if task.done() and not task.cancelled():
          task.exception()
      raise


def _register(kind: type, handler) -> None:
  """Registers orbax's type handler of ``kind`` process-wide, without orbax's warning that
  it overrides one (meant here)."""
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(kind, handler, override=True)
  finally:
    absl.setLevel(level)


def _orbax_handlers() -> None:
  """Makes orbax write the numpy arrays it is handed as they are, without a copy first, with
  :class:`_NumpyHandler`, and read jax.Arrays with :class:`_ArrayHandler`.

  orbax deep-copies every numpy array it saves before ``save`` returns (the caller might
  change it while the write goes on in the background). The only numpy arrays this module
  saves are host copies it makes for the save and nothing writes to: those of Ginger's
  buckets (:func:`_bases_on_host`, cut per leaf as views) and, in one process, of every other
  array of the state (:func:`_on_host`). Copying them again would hold training for another
  pass over ``U`` in host memory at every checkpoint. orbax's handler registry is
  process-wide: both hold for every array saved or restored in this process. The jax.Array
  handler keeps the options of the one registered (a copy of its attributes).
  """
  array_handler = ocp.type_handlers.get_type_handler(jax.Array)
  if type(array_handler) is ocp.type_handlers.ArrayHandler:
    ours = _ArrayHandler.__new__(_ArrayHandler)
    ours.__dict__.update(vars(array_handler))
    _register(jax.Array, ours)
  if "deepcopy_host_arrays" not in inspect.signature(_NumpyHandler.__init__).parameters:
    return  # an orbax older than requirements.txt's: its own handler, which copies first
  if not isinstance(ocp.type_handlers.get_type_handler(np.ndarray), _NumpyHandler):
    _register(np.ndarray, _NumpyHandler(deepcopy_host_arrays=False))


class _OrbaxNoSpace(logging.Filter):
  """Leaves out orbax's log records of a write that found no space: :class:`Checkpointer`
  raises that failure itself, in one line, and orbax logs it with its traceback from each of
  its threads it passes through (four records for one failed save)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and "orbax" in record.pathname and no_space(error))


_ORBAX_NO_SPACE = _OrbaxNoSpace()


def last_good_in(directory: Path) -> int | None:
  """The step of the newest complete checkpoint in ``directory`` (orbax's partial ones,
  ``<step>.orbax-checkpoint-tmp``, are not), None if there is none."""
  if not directory.is_dir():
    return None
  return max(ocp.utils.checkpoint_steps(directory), default=None)


class Checkpointer:
  """Keeps the last ``keep`` checkpoints of a run dir's ``checkpoints/`` folder."""

  @staticmethod
  def folder(run_dir: str | Path) -> Path:
    """The checkpoints' folder of ``run_dir``."""
    return Path(run_dir).absolute() / "checkpoints"

  def __init__(self, run_dir: str | Path, keep: int = 2):
    _orbax_handlers()
    logging.getLogger("absl").addFilter(_ORBAX_NO_SPACE)  # orbax logs through absl
    _Background.join_all()  # a save another Checkpointer handed to a thread
    self.writing: int | None = None  # the step orbax is writing (not yet known to be written)
    self.failed: TrainingError | None = None  # the first failed save (none is made after it)
    self.directory = self.folder(run_dir)
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      # Known before the first save or restore, so that item_metadata can read a checkpoint.
      item_handlers=ocp.StandardCheckpointHandler(),
    )

  def latest_step(self) -> int | None:
    self._handed_over()
    return self.manager.latest_step()

  def last_good(self) -> int | None:
    """The newest complete checkpoint on disk (:func:`last_good_in`; a write under way is not
    one)."""
    return last_good_in(self.directory)

  def steps(self) -> list[int]:
    """The steps that have a checkpoint, ascending."""
    self._handed_over()
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
    """Saves ``state`` with Ginger's bases per leaf, cut from a host copy of ``U``.

    A per-leaf copy of ``U`` made on the device would sit beside the next training steps, whose
    peak would grow by ``U``. :func:`_bases_on_host` moves the buckets to the host first, so
    saving adds no device memory.

    In a single process every array of the state is copied to the host here (the copies all
    started at once), and orbax's ``save`` runs in a thread of its own on those copies while
    training goes on: the state's device buffers are free for the next step to take over
    (donation) as soon as this returns. orbax's ``save`` returns only once it has set up the
    write of every array (Python bookkeeping for each of the state's hundreds of arrays) and
    writes in the background after that; run in the training loop, that bookkeeping would hold
    training at every checkpoint (``python -m bench.checkpoint_stall`` measures the stall). One
    save at a time: a save waits for the thread of the one before; :meth:`wait` (and every
    other method) for the last, and raises its error if it failed (:meth:`check` without
    waiting), naming its step. With several processes orbax's ``save`` coordinates them and is
    called here, in the loop.
    """
    if self.failed is not None:  # no save after a failed one
      self._handed_over()  # a thread's failure is raised from here the first time
      raise self.failed
    single = jax.process_count() == 1
    if single:
      _start_host_copies(state)
    saveable = _to_saveable(ginger.checkpoint_state(_bases_on_host(state)))
    if not single:
      self._settle()
      self._write(step, ocp.args.StandardSave(saveable))
      return
    args = ocp.args.StandardSave(jax.tree.map(_on_host, saveable))
    self._handed_over()

    def write():
      self._settle()
      self._write(step, args)

    _Background(f"checkpoint {step} in {self.directory}", write)

  def _write(self, step: int, args) -> None:
    """orbax's ``save`` of ``step``, which returns once the write is under way."""
    try:
      self.manager.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - a failure of this step, whatever orbax raised
      raise self._failure(step, e) from e
    self.writing = step

  def _settle(self) -> None:
    """Waits until the write orbax has under way is done; raises its failure as that step's
    (orbax raises it in whichever call comes next)."""
    step, self.writing = self.writing, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._failure(step, e) from e

  def _failure(self, step: int | None, e: Exception) -> TrainingError:
    """The error of the failed save of ``step``, kept: no save is made after it (orbax's
    manager raises the failure again at every later call). On a full disk, the failed
    checkpoint's partial files are removed (the space they took is free again) and the error
    names the last good checkpoint."""
    if no_space(e):
      if step is not None and jax.process_index() == 0:
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
          shutil.rmtree(partial, ignore_errors=True)
      what = f"checkpoint {step}" if step is not None else "a checkpoint"
      self.failed = disk_full(self.directory, what, self.last_good(), self.directory)
    else:
      self.failed = CheckpointError(f"saving checkpoint {step} in {self.directory} failed: {e!r}")
    return self.failed

  def _handed_over(self) -> None:
    """Waits until the saves in threads have handed their arrays to orbax (raising a failed
    one's error). Process-wide: orbax's managers coordinate their saves through signals of
    the process, and a save of one beside another's hangs both until orbax's timeout."""
    _Background.join_all()

  def check(self) -> None:
    """Raises the failure of a save that has failed by now, without waiting for one under
    way (the training loop asks at every log step, so that a failed save stops it there)."""
    if _Background.busy():
      return
    self._handed_over()
    if (
      self.failed is None and self.writing is not None and not self.manager.is_saving_in_progress()
    ):
      self._settle()  # done: returns at once, or raises its failure

  def wait(self) -> None:
    """Waits until every checkpoint saved so far is written (raising a failed save's error,
    once)."""
    self._handed_over()
    if self.failed is None:
      self._settle()

  def restore(self, like, step: int | None = None, fix: Callable[[int], str] | None = None):
    """Restores the checkpoint at ``step`` (default: latest) into the structure, bucket plan
    and shardings of ``like`` (a freshly built state of the same run).

    ``like`` may also be a function that builds one: restore then keeps only the template's
    shapes and shardings, and its bases (Ginger's ``U``, zeros) are gone before the checkpoint
    is read, so that a resumed run does not hold a fresh ``U`` beside the restored one.

    A checkpoint that cannot be read raises a :class:`CheckpointError` of one line naming it
    and the newest earlier checkpoint that reads (each is tried), with ``fix(that step)``: how
    the caller's user gets to use it (by default ``step=N``, evaluate.py's).
    """
    step = self.check_step(step)
    if callable(like):
      like = like()
    # The per-leaf view of `like` gives the entries' shapes and, for the bases, shardings
    # (its U is a fresh zero state: the copy lives only until `abstract` is made).
    per_leaf = _abstract(_per_leaf_view(like))
    like = _bases_abstract(like)  # a template built here loses its U now
    try:
      saved = _skipped_from_zero(self._read(step, per_leaf), per_leaf, step)
    except CheckpointError as e:
      raise self._with_intact(step, per_leaf, e, fix or (lambda s: f"use it with step={s}")) from e
    restacked = ginger.restore_checkpoint_state(saved, like)
    return _placed_like(_from_saveable(restacked, like), like)

  def _read(self, step: int, abstract):
    try:
      return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # noqa: BLE001 - orbax raises many types for truncated/corrupt files
      raise self._unreadable(step, e) from e

  def _unreadable(self, step: int, e: Exception) -> CheckpointError:
    # orbax's and TensorStore's messages run to dozens of lines: their first line says what.
    cause = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    cause = cause if len(cause) <= 300 else cause[:297] + "..."
    return CheckpointError(
      f"checkpoint {step} in {self.directory} cannot be read ({type(e).__name__}: {cause}); "
      "it is damaged or from a different configuration"
    )

  def resume_advice(self, intact: int) -> str:
    """How a rerun resumes from checkpoint ``intact`` where a later one cannot be read: a rerun
    resumes from the newest checkpoint in the folder, so the later ones are moved aside."""
    later = [s for s in self.steps() if s > intact]
    moves = "; ".join(
      f"mv {self.directory / str(s)} {self.directory / str(s)}.damaged" for s in later
    )
    return f"to resume from it move the later ones aside ({moves}) and rerun the same command"

  def _with_intact(self, step: int, abstract, e: CheckpointError, fix) -> CheckpointError:
    """``e`` (checkpoint ``step`` cannot be read) with the newest earlier checkpoint that
    reads and how to use it, or saying that none does."""
    for earlier in reversed([s for s in self.steps() if s < step]):
      try:
        self._read(earlier, abstract)
      except CheckpointError:
        continue
      return CheckpointError(f"{e}: checkpoint {earlier} is intact, {fix(earlier)}.")
    return CheckpointError(f"{e}; no earlier checkpoint reads.")


def _abstract(tree):
  """Shapes, dtypes and shardings of the saveable form of ``tree``."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_saveable(tree))
