"""The README's library snippet, run as written on a small real problem: the loss must fall."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from data.images import _digits_table

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet() -> str:
  """The first ```python block of the README."""
  return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_readme_snippet_trains(tmp_path: Path) -> None:
  pixels, labels = _digits_table()  # scikit-learn's digits, without importing it (~2.5 s)
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
  exec(snippet(), scope)  # defines tx, opt_state and step exactly as the README shows them
  params, opt_state, losses = scope["params"], scope["opt_state"], []
  for t in range(60):
    batch = slice(64 * (t % 8), 64 * (t % 8 + 1))
    params, opt_state, loss = scope["step"](
      params, opt_state, x[batch], y[batch], jax.random.key(t)
    )
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  # Falls steadily: every 10-step window's mean below the one before (the clipped update moves
  # each entry by at most lr = 2e-4 a step, so slowly: 2.30 -> 2.04 here).
  windows = np.mean(np.reshape(losses, (6, 10)), axis=1)
  assert np.all(np.diff(windows) < 0), windows
  assert windows[-1] < 0.95 * windows[0], windows
