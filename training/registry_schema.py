"""What a registry entry is, and the table of entries: the schema training/registry.py reads.

:class:`Optimizer` is one optimizer's entry (its keys and their checks, its builder, its costs);
:func:`register` adds one, :func:`get` / :func:`find` / :func:`names` look them up, and the
functions after them answer what the rest of the code asks of an optimizer by name
(:func:`keeps_curvature`, :func:`update_flops`, :func:`lr_key`...). :class:`OptimizerConfig` is
the typed optimizer part of a checked run config, made by :func:`optimizer_config` from the keys
the entry reads. The checks an entry's keys take (:func:`number`, :func:`integer`,
:func:`choice`, :func:`state_dtype`, :func:`steps_between_curvature_updates`) name the key, the
bad value and what is allowed through training/config_check.py's checker.

The entries themselves are in training/registry_paper.py and training/registry_recent.py;
``training.registry`` imports them (in the order the tables list them) and is what the rest of
the code imports. No JAX here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from training.choices import STATE_DTYPES

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


# The checks the entries share.
DECAY = number(0, 1, closed=(True, False))  # an EMA's decay rate, in [0, 1)
ALPHA = number(0, 1, closed=(False, False))
RHO = number(0, closed=(False, True), optional=True)  # the element-wise clip; null: none
FLAG = choice((False, True))


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
    own_decoupled_decay: whether its ``build`` applies ``weight_decay_mode=decoupled`` itself,
      from :attr:`OptimizerConfig.weight_decay` (schedule-free AdamW: its authors' decay, which
      a decay of the weights after its update would not be: those are its averaged iterate);
      False: the framework chains ``training.optimizers.decoupled_weight_decay`` after it.
    families: the model families (``model.family``) it can run; None: every one. Its
      ``refuses`` turns the others down, and results/profiles.py scores a workload of another
      family as one it never reaches, as AlgoPerf scores a method that cannot run a workload.
    lr_key: its entry in configs/best_lr/ (:data:`LrKey`); None: its name.
    compared_with: the arms ``(optimizer, tau)`` its results are compared with, each as one
      Holm family of its own over every optimizer compared with that arm (results/comparisons.py,
      results/newcomers.py); the paper's four optimizers have the paper's own
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
  own_decoupled_decay: bool = False
  families: tuple[str, ...] | None = None
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
    weight_decay: the run's ``weight_decay`` for an entry with
      :attr:`Optimizer.own_decoupled_decay` and ``weight_decay_mode=decoupled``; 0.0 otherwise
      (the framework applies the decay around the optimizer).
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
  weight_decay: float = 0.0
  extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))


def _field_types() -> dict[str, type]:
  """The type of each :class:`OptimizerConfig` field a key is read into (by the key's last
  name: both ``tau`` and ``optimizer.b1`` name a field), from the dataclass's annotations
  (``float | None``: float). ``name``, ``extra`` and ``weight_decay`` (the run's, for an entry
  that applies it itself) are not read from an entry's key of that name."""
  hints = typing.get_type_hints(OptimizerConfig)
  found = {}
  for field in dataclasses.fields(OptimizerConfig):
    if field.name not in ("name", "extra", "weight_decay"):
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
  if optimizer.own_decoupled_decay and config.get("weight_decay_mode") == "decoupled":
    fields["weight_decay"] = float(config.get("weight_decay") or 0.0)
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
