"""Orbax checkpoints of the whole training state, so a killed run continues bit-for-bit.

**Layout.** Ginger keeps its bases ``U`` stacked in buckets, planned for speed from a tuning
constant (``BUCKET_OVERHEAD`` in ``ginger/_common.py``). A checkpoint holds the state as
:func:`ginger.checkpoint_state` gives it instead: each basis as a pytree like the params of
``(leaf.size, rank)`` arrays, which depends only on the model, ``tau`` and ``block``. So a
checkpoint restores, exactly, whatever the bucket plan of the code that reads it, and
:func:`ginger.restore_checkpoint_state` stacks it into the plan of the running code. Every
other state (Adam, Momentum, QNG, params, model state) is saved as it is.

Ginger's momentum (``mu``, kept stacked as ``U`` is) is saved per leaf the same way, as
``(leaf.size,)`` vectors.

Checkpoints of earlier versions hold the stacked buckets themselves. They restore as before
while the bucket plan is the one that wrote them (on GPUs the plan has not changed since;
off GPUs large blocks now get a bucket each, ``SOLO_BUCKETS``); under another plan,
:class:`CheckpointError` says how to continue. Checkpoints of versions whose Ginger chained
``optax.ema`` before its preconditioner (the momentum in an ``EmaState`` of its own, like the
params) restore into this version's state with a warning: the ``ema`` becomes ``mu``, exactly
(a reshape, and a cast from the params' dtype to Ginger's state dtype), its count ``mu_count``.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ginger
from ginger.ginger import StackedBasis, StackedSigma
from training import sharding
from training.errors import TrainingError

log = logging.getLogger("train")

Shapes = dict[tuple[str, ...], tuple[int, ...]]
Entries = dict[tuple[str, ...], Any]  # entry path -> what has .shape and .dtype


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
  stacked = lambda x: isinstance(x, StackedBasis | StackedSigma)  # noqa: E731

  def to_host(x):
    if not stacked(x) or not all(s.is_fully_addressable for s in x.stacks):
      return x
    return type(x)([_host_copy(s) for s in x.stacks], x.layout)

  return jax.tree.map(to_host, tree, is_leaf=stacked)


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
  def join_all(cls) -> None:
    with cls._lock:
      started, cls._started[:] = list(cls._started), []
    for background in started:
      background.thread.join()
    for background in started:
      if background.error is not None:
        raise CheckpointError(
          f"saving {background.name} failed: {background.error!r}"
        ) from background.error


def _bases_abstract(tree):
  """``tree`` with the arrays of Ginger's bases replaced by their shapes, dtypes and shardings
  (all that restoring into them reads); the rest, small, as it is."""

  def abstract(x):
    if not isinstance(x, StackedBasis):
      return x
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, x)

  return jax.tree.map(abstract, tree, is_leaf=lambda x: isinstance(x, StackedBasis))


def _is_sigma(x) -> bool:
  return isinstance(x, StackedSigma)


def _sigma_per_leaf(tree):
  """``tree`` with Ginger's per-tensor ``sigma`` per leaf, as every checkpoint saves it (its
  bases stacked or not)."""
  return jax.tree.map(lambda x: x.tree() if _is_sigma(x) else x, tree, is_leaf=_is_sigma)


def _entries(tree) -> Entries:
  """Entry path -> leaf of a state, or of the metadata of a saved one (orbax saves a NamedTuple
  as a dict of its fields, a custom node as the list or dict of its children)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(map(_key_name, path)): x for path, x in flat}


def _shapes(tree) -> Shapes:
  """Entry path -> shape of a state, or of the metadata of a saved one."""
  return {k: tuple(x.shape) for k, x in _entries(tree).items()}


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _restacked_elsewhere(on_disk: Shapes, per_leaf: Shapes, stacked: Shapes) -> tuple | None:
  """``(buckets on disk, buckets now)`` if ``on_disk`` is the stacked layout of this state
  under another bucket plan: every entry outside the bases as in ``per_leaf``, each basis
  a list of buckets of its own number of axes (``(members, rows, rank)`` for ``U``,
  ``(members, rows)`` for the momentum). None otherwise."""
  # Where a StackedBasis sits -> the number of axes of its buckets.
  ndim = {k[:-1]: len(v) for k, v in stacked.items() if k not in per_leaf}
  if not ndim:
    return None

  def outside(shapes):
    return {k: v for k, v in shapes.items() if not any(k[: len(b)] == b for b in ndim)}

  inside = {k: v for k, v in on_disk.items() if k[:-1] in ndim}
  if outside(on_disk) != outside(per_leaf) or len(inside) + len(outside(on_disk)) != len(on_disk):
    return None
  if not all(k[-1].isdigit() and len(v) == ndim[k[:-1]] for k, v in inside.items()):
    return None

  def buckets(keys):  # of the basis with the most (U and its momentum have the same)
    return max(collections.Counter(k[:-1] for k in keys).values())

  return buckets(inside), buckets(k for k in stacked if k not in per_leaf)


# ---- checkpoints written before Ginger kept its momentum ------------------------------------


class _GingerStateBefore(NamedTuple):
  """:class:`ginger.ScaleByGingerState` as checkpoints saved it before it held the momentum:
  Ginger's chain then began with ``optax.ema(b1, debias=True)``, so that its state was
  ``(EmaState(count, ema), ScaleByGingerState(count, u, sigma), ...)``, ``ema`` like the
  params (in their dtype)."""

  count: Any
  u: Any
  sigma: Any


def _holds_momentum(x) -> bool:
  return isinstance(x, ginger.ScaleByGingerState) and x.mu is not None


def _is_chain(x) -> bool:
  """An ``optax.chain``'s state (a plain tuple) with a Ginger state that holds the momentum."""
  return type(x) is tuple and any(map(_holds_momentum, x))


def _momentum_leaves(state) -> tuple[list[int], Any]:
  """The sizes of the per-leaf momentum vectors of a Ginger ``state`` (abstract, per leaf or
  stacked) and the params' tree structure."""
  if isinstance(state.mu, StackedBasis):
    return list(state.mu.layout.sizes), state.mu.layout.treedef
  leaves, treedef = jax.tree.flatten(state.mu)
  return [x.shape[0] for x in leaves], treedef


def _momentum_apart(template, on_disk: Entries):
  """``template`` (an abstract saveable state: Ginger's bases per leaf or stacked) in the
  layout of checkpoints written before Ginger kept its momentum, or None if ``on_disk`` (the
  entries of a checkpoint) has no such momentum for it. Every ``optax.chain`` state
  ``(..., ScaleByGingerState(count, u, sigma, mu, mu_count), ...)`` becomes
  ``(..., EmaState(mu_count, ema), _GingerStateBefore(count, u, sigma), ...)``, each ``ema``
  leaf of the shape and dtype it has on disk (the params': its size must be that of ``mu``'s
  vector) and placed as ``mu_count`` is (whole: it is made ``mu`` before it is placed)."""
  missing = []

  def ema_like(state, where):
    sizes, treedef = _momentum_leaves(state)

    def leaf(path, size):
      entry = on_disk.get(where + tuple(map(_key_name, path)))
      if entry is None or math.prod(entry.shape) != size:
        missing.append(where)
        return None
      sharding = getattr(state.mu_count, "sharding", None)
      return jax.ShapeDtypeStruct(tuple(entry.shape), entry.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, jax.tree.unflatten(treedef, sizes))

  found = []

  def apart(path, chain):
    if not _is_chain(chain):
      return chain
    out = []
    for x in chain:
      if _holds_momentum(x):
        where = (*map(_key_name, path), str(len(out)), "ema")
        out.append(optax.EmaState(count=x.mu_count, ema=ema_like(x, where)))
        x = _GingerStateBefore(x.count, x.u, x.sigma)
        found.append(where)
      out.append(x)
    return tuple(out)

  before = jax.tree_util.tree_map_with_path(apart, template, is_leaf=_is_chain)
  return before if found and not missing else None


def _momentum_joined(saved, template):
  """Inverse of :func:`_momentum_apart` on the values read: ``saved`` (in the earlier layout)
  in the structure of ``template``, each ``EmaState`` folded into the Ginger state after it:
  ``ema`` as ``mu``'s per-leaf vectors (a reshape, and an exact cast from the params' dtype
  to the state's), its ``count`` as ``mu_count``; Ginger's bases as they were read."""

  def join(chain, old):
    if not _is_chain(chain):
      return old
    parts, out = iter(old), []
    for x in chain:
      y = next(parts)
      if _holds_momentum(x):
        before = next(parts)
        dtype = jax.tree.leaves(x.mu)[0].dtype if jax.tree.leaves(x.mu) else jnp.float32
        mu = jax.tree.map(lambda e, dtype=dtype: jnp.reshape(e, (-1,)).astype(dtype), y.ema)
        y = ginger.ScaleByGingerState(before.count, before.u, before.sigma, mu=mu, mu_count=y.count)
      out.append(y)
    return tuple(out)

  return jax.tree.map(join, template, saved, is_leaf=_is_chain)


def _numpy_arrays_saved_as_given() -> None:
  """Makes orbax write the numpy arrays it is handed as they are, without a copy first.

  orbax deep-copies every numpy array it saves before ``save`` returns (the caller might
  change it while the write goes on in the background). The only numpy arrays this module
  saves are host copies it makes for the save and nothing writes to: those of Ginger's
  buckets (:func:`_bases_on_host`, cut per leaf as views) and, in one process, of every other
  array of the state (:func:`_on_host`). Copying them again held training for another
  pass over ``U`` in host memory at every checkpoint (on a 4x H200 host a save stalled Ginger
  tau 8's ResNet-18 run for 1.0 s against Adam's 0.6 s; on 2 CPU cores ``save`` took 0.62 s
  with the copies, 0.22 s without). orbax's handler registry is process-wide: the option
  holds for every numpy array saved in this process.
  """
  handler = ocp.type_handlers.get_type_handler(np.ndarray)
  if getattr(handler, "_deepcopy_host_arrays", False):
    absl = logging.getLogger("absl")  # orbax warns on every override: this one is meant
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
      ocp.type_handlers.register_type_handler(
        np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False), override=True
      )
    finally:
      absl.setLevel(level)


class Checkpointer:
  """Keeps the last ``keep`` checkpoints of a run dir's ``checkpoints/`` folder."""

  def __init__(self, run_dir: str | Path, keep: int = 2):
    _numpy_arrays_saved_as_given()
    _Background.join_all()  # a save another Checkpointer handed to a thread
    self.directory = Path(run_dir).absolute() / "checkpoints"
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      # Known before the first save or restore, so that item_metadata can read a checkpoint.
      item_handlers=ocp.StandardCheckpointHandler(),
    )

  def latest_step(self) -> int | None:
    self._handed_over()
    return self.manager.latest_step()

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

    A per-leaf copy of ``U`` made on the device would sit beside the next training steps:
    their peak + ``U`` (ResNet-50, tau 32: 3 GB). :func:`_bases_on_host` moves the buckets to
    the host first, so saving adds no device memory.

    In a single process every array of the state is copied to the host here (the copies all
    started at once), and orbax's ``save`` runs in a thread of its own on those copies while
    training goes on: the state's device buffers are free for the next step to take over
    (donation) as soon as this returns. orbax's ``save`` returns only once it has set up the
    write of every array (Python bookkeeping, ~1 ms an array: 0.3-0.5 s for a ResNet-18
    state of 200-400 arrays on 2 CPU cores) and writes in the background after that; run in
    the training loop, that bookkeeping held training at every checkpoint (ResNet-18 on an
    H200, ``python -m bench.checkpoint_stall``: Ginger tau 8 0.81 s a save, 0.49 s with the
    thread; Adam 0.43 and 0.41 s). One save at a time: a save waits
    for the thread of the one before; :meth:`wait` (and every other method) for the last, and
    raises its error if it failed. With several processes orbax's ``save`` coordinates them
    and is called here, as before.
    """
    single = jax.process_count() == 1
    if single:
      _start_host_copies(state)
    saveable = _to_saveable(ginger.checkpoint_state(_bases_on_host(state)))
    if not single:
      self.manager.save(step, args=ocp.args.StandardSave(saveable), force=True)
      return
    args = ocp.args.StandardSave(jax.tree.map(_on_host, saveable))
    self._handed_over()
    _Background(
      f"checkpoint {step} in {self.directory}",
      lambda: self.manager.save(step, args=args, force=True),
    )

  def _handed_over(self) -> None:
    """Waits until the saves in threads have handed their arrays to orbax (raising a failed
    one's error). Process-wide: orbax's managers coordinate their saves through signals of
    the process, and a save of one beside another's hung them (a 300 s timeout)."""
    _Background.join_all()

  def wait(self) -> None:
    """Waits until every checkpoint saved so far is written (raising a failed save's error)."""
    self._handed_over()
    self.manager.wait_until_finished()

  def restore(self, like, step: int | None = None):
    """Restores the checkpoint at ``step`` (default: latest) into the structure, bucket plan
    and shardings of ``like`` (a freshly built state of the same run).

    ``like`` may also be a function that builds one: restore then keeps only the template's
    shapes and shardings, and its bases (Ginger's ``U``, zeros) are gone before the checkpoint
    is read, so that a resumed run does not hold a fresh ``U`` beside the restored one.
    """
    step = self.check_step(step)
    if callable(like):
      like = like()
    # The per-leaf view of `like` gives the entries' shapes and, for the bases, shardings
    # (its U is a fresh zero state: the copy lives only until `abstract` is made).
    per_leaf = _abstract(ginger.checkpoint_state(like))
    stacked = _abstract(_sigma_per_leaf(like))  # earlier versions: U stacked, sigma per leaf
    like = _bases_abstract(like)  # a template built here loses its U now
    entries = self._entries_on_disk(step)
    on_disk = {k: tuple(x.shape) for k, x in entries.items()}
    if on_disk != _shapes(per_leaf):
      if on_disk == _shapes(stacked):
        log.info(
          "checkpoint %d in %s holds Ginger's bases stacked (the layout of earlier versions), "
          "in this version's bucket plan: restored as written; later checkpoints are per leaf",
          step,
          self.directory,
        )
        restacked = ginger.restore_checkpoint_state(self._read(step, stacked), like)
        return _placed_like(_from_saveable(restacked, like), like)
      # Written before Ginger kept its momentum (optax.ema's state, then Ginger's), with the
      # bases per leaf or, earlier still, stacked.
      before = {
        layout: _momentum_apart(template, entries)
        for layout, template in (("per leaf", per_leaf), ("stacked", stacked))
      }
      for (layout, old), template in zip(before.items(), (per_leaf, stacked), strict=True):
        if old is not None and on_disk == _shapes(old):
          log.warning(
            "checkpoint %d in %s was written before Ginger kept its momentum (optax.ema's "
            "state before Ginger's, its bases %s): restored with the momentum moved into "
            "Ginger's state, exactly; later checkpoints are in this version's layout",
            step,
            self.directory,
            layout,
          )
          saved = _momentum_joined(self._read(step, old), template)
          restacked = ginger.restore_checkpoint_state(saved, like)
          return _placed_like(_from_saveable(restacked, like), like)
      buckets = _restacked_elsewhere(on_disk, _shapes(per_leaf), _shapes(stacked))
      if buckets is None and None not in before.values():
        buckets = _restacked_elsewhere(
          on_disk, _shapes(before["per leaf"]), _shapes(before["stacked"])
        )
      if buckets is not None:
        raise CheckpointError(
          f"checkpoint {step} in {self.directory} was written by an earlier version, which "
          "saved Ginger's bases stacked by bucket, and this version buckets them differently "
          f"({buckets[0]} buckets in the checkpoint, {buckets[1]} now): it restores only under "
          "the bucket plan that wrote it. To continue the run, resume it once with "
          "BUCKET_OVERHEAD in ginger/_common.py set to the value it was written with (1 << 21 "
          "in every earlier version) and, off GPUs, SOLO_BUCKETS there set to False (earlier "
          "versions stacked large blocks on every backend) until it saves a checkpoint (those "
          "are per leaf and restore under any plan), then put the values back; or start over "
          "with resume=false."
        )
    saved = self._read(step, per_leaf)
    restacked = ginger.restore_checkpoint_state(saved, like)
    return _placed_like(_from_saveable(restacked, like), like)

  def _entries_on_disk(self, step: int) -> Entries:
    """The saved entries' shapes and dtypes, from the checkpoint's metadata (no array is
    read)."""
    try:
      metadata = self.manager.item_metadata(step)
      return _entries(metadata.tree)
    except Exception as e:  # noqa: BLE001 - orbax raises many types for missing/corrupt files
      raise self._unreadable(step, e) from e

  def _read(self, step: int, abstract):
    try:
      return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # noqa: BLE001 - orbax raises many types for truncated/corrupt files
      raise self._unreadable(step, e) from e

  def _unreadable(self, step: int, e: Exception) -> CheckpointError:
    return CheckpointError(
      f"checkpoint {step} in {self.directory} cannot be read ({type(e).__name__}: {e}); "
      "it may be corrupt or from a different configuration"
    )


def _abstract(tree):
  """Shapes, dtypes and shardings of the saveable form of ``tree``."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_saveable(tree))
