"""The passes' tuning (ginger._src.tuning.Tuning) is an explicit, hashable argument: a jitted
caller that is given another tuning compiles another program that follows it, and no pass reads
a module global while it is traced (a changed global would otherwise leave jit's cache with a
program of the old value)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

from bench.kernels_check import PASSES, ROTATE_KEYS, call, random_inputs
from ginger._src import common, kernels, lowrank, pallas_passes, tuning
from ginger._src.tuning import DEFAULT, Tuning


def test_tuning_is_frozen_and_hashable():
  a = Tuning(tile_rows={32: 64, 16: 512})
  assert a == DEFAULT and hash(a) == hash(DEFAULT)  # a mapping is kept as its sorted items
  assert Tuning(steps=2) != DEFAULT
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.steps = 2  # type: ignore[misc]


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("min_padded_rank", 12, "min_padded_rank must be a power of two >= 4, got 12"),
    ("rotate_min_padded_rank", 2, "rotate_min_padded_rank must be a power of two >= 4, got 2"),
    ("tile_rows", {16: 24}, r"tile_rows\[16\] must be a power of two >= 16"),
    ("tile_rows", [1, 2], "tile_rows must map padded ranks to rows per tile"),
    ("steps", 0, "steps must be an int >= 1, got 0"),
    ("num_stages", 0, "num_stages must be an int >= 1, got 0"),
    ("jnp_row_blocks", "yes", "jnp_row_blocks must be None, True or False, got 'yes'"),
    ("solo_buckets", 1, "solo_buckets must be None, True or False, got 1"),
    ("bucket_overhead", -1, "bucket_overhead must be an int >= 0, got -1"),
  ],
)
def test_bad_tuning_is_refused_when_made(field, value, message):
  with pytest.raises(ValueError, match=message):
    Tuning(**{field: value})


def test_a_pass_and_the_plan_refuse_what_is_not_a_tuning():
  x = random_inputs(0, 1, 20, 4)
  with pytest.raises(ValueError, match="tuning must be a ginger.Tuning"):
    kernels.project(x["u"], x["g"], impl="pallas", tuning={"steps": 2})
  with pytest.raises(ValueError, match="tuning must be a ginger.Tuning, got 3"):
    common.plan_layout([4], 2, "per_tensor", None, 3)


def _rotate(x, tuning):
  return kernels.rotate_from_residual(*(x[q] for q in ROTATE_KEYS), impl="jnp", tuning=tuning)


def test_the_bucket_plan_follows_the_tuning():
  """One bucket per rank at a large ``bucket_overhead``, one per size at 0; blocks of at least
  ``solo_rows`` rows alone where ``solo_buckets`` says."""
  count = lambda **kw: len(common.plan_layout(SIZES, 2, "per_tensor", None, Tuning(**kw)).buckets)  # noqa: E731
  assert count(bucket_overhead=10**12, solo_buckets=False) == 1
  assert count(bucket_overhead=0, solo_buckets=False) == 6  # the distinct sizes
  assert count(bucket_overhead=10**12, solo_buckets=True) == 1 + 3
  assert count(bucket_overhead=10**12, solo_buckets=True, solo_rows=64) == 1 + 5


def test_another_tuning_is_another_program_that_follows_it():
  """The jnp rotation of this ``U`` (3 x 40 x 8 elements) runs in one piece by default on the
  CPU and in row blocks (a loop) under a tuning that asks for blocks of 64 elements; with the
  tuning static, jit compiles one program for each and reuses them."""
  x = random_inputs(0, 3, 40, 8)
  blocked = Tuning(jnp_row_blocks=True, row_block_elements=64)
  fn = jax.jit(_rotate, static_argnames="tuning")
  assert "while" not in fn.lower(x, tuning=DEFAULT).as_text()
  assert "while" in fn.lower(x, tuning=blocked).as_text()
  for t in (DEFAULT, blocked, Tuning(jnp_row_blocks=True, row_block_elements=64)):
    fn(x, tuning=t)
  assert fn._cache_size() == 2


def test_kernel_tiles_follow_the_tuning():
  """Pass 1's kernel (interpreted) over 40 rows at rank 8: one program of 512-row tiles by
  default, three of 16 rows under ``tile_rows={16: 16}``; the same values either way (the
  order of the sums over the rows apart)."""
  x = random_inputs(1, 1, 40, 8)
  small = Tuning(tile_rows={16: 16})
  run = lambda t: kernels.project(x["u"], x["g"], impl="pallas", interpret=True, tuning=t)
  grid = lambda t: str(jax.make_jaxpr(functools.partial(run, t))()).count("grid=(1, 3)")
  assert (grid(DEFAULT), grid(small)) == (0, 1)
  assert jax.numpy.allclose(run(DEFAULT), run(small), rtol=1e-5, atol=1e-6)


# Module globals of the passes' modules and a value each that would change a pass that read it.
def _perturbed(value):
  if isinstance(value, bool) or value is None:
    return True if value is None else not value
  if isinstance(value, int):
    return 2 * value
  if isinstance(value, dict):
    return {k: 2 * v for k, v in value.items()} or {8: 16, 16: 16, 32: 16}
  if isinstance(value, Tuning):
    return Tuning(
      tile_rows={16: 16, 32: 16},
      min_padded_rank=8,
      steps=2,
      jnp_row_blocks=True,
      bucket_overhead=0,
      solo_buckets=False,
    )
  return value


def _all_passes(x):
  pallas = dict(impl="pallas", interpret=True)
  return (
    [call(name, x, **pallas) for name in PASSES]
    + [call(name, x, impl="jnp") for name in PASSES]
    + [call("rotate_from_residual", x, impl="jnp", rows_per_block=None)]
  )


# Blocks below and above the CPU's solo rows, of sizes the bucket plan merges or not.
SIZES = [3, 5, 64, 100, 1 << 15, 1 << 15, 1 << 16]


def _plans():
  return [common.plan_layout(SIZES, tau, "per_tensor", None) for tau in (2, 8)]


def test_no_pass_reads_a_module_global_when_traced(monkeypatch):
  """Every module global of the passes' modules and of the bucket plan's that a knob could be
  (numbers, flags, mappings, tunings) set to another value changes nothing of the traced
  passes (the jnp and the Pallas ones) nor of the plan: they read only their arguments."""
  x = random_inputs(2, 2, 1100, 8)  # rows for more than one tile of every tiling
  # A new function each time: jax caches what it traced by function.
  before = str(jax.make_jaxpr(lambda x: _all_passes(x))(x)), _plans()
  changed = []
  for module in (kernels, lowrank, pallas_passes, tuning, common):
    for name, value in vars(module).items():
      if name.startswith("__") or _perturbed(value) is value:
        continue
      monkeypatch.setattr(module, name, _perturbed(value))
      changed.append(f"{module.__name__}.{name}")
  assert "ginger._src.kernels.DEFAULT" in changed
  after = str(jax.make_jaxpr(lambda x: _all_passes(x))(x)), _plans()
  assert after == before, changed
