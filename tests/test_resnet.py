"""CIFAR ResNets in NNX: shapes, parameter and MAC counts, BatchNorm modes, dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.flops import (
  conv2d_macs,
  count_macs,
  dense_macs,
  forward_macs,
  resnet_forward_macs,
  train_step_flops,
)
from models.resnet import ARCHS, build_resnet, count_params

RESNET18_PARAMS_100 = 11_220_132  # torchvision resnet18 with CIFAR stem, 100 classes
RESNET50_PARAMS_100 = 23_705_252


def _hand_count(
  block: str,
  blocks: list[int],
  num_classes: int,
  width: int = 64,
  hw: int = 32,
  in_channels: int = 3,
) -> tuple[int, int]:
  """(params, forward MACs) from the paper's architecture, written out layer by layer.

  Independent of models/: a conv is (k, cin, cout, output side), a BN has 2 params/channel.
  """
  convs: list[tuple[int, int, int, int]] = [(3, in_channels, width, hw)]
  bn_channels = [width]
  cin = width
  for stage, n in enumerate(blocks):
    planes = width * 2**stage
    for i in range(n):
      stride = 2 if stage > 0 and i == 0 else 1
      out_hw = (hw - 1) // stride + 1
      if block == "basic":
        cout = planes
        convs += [(3, cin, planes, out_hw), (3, planes, planes, out_hw)]
        bn_channels += [planes, planes]
      else:
        cout = 4 * planes
        convs += [(1, cin, planes, hw), (3, planes, planes, out_hw), (1, planes, cout, out_hw)]
        bn_channels += [planes, planes, cout]
      if stride != 1 or cin != cout:
        convs.append((1, cin, cout, out_hw))
        bn_channels.append(cout)
      cin, hw = cout, out_hw
  params = sum(k * k * a * b for k, a, b, _ in convs) + 2 * sum(bn_channels)
  params += cin * num_classes + num_classes
  macs = sum(k * k * a * b * s * s for k, a, b, s in convs) + cin * num_classes
  return params, macs


def _abstract(name: str, num_classes: int = 100, in_channels: int = 3) -> nnx.Module:
  return nnx.eval_shape(
    lambda: build_resnet(name, num_classes, in_channels=in_channels, rngs=nnx.Rngs(0))
  )


def test_param_counts_match_hand_count_and_paper():
  r18, r50 = count_params(_abstract("resnet18")), count_params(_abstract("resnet50"))
  assert r18 == _hand_count("basic", [2, 2, 2, 2], 100)[0] == RESNET18_PARAMS_100
  assert r50 == _hand_count("bottleneck", [3, 4, 6, 3], 100)[0] == RESNET50_PARAMS_100
  assert 11.1e6 < r18 < 11.3e6  # "ResNet-18 (11M parameters)"
  assert 23.6e6 < r50 < 23.8e6  # "ResNet-50 (24M parameters)"
  assert count_params(_abstract("resnet34")) == _hand_count("basic", [3, 4, 6, 3], 100)[0]


def _abstract_forward(model: nnx.Module, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  graphdef, state = nnx.split(model)
  return jax.eval_shape(lambda state, x: nnx.merge(graphdef, state)(x), state, x)


# One compiled program per call instead of op-by-op dispatch (each op compiles on first use).
_apply = nnx.jit(lambda model, x: model(x))


@pytest.fixture(scope="module")
def tiny() -> nnx.Module:
  """One concrete tiny net for the module; tests that change it use ``nnx.clone(tiny)``.

  Initialised in one jitted program with "rbg" keys: threefry's per-shape init compiles take
  ~15 s on a 2-core CPU, rbg's take ~2 s. The architecture under test is unaffected.
  """
  init = nnx.jit(
    lambda: build_resnet(
      "resnet_tiny", 10, in_channels=1, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))
    )
  )
  return init()


def test_count_params_excludes_batch_stats(tiny):
  expected = _hand_count("basic", [1, 1, 1, 1], 10, width=16, in_channels=1)[0]
  assert count_params(tiny) == expected
  stats = jax.tree.leaves(nnx.state(tiny, nnx.BatchStat))
  assert sum(x.size for x in stats) > 0


@pytest.mark.parametrize("name,classes", [("resnet18", 100), ("resnet50", 100), ("resnet34", 7)])
def test_large_output_shapes_abstract(name, classes):
  model = _abstract(name, classes)
  out = _abstract_forward(model, jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32))
  assert out.shape == (2, classes) and out.dtype == jnp.float32


def test_tiny_forward_grayscale_8x8(tiny):
  model = nnx.clone(tiny)
  y = _apply(model, jax.random.normal(jax.random.key(1), (3, 8, 8, 1)))
  assert y.shape == (3, 10) and y.dtype == jnp.float32 and np.isfinite(y).all()


def test_batchnorm_train_eval_modes(tiny):
  model = nnx.clone(tiny)
  x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
  mean_before = model.bn1.mean.value.copy()
  model.train()
  assert not model.bn1.use_running_average
  y_train = _apply(model, x)
  assert not np.allclose(model.bn1.mean.value, mean_before)  # running stats updated
  model.eval()
  assert model.bn1.use_running_average and model.blocks[0].bn2.use_running_average
  mean_after_train = model.bn1.mean.value.copy()
  y_eval = _apply(model, x)
  np.testing.assert_array_equal(model.bn1.mean.value, mean_after_train)  # eval: frozen
  assert not np.allclose(y_train, y_eval, atol=1e-3)


def test_bfloat16_compute_float32_logits(tiny):
  model = nnx.eval_shape(
    lambda: build_resnet("resnet_tiny", 10, in_channels=1, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  )
  nnx.update(model, nnx.state(tiny))  # reuse the fixture's float32 parameters
  model.eval()
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  jaxpr = jax.make_jaxpr(lambda x: model(x))(x)
  assert jaxpr.out_avals[0].dtype == jnp.float32
  convs = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
  assert len(convs) == 12  # stem, 4 blocks x 2, 3 projections
  assert all(e.invars[0].aval.dtype == jnp.bfloat16 for e in convs)
  y = _apply(model, x)
  assert y.dtype == jnp.float32 and np.isfinite(y).all()
  reference = nnx.clone(tiny)
  reference.eval()
  expected = _apply(reference, x)
  np.testing.assert_allclose(y, expected, atol=0.05 * float(np.abs(expected).max()))


def test_jit_train_step_with_split_merge(tiny):
  model = nnx.clone(tiny)
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
  labels = jnp.array([0, 1, 2, 0])

  @jax.jit
  def step(params, rest):
    def loss_fn(params):
      # copy=True: fresh Variables inside grad's trace, so BatchNorm may update them.
      m = nnx.merge(graphdef, params, rest, copy=True)
      loss = optax.softmax_cross_entropy_with_integer_labels(m(x), labels).mean()
      return loss, nnx.state(m, nnx.BatchStat)

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, stats, grads

  loss, stats, grads = step(params, rest)
  assert np.isfinite(loss)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
  assert not np.allclose(jax.tree.leaves(stats)[0], jax.tree.leaves(rest)[0])


def test_unknown_name_raises():
  with pytest.raises(ValueError, match=r"resnet101.*resnet18.*resnet50"):
    build_resnet("resnet101", 10, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="resnet101"):
    resnet_forward_macs("resnet101", 10)


def test_architecture_table():
  assert set(ARCHS) == {"resnet18", "resnet34", "resnet50", "resnet_tiny"}
  assert ARCHS["resnet50"].block == "bottleneck" and ARCHS["resnet50"].blocks == (3, 4, 6, 3)


# -------------------------------------------------------------------------------- FLOPs


def test_resnet18_macs():
  macs = resnet_forward_macs("resnet18", 100)
  assert abs(macs - 0.5555e9) / 0.5555e9 < 0.01
  assert macs == _hand_count("basic", [2, 2, 2, 2], 100)[1] == 555_468_800
  forward = 2 * macs  # 1.111 GFLOPs per example
  assert train_step_flops(forward, fisher_forward=None) == 6 * macs  # forward + backward
  assert train_step_flops(forward, fisher_forward="shared") == 10 * macs  # + a backward
  assert train_step_flops(forward, fisher_forward="eval") == 12 * macs  # + forward, backward


def test_resnet50_macs():
  macs = resnet_forward_macs("resnet50", 100, (32, 32, 3))
  assert macs == _hand_count("bottleneck", [3, 4, 6, 3], 100)[1] == 1_298_014_208
  assert abs(macs - 1.30e9) / 1.30e9 < 0.01  # 2.6 GFLOPs forward per CIFAR image


def test_tiny_macs_on_digits_shape():
  hand = _hand_count("basic", [1, 1, 1, 1], 10, width=16, hw=8, in_channels=1)[1]
  assert resnet_forward_macs("resnet_tiny", 10, (8, 8, 1)) == hand


def test_a_built_model_is_counted_as_the_named_one_and_left_as_it_was():
  """The task counts its own network (train mode, real arrays) instead of building an abstract
  copy: the same MACs as the count by name, and the model keeps its mode and statistics."""
  model = build_resnet("resnet_tiny", 10, in_channels=1, rngs=nnx.Rngs(0))
  before = jax.tree.map(np.asarray, nnx.state(model))
  assert forward_macs(model, (8, 8, 1)) == resnet_forward_macs("resnet_tiny", 10, (8, 8, 1))
  after = jax.tree.map(np.asarray, nnx.state(model))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  bn = next(m for _, m in model.iter_modules() if isinstance(m, nnx.BatchNorm))
  assert not bn.use_running_average  # still in train mode


def test_layer_helpers_and_generic_counter():
  assert conv2d_macs(3, 64, 128, (16, 16)) == 9 * 64 * 128 * 256
  assert conv2d_macs((1, 1), 64, 64, (4, 4), groups=4) == 16 * 64 * 16
  assert dense_macs(512, 100) == 51_200
  a, b = jnp.ones((4, 5)), jnp.ones((5, 6))
  assert count_macs(jnp.dot, a, b) == 4 * 5 * 6

  # matmuls inside a scan count once per iteration
  def scanned(a, b):
    return jax.lax.scan(lambda c, _: (c, c @ b), a, None, length=3)[1]

  assert count_macs(scanned, a, b) == 3 * 4 * 5 * 6


def test_init_model_is_the_op_by_op_draw():
  """models.tasks.init_model (one compiled program, LLVM optimisations off on the CPU) builds
  the module that building it op by op does: the same structure and variable types, the same
  values up to float32 rounding of the normal sampler (a few ulps: the key bits are exact
  integer arithmetic), the same draw for the same seed, another for another seed."""
  from models.tasks import init_model

  def build(key):
    rngs = nnx.Rngs(key)
    return nnx.Sequential(
      nnx.Conv(1, 4, (3, 3), rngs=rngs), nnx.BatchNorm(4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)
    )

  compiled, again, other = init_model(build, 0), init_model(build, 0), init_model(build, 1)
  eager = build(jax.random.key(0))
  assert nnx.graphdef(compiled) == nnx.graphdef(eager)
  for want, got in zip(jax.tree.leaves(nnx.state(eager)), jax.tree.leaves(nnx.state(compiled))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  same = jax.tree.map(np.array_equal, nnx.state(compiled), nnx.state(again))
  assert all(jax.tree.leaves(same))
  kernel = lambda m: np.asarray(m.layers[0].kernel.value)
  assert not np.allclose(kernel(compiled), kernel(other))


def test_init_model_runs_where_jax_has_no_cpu_backend(monkeypatch):
  """init_model compiles the initialisation for the host's CPU; under ``JAX_PLATFORMS=cuda``
  (no CPU backend: ``jax.devices("cpu")`` and ``jax.local_devices(backend="cpu")`` raise) it
  builds the same draw on the default device."""
  from models import tasks

  def build(key):
    return nnx.Linear(3, 2, rngs=nnx.Rngs(key))

  on_cpu = tasks.init_model(build, 0)
  assert tasks.host_cpu() == jax.local_devices(backend="cpu")[0]  # this process's own
  real, real_local = jax.devices, jax.local_devices

  def no_cpu(backend=None):
    if backend == "cpu":
      raise RuntimeError("Unknown backend cpu")
    return real(backend)

  def no_local_cpu(process_index=None, backend=None):
    if backend == "cpu":
      raise RuntimeError("Unknown backend cpu")
    return real_local(process_index, backend)

  monkeypatch.setattr(jax, "devices", no_cpu)
  monkeypatch.setattr(jax, "local_devices", no_local_cpu)
  assert tasks.host_cpu() is None
  default = tasks.init_model(build, 0)
  np.testing.assert_array_equal(on_cpu.kernel.value, default.kernel.value)
