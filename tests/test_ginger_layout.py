"""Ginger's stacked state layout: buckets, padding and leaf views change no result; the fused
three-pass update keeps float32 U orthonormal; no big product of U runs at reduced precision."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core
from reference import ginger_direction, ginger_step

import ginger
from ginger import StackedBasis, StackedSigma
from ginger._src import common, lowrank
from ginger._src.tuning import DEFAULT, Tuning

RESNET_LIKE = [64, 64, 100, 128, 1728, 8192, 36864, 36864, 147456, 589824, 2359296]


@pytest.mark.parametrize("solo", [False, True])
@pytest.mark.parametrize("tau", [1, 8, 32])
def test_plan_covers_every_leaf_once(tau, solo):
  layout = common.plan_layout(RESNET_LIKE, tau, "per_tensor", None, Tuning(solo_buckets=solo))
  seen = []
  for bucket in layout.buckets:
    for pieces in bucket.members:
      ((leaf, row),) = pieces
      assert row == 0 and RESNET_LIKE[leaf] <= bucket.rows
      assert bucket.rank == min(tau, RESNET_LIKE[leaf])
      seen.append(leaf)
  assert sorted(seen) == list(range(len(RESNET_LIKE)))
  # Small tensors share a bucket, and the padding costs less than the buckets it saves.
  saved = len(set(RESNET_LIKE)) - len(layout.buckets)
  assert saved > 0
  padding = sum(b.rows * len(b.members) for b in layout.buckets) - sum(RESNET_LIKE)
  assert padding * (min(tau, 64) + 2) <= saved * DEFAULT.bucket_overhead


def test_large_blocks_get_a_bucket_each_off_gpus():
  """The CPU plan (``solo_buckets``, None off GPUs): every block of at least ``solo_rows`` rows
  is a bucket of its own, unpadded, even beside blocks of its size (stacking would copy its v
  and g every step); smaller blocks are planned as on GPUs. The global block is one bucket
  anyway."""
  assert jax.default_backend() != "gpu"  # the tests run on the CPU
  layout = common.plan_layout(RESNET_LIKE, 8, "per_tensor", None)
  large = [i for i, n in enumerate(RESNET_LIKE) if n >= DEFAULT.solo_rows]
  assert len(large) == 5  # two blocks of 36864 among them
  solo = [b for b in layout.buckets if len(b.members) == 1 and b.members[0][0][0] in large]
  assert [b.members[0][0][0] for b in solo] == large
  assert all(b.rows == RESNET_LIKE[b.members[0][0][0]] and b.rank == 8 for b in solo)
  small = [n for n in RESNET_LIKE if n < DEFAULT.solo_rows]
  stacked = common.plan_layout(small, 8, "per_tensor", None, Tuning(solo_buckets=False))
  assert [b.rows for b in layout.buckets if b not in solo] == [b.rows for b in stacked.buckets]
  assert len(common.plan_layout(RESNET_LIKE, 8, "global", None).buckets) == 1


def test_global_plan_is_one_block_of_consecutive_rows():
  layout = common.plan_layout([3, 5, 2], 4, "global", None)
  (bucket,) = layout.buckets
  assert bucket.rows == 10 and bucket.rank == 4
  assert bucket.members == (((0, 0), (1, 3), (2, 8)),)


def test_size_runs_trade_padding_against_buckets():
  assert common._size_runs([10, 20], [1, 1], 4, 0) == [{10}, {20}]  # padding only costs
  assert common._size_runs([10, 20], [1, 1], 4, 10**9) == [{10, 20}]  # launches only cost


def test_stacked_basis_reads_like_per_leaf_state():
  params = {"w": jnp.zeros((4, 5)), "b": jnp.zeros(3), "c": jnp.zeros(7)}
  state = ginger.scale_by_ginger(4).init(params)
  assert isinstance(state.u, StackedBasis)
  stacks = jax.tree.leaves(state.u)
  assert all(x.ndim == 3 for x in stacks)
  assert state.u["w"].shape == (20, 4) and state.u["c"].shape == (7, 4)
  assert state.u["b"].shape == (3, 3)
  np.testing.assert_array_equal(state.u["c"], np.eye(7, 4))
  assert jax.tree.structure(state.u.tree()) == jax.tree.structure(params)
  # Pytree round trip (jit, tree.map) keeps the layout.
  same = jax.jit(lambda s: s)(state)
  assert same.u.layout == state.u.layout
  assert jax.tree.map(lambda x: x, state.u).layout == state.u.layout
  # sigma: one (members, rank) array per bucket (a step on a GPU cut it per leaf, one copy
  # kernel per tensor), read per leaf after an update as the per-leaf state was.
  _, state = jax.jit(ginger.scale_by_ginger(4).update)(
    jax.tree.map(jnp.ones_like, params), state, fisher_grads=jax.tree.map(jnp.ones_like, params)
  )
  assert isinstance(state.sigma, StackedSigma) and state.sigma.layout == state.u.layout
  assert [x.shape for x in state.sigma.stacks] == [
    (len(b.members), b.rank) for b in state.u.layout.buckets
  ]
  for i, key in enumerate(("b", "c", "w")):  # jax.tree.leaves order
    np.testing.assert_array_equal(state.sigma[key], state.sigma.leaf(i))
    assert state.sigma[key].shape == (state.u[key].shape[1],)
  restored = StackedSigma.from_tree(state.sigma.tree(), state.u.layout)
  for x, y in zip(restored.stacks, state.sigma.stacks, strict=True):
    np.testing.assert_array_equal(x, y)


def test_buckets_and_padding_change_no_result(x64):
  """Leaves of different sizes stacked into one zero-padded bucket give exactly what each
  leaf gives alone."""
  one_per_rank = Tuning(bucket_overhead=10**9)
  rng = np.random.default_rng(0)
  shapes = {"a": (5, 3), "b": (11,), "c": (2, 2, 2), "d": (9,)}
  params = {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}
  tx = ginger.scale_by_ginger(
    3, 0.9, 1e-2, state_dtype="float64", reorthonormalise_every=4, tuning=one_per_rank
  )
  state = tx.init(params)
  assert len(jax.tree.leaves(state.u)) == 1 and jax.tree.leaves(state.u)[0].shape == (4, 15, 3)
  alone = {k: (tx.init({k: p}), tx) for k, p in params.items()}
  update = jax.jit(tx.update)
  for _ in range(9):
    g = {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}
    d = {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}
    out, state = update(g, state, fisher_grads=d)
    for k in shapes:
      s_k, _ = alone[k]
      out_k, s_k = update({k: g[k]}, s_k, fisher_grads={k: d[k]})
      alone[k] = (s_k, tx)
      np.testing.assert_allclose(out[k], out_k[k], rtol=1e-11, atol=1e-11)
      np.testing.assert_allclose(state.sigma[k], s_k.sigma[k], rtol=1e-11, atol=1e-11)
  padding = jax.tree.leaves(state.u)[0][:, :, :]
  sizes = [math.prod(shapes[k]) for k in sorted(shapes)]
  for j, n in enumerate(sizes):  # leaves flatten in sorted key order
    assert np.all(np.asarray(padding[j, n:]) == 0)


@pytest.mark.parametrize("block", ["per_tensor", "global"])
@pytest.mark.parametrize("every", [1, 2])
def test_reorthonormalising_steps_match_dense(x64, block, every):
  """Steps that re-orthonormalise (the factor Q folded into the update) still compute the
  definition."""
  rng = np.random.default_rng(1)
  params = {"w": jnp.zeros((4, 3), jnp.float64), "b": jnp.zeros(5, jnp.float64)}
  tx = ginger.scale_by_ginger(
    3, 0.9, 1e-2, block, state_dtype="float64", reorthonormalise_every=every
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  keys = sorted(params)
  blocks = [keys] if block == "global" else [[k] for k in keys]
  dense = [None] * len(blocks)
  for _ in range(8):
    g = {k: jnp.asarray(rng.normal(size=p.shape)) for k, p in params.items()}
    d = {k: jnp.asarray(rng.normal(size=p.shape)) for k, p in params.items()}
    out, state = update(g, state, fisher_grads=d)
    for b, names in enumerate(blocks):
      cat = lambda t, names=names: np.concatenate([np.ravel(t[k]) for k in names])
      if dense[b] is None:
        dense[b] = np.zeros((cat(d).size,) * 2)
      dense[b], _ = ginger_step(dense[b], cat(d), 0.9, 3)
      ref = ginger_direction(dense[b], cat(g), 1e-2)
      np.testing.assert_allclose(cat(out), ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("n", [12, 2000])
def test_nearly_in_span_vector_keeps_float32_basis_orthonormal(n):
  """After one step (sigma = [s, 0, 0, 0]) a d nearly along U's first column (relative
  residual 1e-5, above the in-span cut) puts its residual direction p into U' as a whole
  column (its eigenvalue ties with the zeros). A one-pass p has a component of order
  eps ||d|| / r ~ 1e-2 along U; the CGS2 correction must remove it."""
  rng = np.random.default_rng(n)
  tx = ginger.scale_by_ginger(4, 0.9, 1e-5, reorthonormalise_every=10**6)
  update = jax.jit(tx.update)
  first = rng.normal(size=n)
  _, state = update({"w": jnp.asarray(first, jnp.float32)}, tx.init({"w": jnp.zeros(n)}))
  other = rng.normal(size=n)
  other -= first * (first @ other) / (first @ first)
  d = 1e3 * (first / np.linalg.norm(first) + 1e-5 * other / np.linalg.norm(other))
  _, state = update({"w": jnp.asarray(d, jnp.float32)}, state)
  assert float(state.sigma["w"][1]) > 0  # p was kept
  assert float(lowrank.orthonormality_error([state.u["w"]])) < 1e-5


def test_no_reduced_precision_product_of_u():
  """Every dot in the update asks for full precision (a default float32 dot runs in TF32 on
  GPUs, which would break U^T U = I there)."""
  params = {"w": jnp.zeros((6, 5)), "b": jnp.zeros(4)}
  for block in ("per_tensor", "global"):
    tx = ginger.scale_by_ginger(3, block=block, reorthonormalise_every=2)
    state = tx.init(params)
    jaxpr = jax.make_jaxpr(lambda s, tx=tx: tx.update(params, s, fisher_grads=params))(state)

    def dots(jaxpr):
      for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
          yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
          yield from dots(sub)

    found = list(dots(jaxpr.jaxpr))
    assert found
    for eqn in found:
      assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, eqn


def test_empty_params():
  for block in ("per_tensor", "global"):
    tx = ginger.scale_by_ginger(2, block=block)
    out, state = tx.update({}, tx.init({}), fisher_grads={})
    assert out == {} and int(state.count) == 1


def test_checkpoint_does_not_depend_on_the_bucketing(x64, tmp_path):
  """A state saved under one bucket plan (``bucket_overhead``, a speed knob) restores into
  another and continues exactly as the uninterrupted run."""
  import orbax.checkpoint as ocp

  rng = np.random.default_rng(2)
  shapes = {"a": (5, 3), "b": (11,), "c": (2, 2, 2), "d": (9,), "e": (2,)}
  params = {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}
  plan = lambda overhead: ginger.ginger(  # noqa: E731
    0.1,
    tau=3,
    alpha=0.9,
    gamma=1e-2,
    state_dtype="float64",
    tuning=Tuning(bucket_overhead=overhead),
  )
  tx = plan(10**9)  # one bucket per rank
  update = jax.jit(tx.update)
  batches = [
    tuple({k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()} for _ in range(2))
    for _ in range(6)
  ]
  state = tx.init(params)
  for g, d in batches[:3]:
    _, state = update(g, state, params, fisher_grads=d)
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, ginger.checkpoint_state(state))
  expected = []
  for g, d in batches[3:]:
    out, state = update(g, state, params, fisher_grads=d)
    expected.append(out)

  like = plan(0).init(params)  # one bucket per size
  old, new = (
    [x.u.layout for x in jax.tree.leaves(s, is_leaf=_is_state) if _is_state(x)]
    for s in (state, like)
  )
  assert len(new[0].buckets) > len(old[0].buckets)
  assert jax.tree.structure(state) != jax.tree.structure(like)  # stacked: would not restore
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, ginger.checkpoint_state(like))
  with ocp.StandardCheckpointer() as ckpt:
    restored = ginger.restore_checkpoint_state(ckpt.restore(path, abstract), like)
  assert jax.tree.structure(restored) == jax.tree.structure(like)
  for (g, d), want in zip(batches[3:], expected, strict=True):
    out, restored = update(g, restored, params, fisher_grads=d)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-14), out, want)
  # The relayout also works in memory, stacked to stacked.
  again = ginger.restore_checkpoint_state(state, like)
  assert jax.tree.structure(again) == jax.tree.structure(like)
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-14),
    ginger.checkpoint_state(again),
    ginger.checkpoint_state(restored),
  )


def _is_state(x):
  return isinstance(x, ginger.ScaleByGingerState)


def test_checkpoint_state_leaves_other_states_alone():
  params = {"w": jnp.zeros((3, 2))}
  for tx in (optax.adam(0.1), ginger.qng(0.1, tau=2)):
    state = tx.init(params)
    assert ginger.checkpoint_state(state) is not None
    jax.tree.map(
      np.testing.assert_array_equal, ginger.restore_checkpoint_state(state, state), state
    )


@pytest.mark.parametrize(
  "saved_by, match",
  [
    (dict(tau=2), r"u\['b'\]: saved \(5, 2\), this optimizer's state has \(5, 3\)"),
    (
      dict(tau=3, block="global"),
      r"sigma: saved for params structured PyTreeDef\(\*\), this optimizer's",
    ),
  ],
)
def test_restore_refuses_a_state_of_another_optimizer(saved_by, match):
  """A per-leaf state saved by another tau (or block) does not fit this optimizer's layout:
  before, it was stacked as it was and the state no longer matched its optimizer."""
  params = {"w": jnp.ones((6, 5)), "b": jnp.ones(5)}
  other = ginger.ginger(1e-3, **saved_by)
  saved = ginger.checkpoint_state(other.init(params))
  like = ginger.ginger(1e-3, tau=3).init(params)
  with pytest.raises(ValueError, match=match):
    ginger.restore_checkpoint_state(saved, like)


def test_restore_refuses_a_state_of_other_params():
  params = {"w": jnp.ones((6, 5)), "b": jnp.ones(5)}
  tx = ginger.ginger(1e-3, tau=2)
  saved = ginger.checkpoint_state(tx.init(params))
  with pytest.raises(ValueError, match=r"saved for params structured .* this optimizer's"):
    ginger.restore_checkpoint_state(saved, tx.init({"w": params["w"]}))
