"""What a data-parallel Ginger step with a split state sends between devices (4 simulated CPU
devices, the compiled HLO of a small model): with ``sharding=`` (``ginger.sharding.
StateSharding``) each device slices its rows of the stacked ``g`` and ``d`` out of the
all-reduced gradients, runs the passes on them, sums only ``tau``-vectors and all-gathers the
update once; and the values are those of the unsharded step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_devices import run_on_cpu_devices

import ginger

_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import ginger
from bench.collectives import collectives
from ginger.sharding import StateSharding
from ginger._src.tuning import Tuning

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
# Three blocks of 73728 rows and one of 64000 (one bucket padded to 73728 rows, each device
# holding a quarter of every member's rows: the short member ends inside a device's quarter,
# as most of a real model's do) and one of 3 (rank 3: its own, small bucket, replicated).
params = {"conv": jnp.ones((3, 3, 64, 128)), "dense": jnp.ones((576, 128)),
          "wide": jnp.ones((64, 1152)), "short": jnp.ones((64, 1000)), "scale": jnp.ones((3,))}
keys = iter(jax.random.split(jax.random.key(0), 100))
like = lambda: jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
# d of a realistic size (sampled-Fisher vectors are scaled by 1/sqrt(N)): see the bound below.
batches = [(like(), jax.tree.map(lambda x: 1e-2 * x, like())) for _ in range(3)]
split = StateSharding(mesh, "data", min_size=1 << 14)
whole = NamedSharding(mesh, P())
out = {"param_bytes": sum(x.nbytes for x in jax.tree.leaves(params))}
# GPUs stack equal-size blocks into one bucket (Tuning.solo_buckets, read at init; the CPU
# gives each of these blocks a bucket of its own: "pinned_solo") and rotate U in row blocks
# (Tuning.jnp_row_blocks); forced here, with blocks small enough that this
# U (3 x 73728 x 4 = 884736 elements) has several per device, or with blocks that split the
# whole U (2 blocks) but hold a device's quarter in one.
variants = {"pinned": (None, 1 << 16, False), "pinned_row_blocks": (True, 1 << 16, False),
            "pinned_one_block_per_device": (True, 1 << 19, False),
            "pinned_solo": (None, 1 << 16, True)}
for name in json.loads(sys.argv[1]):
  blocks, elements, solo = variants[name]
  tuning = Tuning(jnp_row_blocks=blocks, row_block_elements=elements, solo_buckets=solo)
  tx = ginger.ginger(1e-3, tau=4, gamma=1e-2, sharding=split, tuning=tuning)
  state = tx.init(params)
  shardings = split.shardings(state)

  def step(params, state, g, d):  # as training/loop.py: gradients all-reduced, params whole
    g, d = jax.lax.with_sharding_constraint((g, d), whole)
    updates, state = tx.update(g, state, params, fisher_grads=d)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(step, in_shardings=(whole, shardings, whole, whole),
                   out_shardings=(whole, shardings))
  # The executable whose HLO is inspected is the one that runs (calling `jitted` would compile
  # it again); the reference takes and returns its state whole, so that its second step does
  # not compile again for the layout its first step returned.
  compiled = jitted.lower(params, state, params, params).compile()
  rows = {}
  for (kind, _), (count, nbytes) in collectives(compiled.as_text()).items():
    rows.setdefault(kind, []).append(nbytes)
  plain = jax.jit(step, out_shardings=whole)
  sharded, err = jax.device_put(state, shardings), 0.0
  state = jax.device_put(state, whole)
  for g, d in batches:
    new, sharded = compiled(params, sharded, g, d)
    ref, state = plain(params, state, g, d)
    err = max([err] + [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                       for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref))])
  inner = [s for s in jax.tree.leaves(sharded, is_leaf=lambda x: isinstance(
      x, ginger.ScaleByGingerState)) if isinstance(s, ginger.ScaleByGingerState)][0]
  out[name] = {"bytes": {k: sorted(v) for k, v in rows.items()}, "max_rel_error": err,
               "stacked_bytes": sum(4 * u.shape[0] * u.shape[1] for u in inner.u.stacks),
               "bases": [list(u.sharding.spec) for u in inner.u.stacks],
               "momentum": [list(m.sharding.spec) for m in inner.mu.stacks]}
specs = lambda tree: jax.tree.map(lambda s: list(s.spec), tree,
                                  is_leaf=lambda x: isinstance(x, NamedSharding))
out["adam"] = specs(split.shardings(optax.adam(1e-3).init(params))[0].mu)
print(json.dumps(out))
"""


@pytest.mark.parametrize(
  "names",
  [
    # the GPUs' row-blocked rotation where a device's rows are one block (which once cost a
    # 311 MB all-gather)
    ["pinned_one_block_per_device"],
    # the CPU's own layout (its values on 4 devices: test_sharding.py, also `make test-all`),
    # the GPUs' stacked buckets unblocked and in several blocks per device: `make test-all`
    pytest.param(["pinned_solo", "pinned", "pinned_row_blocks"], marks=pytest.mark.slow),
  ],
)
def test_pinned_step_slices_g_and_d_locally_and_gathers_the_update_once(names):
  out = run_on_cpu_devices(_SCRIPT, json.dumps(names))
  for name in names:
    sent = out[name]["bytes"]
    assert out[name]["bases"][-1] == [None, "data", None]  # the big bucket: rows split
    assert len(out[name]["bases"]) == (5 if name == "pinned_solo" else 2)
    # Only the update is gathered, once (the parameters are whole on every device): its
    # stacked rows, d floats and the buckets' zero padding, a quarter of U's. No re-layout of
    # g, d, U or the update by permutes or all-to-alls (slicing a leaf that ends inside a
    # device's rows out of the split update would send its edge to a neighbour), no U (nor
    # its p1, g) gathered for row blocks that cut across the devices' rows.
    assert out["param_bytes"] <= out[name]["stacked_bytes"] < 1.1 * out["param_bytes"]
    assert sum(sent.get("all-gather", [])) <= out[name]["stacked_bytes"], (name, sent)
    for kind in ("collective-permute", "all-to-all", "reduce-scatter"):
      assert kind not in sent, (name, sent)
    # The all-reduces are the tau-vectors U^T v and the small cores' inputs: kilobytes.
    assert max(sent.get("all-reduce", [0])) < 10_000, (name, sent)
    # Rounding of two summation orders, magnified by sigma_max / gamma (see test_sharding.py's
    # four-device test: <= ~1e-4); a row dropped or a sum not all-reduced changes it by O(1).
    assert out[name]["max_rel_error"] < 1e-4, (name, out[name]["max_rel_error"])
    # Ginger's momentum, (members, rows) per bucket, is split as its bucket's U (placed so by
    # StateSharding.shardings, and kept by the steps): each device averages its own rows.
    for mu, u in zip(out[name]["momentum"], out[name]["bases"], strict=True):
      assert (mu + [None] * 2)[:2] == (u + [None] * 3)[:2], (name, mu, u)
  # Any other state: the generic rule.
  assert out["adam"]["dense"] == ["data", None], out["adam"]


def test_without_sharding_the_step_has_no_constraint():
  """``sharding=None`` (the default) traces the optax-level step as before: no mesh, no
  sharding constraint, usable on one device and under plain ``jit``."""
  params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}
  tx = ginger.ginger(1e-3, tau=2)
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda s, g: tx.update(g, s, params, fisher_grads=g))(state, params)
  assert "sharding_constraint" not in str(jaxpr)


def test_row_blocks_of_each_devices_rows_rotate_as_the_whole():
  """``row_shards``: blocks of each shard's rows give the one-piece rotation's values (every
  row depends only on itself, so only the order of rows visited changes)."""
  keys = iter(jax.random.split(jax.random.key(1), 10))
  normal = lambda *shape: jax.random.normal(next(keys), shape)
  m, n, k = 2, 96, 3
  u, p1, g = normal(m, n, k), normal(m, n), normal(m, n)
  small = (normal(m, k), 1.0 + jnp.abs(normal(m)), normal(m, k, k), normal(m, k), normal(m, k))
  args = (u, p1, g, *small, normal(m), 0.5)
  whole = ginger._src.kernels.rotate_from_residual(*args, impl="jnp", rows_per_block=n)
  for shards, rows in ((4, 5), (4, 24), (3, 7), (5, 10)):  # 5 does not divide 96: unsplit
    got = ginger._src.kernels.rotate_from_residual(
      *args, impl="jnp", rows_per_block=rows, row_shards=shards
    )
    for a, b in zip(got, whole, strict=True):
      assert a.shape == b.shape
      # The same operations on every entry; only XLA's fusion of them may differ.
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
