"""Lowering and compiling a run's programs ahead of time, before its first step.

:func:`compile_run` is what the training loop calls: every program a run needs
(:func:`programs`) lowered and compiled at once in threads (:func:`compile_all`), those first
needed many steps in (:data:`LATER`) compiled while the run trains (:func:`compile_later`).
Lowering goes through :mod:`training.program_cache` where ``compilation_cache_dir`` is set;
:func:`use_compilation_cache` points JAX's persistent compilation cache there.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from training import program_cache
from training.steps import EvalStep, eval_batch_sizes

log = logging.getLogger("train")


def use_compilation_cache(folder: str | None) -> None:
  """Points JAX's persistent compilation cache at ``folder`` (config ``compilation_cache_dir``;
  None leaves JAX's own setting: off unless ``JAX_COMPILATION_CACHE_DIR`` is set).

  Every program that takes longer to compile than ``jax_persistent_cache_min_compile_time_secs``
  (JAX's default: 1 s; the training and evaluation steps) is written there, keyed by the
  program, its devices and the compiler's version and options, and a later process that
  compiles the same program reads the executable back instead of compiling it: another seed
  of a sweep (the seed is an argument of the step, not part of the program) or a resumed run.
  A change of lr, tau, K, batch size or code is another program and compiles anew. On GPUs
  JAX also keeps XLA's per-fusion autotuning results there, which other programs of the same
  shapes reuse. The executable read back is what this program compiled to before (on a CPU
  the very code a fresh compilation gives; on a GPU with the autotuner's choices of that
  compilation, which a fresh one may make differently, as two fresh ones may): it changes
  start-up time, not the program (compare start-up times only between runs that both hit, or
  both missed, the cache). JAX decides whether to use the cache at a process's first compilation:
  set it before (train.py and evaluate.py do, in ``training.run_setup.check``).
  """
  if folder is None:
    return
  path = Path(folder).expanduser().resolve()
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  # A Pallas kernel's Triton module carries its source locations, file paths included, into
  # the program the cache keys on: keep them relative to the repository, or every other copy
  # of the checkout (another clone, a sweep's copy) compiles the Ginger step anew.
  jax.config.update(
    "jax_hlo_source_file_canonicalization_regex", "^" + re.escape(f"{program_cache.REPO}/")
  )


def programs(setup, state, frozen, train_arrays, val_arrays, indices, rc, resolved) -> dict:
  """The lowerings of every program a run needs, to pass to :func:`compile_all`: ``True``,
  the training step (with the curvature update, if any); ``False``, the step without it
  (``curvature_every`` > 1 only); ``("eval", n)``, the evaluation step on batches of ``n``
  (:func:`training.steps.eval_batch_sizes`); ``"reorthonormalise"``, Ginger's
  ``reorthonormalise_step``.
  ``indices``: a training batch's, placed (``plan.indices``). ``rc``: the run's
  ``training.run_config.RunConfig``; ``resolved``: its resolved config as plain containers,
  which the kept programs' keys hash (:func:`training.program_cache.key`).

  The first is the one :func:`compile_all` compiles alone: with ``curvature_every`` > 1 the
  step without the curvature update, which lowers much faster than the training step and
  autotunes the convolutions both share; the training step, lowered meanwhile, then compiles
  reading them, so the run starts sooner than with the training step first."""
  steps = {False: setup.precondition_step} if setup.curvature_every > 1 else {}
  steps[True] = setup.train_step
  jobs = {key: (fn, (state, frozen, train_arrays, indices), (0,)) for key, fn in steps.items()}
  for size in eval_batch_sizes(setup.task.num_val, rc.eval_batch_size):
    args = setup.eval_step.arguments(
      state.trainable, frozen, state.rest, val_arrays, np.arange(size)
    )
    jobs["eval", size] = (setup.eval_step.jitted, args, ())
  if setup.reorthonormalise_step is not None:
    jobs["reorthonormalise"] = (setup.reorthonormalise_step, (state,), (0,))
  if not rc.compilation_cache_dir:
    return {key: functools.partial(fn.lower, *args) for key, (fn, args, _) in jobs.items()}
  # With a compilation cache, the lowered programs are kept beside it (program_cache).
  folder = program_cache.folder_of(rc.compilation_cache_dir)
  data = program_cache.data_digest(setup.task)

  def cached(key, fn, args, donate):
    lowered, how = program_cache.lower(
      fn,
      args,
      name=program_name(key),
      donate_argnums=donate,
      config=resolved,
      folder=folder,
      data=data,
    )
    return Lowering(lowered, how)

  return {key: functools.partial(cached, key, *job) for key, job in jobs.items()}


class Lowering(NamedTuple):
  """A program lowered through :mod:`training.program_cache`: ``how`` it was (see
  :func:`training.program_cache.lower`); :func:`compile_all` records it."""

  lowered: Any
  how: str

  def compile(self):
    return self.lowered.compile()


# Threads that compile a run's programs (None: one per program; 1: one after the other).
COMPILE_THREADS: int | None = None
# Programs a run first needs many steps in (Ginger's re-orthonormalisation: after
# ginger.default_reorthonormalise_every curvature updates): compiled in a thread of their own
# while the run trains (compile_later), not beside the others before the first step, where
# they would slow the others' compilations and delay the first step; and only by a run that
# gets that far (Setup.first_reorthonormalisation).
LATER = ("reorthonormalise",)


def compile_later(lowering: Callable[[], Any]) -> Future:
  """``lowering().compile()`` in a thread of its own, started now: the executable's future
  (:meth:`~concurrent.futures.Future.result` waits for it where it is first needed)."""
  pool = ThreadPoolExecutor(1, thread_name_prefix="compile-later")
  try:
    return pool.submit(lambda: lowering().compile())
  finally:
    pool.shutdown(wait=False)  # the thread ends when its compilation does


def compile_all(
  lower: dict[Any, Callable[[], Any]], threads: int | None = None, times: dict | None = None
) -> dict:
  """``{key: lower[key]().compile()}``: the first program's compilation alone, then the
  others' at once, in threads.

  Lowering (tracing Python) holds the GIL and runs here, one program after the other; XLA's
  compilation releases it, so the others are lowered while the first (a training step:
  :func:`programs`) compiles. Their compilations start once it is done: on a GPU, XLA's
  autotuner keeps the kernels it timed for the rest of the process, and the other programs
  share most of the first's convolutions, so they read its choices instead of each autotuning
  them again beside the others on the same GPU, where the autotuners' timings slow one
  another. The executables are those that compiling one after the other gives (the same
  programs, the same compiler options).

  ``threads``: at most this many compilations at once (default: all of them; 1: one after the
  other). ``times``: if given, filled with ``{key: {"lower": s, "compile": s}}`` (wall-clock
  seconds of each program's lowering and of its compilation, which overlap the others').
  """
  times = {} if times is None else times

  def lowered(key):
    began = time.perf_counter()
    out = lower[key]()
    times[key] = {"lower": time.perf_counter() - began}
    if isinstance(out, Lowering):
      times[key]["program"] = out.how
    return out

  def compiled(key, program):
    began = time.perf_counter()
    out = program.compile()
    times[key]["compile"] = time.perf_counter() - began
    return out

  threads = len(lower) if threads is None else int(threads)
  if threads < 2 or len(lower) < 2:
    return {key: compiled(key, lowered(key)) for key in lower}
  first, *others = lower
  with ThreadPoolExecutor(min(threads, len(lower)), thread_name_prefix="compile") as pool:
    future = pool.submit(compiled, first, lowered(first))
    programs = {key: lowered(key) for key in others}  # while the first compiles
    out = {first: future.result()}
    futures = {key: pool.submit(compiled, key, program) for key, program in programs.items()}
    return out | {key: future.result() for key, future in futures.items()}


def program_name(key) -> str:
  """A :func:`programs` key as the run record names it."""
  if isinstance(key, bool):
    return "train_step" if key else "precondition_step"
  if key == "reorthonormalise":
    return "reorthonormalise_step"
  return f"eval_step[{key[1]}]"


class CompiledRun(NamedTuple):
  """A run's programs, compiled (:func:`compile_run`)."""

  # The training steps' executables: True, the step with the curvature update (if any);
  # False, the one without (curvature_every > 1 only).
  steps: dict
  eval_step: EvalStep  # with its executables for the evaluation's batch sizes
  later: dict[Any, Future]  # LATER's programs, compiling in threads of their own
  seconds: float  # lowering and compiling all but LATER's, wall-clock
  count: int  # the programs compiled before the first step
  times: dict  # per program: compile_all's times

  def startup_per_program(self) -> dict:
    """Each program's lowering and compilation seconds, by :func:`program_name`, as the run
    record keeps them; with ``compilation_cache_dir`` also ``"program"``: ``"read"`` (kept by
    an earlier run: no tracing), ``"exported"`` (traced and kept) or ``"traced"``."""
    return {
      program_name(key): {k: v if isinstance(v, str) else round(v, 3) for k, v in t.items()}
      for key, t in self.times.items()
    }


def compile_run(
  setup, frozen, train_arrays, val_arrays, indices, rc, resolved, start: int
) -> CompiledRun:
  """Every program of ``setup`` (a ``training.run_setup.Setup``) compiled once, ahead of
  time: the same executable gives XLA's cost/memory analysis and runs every step (calling
  the jitted function would compile a second time). With ``curvature_every`` = K > 1 two
  training steps, with and without the curvature update; the evaluation step too, so that
  the first evaluation does not stop training to compile. ``indices``: the first batch's,
  placed; ``rc``, ``resolved``: as for :func:`programs`; ``start``: the step the run starts at.

  In threads (:func:`compile_all`): the first of :func:`programs` alone (the step without the
  curvature update, else the training step), the others lowered meanwhile and compiled at
  once after it, reading its autotuned kernels; :data:`LATER`'s while the run trains, and
  only where the run gets that far (``Setup.first_reorthonormalisation``).
  """
  began = time.perf_counter()
  lower = programs(setup, setup.state, frozen, train_arrays, val_arrays, indices, rc, resolved)
  later = {key: lower.pop(key) for key in LATER if key in lower}
  times: dict = {}
  executables = compile_all(lower, COMPILE_THREADS, times)
  seconds = time.perf_counter() - began
  first = setup.first_reorthonormalisation(start)
  compiling = {
    key: compile_later(lowering)
    for key, lowering in later.items()
    if first is not None and first < setup.total_steps
  }
  steps = {key: c for key, c in executables.items() if isinstance(key, bool)}
  eval_step = setup.eval_step.with_compiled(
    {key[1]: c for key, c in executables.items() if isinstance(key, tuple)}
  )
  return CompiledRun(steps, eval_step, compiling, seconds, len(lower), times)


def wait_for_later(compiling: dict[Any, Future]) -> None:
  """Waits for :func:`compile_later`'s compilations (no compilation outlives the run: a sweep
  runs the next one in this process); a failed one is logged."""
  futures.wait(compiling.values())
  for key, future in compiling.items():
    if future.exception() is not None:
      log.warning("compiling %s failed: %r", program_name(key), future.exception())
