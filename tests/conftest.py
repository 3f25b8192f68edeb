"""Test-wide settings: CPU only, offline, one persistent compilation cache for the whole suite
(and the subprocesses it starts), and an opt-in float64 fixture for dense references."""

import collections
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# Many tests build the same models and steps (in this process and in the train.py / sweep
# subprocesses they start, which inherit these variables): XLA compiles each program once and
# later builds read it from disk, also in the next run. Compilations over 0.25 s are stored
# (the default keeps only those over 1 s, which would miss a demo model's evaluation step;
# storing the thousands of op-by-op programs too costs more than they take to compile);
# JAX_COMPILATION_CACHE_DIR= (empty) turns the cache off.
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
# Runs' own cache (config compilation_cache_dir, by default in the user's ~/.cache/ginger) off:
# a test sees the start-up it sets up, not what an earlier test or the user's runs left behind.
os.environ.setdefault("GINGER_COMPILATION_CACHE_DIR", "none")

import jax  # noqa: E402
import pytest  # noqa: E402

# JAX reads the variables when it is first imported; a plugin may have imported it earlier.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"] or None)
jax.config.update(
  "jax_persistent_cache_min_compile_time_secs",
  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


@pytest.fixture
def x64():
  """float64 inside the test only (other tests compare float32 models with PyTorch)."""
  with jax.enable_x64(True):
    yield


@pytest.fixture
def no_waiting(monkeypatch):
  """Fails the test if its code waits (``time.sleep``: a retry or a back-off) or opens a
  network connection: what "fails fast offline" means, without timing anything."""
  import socket
  import time

  def waited(*args, **kwargs):
    raise AssertionError("the code waited (time.sleep): a retry or back-off, not a fast failure")

  def connected(*args, **kwargs):
    raise AssertionError("the code opened a network connection")

  monkeypatch.setattr(time, "sleep", waited)
  monkeypatch.setattr(socket.socket, "connect", connected)


# `make test` spreads the test files over two pytest-xdist workers (--dist loadfile), by
# default handing out the files with the most tests first: the last ones handed out are then
# files of a few tests, and several of those are among the longest (a process on 4 simulated
# devices, 3000-step scans), so that one worker went on alone for half a minute at the end.
# The files below go first instead, longest first (each file's total on 2 CPU cores with an
# empty compilation cache, from `--durations=0`; those under ~10 s follow in xdist's order).
# The order changes no result; a stale list only balances the two workers less well.
LONGEST_FIRST = (
  "test_train.py",
  "test_ginger.py",
  "test_checkpoints.py",
  "test_curvature_every.py",
  "test_contract.py",
  "test_ginger_kernels_wired.py",
  "test_kappa_eps.py",
  "test_float32_exactness.py",
  "test_sweeps.py",
  "test_fisher_batch.py",
  "test_startup.py",
  "test_kernels.py",
  "test_results_stats.py",  # a property test against statsmodels (~60 ms a call)
  "test_config_check.py",
  "test_batchnorm_groups.py",
  "test_ginger_layout.py",
  "test_t5.py",
  "test_properties.py",
  "test_fisher.py",
  "test_state_memory.py",
  "test_loop_reorthonormalise.py",
  "test_run_config.py",
  "test_registry.py",
  "test_backend.py",
  "test_standin_scale.py",
  "test_soap.py",
  "test_resnet.py",
  "test_qng.py",
  "test_configuration_doc.py",
  "test_sharding_collectives.py",
  "test_secular.py",
  "test_kfac.py",
  "test_install.py",
)


def pytest_configure(config):
  if getattr(config.option, "loadscopereorder", False):  # xdist: our order, not its own
    config.option.loadscopereorder = False


# The tests this run selected (after -m and -k), for module fixtures that build only what
# their selected tests ask for.
SELECTED_ITEMS = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)  # after -m's deselection: xdist counts the tests left
def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  tests = collections.Counter(item.path.name for item in items)
  # A stable sort: each file's tests stay together and in their order.
  items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests[item.path.name]))
  config.stash[SELECTED_ITEMS] = items
  gpu = [item for item in items if item.get_closest_marker("gpu")]
  reason = gpu and gpu_unavailable()  # asks JAX only when a gpu test was selected
  if reason:
    for item in gpu:
      item.add_marker(pytest.mark.skip(reason=reason))


GPU_COMMAND = "JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest -m gpu tests"


def gpu_unavailable() -> str | None:
  """Why the gpu tests cannot run in this process, or None. They need JAX's CUDA backend as the
  default and its CPU backend beside it (their float64 references run there)."""
  try:
    backend = jax.default_backend()
  except (RuntimeError, AssertionError) as error:  # JAX_PLATFORMS=cuda without a GPU
    return f"needs a GPU: JAX found none ({error!s:.80}); run {GPU_COMMAND} with JAX's CUDA build"
  if backend != "gpu":
    return f"needs a GPU: JAX runs on {backend}; run {GPU_COMMAND} with JAX's CUDA build"
  try:
    jax.devices("cpu")
  except RuntimeError:
    return f"needs JAX's CPU backend beside the GPU for the float64 references: {GPU_COMMAND}"
  return None
