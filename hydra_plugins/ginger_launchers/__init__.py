"""train.py's submitit launchers (training/launchers.py) where Hydra accepts launcher classes:
a module of the ``hydra_plugins`` namespace package, which Hydra scans when it starts."""

from training import launchers


class SlurmLauncher(launchers.SlurmLauncher):
  """``hydra/launcher=submitit_slurm``: one SLURM job per run (a job array)."""


class LocalLauncher(launchers.LocalLauncher):
  """``hydra/launcher=submitit_local``: one process per run on this machine, all at once."""
