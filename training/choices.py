"""The values each choice key of train.py's config accepts, each list written once.

The config check (training/config_check.py), the registry's key checks
(training/registry_schema.py), the code that acts on a value (training/optimizers.py's
schedule, training/logs.py's logger) and docs/configuration.md read these. Where the library,
a model or a data loader keeps its own list (they import nothing of the framework, and reading
theirs would import JAX: a config is checked in milliseconds, before anything loads),
tests/test_config_check.py checks that the two agree.
"""

from __future__ import annotations

# The run.
SCHEDULES = ("constant", "warmup_constant", "cosine", "warmup_cosine")  # optimizers.learning_rate
WARMUP_SCHEDULES = ("warmup_constant", "warmup_cosine")  # the schedules warmup_epochs shapes
WEIGHT_DECAY_MODES = ("l2", "decoupled")  # training.optimizers.build_optimizer
PRECISIONS = ("float32", "bfloat16")  # models.tasks.DTYPES
DISTRIBUTED = ("auto", True, False)
LOGGERS = ("wandb", "none")
WANDB_MODES = ("online", "offline", "disabled", "shared")
BATCHNORMS = ("sync", "per_device")  # models.tasks.BATCHNORMS

# The d-pass of the curvature optimizers.
FISHERS = ("sampled", "empirical")
FISHER_FORWARDS = ("eval", "shared")
# "auto" picks one; "local" pulls back per device (training.steps.fisher_backward).
FISHER_BACKWARDS = ("auto", "batched", "sequential", "local")  # + ginger.fisher.BACKWARDS

# The curvature optimizers' own keys (Ginger's and QNG's registry entries).
BLOCKS = ("per_tensor", "global")  # ginger._src.common.BLOCKS
# A float64 state needs JAX's 64-bit mode, which a training run does not use (the library takes
# it: ginger.scale_by_ginger(..., state_dtype="float64") under jax_enable_x64).
STATE_DTYPES = ("float32", "bfloat16", "float16")
PASSES = ("jnp", "pallas", "auto")  # Ginger's passes over U, ginger._src.common.PASSES

# The model families and their datasets.
FAMILIES = ("resnet", "t5")  # models.tasks.TASKS
IMAGE_DATASETS = ("cifar100", "cifar10", "digits")  # data.images.DATASETS
IMAGE_SOURCES = ("hf", "tfds", "local")  # data.images.SOURCES
XSUM_SOURCES = ("hf", "tfds", "local", "demo")  # data.xsum.SOURCES
XSUM_EVAL_SPLITS = ("validation", "test")
