"""``batchnorm=per_device``: the ResNet's BatchNorm statistics over each data-parallel device's
share of the batch (models.resnet.GroupedBatchNorm), as PyTorch DDP without SyncBN.

Checked here: in training mode a GroupedBatchNorm of G groups is nnx.BatchNorm applied to each
of the G slices of the batch (outputs, gradients; running statistics the mean over the slices of
what nnx.BatchNorm keeps), in evaluation mode it is nnx.BatchNorm; G = 1 is nnx.BatchNorm itself
and the variables do not depend on G; on 4 (simulated CPU) devices the compiled training step of
``batchnorm=per_device`` has no BatchNorm all-reduces where ``sync`` has one per layer and pass;
bad values are refused up front, and the mode is part of a run dir's fingerprint.

Tolerances: the grouped layer and the per-slice reference run the same float32 operations on the
same numbers; only the order in which XLA sums a slice's B/G x H x W elements may differ, which
moves a mean by a few ulps (float32 ulp 2^-24 ~ 6e-8 relative). The inputs keep each group's
|mean| within a few standard deviations, so E[x^2] - E[x]^2 loses at most a few bits to
cancellation: rtol = atol = 1e-5 (about 100 ulps) bounds that with room, and is four orders of
magnitude below the differences between grouped and whole-batch statistics that the tests
below make sure exist.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_devices import run_on_cpu_devices
from flax import nnx
from hydra import compose, initialize_config_dir

from models import tasks
from models.resnet import GroupedBatchNorm, batchnorm, build_resnet
from training import config_check, run_record
from training.config_check import ConfigError, check_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "configs")
TOL = dict(rtol=1e-5, atol=1e-5)
FEATURES = 6
MEAN0 = np.linspace(-0.5, 0.5, FEATURES, dtype=np.float32)  # starting running statistics
VAR0 = np.linspace(0.5, 2.0, FEATURES, dtype=np.float32)


def config(*overrides: str):
  with initialize_config_dir(config_dir=CONFIGS, version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def _inputs(groups: int, per_group: int = 3, seed: int = 0) -> jax.Array:
  """(G * per_group, 4, 4, FEATURES) images whose groups have different means and spreads, so
  that per-group and whole-batch statistics differ by O(1)."""
  key_x, key_shift, key_spread = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(key_x, (groups, per_group, 4, 4, FEATURES))
  shift = jax.random.uniform(key_shift, (groups, 1, 1, 1, FEATURES), minval=-2.0, maxval=2.0)
  spread = jax.random.uniform(key_spread, (groups, 1, 1, 1, FEATURES), minval=0.5, maxval=3.0)
  return (x * spread + shift).reshape(groups * per_group, 4, 4, FEATURES)


def _layers(groups: int, dtype=jnp.float32):
  """A GroupedBatchNorm and an nnx.BatchNorm of the same settings, split as (graphdef, rest),
  and one set of random scale/bias (``nnx.Param`` state) that fits both."""
  kw = dict(momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  grouped = GroupedBatchNorm(FEATURES, groups=groups, **kw)
  plain = nnx.BatchNorm(FEATURES, **kw)
  # Running statistics away from their (0, 1) start, so the momentum update is exercised.
  for layer in (grouped, plain):
    layer.mean[...] = jnp.asarray(MEAN0)
    layer.var[...] = jnp.asarray(VAR0)
  g_def, params, g_rest = nnx.split(grouped, nnx.Param, ...)
  p_def, _, p_rest = nnx.split(plain, nnx.Param, ...)
  ks, kb = jax.random.split(jax.random.key(1))
  params = jax.tree.map(lambda v: v, params)
  params["scale"].value = 1.0 + 0.5 * jax.random.normal(ks, (FEATURES,))
  params["bias"].value = jax.random.normal(kb, (FEATURES,))
  return (g_def, g_rest), (p_def, p_rest), params


# The two computations below run jitted in the tests (one program each; op by op they compiled
# a small program per operation and shape, most of these tests' time): the same operations on
# the same numbers, so the tolerances above hold either way.


def _grouped(layer, params, x, train=True):
  """Output and running statistics of the grouped layer."""
  graphdef, rest = layer
  m = nnx.merge(graphdef, params, rest, copy=True)
  m.train() if train else m.eval()
  y = m(x)
  return y, (m.mean[...], m.var[...])


def _per_slice(layer, params, x, groups, train=True):
  """nnx.BatchNorm applied to each of the ``groups`` slices separately (a fresh copy for each:
  each sees the same starting running statistics); outputs concatenated, running statistics
  averaged over the slices."""
  graphdef, rest = layer
  b = x.shape[0] // groups
  ys, means, variances = [], [], []
  for g in range(groups):
    m = nnx.merge(graphdef, params, rest, copy=True)
    m.train() if train else m.eval()
    ys.append(m(x[g * b : (g + 1) * b]))
    means.append(m.mean[...])
    variances.append(m.var[...])
  return jnp.concatenate(ys), (jnp.mean(jnp.stack(means), 0), jnp.mean(jnp.stack(variances), 0))


# ------------------------------------------------------------------- the grouped layer itself


@pytest.mark.parametrize("groups", [2, 4])
def test_train_mode_is_nnx_batchnorm_per_slice(groups):
  grouped, plain, params = _layers(groups)
  x = _inputs(groups)
  y, (mean, var) = jax.jit(lambda p, x: _grouped(grouped, p, x))(params, x)
  per_slice = jax.jit(lambda p, x, groups: _per_slice(plain, p, x, groups), static_argnums=2)
  y_ref, (mean_ref, var_ref) = per_slice(params, x, groups)
  np.testing.assert_allclose(y, y_ref, **TOL)
  np.testing.assert_allclose(mean, mean_ref, **TOL)
  np.testing.assert_allclose(var, var_ref, **TOL)
  # The test can fail: whole-batch statistics give other outputs and running variances.
  y_whole, (_, var_whole) = per_slice(params, x, 1)
  assert np.max(np.abs(y - y_whole)) > 0.1
  assert np.max(np.abs(var - var_whole)) > 0.01


@pytest.mark.parametrize("groups", [2, 4])
def test_gradients_are_those_of_the_per_slice_computation(groups):
  grouped, plain, params = _layers(groups)
  x = _inputs(groups)
  w = jax.random.normal(jax.random.key(2), x.shape)  # a generic cotangent

  def loss(apply):
    return lambda p, x: jnp.sum(apply(p, x)[0] * w)

  grad = lambda apply, argnums=(0, 1): jax.jit(jax.grad(loss(apply), argnums))  # noqa: E731
  g_params, g_x = grad(lambda p, x: _grouped(grouped, p, x))(params, x)
  r_params, r_x = grad(lambda p, x: _per_slice(plain, p, x, groups))(params, x)
  np.testing.assert_allclose(g_x, r_x, **TOL)
  for key in ("scale", "bias"):
    # Sums of B x H x W terms of O(1): relative to their size.
    ref = np.asarray(r_params[key].value)
    np.testing.assert_allclose(g_params[key].value, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  # No gradient flows into the running statistics (nnx.BatchNorm's behaviour).
  whole_x = grad(lambda p, x: _per_slice(plain, p, x, 1), 1)(params, x)
  assert np.max(np.abs(g_x - whole_x)) > 1e-2


def test_eval_mode_is_nnx_batchnorm_and_leaves_the_statistics():
  grouped, plain, params = _layers(4)
  x = _inputs(4)
  y, stats = _grouped(grouped, params, x, train=False)
  y_ref, _ = _per_slice(plain, params, x, 1, train=False)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(stats[0], MEAN0)
  np.testing.assert_array_equal(stats[1], VAR0)
  # Evaluation batches need not divide by G.
  y_odd, _ = _grouped(grouped, params, x[:5], train=False)
  np.testing.assert_array_equal(y_odd, y_ref[:5])


def test_bfloat16_compute_within_one_bfloat16_ulp_of_nnx_per_slice():
  # Statistics in float32 as nnx.BatchNorm's; outputs rounded to bfloat16 (8 bits): the few
  # float32 ulps of reduction order can move a result across one bfloat16 rounding boundary.
  grouped, plain, params = _layers(2, dtype=jnp.bfloat16)
  x = _inputs(2).astype(jnp.bfloat16)
  y, _ = jax.jit(lambda p, x: _grouped(grouped, p, x))(params, x)
  y_ref, _ = jax.jit(lambda p, x: _per_slice(plain, p, x, 2))(params, x)
  assert y.dtype == y_ref.dtype == jnp.bfloat16
  y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
  np.testing.assert_allclose(y, y_ref, rtol=2**-8, atol=2**-8)


def test_batch_not_divisible_by_the_groups_is_refused():
  grouped, _, params = _layers(4)
  with pytest.raises(ValueError, match="groups=4 needs a batch .* divisible by 4"):
    _grouped(grouped, params, _inputs(1, per_group=6))
  with pytest.raises(ValueError, match="groups must be an integer >= 1"):
    GroupedBatchNorm(4, groups=0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="batchnorm_groups must be an integer >= 1, got 0"):
    build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(0), batchnorm_groups=0)


# ------------------------------------------------------------------- the ResNet and the config


def _resnet(**kwargs):
  """resnet_tiny initialised as models/tasks.py does (init_model: one compiled program)."""
  build = lambda key: build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(key), **kwargs)
  return tasks.init_model(build, 0)


def _bns(model):
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.BatchNorm)]


def test_one_group_is_nnx_batchnorm_itself():
  kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert type(batchnorm(8, groups=1, **kw)) is nnx.BatchNorm
  default = _resnet()
  one = _resnet(batchnorm_groups=1)
  assert {type(m) for m in _bns(default)} == {type(m) for m in _bns(one)} == {nnx.BatchNorm}
  x = _inputs(1, per_group=4)[..., :3]
  x = jnp.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)))  # 8x8x3 images
  forward = nnx.jit(lambda model, x: model(x))  # one program for both (op by op: ~20 s)
  np.testing.assert_array_equal(forward(default, x), forward(one, x))


def test_variables_do_not_depend_on_the_groups():
  # Same names, types, shapes and values: checkpoints and the optimizer's partitioning agree.
  one = _resnet()
  four = _resnet(batchnorm_groups=4)
  assert len(_bns(four)) == len(_bns(one)) == 12
  assert all(type(m) is GroupedBatchNorm and m.groups == 4 for m in _bns(four))
  s1, s4 = nnx.state(one), nnx.state(four)
  assert jax.tree.structure(s1) == jax.tree.structure(s4)
  for a, b in zip(jax.tree.leaves(s1, is_leaf=_is_var), jax.tree.leaves(s4, is_leaf=_is_var)):
    assert type(a) is type(b)
    np.testing.assert_array_equal(a.value, b.value)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def test_config_resolves_the_groups():
  assert tasks.resolve_batchnorm_groups(config("experiment=demo")) == 1
  # One CPU device here: per_device on a one-device data axis is sync (nnx.BatchNorm).
  cfg = config("experiment=demo", "batchnorm=per_device")
  assert tasks.resolve_batchnorm_groups(cfg) == jax.device_count()
  assert config_check.BATCHNORMS == tasks.BATCHNORMS


@pytest.mark.parametrize(
  "overrides, named",
  [
    (
      ("experiment=demo", "batchnorm=syncbn"),
      "batchnorm='syncbn': must be one of ['sync', 'per_device']",
    ),
    (
      ("experiment=demo_xsum", "batchnorm=per_device"),
      "batchnorm='per_device': must be 'sync' for model.family='t5' (T5 has no BatchNorm",
    ),
  ],
)
def test_bad_values_are_refused_up_front(overrides, named):
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  assert named in str(info.value)


def test_per_device_needs_an_explicit_data_axis():
  """The statistics groups are the data axis's size: with mesh.data=-1 ("all devices") they
  would depend on the machine a run happens to start or resume on."""
  overrides = ("experiment=demo", "batchnorm=per_device")
  with pytest.raises(ConfigError) as info:
    check_config(config(*overrides), overrides=overrides)
  assert "mesh.data=-1: must be an explicit number of devices (>= 1) with batchnorm=per_device" in (
    str(info.value)
  )


def test_good_values_pass():
  for overrides in (
    ("experiment=demo", "batchnorm=per_device", "mesh.data=1"),
    ("experiment=demo", "batchnorm=sync"),
    ("experiment=demo_xsum", "batchnorm=sync"),
    ("experiment=demo", "batchnorm=null"),
  ):
    check_config(config(*overrides), overrides=overrides)


def test_the_batchnorm_mode_is_part_of_the_fingerprint():
  cfg = run_record.plain(config("experiment=demo"))
  assert run_record.fingerprinted(cfg)["batchnorm"] == "sync"
  per_device = dict(cfg, batchnorm="per_device")
  assert run_record.fingerprint(per_device) != run_record.fingerprint(cfg)


def test_per_device_runs_on_other_data_axes_are_other_runs():
  """per_device's statistics groups are part of what a run computes: a run dir trained on 4
  devices never resumes on 2 (the fingerprints differ), while sync runs move between meshes."""
  cfg = run_record.plain(config("experiment=demo"))
  on = lambda data, mode: dict(cfg, batchnorm=mode, mesh=dict(cfg["mesh"], data=data))  # noqa: E731
  assert run_record.fingerprint(on(2, "sync")) == run_record.fingerprint(on(4, "sync"))
  assert run_record.fingerprint(on(2, "per_device")) != run_record.fingerprint(on(4, "per_device"))
  sync, per_device = run_record.identity(on(4, "sync")), run_record.identity(on(4, "per_device"))
  assert (sync["batchnorm"], sync["batchnorm_groups"]) == ("sync", None)
  assert (per_device["batchnorm"], per_device["batchnorm_groups"]) == ("per_device", 4)
  xsum = run_record.identity(run_record.plain(config("experiment=demo_xsum")))
  assert (xsum["batchnorm"], xsum["batchnorm_groups"]) == (None, None)  # T5: no BatchNorm


# ------------------------------------------------------------------- collectives on 4 devices

_COLLECTIVES = """
import json, re, sys
import numpy as np
from hydra import compose, initialize_config_dir
from training import loop, sharding
from models.tasks import resolve_batchnorm_groups

def compose_(*overrides):
  with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    return compose(config_name="config", overrides=["experiment=demo", *overrides])

# The groups are the data axis of the mesh the loop builds.
out = {"groups_vs_mesh": [
  [resolve_batchnorm_groups(cfg), sharding.plan_from_config(cfg.mesh).data_size]
  for cfg in (compose_("batchnorm=per_device", *mesh) for mesh in (
    [], ["mesh.data=2"], ["mesh.model=2"], ["mesh.data=1", "mesh.model=2"]))
]}
for mode in ("sync", "per_device"):
  with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    cfg = compose(config_name="config", overrides=[
      "experiment=demo", "logger=none", "optimizer=momentum", "batch_size=32", "max_steps=2",
      f"batchnorm={mode}", "mesh.data=4"])
  setup = loop.build(cfg)
  groups = sorted({getattr(m, "groups", 1) for _, m in __import__("flax").nnx.iter_graph(
    setup.task.model) if hasattr(m, "use_running_average")})
  idx = setup.plan.indices(np.arange(32))
  args = (setup.state, setup.frozen, setup.task.train_arrays, idx)
  executable = setup.train_step.lower(*args).compile()  # inspected and run: compiled once
  hlo = executable.as_text()
  reduces = [l for l in hlo.splitlines() if re.search(r" all-reduce(-start)?[(]", l)]
  state = executable(*args)
  out[mode] = {"all_reduces": len(reduces), "groups": groups,
               "loss": float(state.stats["last_loss"])}
print(json.dumps(out))
"""


def test_per_device_statistics_need_no_collective_on_four_devices():
  out = run_on_cpu_devices(_COLLECTIVES, CONFIGS, timeout=600, HF_HUB_OFFLINE="1")
  assert out["groups_vs_mesh"] == [[4, 4], [2, 2], [2, 2], [1, 1]]
  sync, per_device = out["sync"], out["per_device"]
  assert sync["groups"] == [1] and per_device["groups"] == [4]
  # resnet_tiny has 12 BatchNorms: sync needs their statistics' all-reduces in the forward and
  # backward (XLA combines some of them); per_device keeps only the few that remain after XLA's
  # combiner for the gradients, the running statistics and the loss.
  assert sync["all_reduces"] >= 12
  assert per_device["all_reduces"] <= 3 < sync["all_reduces"]
  assert np.isfinite(sync["loss"]) and np.isfinite(per_device["loss"])


def test_per_shard_batchnorm_copies_the_statistics_for_one_shard():
  """models.resnet.per_shard_batchnorm (fisher_backward=local): per-device statistics become
  one group (the shard), global ones are reduced over the mesh axis; the model is untouched."""
  from models.resnet import GroupedBatchNorm, build_resnet, per_shard_batchnorm

  for groups in (4, 1):
    model = build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(0), batchnorm_groups=groups)
    copy = per_shard_batchnorm(model, "data")
    norms = lambda m: [x for _, x in nnx.iter_modules(m) if isinstance(x, nnx.BatchNorm)]
    assert len(norms(copy)) == len(norms(model)) > 0
    for before, after in zip(norms(model), norms(copy), strict=True):
      if groups > 1:
        assert isinstance(after, GroupedBatchNorm) and after.groups == 1 and before.groups == 4
      else:
        assert after.axis_name == "data" and before.axis_name is None
    same = jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(model), nnx.state(copy))
    assert all(jax.tree.leaves(same))


def test_per_device_pull_back_refuses_a_model_that_draws_randomness():
  from training.config_check import ConfigError
  from training.steps import per_shard_graphdef

  class Net(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(1))

  with pytest.raises(ConfigError, match=r"fisher_backward=local: .*\(Rng"):
    per_shard_graphdef(Net(), 8, 4)
  with pytest.raises(ConfigError, match="batch_size=10 must split evenly over the 4 devices"):
    per_shard_graphdef(Net(), 10, 4)
