"""Whether a run's optimizer state fits one device, decided before anything is placed or compiled.

Ginger keeps ``U`` of ``d x k`` per block (``k = min(tau, block size)``), QNG ``tau`` factors of
``d`` each per block: a large ``tau`` asks for ``d x tau`` floats, which a run would otherwise
discover only while compiling (minutes) or when the allocation fails. :func:`check_state_fits`
sizes the state from its shapes alone (``jax.eval_shape`` of the optimizer's ``init``: nothing
is allocated), per device where the mesh splits it, and refuses a state that cannot fit with
one :class:`~training.config_check.ConfigError` naming the bytes needed, the device's bytes and
the largest ``tau`` that fits.

What is counted: the optimizer state twice (a curvature update writes the new ``U`` or factors
beside the old ones: both are live at once) and the trained parameters once. Activations,
gradients and the data come on top, so a state that passes may still not fit; one that is
refused never could.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from training.config_check import ConfigError

# The state's copies live at once during a curvature update (the old and the new U).
STATE_COPIES = 2


def tree_bytes(tree) -> int:
  """Bytes of one device's share of ``tree``'s arrays or ``jax.ShapeDtypeStruct`` s: a leaf
  with a sharding counts its shard's shape, one without its whole shape."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = tuple(leaf.shape)
    where = getattr(leaf, "sharding", None)
    if where is not None and hasattr(where, "shard_shape"):
      shape = tuple(where.shard_shape(shape))
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def _host_bytes() -> int:
  """The memory this process may use on the host: its RAM, lowered by a cgroup limit or an
  address-space limit (``ulimit -v``) where one is set."""
  limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      text = Path(path).read_text().strip()
    except OSError:
      continue
    if text.isdigit():
      limits.append(int(text))
  soft = resource.getrlimit(resource.RLIMIT_AS)[0]
  if soft not in (resource.RLIM_INFINITY, -1):
    limits.append(soft)
  return min(limits)


def device_bytes() -> tuple[int, str]:
  """``(bytes, what)``: the memory of this process's smallest device (its ``bytes_limit``), or
  of the host where the backend reports none (CPU)."""
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
  if limits and all(limits):
    device = jax.local_devices()[int(np.argmin(limits))]
    return int(min(limits)), f"{device.device_kind} {device.id}"
  return _host_bytes(), "the host's memory"


def _gb(n: int) -> str:
  return f"{n:,} bytes ({n / 2**30:.3g} GiB)"


def largest_fitting(needed: Callable[[int], int], tau: int, available: int) -> int | None:
  """The largest ``t < tau`` with ``needed(t) <= available``, or None where not even ``t = 1``
  fits; ``needed`` must grow with ``t`` and not fit at ``tau``.

  A state's bytes are piecewise linear in ``t`` (linear in the rank, which saturates at a
  block's size), so the secant of the bracket (regula falsi) lands on the answer in a few of
  the calls bisection would need: each is a trace of the optimizer's ``init``. Where a secant
  step does not halve the bracket, the next step bisects it.
  """
  low, high = 1, tau
  at_low, at_high = needed(low), needed(high)
  if at_low > available:
    return None
  secant = True
  while high - low > 1:
    width = high - low
    if secant and at_high > at_low:
      guess = low + (available - at_low) * width // (at_high - at_low)
    else:
      guess = (low + high) // 2
    guess = min(max(guess, low + 1), high - 1)
    value = needed(guess)
    if value <= available:
      low, at_low = guess, value
    else:
      high, at_high = guess, value
    secant = high - low <= width // 2
  return low


def check_state_fits(
  state_bytes: Callable[[int | None], int],
  params_bytes: int,
  tau: int | None,
  available: tuple[int, str] | None = None,
) -> int:
  """Raises :class:`ConfigError` where the optimizer state cannot fit one device.

  Args:
    state_bytes: one device's bytes of the optimizer state for a ``tau`` (the run's: None),
      from its shapes alone.
    params_bytes: one device's bytes of the trained parameters.
    tau: the run's ``tau``; None for an optimizer without one (then no largest tau is named).
    available: ``(bytes, what)`` of the device; default :func:`device_bytes`.

  Returns the bytes counted (:data:`STATE_COPIES` states and the parameters).
  """
  limit, what = device_bytes() if available is None else available

  def needed(t: int | None) -> int:
    return STATE_COPIES * state_bytes(t) + params_bytes

  total = needed(None)
  if total <= limit:
    return total
  message = (
    f"the optimizer state does not fit: it needs {_gb(total)} per device (the state twice, "
    f"as a curvature update holds the old and the new one, plus the parameters), {what} has "
    f"{_gb(limit)}."
  )
  if tau is not None:
    best = largest_fitting(needed, tau, limit)
    message = f"tau={tau}: {message} " + (
      f"The largest tau that fits is {best}." if best else "Not even tau=1 fits."
    )
  raise ConfigError(message)


__all__ = ["STATE_COPIES", "check_state_fits", "device_bytes", "largest_fitting", "tree_bytes"]
