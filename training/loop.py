"""The training loop, for any task of models/tasks.py and any optimizer of training/optimizers.py.

:func:`train` runs (or resumes) one run in a run dir; :func:`evaluate` scores a state on the
task's evaluation split. What the loop runs is made elsewhere, each in a module of its own:
training/run_setup.py builds the run from its config (data, model, optimizer, state),
training/steps.py its jitted programs, training/compilation.py compiles them before the first
step, training/summary.py writes down what summary.json records, training/stopping.py says when
to stop early. All of it reads the run's checked, typed config (``rc``,
training/run_config.py); the raw resolved config (``resolved``) only goes into the run's
records. The loop knows nothing of the task's kind: the task loads its data, orders the
examples of an epoch, forms batches, scores evaluations (generation included), says which
evaluation is the best and counts its forward FLOPs.

A run stops early in four ways, each leaving a summary.json: a NaN/Inf loss (status
"failed", :class:`NonFiniteLossError`), a full disk (a checkpoint or the metrics could not be
written: status "failed", a :class:`~training.errors.DiskFullError` of one line naming the
last good checkpoint, which a rerun resumes from; summary.json only where it still fits),
SIGTERM or SIGINT (a checkpoint at the current step, status "interrupted",
:class:`Interrupted`; a rerun continues bit for bit), or a bug (raised as is).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
from omegaconf import DictConfig, OmegaConf

import ginger
from training import compilation, kappa, logs, profiling, run_record, sharding, summary
from training.checkpoints import Checkpointer, CheckpointError, last_good_in
from training.compilation import CompiledRun
from training.errors import DiskFullError, Interrupted, NonFiniteLossError, disk_full, no_space
from training.evaluation import evaluate
from training.optimizers import divergence_advice
from training.run_config import RunConfig
from training.run_setup import Setup, build, check
from training.steps import TrainState
from training.stopping import StopRequest, agreed, preempted, stop_on_signals

log = logging.getLogger("train")


# ------------------------------------------------------------------------------ the run


def claim_run_dir(run_dir: Path, resolved: dict, resume: bool) -> None:
  """Records the resolved config as the run of ``run_dir``, or refuses (a run of another
  config is there)."""
  run_record.claim(run_dir, resolved, fresh=not resume, write=jax.process_index() == 0)


def train(cfg: DictConfig, run_dir: Path, *, stop: StopRequest | None = None) -> dict[str, Any]:
  """Runs (or resumes) one training run in ``run_dir``; returns its summary.

  ``stop`` is asked after every step whether to stop early (default: on SIGTERM/SIGINT).
  """
  if stop is None:
    with stop_on_signals() as on_signal:
      return train(cfg, run_dir, stop=on_signal)
  run_dir = Path(run_dir)
  rc, plan = check(cfg)
  # What the run records (run.json, summary.json): the config as composed, resolved.
  resolved = OmegaConf.to_container(cfg, resolve=True)
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() != 0:  # process 0 holds the dir for a multi-host run
      return _train(rc, resolved, run_dir, plan, stop)
    with run_record.exclusive(run_dir):
      return _train(rc, resolved, run_dir, plan, stop)
  except OSError as e:  # a write outside the loop's (run.json, a resume's cut of the metrics)
    if not no_space(e):
      raise
    checkpoints = Checkpointer.folder(run_dir)
    raise disk_full(e.filename or run_dir, None, last_good_in(checkpoints), checkpoints) from e


def _train(rc: RunConfig, resolved: dict, run_dir: Path, plan, stop: StopRequest) -> dict:
  """:func:`train` once the run dir is this process's."""
  claim_run_dir(run_dir, resolved, rc.resume)
  began = time.perf_counter()
  setup = build(rc, plan, materialize=False)  # the optimizer state after compiling (_run)
  build_s = time.perf_counter() - began
  log.info(
    "model %s: %s parameters (%s trained)",
    rc.model.name,
    f"{setup.n_model:,}",
    f"{sum(setup.sizes):,}",
  )
  for line in logs.d_pass_lines(rc, setup.fisher_backward):
    log.info(line)
  checkpointer = Checkpointer(run_dir)
  resume_from = checkpointer.latest_step()
  if resume_from is not None and rc.resume:
    finished = run_record.finished_summary(run_dir, resume_from, setup.total_steps)
    if finished is not None:
      log.info("run already complete (%d steps): keeping its summary.json", resume_from)
      return finished
  elif resume_from is not None:
    log.info("resume=false: removing old checkpoints in %s", checkpointer.directory)
    if jax.process_index() == 0:
      shutil.rmtree(checkpointer.directory)
    sharding.sync("removed old checkpoints")
    checkpointer = Checkpointer(run_dir)
    resume_from = None
  start = resume_from or 0

  def initial_state() -> TrainState:
    """The state the first step starts from: built, or restored from the latest checkpoint."""
    if resume_from is None:
      return setup.init_state()
    # Given the builder, restore drops the fresh U before it reads the saved one.
    state = checkpointer.restore(setup.init_state, resume_from, fix=checkpointer.resume_advice)
    if int(state.step) != resume_from:
      raise CheckpointError(
        f"checkpoint {resume_from} in {checkpointer.directory} holds step {int(state.step)}"
      )
    log.info("resumed from %s at step %d", checkpointer.directory, resume_from)
    return state

  metrics = logs.MetricsLog(run_dir, rc.logger, resolved, resume_step=start if start else None)
  try:
    return _run(
      rc, run_dir, setup, initial_state, start, checkpointer, metrics, resolved, stop, build_s
    )
  finally:
    metrics.close()


class _Loop(NamedTuple):
  """What the steps of a run need, fixed for the run."""

  rc: RunConfig
  run_dir: Path
  setup: Setup
  compiled: CompiledRun
  train_arrays: Any  # the whole training set, replicated on every device
  val_arrays: Any
  batch_indices: Callable[[int], jax.Array]  # a step's batch, placed (split on `data`)
  eval_every: int
  metrics: logs.MetricsLog
  checkpointer: Checkpointer
  stop: StopRequest
  evals: list[dict]  # the run's evaluation records so far (a resumed run's included)


@dataclasses.dataclass
class _Position:
  """Where the steps stand: what the run's end reports."""

  state: TrainState
  done: int  # steps done
  last_good: int | None  # the step of the last checkpoint; None: no checkpoint yet
  stopped_by: int | None = None  # the signal that asked the run to stop
  kappa_eps_warned: bool = False  # whether the log said that sigma_max * eps / gamma passed 1
  step_times: list[float] = dataclasses.field(default_factory=list)  # per log interval


def _run(
  rc, run_dir, setup: Setup, initial_state, start, checkpointer, metrics, resolved, stop, build_s
):
  """:func:`_train` once the run is built: compile, train from step ``start``, write down
  summary.json, raise what stopped the run early."""
  task, plan = setup.task, setup.plan
  eval_every = setup.steps_per_epoch if rc.eval_every == "epoch" else rc.eval_every
  evals = (
    [e for e in run_record.read_events(run_dir, strict=True) if e["event"] == "eval"]
    if metrics.writer
    else []
  )
  # The whole dataset on every device; each step gathers its batch by index on the devices.
  train_arrays = sharding.put(task.train_arrays, plan.replicated)
  val_arrays = sharding.put(task.val_arrays, plan.replicated)
  batch_indices = _batch_indices_by_step(setup, rc)
  compiled = compilation.compile_run(
    setup, setup.frozen, train_arrays, val_arrays, batch_indices(start), rc, resolved, start
  )
  # Only now the optimizer state (build(materialize=False)): compile-time scratch and the
  # state (Ginger's U) are never on the device at once.
  state = initial_state()
  record = summary.startup_record(resolved, rc, setup, state, compiled, train_arrays, build_s)
  _log_startup(setup, rc, compiled, record["flops_per_iter"], build_s)
  # What is resident before the first step (state, data, compiled code) and the high-water
  # mark so far (compilation and autotuning): the end's peak_memory_bytes above this one
  # means the training steps or the evaluations raised it.
  before = logs.device_memory()
  record["memory_in_use_before_training_bytes"] = before.get("bytes_in_use")
  record["peak_memory_before_training_bytes"] = before.get("peak_bytes_in_use")
  data = (train_arrays, val_arrays, batch_indices)
  loop = _Loop(rc, run_dir, setup, compiled, *data, eval_every, metrics, checkpointer, stop, evals)
  at = _Position(state, start, checkpointer.latest_step(), agreed(stop(start)))
  failure = _train_steps_until_stopped(loop, at)
  status, error = _status(at, failure, setup.total_steps, checkpointer)
  record |= summary.end_record(
    task, at.state, status, error, setup.total_steps, rc.batch_size, at.step_times, evals
  )
  if jax.process_index() == 0:
    try:
      run_record.write_summary(run_dir, record)
    except OSError as e:  # a failed run's summary is left out where it does not fit
      if not no_space(e):
        raise
      if failure is None and not at.stopped_by:
        path = run_dir / run_record.SUMMARY
        failure = disk_full(path, None, checkpointer.last_good(), checkpointer.directory)
  if failure is not None:
    raise failure
  if at.stopped_by:
    raise Interrupted(error, at.stopped_by)
  return record


def _batch_indices_by_step(setup: Setup, rc: RunConfig) -> Callable[[int], jax.Array]:
  """A step's batch indices, placed on the mesh (split on its ``data`` axis)."""
  batch_size, steps_per_epoch = rc.batch_size, setup.steps_per_epoch
  # One shuffle per epoch, not per step (the order is a pure function of seed and epoch).
  order = functools.lru_cache(maxsize=2)(lambda epoch: setup.task.batch_order(rc.seed, epoch))

  def batch_indices(step):
    epoch, i = divmod(step, steps_per_epoch)
    return setup.plan.indices(order(epoch)[i * batch_size : (i + 1) * batch_size])

  return batch_indices


def _log_startup(setup: Setup, rc: RunConfig, compiled: CompiledRun, flops_per_iter: dict, build_s):
  """The start-up's lines: build and compile times, the run's length and FLOPs per step."""
  log.info(
    "built in %.1f s; %d programs lowered and compiled in %.1f s",
    build_s,
    compiled.count,
    compiled.seconds,
  )
  log.info(
    "%d steps (%d per epoch), batch %d; FLOPs/iter analytic %.3g, XLA %s",
    setup.total_steps,
    setup.steps_per_epoch,
    rc.batch_size,
    flops_per_iter["analytic"],
    flops_per_iter["xla"],
  )
  every = setup.curvature_every
  if every > 1:
    log.info("curvature update on every %d-th step (steps 0, %d, %d, ...)", every, every, 2 * every)


def _train_steps_until_stopped(
  loop: _Loop, at: _Position
) -> NonFiniteLossError | DiskFullError | None:
  """Runs :func:`_train_steps`; returns what ends the run as "failed" (a NaN/Inf loss, a full
  disk), None where it completed or was stopped; raises anything else (a bug)."""
  try:
    _train_steps(loop, at)
  except (NonFiniteLossError, DiskFullError) as e:
    return e
  except OSError as e:  # metrics.jsonl or spectrum.jsonl.gz (named by MetricsLog.write)
    if not no_space(e):
      raise
    checkpointer = loop.checkpointer
    where = e.filename or loop.run_dir
    return disk_full(where, f"step {at.done}", checkpointer.last_good(), checkpointer.directory)
  return None


def _status(at: _Position, failure, total_steps: int, checkpointer) -> tuple[str, str | None]:
  """The run's status and its error message (None where it completed)."""
  if failure is not None:
    return "failed", str(failure)
  if not at.stopped_by:
    return "completed", None
  saved = (
    f"; checkpoint saved in {checkpointer.directory}"
    if at.last_good is not None
    else " (no checkpoint yet)"
  )
  return "interrupted", (
    f"stopped by {signal.Signals(at.stopped_by).name} at step {int(at.state.step)} of "
    f"{total_steps}{saved}. Rerun the same command to continue."
  )


class _Intervals:
  """Wall-clock of the steps between two log steps: the step time of the metrics' train
  records and, the median of its laps, of summary.json."""

  def __init__(self, start: int, step_times: list[float]):
    self.start, self.step_times = start, step_times
    self.restart()

  def restart(self) -> None:
    self.began, self.steps = time.perf_counter(), 0

  def lap(self, done: int) -> float:
    """Seconds since :meth:`restart`, kept as a step time but for the first interval, which
    includes the programs' first runs."""
    elapsed = time.perf_counter() - self.began
    if self.steps and done - self.steps > self.start:  # skip the compile interval
      self.step_times.append(elapsed / self.steps)
    return elapsed


def _train_steps(loop: _Loop, at: _Position) -> None:
  """The steps from ``at.done`` to the end or to a stop request, moving ``at`` along: logs at
  the log steps, evaluates at the evaluation steps, saves at the checkpoint steps and where
  the run is asked to stop; a NaN/Inf loss raises."""
  rc, checkpointer, total = loop.rc, loop.checkpointer, loop.setup.total_steps
  progress = logs.Progress(total, at.done)
  intervals = _Intervals(at.done, at.step_times)
  single = jax.process_count() == 1
  trace = profiling.StepTrace(loop.run_dir / profiling.FOLDER, rc.profile_start, rc.profile_steps)
  try:
    for step in range(at.done, total if at.stopped_by is None else at.done):
      trace.before(step, at.state)
      at.state = _step(loop, at.state, step)
      intervals.steps += 1
      at.done = done = step + 1
      trace.after(done, at.state)
      at_eval = done % loop.eval_every == 0 or done == total
      at_ckpt = done % rc.checkpoint_every == 0 or done == total
      at_log = done % rc.log_every == 0 or at_eval or at_ckpt
      at.stopped_by = _stop_request(loop.stop, done, total, single, at_log)
      if at_log or at.stopped_by:
        stats = jax.device_get(at.state.stats)
        if stats["nonfinite"]:
          raise NonFiniteLossError(_nonfinite_message(rc, done, stats, at.last_good, checkpointer))
      if at_log:
        ratios = _log_train(
          loop, at.state, stats, done, intervals.lap(done), intervals.steps, progress
        )
        at.kappa_eps_warned = at.kappa_eps_warned or kappa.warn_once(loop.rc, ratios, done)
      elif progress.due():  # no terminal, log steps far apart: a line with rate and ETA
        progress.update(done, loss=float(jax.device_get(at.state.stats["last_loss"])))
      if at_eval:
        _evaluate_and_log(loop, at.state, stats, done, progress)
      if single and at_log:
        # A failed save stops the run at the log step that finds it failed (a write fails
        # while the loop waits for the device, which it does at log steps), not at the next
        # save; the steps between log steps stay free of host work.
        checkpointer.check()
      if at_ckpt or at.stopped_by:
        checkpointer.save(done, at.state)
        at.last_good = done
      if at.stopped_by:
        break
      if at_log:
        intervals.restart()
  finally:
    trace.close()
    progress.close()
    compilation.wait_for_later(loop.compiled.later)
    checkpointer.wait()  # a failed save raises here at the latest


def _step(loop: _Loop, state: TrainState, step: int) -> TrainState:
  """Step ``step`` (0-based): the training step with or without the curvature update, and
  Ginger's re-orthonormalisation after it where one falls due."""
  run_step = loop.compiled.steps[loop.setup.updates_curvature(step)]
  state = run_step(state, loop.setup.frozen, loop.train_arrays, loop.batch_indices(step))
  if loop.setup.reorthonormalises_after(step):
    state = loop.compiled.later["reorthonormalise"].result()(state)
  return state


def _stop_request(stop: StopRequest, done: int, total: int, single: bool, at_log: bool):
  """The signal that stops the run after step ``done``, or None. Multi-host: on the step
  JAX's runtime agreed on after a SIGTERM, or a request all processes agree on at a log step."""
  if done < total and not single and preempted(done):
    return signal.SIGTERM
  if done < total and (single or at_log):  # multi-host: agree at the log steps
    return agreed(stop(done))
  return None


def _log_train(
  loop: _Loop, state, stats, done: int, elapsed: float, steps: int, progress
) -> dict[str, float]:
  """A log step's train record (``steps`` steps in ``elapsed`` seconds since the last one), the
  progress line, and every ``spectrum_every`` steps the curvature's spectrum. Returns Ginger's
  ``sigma_max * eps / gamma`` per block (``training.kappa.block_ratios``; {} for the other
  optimizers), whose largest the train record holds as ``kappa_eps``."""
  rc = loop.rc
  ratios = kappa.block_ratios(rc, state)
  loop.metrics.write(
    "train",
    done,
    train_loss=stats["last_loss"],
    min_train_loss=stats["loss_min"],
    grad_norm=stats["grad_norm"],
    **{k: stats[k] for k in ("clip_fraction",) if k in stats},
    lr=loop.setup.schedule(done - 1),
    epoch=done / loop.setup.steps_per_epoch,
    step_time_s=elapsed / max(steps, 1),
    examples_per_s=rc.batch_size * steps / max(elapsed, 1e-9),
    **({"kappa_eps": max(ratios.values())} if ratios else {}),
  )
  progress.update(done, loss=float(stats["last_loss"]))
  if rc.spectrum_every and done % rc.spectrum_every == 0:
    spectrum = jax.device_get(ginger.curvature_spectrum(state.opt_state))
    if spectrum:
      by_block = {"kappa_eps": ratios} if ratios else {}
      loop.metrics.write(
        "spectrum", done, sigma={k: v.tolist() for k, v in spectrum.items()}, **by_block
      )
  return ratios


def _evaluate_and_log(loop: _Loop, state, stats, done: int, progress) -> None:
  """An evaluation step's eval record (with the mean training loss so far) and its line."""
  setup = loop.setup
  result = evaluate(
    setup.task,
    loop.compiled.eval_step,
    state,
    setup.frozen,
    loop.val_arrays,
    loop.rc,
    setup.eval_weights,
    loop.train_arrays,
  )
  epoch_mean = float(stats["loss_sum"] / max(int(stats["loss_count"]), 1))
  record = loop.metrics.write("eval", done, **result, train_loss_mean=epoch_mean)
  loop.evals.append(record)
  progress.line(
    f"step {done}/{setup.total_steps} "
    + " ".join(f"{k}={v:.4g}" for k, v in result.items() if isinstance(v, float))
  )


def _nonfinite_message(rc, done: int, stats, last_good: int | None, checkpointer) -> str:
  where = (
    f"The last good checkpoint is step {last_good} in {checkpointer.directory}."
    if last_good is not None
    else f"No checkpoint was saved before it (checkpoint_every={rc.checkpoint_every})."
  )
  return (
    f"the training loss became NaN/Inf at or before step {done} (last loss "
    f"{stats['last_loss']}); {divergence_advice(rc)}. {where}"
  )
