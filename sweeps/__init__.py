"""Sweep helpers around train.py's Hydra multiruns (configs/sweep/): see sweeps/README.md.

- ``sweeps.arms``: the sweep arms, one line each, written to configs/sweep/arm/.
- ``sweeps.expand``: the jobs a ``train.py -m`` command runs, their run dirs and learning rates,
  computed with Hydra's own composition and basic-sweeper expansion (nothing is trained).
- ``sweeps.best_lr``: the lr_tune runs' best learning rate per experiment and optimizer, written
  to configs/best_lr/ where the table sweeps read it.
- ``sweeps.gpu_pool``: runs a sweep's jobs one per GPU (CUDA_VISIBLE_DEVICES pinned per slot).
"""
