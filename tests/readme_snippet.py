"""The README's library snippet, completed with a small model and run on the digits.

Needs only jax and numpy (and the installed ``ginger``), so that it also runs as a script in an
environment holding nothing but the library's wheel and its declared dependencies
(tests/test_wheel.py): ``python readme_snippet.py README.md digits.npz`` (arrays ``pixels``
(n, 8, 8) and ``labels``) trains, checks that the loss falls, and prints where ``ginger`` came
from.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = 60


def snippet(readme: Path = README) -> str:
  """The first ```python block of the README."""
  return re.search(r"```python\n(.*?)```", Path(readme).read_text(), re.S).group(1)


def train(source: str, pixels: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """The losses of ``STEPS`` steps of ``source`` (the snippet) on a tanh MLP: the snippet
  defines ``tx``, ``opt_state`` and ``step`` exactly as the README shows them."""
  x = jnp.asarray(pixels[:512].reshape(-1, 64) / 16.0, jnp.float32)
  y = jnp.asarray(labels[:512])
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "w1": jax.random.normal(k1, (64, 64)) / 8.0,
    "b1": jnp.zeros(64),
    "w2": jax.random.normal(k2, (64, 10)) / 8.0,
    "b2": jnp.zeros(10),
  }

  def model_apply(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

  scope = {"params": params, "model_apply": model_apply}
  exec(source, scope)
  params, opt_state, losses = scope["params"], scope["opt_state"], []
  for t in range(STEPS):
    batch = slice(64 * (t % 8), 64 * (t % 8 + 1))
    params, opt_state, loss = scope["step"](
      params, opt_state, x[batch], y[batch], jax.random.key(t)
    )
    losses.append(float(loss))
  return np.asarray(losses)


def check_falls(losses: np.ndarray) -> None:
  """Finite, and falling steadily: every 10-step window's mean below the one before (the
  clipped update moves each entry by at most lr = 2e-4 a step, so slowly: 2.30 -> 2.04)."""
  assert np.all(np.isfinite(losses)), losses
  windows = np.mean(np.reshape(losses, (-1, 10)), axis=1)
  assert np.all(np.diff(windows) < 0), windows
  assert windows[-1] < 0.95 * windows[0], windows


if __name__ == "__main__":
  import ginger

  readme, digits = sys.argv[1:]
  with np.load(digits) as table:
    losses = train(snippet(Path(readme)), table["pixels"], table["labels"])
  check_falls(losses)
  print(f"ginger from {Path(ginger.__file__).parent}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
