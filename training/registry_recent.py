"""Today's optimizers beside the paper's: Muon and schedule-free AdamW (first-order), SOAP
(Adam in Shampoo's eigenbasis) and K-FAC (kfac-jax's Kronecker-factored curvature), each a
registry entry with its builder, its update FLOPs and its state bytes
(training/registry_schema.py says what an entry holds; docs/adding-an-optimizer.md how to add
one here). The builders and FLOP counts import JAX, optax and the libraries when called only.
"""

from __future__ import annotations

from training.registry_costs import elementwise_flops, traced_state_bytes
from training.registry_schema import (
  DECAY,
  FLAG,
  Optimizer,
  OptimizerConfig,
  choice,
  integer,
  number,
  register,
)

# ------------------------------------------------------------------ today's first-order methods


def _build_muon(opt: OptimizerConfig, schedule, sharding):
  import optax

  from training import muon_layout

  return optax.contrib.muon(
    schedule,
    ns_steps=opt.extra["optimizer.ns_steps"],
    beta=opt.b1,
    nesterov=opt.extra["optimizer.nesterov"],
    adam_b1=opt.extra["optimizer.adam_b1"],
    adam_b2=opt.b2,
    eps=opt.eps,
    muon_weight_dimension_numbers=muon_layout.dimension_numbers,
    consistent_rms=opt.extra["optimizer.consistent_rms"],
  )


def _muon_flops(params, opt: OptimizerConfig, **_) -> float:
  """The element-wise work of both branches plus ``ns_steps`` Newton-Schulz iterations on each
  matrix Muon orthogonalises (training/muon_layout.py: a convolution filter as its
  ``(kh * kw * in, out)`` matrix), ``models.flops.newton_schulz_flops``."""
  import jax

  from models import flops
  from training import muon_layout

  layout = muon_layout.dimension_numbers(params)
  leaves = jax.tree.leaves(params)
  numbers = jax.tree.leaves(layout, is_leaf=lambda x: x is None or hasattr(x, "output_axis"))
  steps = int(opt.extra["optimizer.ns_steps"])
  total = elementwise_flops(params)
  for leaf, dims in zip(leaves, numbers, strict=True):
    if dims is not None:
      total += steps * flops.newton_schulz_flops(*muon_layout.matrix_shape(leaf.shape, dims))
  return total


def _build_schedule_free_adamw(opt: OptimizerConfig, schedule, sharding):
  import optax

  return optax.contrib.schedule_free_adamw(
    schedule,
    b1=opt.b1,
    b2=opt.b2,
    eps=opt.eps,
    weight_decay=opt.weight_decay,
    weight_lr_power=opt.extra["optimizer.weight_lr_power"],
  )


def _schedule_free_eval_params(opt_state, trainable):
  """Schedule-free's x sequence (where its guarantees hold) from the trained y and the state's
  z: ``x = (y - (1 - b1) z) / b1`` (``optax.contrib.schedule_free_eval_params``), found in
  the state however the framework chained it."""
  import jax
  import optax

  found = [
    s
    for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, optax.contrib.ScheduleFreeState)
    )
    if isinstance(s, optax.contrib.ScheduleFreeState)
  ]
  if len(found) != 1:
    raise ValueError(f"expected one ScheduleFreeState in the optimizer state, found {len(found)}.")
  return optax.contrib.schedule_free_eval_params(found[0], trainable)


register(
  Optimizer(
    name="muon",
    display="Muon",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.nesterov": choice((True, False)),
      "optimizer.ns_steps": integer(1),
      "optimizer.consistent_rms": number(0, closed=(False, True), optional=True),
      "optimizer.adam_b1": DECAY,
      "optimizer.b2": DECAY,
      "optimizer.eps": number(0, closed=(False, True)),
    },
    build=_build_muon,
    update_flops=_muon_flops,
    state_bytes=traced_state_bytes,  # momentum for every leaf, AdamW's nu for its branch
  )
)
register(
  Optimizer(
    name="schedule_free_adamw",
    display="SF-AdamW",
    keys={
      "optimizer.b1": number(0, 1, closed=(False, False)),  # schedule_free needs b1 > 0
      "optimizer.b2": DECAY,
      "optimizer.eps": number(0, closed=(False, True)),
      "optimizer.weight_lr_power": number(0),
    },
    build=_build_schedule_free_adamw,
    update_flops=elementwise_flops,
    state_bytes=traced_state_bytes,  # z, the second moment and the averaging's scalars
    eval_params=_schedule_free_eval_params,
    own_decoupled_decay=True,
  )
)


# ----------------------------------------------------------------------------- SOAP


def _build_soap(opt: OptimizerConfig, schedule, sharding):
  import ginger

  own = opt.extra
  # weight_decay=0: the framework chains the config's weight_decay around every optimizer.
  return ginger.soap(
    schedule,
    b1=opt.b1,
    b2=opt.b2,
    shampoo_beta=own["optimizer.shampoo_beta"],
    eps=opt.eps,
    weight_decay=0.0,
    precondition_frequency=own["optimizer.precondition_frequency"],
    max_precond_dim=own["optimizer.max_precond_dim"],
    merge_dims=own["optimizer.merge_dims"],
    precondition_1d=own["optimizer.precondition_1d"],
    normalize_grads=own["optimizer.normalize_grads"],
    correct_bias=own["optimizer.correct_bias"],
  )


def _soap_flops(params, opt: OptimizerConfig, **_) -> float:
  """Adam's element-wise work plus, per leaf of n entries with factors of sizes d_i, the three
  n sum(d_i) multiply-adds of every step (the gradient into the eigenbasis, the update back,
  the factors' G_(i) G_(i)^T) and the refresh of the bases every precondition_frequency steps,
  amortised (``models.flops.soap_update_flops``). Needs the leaves' shapes and the run's
  config: a SOAP update's cost is not a function of the sizes alone."""
  import jax

  from models import flops

  own = opt.extra
  return elementwise_flops(params) + flops.soap_update_flops(
    [tuple(leaf.shape) for leaf in jax.tree.leaves(params)],
    precondition_frequency=own["optimizer.precondition_frequency"],
    max_precond_dim=own["optimizer.max_precond_dim"],
    merge_dims=own["optimizer.merge_dims"],
    precondition_1d=own["optimizer.precondition_1d"],
  )


register(
  Optimizer(
    name="soap",
    display="SOAP",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.b2": DECAY,
      "optimizer.shampoo_beta": number(0, 1, closed=(True, False), optional=True),
      "optimizer.eps": number(0),
      "optimizer.precondition_frequency": integer(1),
      "optimizer.max_precond_dim": integer(1),
      "optimizer.merge_dims": FLAG,
      "optimizer.precondition_1d": FLAG,
      "optimizer.normalize_grads": FLAG,
      "optimizer.correct_bias": FLAG,
    },
    build=_build_soap,
    update_flops=_soap_flops,
    state_bytes=traced_state_bytes,  # its moments, factors and eigenbases, as the library lays them
  )
)


# ----------------------------------------------------------------------------- K-FAC


def _build_kfac(opt: OptimizerConfig, schedule, sharding, loss):
  from training.kfac import kfac  # imports kfac-jax (and its distrax) when built only

  del sharding  # its factors are small: replicated, as the mesh's plan keeps small arrays
  return kfac(
    schedule,
    loss,
    b1=opt.b1,
    damping=opt.extra["optimizer.damping"],
    inverse_update_period=opt.extra["optimizer.inverse_update_period"],
    curvature_ema=opt.extra["optimizer.curvature_ema"],
    norm_constraint=opt.extra["optimizer.norm_constraint"],
  )


# The distributions kfac_jax imports beyond the library's own (jax, optax, numpy, absl), each
# by the top-level module the import system finds it as (requirements.txt pins them).
KFAC_JAX_DEPENDENCIES = {
  "distrax": "distrax",
  "tensorflow_probability": "tfp-nightly",
  "tree": "dm-tree",
  "immutabledict": "immutabledict",
}


def kfac_jax_unavailable() -> str | None:
  """Why ``optimizer=kfac`` cannot run in this environment (None: it can): kfac_jax's vendored
  source (``third_party/kfac_jax``, which the ``training`` package puts first on ``sys.path``)
  is missing, or a distribution it imports is not installed. Asked of the import system's
  finders: nothing is imported, so the config check stays fast."""
  from importlib import machinery, util

  from training import KFAC_JAX_DIR

  if machinery.PathFinder.find_spec("kfac_jax", [str(KFAC_JAX_DIR)]) is None:
    return (
      f"kfac_jax cannot be imported: its vendored source {KFAC_JAX_DIR / 'kfac_jax'} is missing"
    )
  missing = [
    dist for module, dist in KFAC_JAX_DEPENDENCIES.items() if util.find_spec(module) is None
  ]
  if missing:
    return (
      f"kfac_jax cannot be imported: {', '.join(missing)} not installed (pip install -r "
      "requirements.txt)"
    )
  return None


def _kfac_refuses(c, optimizer: Optimizer) -> None:
  missing = kfac_jax_unavailable()
  if missing is not None:
    c.bad("optimizer.name", "kfac", f"an optimizer whose library can be imported here ({missing})")
  # kfac-jax gives each parameter one layer of the loss's trace, matched by its patterns.
  if c.get("model.family") not in optimizer.families:
    c.bad(
      "model.family",
      c.get("model.family"),
      f"'resnet' for optimizer={optimizer.name} (kfac-jax does not support weight sharing: T5 "
      "uses its token embedding for the encoder's and decoder's inputs and the tied LM head, "
      "and each stack's relative-position table in every layer)",
    )
  if c.get("precision") == "bfloat16":
    c.bad(
      "precision",
      "bfloat16",
      f"'float32' for optimizer={optimizer.name} (kfac-jax's graph matcher finds no dense or "
      "conv layer behind bfloat16's casts: no Kronecker factors)",
    )


def _kfac_layers(params) -> list[tuple[int, int]]:
  """K-FAC's Kronecker factors per layer, ``(a, g)``: a dense kernel ``(in, out)`` or a
  convolution filter ``(kh, kw, in, out)`` has an input factor of side ``a = kh * kw * in``
  (+ 1 with a bias beside it) and an output factor of side ``g = out``; BatchNorm's scale and
  shift pairs are kfac-jax's diagonal scale-and-shift blocks, ``(features, 0)``."""
  import math

  from models.lora import named_leaves  # "/"-joined paths, nnx.Variable's .value left out

  leaves = {name: leaf.shape for name, leaf in named_leaves(params)}
  layers = []
  for name, shape in leaves.items():
    module, _, leaf = name.rpartition("/")
    bias = f"{module}/bias" in leaves
    if leaf == "kernel" and len(shape) in (2, 4):
      layers.append((math.prod(shape[:-1]) + int(bias), shape[-1]))
    elif leaf == "scale":
      layers.append((shape[-1], 0))
  return layers


def _kfac_state_bytes(params, opt: OptimizerConfig) -> int:
  """kfac-jax's state: the momentum (float32, one copy of the parameters); per dense or
  convolution layer each factor's moving average and its damped inverse, ``2 (a^2 + g^2)``
  floats, and a float32 weight per factor; per scale-and-shift block a diagonal moving average
  for the scale and one for the shift (``2 features``) with their weights; and the counters:
  two int32 steps and a bool (tests/test_kfac.py checks it against the allocated state)."""
  import math

  import jax

  floats = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  for a, g in _kfac_layers(params):
    floats += (2 * (a * a + g * g) if g else 2 * a) + 2
  return 4 * floats + 2 * 4 + 1


def _kfac_flops(params, opt: OptimizerConfig, **_) -> float:
  """The update's own work: element-wise (momentum, the update), each layer's gradient
  preconditioned on both sides, ``A^-1 grad G^-1`` (2 (a^2 g + a g^2) FLOPs), and the damped
  inverses of both factors every ``inverse_update_period`` steps (about ``a^3 + g^3`` each,
  amortised). Not counted: the factors' statistics, gathered in kfac-jax's own forward and
  backward pass over the batch (XLA's count of the compiled step has them)."""
  period = int(opt.extra["optimizer.inverse_update_period"])
  total = elementwise_flops(params)
  for a, g in _kfac_layers(params):
    if g:
      total += 2 * (a * a * g + a * g * g) + (a**3 + g**3) / period
  return total


def _kfac_advice(opt: OptimizerConfig) -> str:
  norm = opt.extra["optimizer.norm_constraint"]
  bound = " or bound the update (optimizer.norm_constraint=0.01)" if norm is None else ""
  return f"raise optimizer.damping (now {opt.extra['optimizer.damping']}){bound}"


register(
  Optimizer(
    name="kfac",
    display="K-FAC",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.damping": number(0, closed=(False, True)),
      "optimizer.inverse_update_period": integer(1),
      "optimizer.curvature_ema": DECAY,
      "optimizer.norm_constraint": number(0, closed=(False, True), optional=True),
    },
    build=_build_kfac,
    update_flops=_kfac_flops,
    state_bytes=_kfac_state_bytes,
    advice=_kfac_advice,
    traces_loss=True,
    refuses=_kfac_refuses,
    families=("resnet",),
  )
)
