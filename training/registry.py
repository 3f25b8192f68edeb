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
* ``training/config_doc.py``, ``results/``'s tables and plots: names and order;
  ``results/comparisons.py`` and ``results/newcomers.py``: the arms each optimizer
  beyond the paper's is compared with (:attr:`Optimizer.compared_with`), its state bytes
  (:func:`state_bytes`) and update FLOPs.

Where each part lives: the entry type, its checks, the typed config and the lookups in
training/registry_schema.py; the costs several entries share in training/registry_costs.py;
the entries in training/registry_paper.py (Ginger, QNG, Adam, momentum) and
training/registry_recent.py (Muon, schedule-free AdamW, SOAP, K-FAC). This module registers
them, in that order (the order tables list optimizers beyond the paper's), and is the one the
rest of the code imports: ``from training import registry``.

A new optimizer is one entry (:func:`register`, e.g. at the end of
training/registry_recent.py) and one ``configs/optimizer/<name>.yaml``
(docs/adding-an-optimizer.md). This module imports no JAX: the builders and FLOP counts import
what they need when called, so the config check, the results and the sweeps read the entries
in milliseconds.
"""

from __future__ import annotations

from training import registry_paper, registry_recent  # noqa: F401 - each registers its entries
from training.choices import BLOCKS, PASSES, STATE_DTYPES
from training.registry_costs import (
  elementwise_flops,
  leaf_sizes,
  moments_state_bytes,
  step_flops,
  traced_state_bytes,
)
from training.registry_recent import KFAC_JAX_DEPENDENCIES, kfac_jax_unavailable
from training.registry_schema import (
  ALPHA,
  DECAY,
  FISHER_KEYS,
  FLAG,
  PAPER_KEYS,
  PAPER_ORDER,
  REFERENCE_ARMS,
  RHO,
  Advice,
  Build,
  Check,
  EvalParams,
  LrKey,
  Optimizer,
  OptimizerConfig,
  Refuse,
  ReorthonormaliseEvery,
  StateBytes,
  UpdateFlops,
  choice,
  compared,
  display_name,
  find,
  get,
  integer,
  keeps_curvature,
  lr_key,
  names,
  number,
  optimizer_config,
  reads,
  register,
  registered,
  state_bytes,
  state_dtype,
  steps_between_curvature_updates,
  table_order,
  traces_loss,
  unregister,
  update_flops,
)

__all__ = [
  "ALPHA",
  "Advice",
  "BLOCKS",
  "Build",
  "Check",
  "DECAY",
  "EvalParams",
  "FISHER_KEYS",
  "FLAG",
  "KFAC_JAX_DEPENDENCIES",
  "LrKey",
  "Optimizer",
  "OptimizerConfig",
  "PAPER_KEYS",
  "PAPER_ORDER",
  "PASSES",
  "REFERENCE_ARMS",
  "RHO",
  "Refuse",
  "ReorthonormaliseEvery",
  "STATE_DTYPES",
  "StateBytes",
  "UpdateFlops",
  "choice",
  "compared",
  "display_name",
  "elementwise_flops",
  "find",
  "get",
  "integer",
  "keeps_curvature",
  "kfac_jax_unavailable",
  "leaf_sizes",
  "lr_key",
  "moments_state_bytes",
  "names",
  "number",
  "optimizer_config",
  "reads",
  "register",
  "registered",
  "state_bytes",
  "state_dtype",
  "step_flops",
  "steps_between_curvature_updates",
  "table_order",
  "traced_state_bytes",
  "traces_loss",
  "unregister",
  "update_flops",
]
