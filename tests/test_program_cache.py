"""training.program_cache: a program kept on disk is read back without tracing, computes what
the traced program computes, donates what it donated, and is keyed by everything that changes
it. (A whole run reading its programs back: tests/test_startup.py.)"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from training import program_cache

CONFIG = {"lr": 0.1, "tau": 8, "seed": 0, "logger": "none"}


def make_step(traced: list):
  """A jitted step that donates its state and counts how often Python traces it."""

  def step(state, x):
    traced.append(1)
    new = {"w": state["w"] - 0.1 * x.T @ jnp.tanh(x @ state["w"]), "n": state["n"] + 1}
    return new, jnp.sum(new["w"] ** 2)

  return jax.jit(step, donate_argnums=0)


def arguments():
  state = {"w": jnp.arange(12.0).reshape(4, 3) / 10, "n": jnp.zeros([], jnp.int32)}
  return state, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def lower(fn, args, folder, config=CONFIG):
  return program_cache.lower(
    fn, args, name="train_step", donate_argnums=(0,), config=config, folder=folder
  )


def test_a_program_kept_is_read_back_without_tracing_and_computes_the_same(tmp_path):
  traced: list = []
  step = make_step(traced)
  state, x = arguments()
  want = jax.device_get(step.lower(state, x).compile()(*arguments()))
  first, how = lower(step, (state, x), tmp_path)
  assert how == "exported" and len(list(tmp_path.iterdir())) == 1
  count = len(traced)
  second, how = lower(make_step(traced), (state, x), tmp_path)  # a fresh function: no jit cache
  assert how == "read" and len(traced) == count  # Python did not run
  for lowered in (first, second):
    state, x = arguments()
    got = jax.device_get(lowered.compile()(state, x))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)  # the same program: the same bits
    assert state["w"].is_deleted()  # the state is still donated


@pytest.mark.parametrize(
  "change",
  ["config", "shape", "dtype", "donation", "name", "sources"],
)
def test_what_changes_the_program_changes_the_key(change, monkeypatch):
  state, x = arguments()
  args, config, donate, name = (state, x), dict(CONFIG), (0,), "train_step"
  before = program_cache.key(name, args, donate, config)
  if change == "config":
    config["lr"] = 0.2
  elif change == "shape":
    args = (state, jnp.zeros((3, 4)))
  elif change == "dtype":
    args = (state, x.astype(jnp.bfloat16))
  elif change == "donation":
    donate = ()
  elif change == "name":
    name = "precondition_step"
  else:
    monkeypatch.setattr(program_cache, "source_digest", lambda: "edited")
  assert program_cache.key(name, args, donate, config) != before


def test_what_only_changes_the_arguments_values_keeps_the_key():
  """Another seed (the initial state and key are arguments), another logger or run name: the
  same program, read back."""
  state, x = arguments()
  before = program_cache.key("train_step", (state, x), (0,), CONFIG)
  other = {**CONFIG, "seed": 1, "logger": "wandb", "name": "other"}
  assert program_cache.key("train_step", (state, x + 1), (0,), other) == before


def test_a_damaged_file_is_traced_again_and_replaced(tmp_path, caplog):
  state, x = arguments()
  lower(make_step([]), (state, x), tmp_path)
  (path,) = tmp_path.iterdir()
  path.write_bytes(b"not a program")
  with caplog.at_level(logging.WARNING, logger="train"):
    _, how = lower(make_step([]), (state, x), tmp_path)
  assert how == "exported" and "could not be read back" in caplog.text
  assert lower(make_step([]), (state, x), tmp_path)[1] == "read"


def test_a_program_with_a_host_callback_is_traced_without_the_cache(tmp_path, caplog):
  """A host callback is a Python object of the process that traced it: not kept."""

  @jax.jit
  def step(state, x):
    jax.debug.callback(lambda v: None, x)
    return state, jnp.sum(x)

  state, x = arguments()
  with caplog.at_level(logging.WARNING, logger="train"):
    lowered, how = program_cache.lower(
      step, (state, x), name="train_step", donate_argnums=(), config=CONFIG, folder=tmp_path
    )
  assert how == "traced" and "could not be exported" in caplog.text
  assert not tmp_path.exists() or not list(tmp_path.iterdir())
  lowered.compile()(state, x)


def test_the_data_is_part_of_the_key():
  """Constants computed from the data (the images' mean and std) are baked into the steps:
  another dataset at the same path (same config, same shapes) is another program. The model's
  parameters (JAX arrays, arguments of the steps: another seed) are not."""
  import dataclasses

  @dataclasses.dataclass
  class Task:
    train_arrays: dict
    mean: np.ndarray
    model: dict
    name: str = "images"

  images = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
  task = Task({"images": images}, np.array([0.5, 0.4], np.float32), {"w": jnp.ones(3)})
  before = program_cache.data_digest(task)
  assert program_cache.data_digest(dataclasses.replace(task, model={"w": jnp.zeros(3)})) == before
  other_mean = dataclasses.replace(task, mean=np.array([0.5, 0.3], np.float32))
  other_images = dataclasses.replace(task, train_arrays={"images": images[::-1].copy()})
  for other in (other_mean, other_images):
    assert program_cache.data_digest(other) != before
  state, x = arguments()
  keys = {
    program_cache.key("train_step", (state, x), (0,), CONFIG, data=program_cache.data_digest(t))
    for t in (task, other_mean)
  }
  assert len(keys) == 2


@pytest.mark.slow  # ~40 s on 2 cores: a process on 4 simulated devices, two demo runs
def test_a_sharded_run_reads_its_programs_back(tmp_path):
  """The demo with the batch and Ginger's state split over 4 devices: the first run keeps its
  programs, the second reads them back (their shardings are part of the module) and logs the
  same numbers."""
  from cpu_devices import run_on_cpu_devices

  out = run_on_cpu_devices(
    """
    import json, sys
    from pathlib import Path
    from hydra import compose, initialize_config_dir
    from training import loop, run_record
    root = Path(sys.argv[1])
    overrides = ["experiment=demo", "optimizer=ginger", "logger=none", "max_steps=3",
                 "eval_every=3", "batch_size=32", "spectrum_every=0", "mesh.data=4",
                 "mesh.min_shard_size=16384", f"compilation_cache_dir={root / 'cache'}"]
    with initialize_config_dir(config_dir=str(Path.cwd() / "configs"), version_base=None):
      cfg = compose(config_name="config", overrides=overrides)
    out = {}
    for run in ("first", "second"):
      loop.train(cfg, root / run, stop=lambda step: None)
      summary = run_record.read_summary(root / run)
      out[run] = {
        "how": sorted({p["program"] for p in summary["startup_s"]["per_program"].values()}),
        "mesh": summary["mesh"]["shape"],
        "events": [
          [e.get("train_loss"), e.get("val_loss")] for e in run_record.read_events(root / run)
        ],
      }
    print(json.dumps(out))
    """,
    str(tmp_path),
    timeout=600,
  )
  assert out["first"]["how"] == ["exported"] and out["second"]["how"] == ["read"]
  assert out["first"]["mesh"] == out["second"]["mesh"] == {"data": 4, "model": 1}
  assert out["first"]["events"] == out["second"]["events"]
