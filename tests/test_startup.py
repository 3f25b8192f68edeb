"""Start-up: the training loop compiles every program a run needs before its first step, in
threads (one training step first, the others at once after it), and the executables compute
what compiling them one after the other gives.

Checked on the demo experiment (curvature_every = 3: the step with the curvature update, the
step without it, the evaluation step and Ginger's re-orthonormalisation): no training or
evaluation program is compiled after the first step (before, the evaluation step compiled at
the first evaluation, in the middle of training), :func:`training.compilation.compile_all` really
compiles in that order, and a run whose programs were compiled concurrently logs exactly the
numbers of one compiled one after the other.
"""

import contextlib
import json
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from abstract_gpu import abstract_h200
from conftest import SELECTED_ITEMS
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import compilation, sharding
from training import loop as train
from training.steps import eval_batch_sizes

ROOT = Path(__file__).resolve().parents[1]
BASE = [
  "experiment=demo",
  "optimizer=ginger",
  "curvature_every=3",
  "logger=none",
  "log_every=1",
  "spectrum_every=0",
  "eval_every=2",
  "checkpoint_every=100",
  "max_steps=4",
  "eval_batch_size=100",  # the digits' 359 test images: batches of 100 and one of 59
]
PROGRAMS = ("jit(step)", "jit(eval_step)")  # the training steps and the evaluation step


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


@contextlib.contextmanager
def backend_compiles():
  """The names of the programs XLA compiles inside the block (a list, filled as they are)."""
  compiled: list[str] = []

  def listen(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(kwargs.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def events(run_dir: Path) -> list[dict]:
  """metrics.jsonl without its wall-clock fields."""
  out = []
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    event = json.loads(line)
    out.append({k: v for k, v in event.items() if k not in ("wall_time_s", "step_time_s")})
  return [{k: v for k, v in e.items() if k != "examples_per_s"} for e in out]


def run_logging_compiles(run_dir: Path, monkeypatch, threads) -> list[tuple]:
  """Trains the demo run and returns, in order, ``("compiled", name)`` for every XLA
  compilation (JAX's backend-compile event, also for ahead-of-time compilations) and
  ``("stop asked", step)`` for every time the loop asked whether to stop (once before the
  first step, then after every step)."""
  monkeypatch.setattr(compilation, "COMPILE_THREADS", threads)
  log: list[tuple] = []

  def compiled(event, start, end, **kwargs):
    del start, end
    if event == "/jax/core/compile/backend_compile_duration":
      log.append(("compiled", kwargs.get("fun_name")))

  def stop(step):
    log.append(("stop asked", step))

  jax.monitoring.register_event_time_span_listener(compiled)
  try:
    train.train(config(*BASE), run_dir, stop=stop)
  finally:
    jax.monitoring.unregister_event_time_span_listener(compiled)
  return log


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
  """The demo trained with its programs compiled concurrently (the loop's default) and, where
  this run's selected tests ask for it, one after the other."""
  items = request.config.stash[SELECTED_ITEMS]
  which = {
    item.callspec.params["which"]
    for item in items
    if item.originalname == "test_every_program_is_compiled_before_the_first_step"
  }
  one_by_one = "one_by_one" in which or any(
    item.originalname == "test_concurrent_compilation_changes_no_number" for item in items
  )
  root = tmp_path_factory.mktemp("startup")
  out = {"root": root}
  with pytest.MonkeyPatch.context() as monkeypatch:
    out["concurrent"] = run_logging_compiles(root / "concurrent", monkeypatch, None)
    if one_by_one:
      out["one_by_one"] = run_logging_compiles(root / "one_by_one", monkeypatch, 1)
  return out


# The run compiled one program after the other (~10 s more): `make test-all`. It reads every
# program from the compilation cache that the concurrent run has just filled (the suite's), so
# it runs the very executables of that run; `make test` keeps the loop's concurrent start-up
# end to end and compile_all's one-by-one path (test_compile_all_one_by_one).
_ONE_BY_ONE = pytest.mark.slow


@pytest.mark.parametrize("which", ["concurrent", pytest.param("one_by_one", marks=_ONE_BY_ONE)])
def test_every_program_is_compiled_before_the_first_step(runs, which):
  """Both training steps and the evaluation step (both of its batch sizes) are compiled before
  the loop first asks whether to stop, i.e. before step 0 runs; none is compiled later."""
  log = runs[which]
  first_stop = log.index(("stop asked", 0))
  before = [name for kind, name in log[:first_stop] if kind == "compiled" and name in PROGRAMS]
  after = [name for kind, name in log[first_stop:] if kind == "compiled" and name in PROGRAMS]
  assert sorted(before) == ["jit(eval_step)"] * 2 + ["jit(step)"] * 2
  assert after == []
  # Ginger's re-orthonormalisation, first needed after its 1000th curvature update, is not
  # compiled by a run of 4 steps (training.compilation.LATER; tests/test_loop_reorthonormalise.py).
  assert "jit(reorthonormalise)" not in [name for _, name in log]
  assert [step for kind, step in log if kind == "stop asked"] == [0, 1, 2, 3]  # 4 steps ran


@_ONE_BY_ONE
def test_concurrent_compilation_changes_no_number(runs):
  """Losses, gradient norms, evaluations: the run whose programs compiled concurrently logs
  exactly what the run compiled one program after the other logs."""
  concurrent = events(runs["root"] / "concurrent")
  assert [e["event"] for e in concurrent].count("eval") == 2
  assert concurrent == events(runs["root"] / "one_by_one")


def test_ahead_of_time_evaluation_equals_the_jitted_one():
  """The evaluation step's executable compiled ahead of time gives bit for bit the statistics
  of the jitted function (which the loop used before, and still uses for other sizes)."""
  setup = train.build(config(*BASE))
  arrays = sharding.put(setup.task.val_arrays, setup.plan.replicated)
  state = setup.state
  idx = np.arange(100)
  lowered = setup.eval_step.lower(state.trainable, setup.frozen, state.rest, arrays, idx)
  ahead = setup.eval_step.with_compiled({100: lowered.compile()})
  assert ahead.compiled and not setup.eval_step.compiled
  got = jax.device_get(ahead(state.trainable, setup.frozen, state.rest, arrays, idx))
  want = jax.device_get(setup.eval_step(state.trainable, setup.frozen, state.rest, arrays, idx))
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize(
  ("num_val", "batch_size", "sizes"),
  [(360, 100, [100, 60]), (360, 360, [360]), (360, 500, [360]), (10000, 500, [500]), (0, 5, [])],
)
def test_eval_batch_sizes_are_those_evaluate_runs(num_val, batch_size, sizes):
  ran = {min(batch_size, num_val - start) for start in range(0, num_val, batch_size)}
  assert sorted(eval_batch_sizes(num_val, batch_size), reverse=True) == sizes
  assert set(sizes) == ran


class _Lowered:
  """Stands in for a lowered program: compiling waits until ``barrier``'s other parties are
  compiling too (with compilations one after the other it never returns; the timeout only
  turns that hang into an error), and records which compilations were in flight."""

  def __init__(self, name, barrier, log):
    self.name, self.barrier, self.log = name, barrier, log
    log.append(("lowered", name, threading.current_thread() is threading.main_thread()))

  def compile(self):
    self.log.append(("compiling", self.name))
    self.barrier.wait()
    self.log.append(("compiled", self.name))
    return f"executable of {self.name}"


def test_compile_all_compiles_the_first_alone_then_the_others_at_once():
  """The first program (the training step) compiles alone while the others are lowered, in
  the calling thread and in the order given; then the others compile at once (each waits for
  the others at a barrier), after the first is done: on a GPU they read its autotuned kernels
  instead of autotuning the same convolutions beside it."""
  names = ["train", "precondition", "eval"]
  log: list = []
  lowered_all = threading.Event()
  first_saw: list = []

  class First(_Lowered):
    def compile(self):
      # Lowering the others does not wait for this compilation to end.
      first_saw.append(lowered_all.wait(timeout=120))
      return super().compile()

  others = threading.Barrier(len(names) - 1, timeout=120)

  def lower(n):
    if n == "train":
      return First(n, threading.Barrier(1), log)
    program = _Lowered(n, others, log)
    if n == names[-1]:
      lowered_all.set()
    return program

  times: dict = {}
  got = compilation.compile_all({n: (lambda n=n: lower(n)) for n in names}, times=times)
  assert got == {n: f"executable of {n}" for n in names}
  assert first_saw == [True]
  assert [e for e in log if e[0] == "lowered"] == [("lowered", n, True) for n in names]
  compiles = [e for e in log if e[0] != "lowered"]
  assert compiles[:2] == [("compiling", "train"), ("compiled", "train")]
  assert {e[1] for e in compiles[2:4]} == set(names[1:]) and compiles[2][0] == compiles[3][0]
  assert compiles[2][0] == "compiling"
  # Each program's lowering and compilation timed (the compilations overlap).
  assert set(times) == set(names)
  assert all(set(t) == {"lower", "compile"} and min(t.values()) >= 0 for t in times.values())


@pytest.mark.parametrize(("every", "first"), [(3, False), (1, True)])
def test_the_step_without_curvature_update_compiles_first(every, first):
  """``programs`` lists first the program :func:`compile_all` compiles alone: with
  ``curvature_every`` > 1 the step without the curvature update, which lowers in a quarter of
  the training step's time and autotunes the convolutions both share, so that the training
  step compiles after it reading them (one H200, Ginger K=8: 12.9-14.0 s for all programs
  against 14.5-15.0 s with the training step first); else the training step."""
  cfg = config(*BASE, f"curvature_every={every}")
  setup = train.build(cfg)
  arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
  val = sharding.put(setup.task.val_arrays, setup.plan.replicated)
  idx = setup.plan.indices(np.arange(int(cfg.batch_size)))
  resolved = OmegaConf.to_container(cfg, resolve=True)
  keys = list(
    compilation.programs(setup, setup.state, setup.frozen, arrays, val, idx, setup.rc, resolved)
  )
  assert keys[0] is first
  assert (False in keys) == (every > 1) and True in keys


def test_compile_all_one_by_one():
  lower = {n: (lambda n=n: _Lowered(n, threading.Barrier(1), [])) for n in ("a", "b")}
  assert compilation.compile_all(lower, threads=1) == {
    "a": "executable of a",
    "b": "executable of b",
  }


# ---- compilation_cache_dir -------------------------------------------------------------------


@pytest.mark.slow  # two processes (~40 s); the same program for another seed is fast
def test_compilation_cache_dir_keeps_the_steps_for_a_later_process(tmp_path):
  """train.py with ``compilation_cache_dir`` (and no JAX_COMPILATION_CACHE_DIR: the test
  suite's own cache is off in the child) writes the compiled training and evaluation steps
  into that folder, and their lowered programs into its ``programs/``
  (training/program_cache.py). A later process (this one) with the same configuration reads
  every program back instead of tracing it, and logs exactly the child's numbers."""
  import os
  import subprocess
  import sys

  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # store every program
  cache = tmp_path / "compiled"
  overrides = [
    "experiment=demo",
    "optimizer=adam",
    "logger=none",
    "max_steps=2",
    "eval_every=1",
    "spectrum_every=0",
    f"compilation_cache_dir={cache}",
  ]
  out = subprocess.run(
    [sys.executable, "train.py", *overrides, f"hydra.run.dir={tmp_path / 'first'}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  names = [p.name for p in cache.iterdir()]
  assert any(n.startswith("jit_step") for n in names), names
  assert any(n.startswith("jit_eval_step") for n in names), names
  kept = sorted(p.name.split("-")[0] for p in (cache / "programs").iterdir())
  assert kept == ["eval_step[359]", "train_step"], kept  # the digits' 359 test images
  assert programs_of(tmp_path / "first") == {"exported"}

  with cache_settings_restored():
    train.train(config(*overrides), tmp_path / "second", stop=lambda step: None)
  assert programs_of(tmp_path / "second") == {"read"}
  assert events(tmp_path / "second") == events(tmp_path / "first")


@contextlib.contextmanager
def cache_settings_restored():
  """JAX's settings that ``compilation.use_compilation_cache`` changes (process-wide), as they were
  before the block: the suite's other tests keep the suite's cache."""
  names = ["jax_compilation_cache_dir", "jax_hlo_source_file_canonicalization_regex"]
  saved = [getattr(jax.config, n) for n in names]
  try:
    yield
  finally:
    for n, v in zip(names, saved, strict=True):
      jax.config.update(n, v)


def programs_of(run_dir: Path) -> set:
  """How the run's programs were lowered (summary.json: "read", "exported" or "traced")."""
  from training import run_record

  per_program = run_record.read_summary(run_dir)["startup_s"]["per_program"]
  return {t["program"] for t in per_program.values()}


def test_the_cached_ginger_kernels_do_not_depend_on_where_the_checkout_is(tmp_path):
  """A Pallas kernel's Triton module (inside the program, so inside the cache key) records its
  source file paths: with the cache on, they are relative to the repository, so that another
  copy of the checkout reads the programs this one wrote (a copy of the tree compiled the
  Ginger steps anew on a GPU: 10 s instead of 4)."""
  import functools

  import jax.numpy as jnp

  from ginger._src import kernels

  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(1, 1000, 8), (1, 8), (1, 1000)]]
  fn = jax.jit(functools.partial(kernels.precondition, gamma=1e-5, impl="pallas", interpret=False))

  def text():
    with abstract_h200():
      return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  assert f"{ROOT}/ginger/_src/pallas_passes.py" in text()  # the kernels carry their source paths
  with cache_settings_restored():
    compilation.use_compilation_cache(str(tmp_path / "cache"))
    lowered = text()
  assert str(ROOT) not in lowered and "ginger/_src/pallas_passes.py" in lowered


def test_compilation_cache_dir_is_not_part_of_the_run():
  """Where compiled programs are cached changes neither the run-dir fingerprint (a run resumes
  with or without the cache) nor the run dir's name."""
  from training import run_record

  plain = config(*BASE)
  cached = config(*BASE, "compilation_cache_dir=/tmp/somewhere")
  assert run_record.fingerprint(plain) == run_record.fingerprint(cached)
  hydra = OmegaConf.load(ROOT / "configs" / "config.yaml").hydra
  assert "compilation_cache_dir" in hydra.job.config.override_dirname.exclude_keys


def test_the_default_cache_is_the_users(monkeypatch, tmp_path):
  """By default every run of a user shares one cache folder, so every run after the first
  starts warm: ``$GINGER_COMPILATION_CACHE_DIR``, else ``compiled/`` in the data cache
  (``$GINGER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ginger``, else ``~/.cache/ginger``);
  ``GINGER_COMPILATION_CACHE_DIR=none`` (or empty) and ``compilation_cache_dir=null`` turn it
  off."""
  from training import run_record
  from training.config_check import check_config

  monkeypatch.delenv("GINGER_COMPILATION_CACHE_DIR")
  monkeypatch.delenv("GINGER_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert config(*BASE).compilation_cache_dir == str(tmp_path / "xdg" / "ginger" / "compiled")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  expected = tmp_path / "home" / ".cache" / "ginger" / "compiled"
  assert run_record.user_compilation_cache_dir() == str(expected)
  monkeypatch.setenv("GINGER_CACHE_DIR", str(tmp_path / "data"))
  assert config(*BASE).compilation_cache_dir == str(tmp_path / "data" / "compiled")
  monkeypatch.setenv("GINGER_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
  assert config(*BASE).compilation_cache_dir == str(tmp_path / "mine")
  for off in ("none", "", "OFF"):
    monkeypatch.setenv("GINGER_COMPILATION_CACHE_DIR", off)
    assert config(*BASE).compilation_cache_dir is None
  monkeypatch.setenv("GINGER_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
  cfg = config(*BASE, "compilation_cache_dir=null")
  check_config(cfg)
  assert cfg.compilation_cache_dir is None


@pytest.mark.parametrize("value", ["5", "''"])
def test_bad_compilation_cache_dir_is_refused(value):
  from training.config_check import ConfigError, check_config

  with pytest.raises(ConfigError, match="compilation_cache_dir=.*: must be a non-empty string"):
    check_config(config(*BASE, f"compilation_cache_dir={value}"))


def test_another_seed_is_the_same_program():
  """What lets the cache serve the other seeds of a sweep: the seed enters the steps as an
  argument (the state's parameters and key), so both seeds lower to the same program text,
  which is the cache's key (with the devices and the compiler's version and options)."""
  texts = []
  for seed in (0, 1):
    setup = train.build(config(*BASE, f"seed={seed}"))
    arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
    val = sharding.put(setup.task.val_arrays, setup.plan.replicated)
    idx = setup.plan.indices(np.arange(64))  # the demo's batch_size
    resolved = OmegaConf.to_container(config(*BASE), resolve=True)
    lower = compilation.programs(
      setup, setup.state, setup.frozen, arrays, val, idx, setup.rc, resolved
    )
    texts.append({key: fn().as_text() for key, fn in lower.items()})
  assert texts[0].keys() == texts[1].keys() and len(texts[0]) == 5
  for key in texts[0]:
    assert texts[0][key] == texts[1][key], key


def test_the_initial_state_compiles_no_program_of_its_own(monkeypatch):
  """Beside the model's initialisation and the optimizer state's one program, building the
  run's initial state compiles nothing: its counters are host values and its key is drawn on
  the host's CPU, as the model's was (op by op on a GPU, each scalar compiled a program of
  its own for the device: five at every start-up). The values are those of the plain
  definitions, dtypes and weak types included."""
  from training import run_setup

  built = {}
  real = run_setup.initial_state

  def initial_state(*args, **kwargs):
    with backend_compiles() as compiled:
      out = real(*args, **kwargs)
    built["compiled"], built["state"] = compiled, out[0]
    return out

  monkeypatch.setattr(run_setup, "initial_state", initial_state)
  jax.clear_caches()  # cold, as a fresh process is
  run_setup.build(config(*BASE, "seed=7"), materialize=False)
  assert built["compiled"] == []
  state = built["state"]
  zero = jnp.zeros([], jnp.float32)
  want = {
    "step": jnp.zeros([], jnp.int32),
    "key": jax.random.key_data(jax.random.key(7)),
    "loss_min": jnp.asarray(jnp.inf, jnp.float32),
    "loss_sum": zero,
    "loss_count": jnp.zeros([], jnp.int32),
    "nonfinite": jnp.zeros([], bool),
    "last_loss": zero,
    "grad_norm": zero,
    "clip_fraction": zero,  # Ginger's clip is on (rho = 1)
  }
  got = {"step": state.step, "key": jax.random.key_data(state.rng), **state.stats}
  assert got.keys() == want.keys()
  for name, value in want.items():
    assert isinstance(got[name], jax.Array), name  # placed on the run's devices
    assert (got[name].dtype, got[name].weak_type) == (value.dtype, value.weak_type), name
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


@pytest.mark.parametrize("optimizer", ["ginger", "adam"])
def test_optimizer_state_is_initialised_as_op_by_op(optimizer):
  """build() initialises the optimizer state as one jitted program (op by op, Ginger's init
  compiled dozens of small programs at start-up), which gives the very arrays (values, dtypes,
  weak types, structure) of running ``tx.init`` op by op."""
  from training.optimizers import build_optimizer, learning_rate

  cfg = config(*BASE, f"optimizer={optimizer}")
  with backend_compiles() as compiled:
    setup = train.build(cfg)
  assert "jit(init_fn)" in compiled, compiled  # one program, not op by op
  rc = setup.rc
  tx = build_optimizer(rc, learning_rate(rc, setup.steps_per_epoch, setup.total_steps))
  want = tx.init(setup.state.trainable)
  got = setup.state.opt_state
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_summary_reports_the_start_up(runs):
  """summary.json says how long building and compiling took, and how many programs."""
  from training import run_record

  startup = run_record.read_summary(runs["root"] / "concurrent")["startup_s"]
  assert startup["programs"] == 4  # two training steps, the evaluation step at two sizes
  assert startup["build"] > 0 and startup["lower_and_compile"] > 0
  # Per program: every step the run compiled, lowered one after the other.
  per_program = startup["per_program"]
  assert set(per_program) == {"train_step", "precondition_step", "eval_step[100]", "eval_step[59]"}
  assert sum(t["lower"] for t in per_program.values()) <= startup["lower_and_compile"]
