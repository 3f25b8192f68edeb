"""Sampled-Fisher helpers: one forward pass, correct loss gradient, E[d d^T] = Fisher."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ginger import fisher


def _linear_model(key, n=6, features=4, classes=3):
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (n, features), jnp.float64)
  w = 0.5 * jax.random.normal(kw, (features, classes), jnp.float64)
  y = jnp.arange(n) % classes
  return x, w, y


def test_loss_and_gradient_match_autodiff(x64):
  x, w, y = _linear_model(jax.random.key(0))
  (loss, aux), grads, _ = fisher.value_grad_and_fisher(lambda w: x @ w, w, y, jax.random.key(1))
  ref_loss, ref_grad = jax.value_and_grad(lambda w: fisher.cross_entropy(x @ w, y))(w)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
  np.testing.assert_allclose(grads, ref_grad, rtol=1e-12)
  assert aux is None
  import optax

  np.testing.assert_allclose(
    loss, optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean(), rtol=1e-12
  )


def test_forward_runs_once():
  calls = []

  def logits_fn(w):
    calls.append(1)
    return jnp.ones((2, 3)) @ w

  fisher.value_grad_and_fisher(logits_fn, jnp.ones((3, 4)), jnp.array([0, 1]), jax.random.key(0))
  assert len(calls) == 1


def test_expected_outer_product_is_the_fisher(x64):
  """Monte Carlo: mean of d d^T over many label draws equals (1/N) sum_i J_i^T H_i J_i."""
  x, w, y = _linear_model(jax.random.key(2))
  n = x.shape[0]

  def d_of(key):
    _, _, d = fisher.value_grad_and_fisher(lambda w: x @ w, w, y, key)
    return d.ravel()

  ds = jax.vmap(d_of)(jax.random.split(jax.random.key(3), 40_000))
  mc = ds.T @ ds / ds.shape[0]
  probs = jax.nn.softmax(x @ w)
  exact = (
    sum(
      np.kron(np.outer(x[i], x[i]), np.diag(probs[i]) - np.outer(probs[i], probs[i]))
      for i in range(n)
    )
    / n
  )
  np.testing.assert_allclose(mc, exact, atol=0.03 * np.max(np.abs(exact)))


def test_sequence_mask_excludes_padding_and_scales_by_token_count(x64):
  logits = jax.random.normal(jax.random.key(4), (2, 5, 7), jnp.float64)
  labels = jnp.zeros((2, 5), jnp.int32)
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
  ct = fisher.fisher_cotangent(logits, jax.random.key(5), mask)
  assert np.all(np.asarray(ct)[mask == 0] == 0)
  # Each counted row is (onehot - p) / sqrt(5): its entries sum to zero.
  np.testing.assert_allclose(np.asarray(ct).sum(-1), 0, atol=1e-12)
  np.testing.assert_allclose(np.abs(ct[0, 0]).max() <= 1 / np.sqrt(5), True)
  loss_ct = fisher.loss_cotangent(logits, labels, mask)
  ref = jax.grad(lambda z: fisher.cross_entropy(z, labels, mask))(logits)
  np.testing.assert_allclose(loss_ct, ref, rtol=1e-12)


def test_empirical_option_uses_true_labels(x64):
  x, w, y = _linear_model(jax.random.key(6))
  _, grads, d = fisher.value_grad_and_fisher(
    lambda w: x @ w, w, y, jax.random.key(7), fisher="empirical"
  )
  np.testing.assert_allclose(d, -grads * np.sqrt(x.shape[0]), rtol=1e-12)


def test_has_aux_and_errors():
  w = jnp.ones((3, 2))
  (loss, aux), _, _ = fisher.value_grad_and_fisher(
    lambda w: (jnp.ones((4, 3)) @ w, {"stat": 1}),
    w,
    jnp.zeros(4, jnp.int32),
    jax.random.key(0),
    has_aux=True,
  )
  assert aux == {"stat": 1} and np.isfinite(loss)
  with pytest.raises(ValueError, match="fisher must be"):
    fisher.value_grad_and_fisher(
      lambda w: w, w, jnp.zeros(3, jnp.int32), jax.random.key(0), fisher="true"
    )
  with pytest.raises(ValueError, match="does not match labels shape"):
    fisher.value_grad_and_fisher(lambda w: w, w, jnp.zeros(5, jnp.int32), jax.random.key(0))
  # A (B,) mask for (B, T) labels broadcast along T: it masked time steps, silently.
  x, labels = jnp.ones((4, 4, 3)), jnp.zeros((4, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"mask shape \(4,\) does not match labels shape \(4, 4\)"):
    fisher.value_grad_and_fisher(lambda w: x @ w, w, labels, jax.random.key(0), mask=jnp.ones(4))
  with pytest.raises(ValueError, match="mask shape"):
    fisher.cross_entropy(jnp.ones((4, 4, 2)), labels, jnp.ones(4))


def _coupled_model(key, n=8, features=5, hidden=6, classes=4):
  """A nonlinear model whose examples interact (batch-normalised hidden layer), with aux."""
  kx, k1, k2 = jax.random.split(key, 3)
  x = jax.random.normal(kx, (n, features), jnp.float64)
  params = {
    "w1": jax.random.normal(k1, (features, hidden), jnp.float64),
    "w2": jax.random.normal(k2, (hidden, classes), jnp.float64),
  }

  def logits_fn(p):
    h = x @ p["w1"]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-3)
    return jnp.tanh(h) @ p["w2"], {"mean": h.mean()}

  return logits_fn, params, jnp.arange(n) % classes


@pytest.mark.parametrize("kind", ["sampled", "empirical"])
def test_batched_and_sequential_backward_agree_with_autodiff(x64, kind):
  """Both pull-backs give the loss gradient and d_t = grad of sum_i log p(y_hat_i) / sqrt(N)
  with the labels y_hat the key draws (float64: agreement to rounding), and fisher_vector
  (the d-pass with a forward of its own) gives the same d_t."""
  logits_fn, params, y = _coupled_model(jax.random.key(8))
  key = jax.random.key(9)
  mask = jnp.array([1, 1, 1, 0, 1, 1, 0, 1])

  @jax.jit  # one program (op by op, the float64 vmapped backward takes seconds)
  def run(params):
    out = {
      b: fisher.value_grad_and_fisher(
        logits_fn, params, y, key, mask=mask, has_aux=True, fisher=kind, backward=b
      )
      for b in fisher.BACKWARDS
    }
    logits = logits_fn(params)[0]
    drawn = y if kind == "empirical" else jax.random.categorical(key, logits, axis=-1)

    def log_lik(p):
      logp = jax.nn.log_softmax(logits_fn(p)[0])
      picked = jnp.take_along_axis(logp, drawn[:, None], -1)[:, 0]
      return jnp.sum(picked * mask) / jnp.sqrt(jnp.sum(mask))

    ref_d = jax.grad(log_lik)(params)
    ref_g = jax.grad(lambda p: fisher.cross_entropy(logits_fn(p)[0], y, mask))(params)
    alone = fisher.fisher_vector(lambda p: logits_fn(p)[0], params, y, key, mask=mask, fisher=kind)
    return out, logits, ref_d, ref_g, alone

  out, logits, ref_d, ref_g, alone = run(params)
  for (loss, aux), grads, d in out.values():
    np.testing.assert_allclose(loss, fisher.cross_entropy(logits, y, mask), rtol=1e-12)
    assert set(aux) == {"mean"}
    for name in params:
      np.testing.assert_allclose(grads[name], ref_g[name], rtol=1e-10, atol=1e-13)
      np.testing.assert_allclose(d[name], ref_d[name], rtol=1e-10, atol=1e-13)
      np.testing.assert_allclose(alone[name], ref_d[name], rtol=1e-10, atol=1e-13)


def _dots(fn, *args) -> int:
  return sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def test_batched_backward_is_one_backward_pass():
  """Batched: the program has the matrix products of one forward and one backward (each
  product of the backward on a stacked pair of cotangents); sequential: of two backwards."""
  x = jnp.ones((4, 3))
  params = {"w1": jnp.ones((3, 5)), "w2": jnp.ones((5, 2))}
  logits_fn = lambda p: jnp.tanh(x @ p["w1"]) @ p["w2"]
  y, key = jnp.zeros(4, jnp.int32), jax.random.key(0)
  plain = _dots(jax.grad(lambda p: fisher.cross_entropy(logits_fn(p), y)), params)
  batched, sequential = (
    _dots(lambda p, b=b: fisher.value_grad_and_fisher(logits_fn, p, y, key, backward=b), params)
    for b in fisher.BACKWARDS
  )
  forward = 2
  assert batched == plain and sequential == plain + (plain - forward)
  with pytest.raises(ValueError, match="backward must be one of"):
    fisher.value_grad_and_fisher(logits_fn, params, y, key, backward="twice")
  # The config check's list (training.config_check imports no JAX) is this one.
  from training import config_check

  assert config_check.FISHER_BACKWARDS == ("auto", *fisher.BACKWARDS, "local")


_SPLIT_BATCH = """
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from bench.collectives import collectives
from ginger import fisher

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
params = {"w1": jnp.ones((3, 3, 3, 8)), "w2": jnp.ones((3, 3, 8, 8)), "out": jnp.ones((8, 10))}

def logits_fn(p, x):
  for w in (p["w1"], p["w2"]):
    dims = ("NHWC", "HWIO", "NHWC")
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims))
  return x.mean((1, 2)) @ p["out"]

out = {}
for backward in fisher.BACKWARDS:
  def step(p, x, labels):
    key = jax.random.key(0)
    fn = lambda q: logits_fn(q, x)
    _, g, d = fisher.value_grad_and_fisher(fn, p, labels, key, backward=backward)
    return g, d
  batch = NamedSharding(mesh, P("data"))
  x = jax.ShapeDtypeStruct((32, 8, 8, 3), jnp.float32, sharding=batch)
  labels = jax.ShapeDtypeStruct((32,), jnp.int32, sharding=batch)
  hlo = jax.jit(step).lower(params, x, labels).compile().as_text()
  out[backward] = sum(n for (kind, _), (n, _) in collectives(hlo).items() if kind == "all-gather")
print(json.dumps(out))
"""


def test_the_batched_backward_gathers_a_split_batch():
  """Why the training loop's ``fisher_backward=auto`` never takes ``batched`` on several
  devices (but ``local``, or ``sequential``): with the batch split over 4 (CPU) devices, the
  batched pull-back's convolutions fold the pair of cotangents into the batch dimension,
  outside the split, and GSPMD all-gathers their operands; the two sequential backwards gather
  nothing (their gradients are all-reduced)."""
  from cpu_devices import run_on_cpu_devices

  gathers = run_on_cpu_devices(_SPLIT_BATCH)
  assert gathers["sequential"] == 0
  assert gathers["batched"] > 0


def test_auto_backward_takes_the_per_device_pull_back_where_the_batch_is_split():
  """``fisher_backward=auto``: batched on one device; on several, local (one batched backward
  per device) for a model with no state but parameters and BatchNorm statistics, sequential
  for one that draws randomness (dropout) or when no model is given; a named one as named."""
  from types import SimpleNamespace

  from flax import nnx

  from models.resnet import build_resnet
  from training.steps import fisher_backward

  resnet = build_resnet("resnet_tiny", 10, rngs=nnx.Rngs(0))

  class WithDropout(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(1))

  dropout = WithDropout()
  for value, devices, model, expected in [
    ("auto", 1, resnet, "batched"),
    ("auto", 1, dropout, "batched"),
    ("auto", 4, resnet, "local"),
    ("auto", 4, dropout, "sequential"),
    ("auto", 4, None, "sequential"),
    ("batched", 4, resnet, "batched"),  # asked for: as asked
    ("sequential", 4, resnet, "sequential"),
    ("sequential", 1, resnet, "sequential"),
    ("local", 4, dropout, "local"),  # refused by build (per_shard_graphdef), not here
  ]:
    cfg = SimpleNamespace(fisher_backward=value)  # as RunConfig holds it (null: auto)
    plan = SimpleNamespace(data_size=devices)
    got = fisher_backward(cfg, plan, model)
    assert got == expected, (value, devices, type(model).__name__, got)


_PER_DEVICE = """
import json
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from bench.collectives import collectives
from ginger import fisher

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
k = jax.random.split(jax.random.key(0), 6)
params = {
  "w1": 0.3 * jax.random.normal(k[0], (3, 3, 3, 8)),
  "w2": 0.2 * jax.random.normal(k[1], (3, 3, 8, 8)),
  "out": 0.5 * jax.random.normal(k[2], (8, 10)),
}
scale = jnp.float32(1.5)  # a constant: not differentiated

def logits_fn(p, x, c):
  for w in (p["w1"], p["w2"]):
    dims = ("NHWC", "HWIO", "NHWC")
    x = jnp.tanh(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims))
  h = x.mean((1, 2))
  return c * h @ p["out"], jnp.mean(h, 0)  # aux: a batch mean (per device: averaged)

batch = NamedSharding(mesh, P("data"))
x = jax.device_put(jax.random.normal(k[3], (32, 8, 8, 3)), batch)
labels = jax.device_put(jax.random.randint(k[4], (32,), 0, 10), batch)
mask = jax.device_put((jnp.arange(32) % 3 != 0).astype(jnp.float32), batch)  # uneven per device
key = jax.random.key(7)
out = {}
for fisher_kind in ("sampled", "empirical"):
  def gspmd(p, x, labels, mask):
    return fisher.value_grad_and_fisher(
      lambda q: logits_fn(q, x, scale), p, labels, key, mask=mask, has_aux=True,
      fisher=fisher_kind, backward="sequential")

  def per_device(p, x, labels, mask):
    return fisher.value_grad_and_fisher_per_device(
      logits_fn, p, x, labels, key, mesh=mesh, mask=mask, has_aux=True, fisher=fisher_kind,
      constants=(scale,))

  ref = jax.jit(gspmd)(params, x, labels, mask)
  step = jax.jit(per_device).lower(params, x, labels, mask).compile()
  got = step(params, x, labels, mask)
  rel = max(
    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
  )
  kinds = sorted({kind for kind, _ in collectives(step.as_text())})
  out[fisher_kind] = {"rel": rel, "collectives": kinds}
print(json.dumps(out))
"""


def test_per_device_pull_back_matches_and_does_not_gather():
  """The shard_map form of the shared d-pass (each device pulls the pair of cotangents back
  through its own shard) gives the GSPMD values on 4 devices, with the same sampled labels
  (the whole batch's Gumbel noise), the whole batch's count normalising a masked loss
  unevenly split over the devices, the aux averaged, and no all-gather."""
  from cpu_devices import run_on_cpu_devices

  out = run_on_cpu_devices(_PER_DEVICE)
  for kind, row in out.items():
    # float32 sums over the batch in another order (per device, then over devices): a few
    # ulps of the largest entry; a wrong count, noise or scale is off by >= 1e-2.
    assert row["rel"] < 1e-5, (kind, row)
    assert "all-gather" not in row["collectives"], (kind, row)


def test_fisher_cotangent_noise_is_the_categorical_draw():
  logits = jax.random.normal(jax.random.key(1), (64, 10))
  key = jax.random.key(3)
  noise = jax.random.gumbel(key, logits.shape, logits.dtype)
  np.testing.assert_array_equal(
    fisher.fisher_cotangent(logits, key), fisher.fisher_cotangent(logits, None, noise=noise)
  )


def test_a_perfect_prediction_has_loss_plus_zero():
  """log p = 0 exactly (a saturated softmax) is a loss of +0, not -0 (which summaries and tables
  showed as a negative minimum training loss, "-0")."""
  logits = jnp.array([[100.0, -100.0], [-100.0, 100.0]])
  loss = jax.jit(fisher.cross_entropy)(logits, jnp.array([0, 1]))
  assert float(loss) == 0.0 and not np.signbit(loss)
