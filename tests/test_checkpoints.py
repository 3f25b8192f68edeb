"""What a resume reads back: checkpoints (training/checkpoints.py) independent of how Ginger
buckets its bases, every optimizer's state bit for bit, a clear refusal of a checkpoint that
does not fit the state, the metrics log truncated to the checkpoint, and the batch order of an
epoch."""

import collections
import functools
import gc
import json
import logging
import signal
import sys
import time
from pathlib import Path

import fakes
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import ginger
from ginger._src.tuning import Tuning
from models.tasks import build_task
from training import logs, run_record, sharding
from training import loop as train
from training.checkpoints import Checkpointer, CheckpointError
from training.errors import Interrupted, TrainingError

ROOT = Path(__file__).resolve().parents[1]
FEW = 10**9  # bucket_overhead giving one bucket per rank (the demo ResNet: one bucket)
MANY = 0  # one bucket per distinct leaf size (the demo ResNet: 17 buckets)


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


RUN = [
  "experiment=demo",
  "optimizer=ginger",  # block=per_tensor: one basis per leaf, bucketed by the plan
  "logger=none",
  "log_every=1",
  "eval_every=100",
  "checkpoint_every=100",
  "spectrum_every=0",
  "max_steps=4",
]


def _raw(state):
  """Every leaf of ``state`` as a host array (PRNG keys as their data), in tree order."""
  return [
    np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    for x in jax.tree.leaves(state)
  ]


def _assert_bitwise(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_raw(a), _raw(b), strict=True):
    np.testing.assert_array_equal(x, y)
    assert x.dtype == y.dtype


def _buckets(state) -> int:
  return sum(len(u.stacks) for u in _bases(state))


def _bases(state):
  is_state = lambda x: isinstance(x, ginger.ScaleByGingerState)
  return [x.u for x in jax.tree.leaves(state.opt_state, is_leaf=is_state) if is_state(x)]


def _steps(setup, state, start: int, stop: int):
  """The loop's steps ``start..stop`` of epoch 0, with its own step function and batch order;
  returns the state after them and each step's loss."""
  cfg = config(*RUN)
  batch = int(cfg.batch_size)
  assert stop <= setup.steps_per_epoch
  order = setup.task.batch_order(int(cfg.seed), 0)
  arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
  state = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input
  losses = []
  for step in range(start, stop):
    idx = setup.plan.indices(order[step * batch : (step + 1) * batch])
    state = setup.train_step(state, setup.frozen, arrays, idx)
    losses.append(float(state.stats["last_loss"]))
  return state, losses


# The loop-level runs across bucket plans take ~65 s of compiling on 2 CPU cores: `make
# test-all`. `make test` keeps the library-level check (tests/test_ginger_layout.py:
# test_checkpoint_does_not_depend_on_the_bucketing) and the round trips below.
ACROSS_PLANS_SLOW = pytest.mark.slow


def _plan_buckets(patch, overhead: int) -> None:
  """Within ``patch``, Ginger as the loop builds it (``ginger.ginger``) plans its buckets with
  ``overhead`` (``Tuning.bucket_overhead``), and as on every backend (no solo buckets)."""
  tuning = Tuning(bucket_overhead=overhead, solo_buckets=False)
  patch.setattr(ginger, "ginger", functools.partial(ginger.ginger, tuning=tuning))


@pytest.fixture(scope="module")
def across_plans(tmp_path_factory):
  """A demo Ginger run preempted at step 2 under one bucket plan and resumed under another,
  and its references: the same steps with the loop's step function, uninterrupted; the
  state at step 2 moved to the other plan in memory."""
  tmp = tmp_path_factory.mktemp("plans")
  out = {"new": tmp / "new"}
  with pytest.MonkeyPatch.context() as patch:
    _plan_buckets(patch, FEW)
    with pytest.raises(Interrupted, match="stopped by SIGTERM at step 2 of 4"):
      train.train(config(*RUN), out["new"], stop=lambda s: signal.SIGTERM if s == 2 else None)
    few = train.build(config(*RUN))
    out["few"] = few
    out["at_2"], _ = _steps(few, few.state, 0, 2)
    out["few_restored"] = Checkpointer(out["new"]).restore(few.state, 2)
  with pytest.MonkeyPatch.context() as patch:
    _plan_buckets(patch, MANY)
    many = train.build(config(*RUN))
    out["many"] = many
    moved = sharding.put(
      ginger.restore_checkpoint_state(out["at_2"], many.state), many.plan.state(many.state)
    )
    out["at_4"], out["losses"] = _steps(many, moved, 2, 4)
    out["summary"] = train.train(config(*RUN), out["new"])  # resumes at step 2
    out["many_restored"] = {"new": Checkpointer(out["new"]).restore(many.state, 4)}
    out["at_2_many"] = Checkpointer(out["new"]).restore(many.state, 2)
  return out


@ACROSS_PLANS_SLOW
def test_the_plans_differ(across_plans):
  """The test is not vacuous: the two plans stack the bases differently."""
  few, many = across_plans["few"].state, across_plans["many"].state
  assert _buckets(few) < _buckets(many)
  assert jax.tree.structure(few) != jax.tree.structure(many)


@ACROSS_PLANS_SLOW
def test_a_checkpoint_restores_exactly_under_another_bucket_plan(across_plans):
  """Saved at step 2 under one plan, restored under another: the same numbers (each leaf's
  rows of U, bit for bit), in the new plan's structure and placement."""
  at_2, restored = across_plans["at_2"], across_plans["at_2_many"]
  assert jax.tree.structure(restored) == jax.tree.structure(across_plans["many"].state)
  _assert_bitwise(ginger.checkpoint_state(restored), ginger.checkpoint_state(at_2))
  for x, like in zip(jax.tree.leaves(restored), jax.tree.leaves(across_plans["many"].state)):
    assert x.sharding == like.sharding


@ACROSS_PLANS_SLOW
def test_resumed_under_another_plan_continues_bit_for_bit(across_plans):
  """The resumed run (preempted under one plan, continued by train() under another) equals
  the uninterrupted steps that change plan at step 2 in memory: every leaf of the state at
  step 4 and every logged loss. (Across plans only the relayout must be exact: a step under
  another plan sums U's rows in other blocks, so it may round differently.)"""
  assert across_plans["summary"]["status"] == "completed"
  assert across_plans["summary"]["steps"] == 4
  _assert_bitwise(across_plans["many_restored"]["new"], across_plans["at_4"])
  logged = {
    e["step"]: e["train_loss"]
    for e in run_record.read_events(across_plans["new"], strict=True)
    if e["event"] == "train"
  }
  assert [logged[3], logged[4]] == across_plans["losses"]


@ACROSS_PLANS_SLOW
def test_checkpoints_under_the_same_plan_restore_as_saved(across_plans):
  """Under the plan that wrote it, train()'s checkpoint restores to the uninterrupted state at
  step 2."""
  _assert_bitwise(across_plans["few_restored"], across_plans["at_2"])


def _random_state(setup, seed: int):
  """``setup.state`` with random numbers in every float leaf (so that nothing passes by being
  zero), placed as the template: the bases random per leaf and stacked by Ginger, so that the
  padding rows of a bucket stay zero (a checkpoint saves per leaf, without them)."""
  rng = np.random.default_rng(seed)

  def noise(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.asarray(rng.normal(size=x.shape), x.dtype)
    return x

  per_leaf = jax.tree.map(noise, ginger.checkpoint_state(setup.state))
  state = ginger.restore_checkpoint_state(per_leaf, setup.state)
  return sharding.put(state, setup.plan.state(setup.state))


@pytest.mark.parametrize(
  "overrides",
  [
    ["optimizer=adam"],
    ["optimizer=momentum"],
    ["optimizer=qng"],
    ["optimizer=ginger", "block=per_tensor"],
    ["optimizer=ginger", "block=global"],
    ["optimizer=soap"],  # per-leaf tuples of factors, None for an axis without one
  ],
)
def test_every_optimizer_state_round_trips_bit_for_bit(tmp_path, overrides):
  """A state of random numbers in every float leaf (so that nothing passes by being zero)
  comes back bit for bit, in the structure and placement of the template."""
  setup = train.build(config("experiment=demo", "logger=none", *overrides))
  state = _random_state(setup, seed=0)
  state = state._replace(step=jnp.asarray(7, jnp.int32), rng=jax.random.key(5))
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(7, state)
  checkpointer.wait()
  restored = checkpointer.restore(setup.state)
  _assert_bitwise(restored, state)
  for x, like in zip(jax.tree.leaves(restored), jax.tree.leaves(setup.state)):
    assert x.sharding == like.sharding


def test_a_resume_reads_the_checkpoint_without_a_fresh_basis_beside_it(tmp_path, monkeypatch):
  """Given a builder instead of a state, restore makes the template, keeps only its shapes and
  shardings, and reads the checkpoint after the template's ``U`` is gone: a resumed run holds
  one ``U`` fewer than the fresh one plus the restored one (T5-small, tau 32: 7.7 GB); the
  state comes back bit for bit on the template's placement."""
  setup = train.build(config("experiment=demo", "logger=none", "optimizer=ginger", "tau=8"))
  largest_param = max(x.size for x in jax.tree.leaves(setup.state.trainable))
  bases = {
    (x.shape, x.dtype) for x in jax.tree.leaves(setup.state.opt_state) if x.size > largest_param
  }
  assert bases  # the stacked U outgrows every parameter
  state = _random_state(setup, seed=1)
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(4, state)
  checkpointer.wait()
  seen = []
  read = Checkpointer._read

  def recording(self, step, abstract):
    gc.collect()
    seen.append(collections.Counter((x.shape, x.dtype) for x in jax.live_arrays()))
    return read(self, step, abstract)

  monkeypatch.setattr(Checkpointer, "_read", recording)
  del setup  # its state is a template with a U of its own
  built = []

  def build_template():
    built.append(True)
    return train.build(config("experiment=demo", "logger=none", "optimizer=ginger", "tau=8")).state

  restored = Checkpointer(tmp_path).restore(build_template, 4)
  assert built == [True] and len(seen) == 1
  # While the checkpoint is read, the only stacked U of each shape is the saved state's own
  # (still alive here, as `state`), none the template's.
  held = collections.Counter((x.shape, x.dtype) for x in jax.tree.leaves(state.opt_state))
  assert {b: seen[0][b] for b in bases} == {b: held[b] for b in bases}
  _assert_bitwise(restored, state)


def _device_bytes(arrays) -> dict:
  """``{(device, buffer address): bytes}`` of ``arrays``' device buffers (arrays that share a
  buffer, such as a shard's view of a one-device array, count once)."""
  return {
    (s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
    for x in arrays
    if isinstance(x, jax.Array)
    for s in x.addressable_shards
  }


def _live_device_bytes() -> int:
  gc.collect()
  return sum(_device_bytes(jax.live_arrays()).values())


def test_saving_makes_no_device_copy_of_the_bases(tmp_path, monkeypatch):
  """orbax keeps the arrays it is handed until the checkpoint is written, in the background
  while training goes on: a per-leaf device copy of Ginger's ``U`` among them sat beside the
  next training steps (ResNet-50, tau 32, on an H200: peak 13.29 GB = the step's 10.13 + U
  3.01 + 0.15). What a save hands orbax holds no device buffer but the state's own, and the
  device memory in use grows by less than one parameter tensor's bytes, while saving and
  after (one U is ``tau`` times all of them); the checkpoint restores bit for bit.

  Nor a second host copy: the per-leaf bases are views of the one host copy of each bucket,
  and orbax writes them as given (its default deep-copied every numpy array before ``save``
  returned, another pass over ``U`` that held training: on a 4x H200 host a checkpoint stalled
  Ginger 1.0 s, Adam 0.6 s); no numpy array is copied while saving."""
  import copy

  setup = train.build(config("experiment=demo", "logger=none", "optimizer=ginger", "tau=8"))
  state = _random_state(setup, seed=2)
  del setup  # its template U
  own = _device_bytes(jax.tree.leaves(state))
  bases = sum(s.nbytes for u in _bases(state) for s in u.stacks)
  margin = max(x.nbytes for x in jax.tree.leaves(state.trainable))
  assert bases > 8 * margin  # tau 8: U is about 8 copies of all the parameters
  handed = []
  save = ocp.CheckpointManager.save

  def spying(self, step, *args, **kwargs):
    given = _device_bytes(jax.tree.leaves(kwargs["args"].item))
    copies = sum(n for buffer, n in given.items() if buffer not in own)
    handed.append((copies, _live_device_bytes()))
    return save(self, step, *args, **kwargs)

  copied = []
  deepcopy = copy.deepcopy

  def counting(x, *args, **kwargs):
    if isinstance(x, np.ndarray):
      copied.append(x.nbytes)
    return deepcopy(x, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", spying)
  monkeypatch.setattr(copy, "deepcopy", counting)
  checkpointer = Checkpointer(tmp_path)
  before = _live_device_bytes()
  checkpointer.save(5, state)
  after = _live_device_bytes()  # before the write is waited for: what training steps see
  checkpointer.wait()
  monkeypatch.setattr(copy, "deepcopy", deepcopy)
  assert copied == []
  [(copies, during)] = handed
  assert copies < margin
  assert during - before < margin and after - before < margin
  _assert_bitwise(Checkpointer(tmp_path).restore(state), state)


def test_a_save_hands_orbax_host_copies_in_a_thread_and_raises_its_failure(tmp_path, monkeypatch):
  """orbax's ``save`` spends ~1 ms of Python an array before it returns (0.45-0.75 s a
  ResNet-18 checkpoint on a 4x H200 host, training held meanwhile), so it runs in a thread on
  host copies: ``Checkpointer.save`` returns before orbax has started, the state's device
  buffers can go at once (a training step takes them over by donation) and the checkpoint
  still holds them bit for bit; a failed save is raised by ``wait``, never lost."""
  import threading

  state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.asarray(7), "b": jnp.ones(5)}
  expected = jax.device_get(state)
  save = ocp.CheckpointManager.save
  go, entered = threading.Event(), []

  def held(self, step, *args, **kwargs):
    entered.append(threading.current_thread() is not threading.main_thread())
    assert go.wait(60)
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", held)
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(3, state)  # returns with orbax's save held
  for x in jax.tree.leaves(state):
    x.delete()  # as donation to the next step does
  go.set()
  checkpointer.wait()
  assert entered == [True]
  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  like = jax.tree.map(jnp.zeros_like, expected)
  restored = Checkpointer(tmp_path).restore(like, 3)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), expected)

  def failing(self, step, *args, **kwargs):
    raise OSError("No space left on device")

  monkeypatch.setattr(ocp.CheckpointManager, "save", failing)
  checkpointer.save(4, like)
  with pytest.raises(
    CheckpointError, match=r"saving checkpoint 4 in .* failed: OSError\('No space"
  ):
    checkpointer.wait()
  checkpointer.wait()  # raised once; nothing pending after it


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("raised", ["tensorstore", "oserror"])
def test_a_full_disk_fails_once_naming_the_checkpoint_and_the_last_good_one(
  tmp_path, monkeypatch, capfd, caplog, raised
):
  """Checkpoint 2 meets a full disk (the first of its array writes fails, as tensorstore or a
  Python write reports ENOSPC; the others are still running): the failure is raised once, in
  one line that names checkpoint 2 (also where it surfaces in the save of 3), its directory,
  the free space there and the last good checkpoint, 1; nothing is written after it, and
  nothing else is printed or logged (no traceback from orbax's threads, none from writes that
  end on orbax's closed event loop, which Python reports as unraisable). The partial
  checkpoint is gone: 1 restores."""
  fakes.disk_full_from(2, raised, setattr=monkeypatch.setattr)
  # Many arrays: writes still under way when the first one fails.
  state = {f"w{i}": jnp.full((64, 32), float(i)) for i in range(48)}
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(1, state)
  checkpointer.wait()
  checkpointer.save(2, state)
  with caplog.at_level(logging.INFO), pytest.raises(TrainingError) as failed:
    checkpointer.save(3, state)  # the failure of 2 surfaces here, or in wait
    checkpointer.wait()
  message = str(failed.value)
  directory = checkpointer.directory
  assert message.startswith(
    f"no space left on device: writing checkpoint 2 to {directory} failed ("
  ), message
  assert "B free on that filesystem); the last good checkpoint there is step 1." in message
  assert message.endswith("then rerun the same command to resume from step 1."), message
  assert "\n" not in message and "checkpoint 3" not in message
  checkpointer.wait()  # raised once
  with pytest.raises(TrainingError, match="writing checkpoint 2 to"):
    checkpointer.save(4, state)  # no save after a failed one
  assert sorted(p.name for p in directory.iterdir()) == ["1"]  # no partial checkpoint left
  out = capfd.readouterr()
  assert "Traceback" not in out.out + out.err and "Event loop" not in out.out + out.err, out
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  assert Checkpointer(tmp_path).latest_step() == 1
  like = jax.tree.map(jnp.zeros_like, state)
  jax.tree.map(np.testing.assert_array_equal, Checkpointer(tmp_path).restore(like), state)


def test_a_corrupt_checkpoint_fails_clearly(tmp_path):
  setup = train.build(config("experiment=demo", "logger=none", "optimizer=ginger"))
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(3, setup.state)
  checkpointer.wait()
  for f in (checkpointer.directory / "3").rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  with pytest.raises(CheckpointError, match=r"checkpoint 3 in .* cannot be read"):
    Checkpointer(tmp_path).restore(setup.state)


# ---------------------------------------------------------- a checkpoint of another configuration


SMALL = {"a": (5, 3), "b": (11,)}


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path):
  """Ginger tau=3's checkpoint restored into a tau=2 state: refused, quoting the shapes."""
  params = {k: jnp.zeros(s) for k, s in SMALL.items()}
  saved = ginger.ginger(0.1, tau=3, alpha=0.9, gamma=1e-2).init(params)
  writer = Checkpointer(tmp_path)
  writer.save(3, saved)
  writer.wait()  # this manager's write finished (another instance would not wait for it)
  like = ginger.ginger(0.1, tau=2, alpha=0.9, gamma=1e-2).init(params)
  with pytest.raises(CheckpointError, match=r"checkpoint 3 in .* cannot be read .*stored shape"):
    Checkpointer(tmp_path).restore(like, 3)


def test_a_refused_restore_leaves_no_read_running(tmp_path, monkeypatch):
  """When one array of a checkpoint cannot be read, every other array's read has ended before
  the error is raised. orbax runs the reads on an event loop it closes at the first failure: a
  read still running then ends on the closed loop ("Event loop is closed") or is collected
  unfinished ("Exception ignored in: <coroutine object _read_array_index_and_device_put>"),
  each a traceback on stderr after the clear error."""
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  params = {f"w{i}": jnp.zeros((64, 33)) for i in range(8)}
  writer = Checkpointer(tmp_path)
  writer.save(3, ginger.ginger(0.1, tau=3, alpha=0.9, gamma=1e-2).init(params))
  writer.wait()
  like = ginger.ginger(0.1, tau=2, alpha=0.9, gamma=1e-2).init(params)
  with pytest.raises(CheckpointError, match="stored shape"):
    Checkpointer(tmp_path).restore(like, 3)
  time.sleep(0.5)  # reads left running would end within this on their own threads
  gc.collect()
  assert [repr(u.exc_value) for u in unraisable] == []


# ----------------------------------------------------------------------------- metrics.jsonl


def _log(run_dir, resume_step):
  return logs.MetricsLog(run_dir, OmegaConf.create({"name": "none"}), {}, resume_step)


def test_metrics_log_resumes_at_the_checkpoint(tmp_path):
  """On resume metrics.jsonl keeps the events up to the checkpoint's step, as written, and
  the wall clock continues from the last one kept."""
  first = _log(tmp_path, None)
  for step in range(1, 7):
    first.write("train", step, train_loss=1.0 / step, lr=np.float32(0.1))
    if step % 3 == 0:
      first.write("eval", step, val_accuracy=float("inf"), val_loss=float("nan"))
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  resumed = _log(tmp_path, 4)
  kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert kept == [line for line in lines if json.loads(line)["step"] <= 4]
  assert resumed.wall_offset == json.loads(kept[-1])["wall_time_s"]
  resumed.write("train", 5, train_loss=0.2)
  assert [e["step"] for e in run_record.read_events(tmp_path)] == [1, 2, 3, 3, 4, 5]
  _log(tmp_path, None)  # a fresh start drops the old log
  assert not (tmp_path / "metrics.jsonl").exists()


def test_metrics_log_refuses_a_damaged_log_naming_the_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"event": "train", "step": 1}\n{"event": "tr\n')
  with pytest.raises(run_record.RunDirError, match=r"metrics.jsonl, line 2: not JSON"):
    _log(tmp_path, 1)


# ----------------------------------------------------------------------------- batch order


def test_batch_order_is_a_pure_function_of_seed_and_epoch():
  """A resumed run sees the batches of an uninterrupted one: the order of an epoch depends
  only on (seed, epoch), and is a permutation of the training examples."""
  task = build_task(config("experiment=demo"))
  p = task.batch_order(7, 3)
  assert p.dtype == np.int32
  np.testing.assert_array_equal(np.sort(p), np.arange(task.num_train))
  np.testing.assert_array_equal(p, build_task(config("experiment=demo")).batch_order(7, 3))
  assert not np.array_equal(p, task.batch_order(7, 4))
  assert not np.array_equal(p, task.batch_order(8, 3))


@pytest.fixture(scope="module")
def damaged_run(tmp_path_factory):
  """A demo run with checkpoints 2 and 4 whose checkpoint 4 has one damaged file."""
  run_dir = tmp_path_factory.mktemp("damaged") / "run"
  overrides = [*RUN, "optimizer=adam", "checkpoint_every=2"]
  train.train(config(*overrides), run_dir, stop=lambda step: None)
  (run_dir / ".hydra").mkdir()
  OmegaConf.save(config(*overrides), run_dir / ".hydra" / "config.yaml")  # as train.py does
  (run_dir / "summary.json").unlink()  # a run to resume, not a finished one
  files = sorted(f for f in (run_dir / "checkpoints" / "4").rglob("*") if f.is_file())
  biggest = max(files, key=lambda f: f.stat().st_size)
  biggest.write_bytes(b"garbage")
  return run_dir, overrides


def test_evaluate_names_a_damaged_checkpoint_and_the_intact_one(damaged_run):
  """One line: checkpoint 4 is damaged, 2 is intact, and the command that evaluates it."""
  import evaluate

  run_dir, _ = damaged_run
  with pytest.raises(CheckpointError) as info:
    evaluate.evaluate_run(run_dir)
  message = str(info.value)
  assert "\n" not in message, message
  assert f"checkpoint 4 in {run_dir / 'checkpoints'} cannot be read" in message
  assert (
    f"checkpoint 2 is intact, evaluate it with: evaluate.py run_dir={run_dir} step=2" in message
  )
  assert evaluate.evaluate_run(run_dir, 2)["step"] == 2  # and it is


def test_a_resume_from_a_damaged_checkpoint_says_how_to_resume_from_the_intact_one(damaged_run):
  run_dir, overrides = damaged_run
  folder = run_dir / "checkpoints"
  with pytest.raises(CheckpointError) as info:
    train.train(config(*overrides), run_dir, stop=lambda step: None)
  message = str(info.value)
  assert "\n" not in message, message
  assert f"checkpoint 4 in {folder} cannot be read" in message
  move = f"mv {folder / '4'} {folder / '4'}.damaged"
  assert f"checkpoint 2 is intact, to resume from it move the later ones aside ({move})" in message
  (folder / "4").rename(folder / "4.damaged")  # the fix, as printed
  assert train.train(config(*overrides), run_dir, stop=lambda step: None)["steps"] == 4


@pytest.mark.parametrize("make", [ginger.ginger, ginger.qng])
def test_a_checkpoint_without_the_skipped_counter_restores_from_zero(tmp_path, make):
  """Version 0.1.0's Ginger and QNG states had no ``skipped`` counter: their checkpoints
  restore, the counter at 0 and everything else as saved."""
  params = {k: jnp.ones(s) for k, s in SMALL.items()}
  tx = make(0.1, tau=2)
  state = jax.jit(tx.update)(params, tx.init(params), params)[1]  # one program, not op by op
  is_state = lambda x: isinstance(x, (ginger.ScaleByGingerState, ginger.ScaleByQNGState))  # noqa: E731
  old = jax.tree.map(
    lambda s: s._replace(skipped=None) if is_state(s) else s, state, is_leaf=is_state
  )
  writer = Checkpointer(tmp_path)
  writer.save(3, old)
  writer.wait()
  restored = Checkpointer(tmp_path).restore(tx.init(params), 3)
  jax.tree.map(np.testing.assert_array_equal, restored, state)
