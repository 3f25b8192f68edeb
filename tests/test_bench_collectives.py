"""bench.collectives reads an optimized HLO module's collectives: kinds, sources and bytes."""

from __future__ import annotations

from pathlib import Path

from bench import collectives


def _line(name: str, result: str, op: str, op_name: str | None = None) -> str:
  """One HLO instruction as XLA writes it (operands and attributes shortened)."""
  meta = f', metadata={{op_name="{op_name}"}}' if op_name else ""
  return f"  %{name} = {result} {op}(%a, %b), channel_id=2{meta}"


FWD, BWD = "jit(step)/jvp()/reduce_sum", "jit(step)/transpose(jvp())/reduce_sum"
HLO = "\n".join(
  [
    "HloModule jit_step",
    _line("all-reduce.1", "(f32[64]{0}, f32[64]{0})", "all-reduce", FWD),
    _line("all-reduce.2", "(f32[128]{0}, f32[128]{0})", "all-reduce", FWD),
    _line("all-reduce.3", "(f32[64]{0}, f32[64]{0})", "all-reduce", BWD),
    _line(
      "all-reduce.4",
      "(f32[3,3,64,64]{3,2,1,0}, bf16[512,512]{1,0})",
      "all-reduce",
      "jit(step)/transpose(jvp())/conv_general_dilated",
    ),
    _line("ag", "f32[3,3,512,512]{3,1,0,2}", "all-gather"),
    _line("all-reduce-start.5", "f32[10]{0}", "all-reduce-start", "jit(step)/loss"),
    _line("add.1", "f32[64]{0}", "add"),
  ]
)


def test_collectives_of_an_hlo_module() -> None:
  rows = collectives.collectives(HLO)
  assert rows[("all-reduce", "BN forward (batch statistics)")] == [2, (64 + 128) * 2 * 4]
  assert rows[("all-reduce", "BN backward (statistics' gradients)")] == [1, 64 * 2 * 4]
  big = 3 * 3 * 64 * 64 * 4 + 512 * 512 * 2
  assert rows[("all-reduce", "jit(step)/transpose(jvp())/conv_general_dilated")] == [1, big]
  assert rows[("all-gather", "(no op_name)")] == [1, 3 * 3 * 512 * 512 * 4]
  assert rows[("all-reduce", "small: jit(step)/loss")] == [1, 40]
  assert sum(count for count, _ in rows.values()) == 6  # the add is not a collective


def test_step_modules_skip_eval_and_other_modules(tmp_path: Path) -> None:
  for name in (
    "module_0050.jit_step.cpu_after_optimizations.txt",
    "module_0051.jit_plain_step.cpu_after_optimizations.txt",
    "module_0082.jit_eval_step.cpu_after_optimizations.txt",
    "module_0050.jit_step.cpu_after_optimizations-buffer-assignment.txt",
    "module_0000.jit__lambda.cpu_after_optimizations.txt",
  ):
    (tmp_path / name).write_text(HLO)
  names = [p.name.split(".")[1] for p in collectives.step_modules(tmp_path)]
  assert names == ["jit_step", "jit_plain_step"]
  assert "| jit_step | all-gather | (no op_name) | 1 | 9.437 |" in collectives.table(
    collectives.step_modules(tmp_path)
  )
