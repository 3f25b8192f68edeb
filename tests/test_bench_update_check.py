"""bench.update_check, the GPU check of Ginger's whole update: on the CPU (Pallas interpreted)
it passes as the library is, and fails when a kernel's output is off by 1e-4 relative (far
above float32 rounding, far below what a loss curve would show)."""

import jax
import pytest

from bench import update_check
from ginger._src import kernels


@pytest.mark.slow  # ~11 s; that the check fails a slightly wrong kernel: make test
def test_update_check_passes_and_restores_x64(capsys):
  x64 = jax.config.jax_enable_x64
  assert update_check.main(["--size", "tiny", "--taus", "4", "--steps", "3"]) == 0
  assert jax.config.jax_enable_x64 == x64
  out = capsys.readouterr().out
  assert out.count("| pass |") == 3 and "all steps passed" in out


def test_update_check_fails_on_a_slightly_wrong_kernel(monkeypatch, capsys):
  rotate = kernels._rotate_pallas

  def off(*args, **kw):
    u_new, out = rotate(*args, **kw)
    return u_new, out * (1 + 1e-4)

  monkeypatch.setattr(kernels, "_rotate_pallas", off)
  assert update_check.main(["--size", "tiny", "--taus", "4", "--steps", "2"]) == 2
  assert capsys.readouterr().out.count("| FAIL |") == 2


@pytest.mark.parametrize("argv", [["--size", "huge"], ["--steps", "x"]])
def test_update_check_refuses_bad_arguments(argv):
  with pytest.raises(SystemExit):
    update_check.main(argv)
