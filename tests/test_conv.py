"""models.conv: the convolution whose weight gradient, in a backward over a stack of
cotangents, is one convolution per cotangent (train.py's ``conv_weight_grads=per_cotangent``).

Against ``jax.lax.conv_general_dilated``'s own gradient in float64 (the math is the same sum,
so the two agree to float64 rounding), under every vmap it can meet: the batched pull-back's
stack of cotangents, a stack larger than ``MAX_STACK``, per-example gradients; and the reason
it exists, in the lowered program: no transpose of the cotangents."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from models import conv
from models.resnet import build_resnet

DN = ("NHWC", "HWIO", "NHWC")


def _layer(stride, padding, kernel, dilation):
  """``(plain, ours)``: lax's convolution and models.conv's, for the same options."""
  options = dict(
    window_strides=(stride, stride),
    padding=padding,
    rhs_dilation=(dilation, dilation),
    dimension_numbers=lax.conv_dimension_numbers((1, 8, 8, 3), (kernel, kernel, 3, 5), DN),
  )
  plain = lambda x, w: lax.conv_general_dilated(x, w, **options)
  ours = lambda x, w: conv.conv_general_dilated(x, w, **options)
  return plain, ours


def _pull_back(fn, x, w, gs, in_axes=(None, None, 0)):
  """``(dx, dw)`` of ``fn`` at ``(x, w)`` for each cotangent of the stack ``gs`` (vmapped as
  the batched pull-back does: the vjp's residuals shared, the cotangents stacked)."""

  def one(x, w, g):
    return jax.vjp(fn, x, w)[1](g)

  return jax.vmap(one, in_axes=in_axes)(x, w, gs)


@settings(max_examples=6, deadline=None)
@given(
  stride=st.sampled_from([1, 2]),
  padding=st.sampled_from(["SAME", "VALID", ((1, 1), (1, 1)), ((0, 2), (1, 0))]),
  kernel=st.sampled_from([1, 3]),
  dilation=st.sampled_from([1, 2]),
  stack=st.integers(1, conv.MAX_STACK + 2),  # past MAX_STACK: JAX's own folded rule
  seed=st.integers(0, 2**16),
)
def test_the_pull_back_of_a_stack_is_lax_s_to_float64_rounding(
  stride, padding, kernel, dilation, stack, seed
):
  with jax.enable_x64(True):
    _check_stack(stride, padding, kernel, dilation, stack, seed)


def _check_stack(stride, padding, kernel, dilation, stack, seed):
  plain, ours = _layer(stride, padding, kernel, dilation)
  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (2, 8, 8, 3), jnp.float64)
  w = jax.random.normal(kw, (kernel, kernel, 3, 5), jnp.float64)
  out = jax.eval_shape(plain, x, w)
  gs = jax.random.normal(kg, (stack, *out.shape), jnp.float64)
  np.testing.assert_array_equal(ours(x, w), plain(x, w))
  # one cotangent, no vmap (Adam's backward, the sequential d-pass): lax's rule as it is
  for got, want in zip(jax.vjp(ours, x, w)[1](gs[0]), jax.vjp(plain, x, w)[1](gs[0]), strict=True):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(_pull_back(ours, x, w, gs), _pull_back(plain, x, w, gs), strict=True):
    assert got.shape == want.shape
    # The same sums of at most 2 * 8 * 8 * 9 products in float64 (another order at most):
    # |error| <= n eps sum|terms| ~ 1e-13 here, against O(1)..O(100) entries.
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_per_example_gradients_take_jax_s_own_rule(x64):
  """A vmap over the examples (x and the cotangent batched together, the weights shared):
  the fallback, with lax's values."""
  plain, ours = _layer(1, "SAME", 3, 1)
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (3, 1, 8, 8, 3), jnp.float64)
  w = jax.random.normal(kw, (3, 3, 3, 5), jnp.float64)
  gs = jax.random.normal(kg, (3, 1, 8, 8, 5), jnp.float64)
  got = _pull_back(ours, xs, w, gs, in_axes=(0, None, 0))
  want = _pull_back(plain, xs, w, gs, in_axes=(0, None, 0))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def _resnet_pull_back(mode: str):
  """The batched pull-back of (g, d) through resnet_tiny with ``conv_weight_grads=mode``:
  the jitted function and its arguments."""
  from ginger.fisher import value_grad_and_fisher

  model = conv.use_conv_weight_grads(build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(0)), mode)
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
  labels = jax.random.randint(jax.random.key(2), (4,), 0, 10)

  def step(params):
    def forward(p):
      m = nnx.merge(graphdef, p, rest, copy=True)
      return m(x), nnx.split(m, nnx.Param, ...)[2]

    return value_grad_and_fisher(
      forward, params, labels, jax.random.key(3), has_aux=True, backward="batched"
    )

  return jax.jit(step), params


def _stacked_activation_transposes(stablehlo: str) -> list[str]:
  """The lowered program's transposes of 5-d arrays: a stack of NHWC activations'
  cotangents (the dense layer's stacked weight gradient, 3-d, is not one)."""
  shapes = re.findall(r"stablehlo\.transpose.*-> tensor<([0-9x]+)x[a-z0-9]+>", stablehlo)
  return [shape for shape in shapes if len(shape.split("x")) == 5]


def test_the_resnet_s_batched_pull_back_keeps_its_values_and_drops_the_transposes():
  """resnet_tiny's (g, d): the same values (each weight gradient is the same sum, computed
  per cotangent: float32 rounding of the sums' order at most), and in the lowered program no
  transpose of a stack of cotangents, where JAX's folded rule transposes every convolution's."""
  step, params = _resnet_pull_back("folded")
  step_ours, _ = _resnet_pull_back("per_cotangent")
  (loss, _), g, d = step(params)
  (loss_ours, _), g_ours, d_ours = step_ours(params)
  assert float(loss_ours) == float(loss)
  for got, want in ((g_ours, g), (d_ours, d)):
    scale = max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      # float32 sums of <= 4 * 8 * 8 * 9 products in another order: ~1e-7 of the largest entry
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)
  folded = _stacked_activation_transposes(step.lower(params).as_text())
  ours = _stacked_activation_transposes(step_ours.lower(params).as_text())
  assert len(folded) >= 9, folded  # one a convolution of resnet_tiny (9 convs)
  assert ours == [], ours


def test_the_config_refuses_per_cotangent_for_t5_up_front():
  from hydra import compose, initialize_config_dir

  from training.config_check import ConfigError, check_config

  overrides = ["experiment=demo_xsum", "conv_weight_grads=per_cotangent"]
  configs = str(Path(__file__).resolve().parents[1] / "configs")
  with initialize_config_dir(config_dir=configs, version_base=None):
    cfg = compose(config_name="config", overrides=overrides)
  with pytest.raises(ConfigError) as info:
    check_config(cfg, overrides=overrides)
  assert "conv_weight_grads='per_cotangent': must be 'folded' for model.family='t5'" in str(
    info.value
  )


def test_use_conv_weight_grads_refuses_an_unknown_mode():
  with pytest.raises(ValueError, match=r"conv_weight_grads must be one of \['folded', 'per_cot"):
    conv.use_conv_weight_grads(build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(0)), "stacked")


def test_the_config_check_knows_the_same_modes():
  from training import config_check

  assert config_check.CONV_WEIGHT_GRADS == conv.CONV_WEIGHT_GRADS
