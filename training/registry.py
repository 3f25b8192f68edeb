"""The optimizers train.py can run, each described once: what the rest of the code knows of it.

An :class:`Optimizer` entry holds an optimizer's name (``optimizer.name`` in the config), the
name tables print, the config keys it reads with the check each value must pass, whether it keeps
a curvature estimate (takes the sampled-Fisher vector of the d-pass and stores its state in
``optimizer.state_dtype``) and whether that curvature may be updated every K-th step only
(``curvature_every``), the function that builds its optax transformation, the FLOPs of one of
its updates and the bytes of its state for a parameter layout (both required), its entry in
configs/best_lr/ and the arms its results are compared with. Everything else reads the entries:

* ``training/config_check.py``: the allowed ``optimizer.name`` values, each key's check, the
  other settings it refuses (:attr:`Optimizer.refuses`), and the warnings for a key the chosen
  optimizer ignores;
* ``training/run_config.py``: the typed optimizer part of a checked config
  (:class:`OptimizerConfig`, from :func:`optimizer_config`: the values of the keys it reads);
* ``training/optimizers.py``: the transformation (:attr:`Optimizer.build`);
* ``training/steps.py``: whether a step has a d-pass (:func:`keeps_curvature`) and whether
  its update takes the batch (:func:`traces_loss`);
  ``training/summary.py``: the analytic FLOPs (:func:`update_flops`);
* ``training/run_record.py``: which hyperparameters are part of a run's identity (the
  paper-notation keys it reads, and its own keys where a run sets them away from its YAML) and
  its lr key (:func:`lr_key`);
* ``training/config_doc.py``, ``results/tables.py``, ``results/plots.py``: names and order;
  ``results/tables.py``'s comparisons and ``results/newcomers.py``: the arms each optimizer
  beyond the paper's is compared with (:attr:`Optimizer.compared_with`), its state bytes
  (:func:`state_bytes`) and update FLOPs.

A new optimizer is one entry (:func:`register`) and one ``configs/optimizer/<name>.yaml``
(docs/adding-an-optimizer.md). This module imports no JAX: the builders and FLOP counts import
what they need when called, so the config check, the results and the sweeps read the entries
in milliseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

# The values the optimizer keys accept (config_check checks them against the entries below).
BLOCKS = ("per_tensor", "global")  # ginger._src.common.BLOCKS
# A float64 state needs JAX's 64-bit mode, which a training run does not use (the library takes
# it: ginger.scale_by_ginger(..., state_dtype="float64") under jax_enable_x64).
STATE_DTYPES = ("float32", "bfloat16", "float16")
PASSES = ("jnp", "pallas", "auto")  # Ginger's passes over U (ginger.scale_by_ginger)

# The paper-notation keys at the top of the config (configs/config.yaml): an optimizer's YAML
# sets those it does not read to null, so a value there was asked for, and is warned about.
PAPER_KEYS = ("tau", "alpha", "gamma", "rho", "block")
# Keys with config defaults that only the curvature optimizers read (the d-pass's).
FISHER_KEYS = ("fisher", "fisher_forward", "fisher_backward", "fisher_batch")
# The paper's optimizers in the row order of its Table 1: the tables list them first, then every
# other optimizer in the order it was registered.
PAPER_ORDER = ("momentum", "adam", "qng", "ginger")
# The arms every other optimizer is compared with, unless its entry names its own: Adam, the
# paper's baseline, and Ginger at the paper's default rank.
REFERENCE_ARMS = (("adam", None), ("ginger", 8))

# A check of one config key: ``check(checker, key, optimizer)`` reads ``key`` through the
# checker of training/config_check.py (its ``number``, ``integer``, ``choice``, ``check`` and
# ``bad`` methods), which records any problem with the key, the bad value and what is allowed.
Check = Callable[[Any, str, "Optimizer"], Any]
# ``build(opt, schedule, sharding)``: the optax transformation, before weight decay and
# ``with_extra_args_support`` (training/optimizers.py adds both). ``opt`` is the run's
# :class:`OptimizerConfig`, ``schedule`` the learning rate, ``sharding`` where the state's big
# arrays are split (``ginger.sharding.StateSharding``) or None.
Build = Callable[[Any, Any, Any], Any]
# ``update_flops(params, opt, *, curvature_update)``: FLOPs of one update of the trained
# parameters ``params`` (a pytree of arrays or ``jax.ShapeDtypeStruct`` s: their paths, shapes
# and dtypes, the layout) with the run's :class:`OptimizerConfig` ``opt``
# (``curvature_update=False``: a step that only preconditions, see ``curvature_every``).
UpdateFlops = Callable[..., float]
# ``state_bytes(params, opt)``: bytes of the optimizer state for the layout ``params``, whole
# (not split over devices), from the shapes alone.
StateBytes = Callable[[Any, Any], int]
# ``lr_key(values)``: the optimizer's entry in configs/best_lr/ from the run's values of the
# paper-notation keys (``values["rho"]``; a value the caller does not have is None).
LrKey = Callable[[Mapping[str, Any]], str]
# ``reorthonormalise_every(opt)``: curvature updates between the loop's re-orthonormalisations
# of the state's bases (a program of their own), from the run's :class:`OptimizerConfig`.
ReorthonormaliseEvery = Callable[[Any], int]
# ``advice(opt)``: what of its own to change after a NaN/Inf loss, beside the learning rate
# ("raise gamma (now 1e-05)"), from the run's :class:`OptimizerConfig`.
Advice = Callable[[Any], str]
# ``eval_params(opt_state, trainable)``: the weights an evaluation scores where they are not the
# trained ones (schedule-free AdamW's x sequence: ``optax.contrib.schedule_free_eval_params``).
EvalParams = Callable[[Any, Any], Any]
# ``refuse(checker, optimizer)``: records, with the checker's ``bad``, each setting outside the
# optimizer's own keys that it cannot run with (K-FAC: a T5 model, bfloat16), so that the config
# check refuses it before anything loads or compiles.
Refuse = Callable[[Any, "Optimizer"], None]


def number(low: float, high: float | None = None, *, closed=(True, True), optional=False) -> Check:
  """A finite number in the interval from ``low`` to ``high`` (None: unbounded); ``closed``
  says which ends are allowed; ``optional``: null too."""
  return lambda c, key, _: c.number(key, low, high, closed=closed, optional=optional)


def integer(minimum: int, *, optional=False) -> Check:
  """An integer >= ``minimum`` (booleans refused)."""
  return lambda c, key, _: c.integer(key, minimum, optional=optional)


def choice(values: Sequence[Any], *, optional=False) -> Check:
  """One of ``values`` (compared with their types: 1 is not true)."""
  return lambda c, key, _: c.choice(key, values, optional=optional)


def state_dtype(*, float16: bool = True) -> Check:
  """``optimizer.state_dtype``: one of :data:`STATE_DTYPES` (float64 refused with the reason);
  ``float16=False`` refuses float16 too, for a state whose values leave float16's range."""

  def check(c, key: str, optimizer: Optimizer) -> Any:
    if c.get(key) == "float64":
      return c.bad(
        key,
        "float64",
        f"one of {list(STATE_DTYPES)} (a float64 state needs JAX's 64-bit mode, which training "
        "runs do not use: without it JAX would store the state in float32; the library takes "
        "state_dtype='float64' under jax_enable_x64)",
      )
    value = c.choice(key, STATE_DTYPES)
    if value == "float16" and not float16:
      c.bad(
        key,
        "float16",
        f"float32 or bfloat16 for optimizer={optimizer.name} (its update G^{{-1}} g is about "
        "g / gamma: with gamma = 1e-5 it overflows float16's largest value 65504, and gamma "
        "itself lies below float16's smallest normal 6e-5; bfloat16 has float32's range)",
      )
    return value

  return check


def steps_between_curvature_updates(c, key: str, optimizer: Optimizer) -> Any:
  """``curvature_every``: an integer >= 1 or null (every step, as 1); only an optimizer with
  :attr:`Optimizer.curvature_every` takes a value above 1."""
  value = c.check(
    key,
    lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "an integer >= 1 (steps between curvature updates)",
    optional=True,
  )
  if value is not None and not optimizer.curvature_every and value != 1:
    c.bad(
      key,
      value,
      f"1 for optimizer={optimizer.name} (it updates its curvature every step; only "
      f"{', '.join(n for n in names() if get(n).curvature_every)} take curvature_every > 1)",
    )
  return value


def leaf_sizes(params: Any) -> list[int]:
  """The number of entries of each leaf of ``params`` (arrays or shapes), in tree order."""
  import jax

  return [math.prod(leaf.shape) for leaf in jax.tree.leaves(params)]


def elementwise_flops(params: Any, opt: Any = None, **_: Any) -> float:
  """An element-wise update's FLOPs (momentum, Adam's moments, weight decay, the update):
  ``models.flops.ELEMENTWISE_FLOPS_PER_PARAM`` per parameter."""
  from models import flops

  return flops.ELEMENTWISE_FLOPS_PER_PARAM * sum(leaf_sizes(params))


def traced_state_bytes(params: Any, opt: Any) -> int:
  """The bytes of the state the entry's own transformation allocates for ``params``: its
  ``init`` traced with ``jax.eval_shape`` (shapes only, nothing allocated), as the library
  lays the state out (Ginger's buckets of equal-rank blocks, Muon's two branches)."""
  import jax
  import numpy as np

  tx = get(opt.name).build(opt, _constant_schedule, None)  # a schedule, as runs have: its count
  state = jax.eval_shape(tx.init, params)
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def _constant_schedule(step: Any) -> float:
  """A learning-rate schedule (a run's always is one: optax keeps its step count)."""
  del step
  return 1e-3


def moments_state_bytes(copies: int, counts: int = 0) -> StateBytes:
  """The state of an element-wise method: ``copies`` arrays like the parameters (momentum: 1,
  Adam: 2, mu and nu) and ``counts`` int32 step counters (the learning-rate schedule's, which
  every run has, and Adam's for its bias correction: 2)."""

  def state_bytes(params: Any, opt: Any = None) -> int:
    import jax
    import numpy as np

    leaves = jax.tree.leaves(params)
    per_copy = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    return copies * per_copy + 4 * counts

  return state_bytes


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """What the code knows of one optimizer.

  Attributes:
    name: its ``optimizer.name``, also the name of its ``configs/optimizer/<name>.yaml``.
    display: its name in tables ("Adam", "QNG").
    keys: the config keys it reads (dotted, e.g. ``optimizer.b1``, ``tau``), each with its
      check, in the order config_check reports problems. The :data:`PAPER_KEYS` it does not
      list are the ones its YAML sets to null.
    build: the optax transformation from the config (:data:`Build`); imports JAX when called.
    curvature: whether it keeps a curvature estimate: its step takes the sampled-Fisher vector
      of a d-pass (``fisher``, ``fisher_forward``, ``fisher_backward``, ``fisher_batch`` apply)
      and its state has an ``optimizer.state_dtype``.
    curvature_every: whether its curvature may be updated every K-th step only
      (``curvature_every`` = K > 1; the other steps precondition with the curvature they have).
    update_flops: FLOPs of one update of a parameter layout (:data:`UpdateFlops`;
      :func:`elementwise_flops` for an element-wise method). Required: :func:`register`
      refuses an entry without it.
    state_bytes: bytes of its state in a run (with a learning-rate schedule) for a parameter
      layout (:data:`StateBytes`;
      :func:`moments_state_bytes`, or :func:`traced_state_bytes` for the library's own
      layout). Required like ``update_flops``.
    reorthonormalise_every: the period of the loop's re-orthonormalisation of its state
      (:data:`ReorthonormaliseEvery`); None: it has none.
    advice: its own knobs against a diverging loss (:data:`Advice`); None: the learning rate
      and the gradient clip are all there is.
    eval_params: the weights evaluations score (:data:`EvalParams`); None: the trained ones.
      With it, a model with BatchNorm has its running statistics recomputed at those weights
      before each evaluation (``training.steps.make_eval_weights``).
    traces_loss: whether its transformation reads the training loss itself (K-FAC: it finds
      the model's layers in the loss's trace and draws its own Fisher labels). Its ``build``
      then takes a fourth argument, the run's ``training.steps.TrainingLoss`` (None where
      ``training.run_setup.prepare`` builds it only to check its arguments), and the training
      step passes its update ``batch=`` (the step's ``training.steps.LossBatch``) and ``key=``
      (the key a d-pass would draw its labels with).
    refuses: the settings beyond its own keys it cannot run with (:data:`Refuse`); None: any.
    lr_key: its entry in configs/best_lr/ (:data:`LrKey`); None: its name.
    compared_with: the arms ``(optimizer, tau)`` its results are compared with, each as one
      Holm family of its own over every optimizer compared with that arm (results/tables.py's
      comparisons, results/newcomers.py); the paper's four optimizers have the paper's own
      comparisons, every other one by default :data:`REFERENCE_ARMS`.
  """

  name: str
  display: str
  keys: Mapping[str, Check]
  build: Build
  curvature: bool = False
  curvature_every: bool = False
  update_flops: UpdateFlops | None = None
  state_bytes: StateBytes | None = None
  reorthonormalise_every: ReorthonormaliseEvery | None = None
  advice: Advice | None = None
  eval_params: EvalParams | None = None
  traces_loss: bool = False
  refuses: Refuse | None = None
  lr_key: LrKey | None = None
  compared_with: tuple[tuple[str, Any], ...] | None = None

  @property
  def arms(self) -> tuple[tuple[str, Any], ...]:
    """The ``(optimizer, tau)`` arms it is compared with (:attr:`compared_with`)."""
    if self.compared_with is not None:
      return self.compared_with
    return () if self.name in PAPER_ORDER else REFERENCE_ARMS

  @property
  def hyperparameters(self) -> tuple[str, ...]:
    """The top-level keys it reads: its own and, for a curvature optimizer, the d-pass's."""
    own = tuple(k for k in self.keys if "." not in k)
    return own + (FISHER_KEYS if self.curvature else ())


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer part of a checked run config (:func:`optimizer_config`): the values of the
  keys its registry entry reads (:attr:`Optimizer.keys`), typed, and None for those it does not
  read (``optimizer=adam tau=4``: ``tau`` is None, as the config check warned).

  Attributes:
    name: ``optimizer.name``.
    b1, b2, eps: ``optimizer.b1`` (the first-moment decay), ``optimizer.b2``, ``optimizer.eps``.
    state_dtype: ``optimizer.state_dtype``, the dtype a curvature optimizer stores its state in.
    tau: the rank, the curvature directions kept.
    alpha: the decay of the curvature's moving average.
    gamma: Ginger's damping, ``G = gamma I + U diag(sigma) U^T``.
    rho: the element-wise clip of the update to ``[-rho, rho]``; None: no clip.
    block: ``per_tensor`` (one curvature per tensor) or ``global``.
    curvature_every: K, the steps between curvature updates; 1 (every step, the paper) for an
      optimizer without :attr:`Optimizer.curvature_every`, and where the config says null.
    passes: how Ginger's passes over ``U`` run (``jnp``, ``pallas``, ``auto``; null in the config:
      the library's default, ``jnp``). ``auto`` is left to the library
      (``ginger._src.kernels.resolve_impl``: the Pallas kernels on GPUs, the jnp passes
      elsewhere), also on a state split over several devices, where the kernels run per device
      under ``shard_map`` on each device's rows and are still faster than the jnp passes.
    extra: the values of the keys it reads that none of the fields above holds (an optimizer
      registered with keys of its own), by their dotted key.
  """

  name: str
  b1: float | None = None
  b2: float | None = None
  eps: float | None = None
  state_dtype: str | None = None
  tau: int | None = None
  alpha: float | None = None
  gamma: float | None = None
  rho: float | None = None
  block: str | None = None
  curvature_every: int = 1
  passes: str | None = None
  extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))


def _field_types() -> dict[str, type]:
  """The type of each :class:`OptimizerConfig` field a key is read into (by the key's last
  name: both ``tau`` and ``optimizer.b1`` name a field), from the dataclass's annotations
  (``float | None``: float). ``name`` and ``extra`` are not read from a key of that name."""
  hints = typing.get_type_hints(OptimizerConfig)
  found = {}
  for field in dataclasses.fields(OptimizerConfig):
    if field.name not in ("name", "extra"):
      kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
      (found[field.name],) = kinds or [hints[field.name]]  # one type: it converts the value
  return found


_FIELD_TYPES = _field_types()


def optimizer_config(config: Mapping) -> OptimizerConfig:
  """The :class:`OptimizerConfig` of a resolved config that passed the config check (its
  values are as the entry's checks allow them; this only types them)."""
  optimizer = get(config["optimizer"]["name"])
  fields: dict[str, Any] = {}
  extra: dict[str, Any] = {}
  for key in optimizer.keys:
    value = _select(config, key)
    field = key.rsplit(".", 1)[-1]
    if field in _FIELD_TYPES:
      fields[field] = None if value is None else _FIELD_TYPES[field](value)
    else:
      extra[key] = value
  if not optimizer.curvature_every or fields.get("curvature_every") is None:
    fields.pop("curvature_every", None)  # 1: every step
  if "passes" in fields:
    fields["passes"] = fields["passes"] or "jnp"
  return OptimizerConfig(optimizer.name, **fields, extra=types.MappingProxyType(extra))


def _select(config: Mapping, key: str) -> Any:
  """The value at dotted ``key`` of ``config``."""
  for part in key.split("."):
    config = config[part]
  return config


_REGISTRY: dict[str, Optimizer] = {}


def register(optimizer: Optimizer) -> Optimizer:
  """Adds ``optimizer``; an optimizer of the same name must be unregistered first. An entry
  without its update FLOPs or its state bytes is refused: every table of cost reads them."""
  if optimizer.name in _REGISTRY:
    raise ValueError(f"an optimizer named {optimizer.name!r} is already registered.")
  missing = [f for f in ("update_flops", "state_bytes") if getattr(optimizer, f) is None]
  if missing:
    raise ValueError(
      f"optimizer {optimizer.name!r} has no {' and no '.join(missing)}: every entry says what "
      "one update costs (update_flops(params, opt, *, curvature_update); elementwise_flops "
      "for an element-wise method) and what its state holds (state_bytes(params, opt); "
      "moments_state_bytes(k) for k arrays like the parameters, traced_state_bytes for the "
      "library's own layout). docs/adding-an-optimizer.md says how."
    )
  _REGISTRY[optimizer.name] = optimizer
  return optimizer


def unregister(name: str) -> None:
  """Removes the optimizer ``name``."""
  del _REGISTRY[name]


@contextlib.contextmanager
def registered(optimizer: Optimizer) -> Iterator[Optimizer]:
  """``optimizer`` registered inside the ``with`` block only (a test's own optimizer)."""
  register(optimizer)
  try:
    yield optimizer
  finally:
    unregister(optimizer.name)


def names() -> tuple[str, ...]:
  """The registered optimizers' names, in the order they were registered."""
  return tuple(_REGISTRY)


def get(name: str) -> Optimizer:
  """The optimizer ``name``; a ValueError naming the registered ones if there is none."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"optimizer.name must be one of {names()}, got {name!r}.") from None


def find(name: str | None) -> Optimizer | None:
  """The optimizer ``name``, or None (a run record of an optimizer not registered here)."""
  return _REGISTRY.get(name)


def keeps_curvature(name: str | None) -> bool:
  """Whether ``name`` keeps a curvature estimate (:attr:`Optimizer.curvature`)."""
  optimizer = find(name)
  return optimizer is not None and optimizer.curvature


def traces_loss(name: str | None) -> bool:
  """Whether ``name``'s transformation takes the training loss (:attr:`Optimizer.traces_loss`)."""
  optimizer = find(name)
  return optimizer is not None and optimizer.traces_loss


def reads(name: str | None, key: str) -> bool:
  """Whether optimizer ``name`` reads config key ``key`` (False for an unknown name)."""
  optimizer = find(name)
  return optimizer is not None and key in optimizer.keys


def display_name(name: str) -> str:
  """The name tables print ("QNG"); an optimizer not registered here prints as its name."""
  optimizer = find(name)
  return name if optimizer is None else optimizer.display


def table_order(first: Sequence[str] = ()) -> tuple[str, ...]:
  """The rows of an optimizer table: ``first``, then :data:`PAPER_ORDER`, then every other
  registered optimizer in the order it was registered."""
  head = [n for n in (*first, *PAPER_ORDER) if n in _REGISTRY]
  head = list(dict.fromkeys(head))
  return (*head, *(n for n in names() if n not in head))


def update_flops(opt: OptimizerConfig, params: Any, *, curvature_update: bool = True) -> float:
  """FLOPs of one update of ``opt.name`` with the run's :class:`OptimizerConfig` ``opt`` for
  the trained parameters ``params`` (arrays or ``jax.ShapeDtypeStruct`` s: only their paths,
  shapes and dtypes are read); ``curvature_update=False``: a step that only preconditions,
  see ``curvature_every``."""
  return float(get(opt.name).update_flops(params, opt, curvature_update=curvature_update))


def state_bytes(opt: OptimizerConfig, params: Any) -> int:
  """Bytes of the optimizer state of ``opt`` for the trained parameters ``params`` (whole,
  not split over devices; from the shapes alone)."""
  return int(get(opt.name).state_bytes(params, opt))


def lr_key(name: str, values: Mapping[str, Any]) -> str:
  """Optimizer ``name``'s entry in configs/best_lr/ for the run's paper-notation ``values``
  (:attr:`Optimizer.lr_key`); its name where its entry has none or it is not registered."""
  optimizer = find(name)
  if optimizer is None or optimizer.lr_key is None:
    return str(name)
  return optimizer.lr_key(values)


def compared(arm: tuple[str, Any]) -> tuple[str, ...]:
  """The registered optimizers compared with ``arm`` (``(optimizer, tau)``), in table order."""
  return tuple(n for n in table_order() if arm in get(n).arms)


# ----------------------------------------------------------------------------- the optimizers


def _build_ginger(opt: OptimizerConfig, schedule, sharding):
  import ginger

  return ginger.ginger(
    schedule,
    tau=opt.tau,
    alpha=opt.alpha,
    gamma=opt.gamma,
    b1=opt.b1,
    rho=opt.rho,
    block=opt.block,
    state_dtype=opt.state_dtype,
    # The loop re-orthonormalises as a program of its own (_ginger_reorthonormalise_every): a
    # lax.cond in every step would stop the host on GPUs.
    reorthonormalise_every=0,
    curvature_every=opt.curvature_every,
    passes=opt.passes,
    sharding=sharding,
  )


def _ginger_reorthonormalise_every(opt: OptimizerConfig) -> int:
  import ginger

  return ginger.default_reorthonormalise_every(opt.state_dtype or "float32")


def _ginger_advice(opt: OptimizerConfig) -> str:
  # Unclipped, directions outside span U are scaled by 1/gamma.
  rho = " or clip the update (rho=1)" if opt.rho is None else ""
  return f"raise gamma (now {opt.gamma}){rho}"


def _ginger_flops(params, opt: OptimizerConfig, *, curvature_update=True, **_) -> float:
  from models import flops

  sizes, tau = leaf_sizes(params), int(opt.tau)
  if not curvature_update:
    return elementwise_flops(params) + flops.ginger_precondition_flops(sizes, tau, opt.block)
  return elementwise_flops(params) + flops.ginger_update_flops(sizes, tau, opt.block)


def _ginger_lr_key(values: Mapping[str, Any]) -> str:
  # Unclipped, Ginger moves each direction outside span U by lr / gamma times the momentum:
  # its good lrs lie orders of magnitude below the clipped variant's, tuned separately.
  return "ginger_unclipped" if values.get("rho") is None else "ginger"


def _qng_lr_key(values: Mapping[str, Any]) -> str:
  # QNG's clip (Ginger's, as a control) bounds each entry by lr * rho: tuned separately.
  return "qng" if values.get("rho") is None else "qng_clipped"


def _build_qng(opt: OptimizerConfig, schedule, sharding):
  import ginger

  return ginger.qng(
    schedule,
    tau=opt.tau,
    alpha=opt.alpha,
    b1=opt.b1,
    block=opt.block,
    rho=opt.rho,
    state_dtype=opt.state_dtype,
  )


def _qng_flops(params, opt: OptimizerConfig, **_) -> float:
  from models import flops

  return elementwise_flops(params) + flops.qng_update_flops(leaf_sizes(params), int(opt.tau))


def _build_adam(opt: OptimizerConfig, schedule, sharding):
  import optax

  return optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)


def _build_momentum(opt: OptimizerConfig, schedule, sharding):
  import optax

  return optax.sgd(schedule, momentum=opt.b1)


DECAY = number(0, 1, closed=(True, False))  # an EMA's decay rate, in [0, 1)
ALPHA = number(0, 1, closed=(False, False))
RHO = number(0, closed=(False, True), optional=True)  # the element-wise clip; null: none

register(
  Optimizer(
    name="ginger",
    display="Ginger",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.state_dtype": state_dtype(float16=False),
      "tau": integer(1),
      "alpha": ALPHA,
      "block": choice(BLOCKS),
      "gamma": number(0, closed=(False, True)),
      "rho": RHO,
      "curvature_every": steps_between_curvature_updates,
      "passes": choice(PASSES, optional=True),  # null: the library's default, jnp
    },
    build=_build_ginger,
    curvature=True,
    curvature_every=True,
    update_flops=_ginger_flops,
    state_bytes=traced_state_bytes,
    reorthonormalise_every=_ginger_reorthonormalise_every,
    advice=_ginger_advice,
    lr_key=_ginger_lr_key,
  )
)
register(
  Optimizer(
    name="qng",
    display="QNG",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.state_dtype": state_dtype(),
      "tau": integer(1),
      "alpha": ALPHA,
      "block": choice(BLOCKS),
      "rho": RHO,
      "curvature_every": steps_between_curvature_updates,
    },
    build=_build_qng,
    curvature=True,
    update_flops=_qng_flops,
    state_bytes=traced_state_bytes,
    lr_key=_qng_lr_key,
  )
)
register(
  Optimizer(
    name="adam",
    display="Adam",
    keys={
      "optimizer.b1": DECAY,
      "optimizer.b2": DECAY,
      "optimizer.eps": number(0, closed=(False, True)),
    },
    build=_build_adam,
    update_flops=elementwise_flops,
    state_bytes=moments_state_bytes(2, counts=2),  # mu, nu; its and the schedule's counts
  )
)
register(
  Optimizer(
    name="momentum",
    display="Momentum",
    keys={"optimizer.b1": DECAY},
    build=_build_momentum,
    update_flops=elementwise_flops,
    state_bytes=moments_state_bytes(1, counts=1),  # the momentum; the schedule's count
  )
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


# kfac-jax's last release, 0.0.8, reads jax.core names and the ClosedJaxpr class that JAX 0.11
# removed: it runs on JAX up to 0.10 only.
KFAC_JAX_LAST_RELEASE = "0.0.8"


def kfac_jax_unavailable() -> str | None:
  """Why ``optimizer=kfac`` cannot run in this environment (None: it can): kfac-jax is not
  installed, or its installed release is one that JAX 0.11 breaks. Read from the installed
  packages' metadata: nothing is imported."""
  from importlib import metadata

  try:
    kfac = metadata.version("kfac-jax")
  except metadata.PackageNotFoundError:
    return "kfac-jax is not installed"
  jax_major_minor = tuple(int(p) for p in metadata.version("jax").split(".")[:2])
  if kfac == KFAC_JAX_LAST_RELEASE and jax_major_minor >= (0, 11):
    return f"kfac-jax {kfac} does not run on JAX {metadata.version('jax')} (JAX 0.10 at most)"
  return None


def _kfac_refuses(c, optimizer: Optimizer) -> None:
  missing = kfac_jax_unavailable()
  if missing is not None:
    c.bad(
      "optimizer.name",
      "kfac",
      f"an optimizer whose library runs here: {missing}; K-FAC needs kfac-jax "
      f"{KFAC_JAX_LAST_RELEASE} with JAX 0.10.2 (pip install kfac-jax=={KFAC_JAX_LAST_RELEASE} "
      "jax==0.10.2 jaxlib==0.10.2 flax==0.12.8), or a later kfac-jax release that supports "
      "JAX 0.11",
    )
  # kfac-jax gives each parameter one layer of the loss's trace, matched by its patterns.
  if c.get("model.family") == "t5":
    c.bad(
      "model.family",
      "t5",
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
  )
)


# ----------------------------------------------------------------------------- SOAP


def _build_soap(opt: OptimizerConfig, schedule, sharding):
  import ginger

  own = opt.extra
  # weight_decay=0: the config's weight_decay is chained before every optimizer.
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


FLAG = choice((False, True))

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
  )
)
