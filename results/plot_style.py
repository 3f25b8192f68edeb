"""What every figure of results/ shares: matplotlib without a display, colours that stay
distinguishable past ten curves, file names from labels, and curves of finite points only."""

from __future__ import annotations

import re
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def distinct_colors(n: int) -> list[tuple]:
  """``n`` colours for ``n`` curves: matplotlib's tab10 for the first ten, then, from a pool of
  its qualitative palettes, each time the one farthest (RGB distance) from those taken. tab20,
  the usual choice past ten, pairs each hue with a lighter one (its pinks are two curves one
  cannot tell apart); this keeps any two of the first 20 at least 0.25 apart."""
  pool = (
    [
      cmap(i)
      for cmap, k in ((plt.cm.tab10, 10), (plt.cm.Dark2, 8), (plt.cm.Set1, 9))
      for i in range(k)
    ]
    + [plt.cm.tab20(i) for i in range(20)]
    + [plt.cm.Set2(i) for i in range(8)]
  )
  picked, rest = pool[:10], pool[10:]
  while len(picked) < n and rest:
    far = max(rest, key=lambda c: min(_rgb_distance(c, p) for p in picked))
    picked.append(far)
    rest.remove(far)
  return [picked[i % len(picked)] for i in range(n)]


def _rgb_distance(a: tuple, b: tuple) -> float:
  return float(np.linalg.norm(np.subtract(a[:3], b[:3])))


def slug(text: str) -> str:
  """A file-name-safe version of `text`."""
  return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_") or "run"


def plot_xy(ax: Any, x: np.ndarray, y: np.ndarray, **style: Any) -> bool:
  """Plot the finite points of (x, y); False when there are none."""
  ok = np.isfinite(x) & np.isfinite(y)
  if not ok.any():
    return False
  ax.plot(x[ok], y[ok], **style)
  return True
