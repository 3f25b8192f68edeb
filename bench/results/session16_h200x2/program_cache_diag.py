"""Plain vs exported program: cold compile time and ms per step, one process, given order."""

import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from hydra import compose, initialize_config_dir

from training import loop, program_cache, sharding

order = sys.argv[1].split(",")  # e.g. plain,exported
opt = sys.argv[2:] or ["optimizer=ginger", "tau=8", "curvature_every=16"]
ov = [
  "experiment=cifar10_resnet18",
  "batch_size=128",
  "logger=none",
  "eval_batch_size=500",
  "data.source=local",
  "data.path=/tmp/data/cifar10-jpeg.tar.xz",
] + opt
with initialize_config_dir(config_dir="/tmp/B/configs", version_base=None):
  cfg = compose(config_name="config", overrides=ov)
setup = loop.build(cfg, materialize=False)
arrays = sharding.put(setup.task.train_arrays, setup.plan.replicated)
idx = setup.plan.indices(np.arange(128))
args0 = (setup.state, setup.frozen, arrays, idx)
folder = tempfile.mkdtemp()
exe = {}
for way in order:
  t = time.perf_counter()
  if way == "plain":
    low = setup.train_step.lower(*args0)
  else:
    low, how = program_cache.lower(
      setup.train_step, args0, name="train_step", donate_argnums=(0,), config={}, folder=folder
    )
  t1 = time.perf_counter()
  exe[way] = low.compile()
  print(way, "lower", round(t1 - t, 2), "compile", round(time.perf_counter() - t1, 2), flush=True)
state = setup.init_state()
for _rep in range(3):
  for way in order:
    for _ in range(5):
      state = exe[way](state, setup.frozen, arrays, idx)
    jax.block_until_ready(state)
    ts = []
    for _ in range(5):
      t = time.perf_counter()
      for _ in range(20):
        state = exe[way](state, setup.frozen, arrays, idx)
      jax.block_until_ready(state)
      ts.append((time.perf_counter() - t) / 20 * 1e3)
    print(way, "ms/step median", round(statistics.median(ts), 3), flush=True)
