"""Device traces of training steps (config profile_steps/profile_start, training/profiling.py)
and their summary (bench/profile_summary.py): the arithmetic on a hand-built trace, and a real
trace of a demo run on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from jax.profiler import ProfileData

from bench import profile_summary
from training import loop as train
from training.config_check import ConfigError, check_config

ROOT = Path(__file__).resolve().parents[1]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def _plane(pid: int, name: str, lines: dict[str, list[tuple[str, int, int]]]) -> str:
  """A text-proto XPlane: ``lines`` maps a line name to ``(kernel, start_us, duration_us)``."""
  names = sorted({k for events in lines.values() for k, _, _ in events})
  ids = {k: i + 1 for i, k in enumerate(names)}
  body = "".join(
    f'lines {{ id: {j} name: "{line}" timestamp_ns: 0 '
    + "".join(
      f"events {{ metadata_id: {ids[k]} offset_ps: {a * 10**6} duration_ps: {d * 10**6} }} "
      for k, a, d in events
    )
    + "} "
    for j, (line, events) in enumerate(lines.items(), 1)
  )
  meta = "".join(
    f'event_metadata {{ key: {i} value {{ id: {i} name: "{k}" }} }} ' for k, i in ids.items()
  )
  return f'planes {{ id: {pid} name: "{name}" {body}{meta}}}\n'


def test_times_of_a_hand_built_two_step_trace():
  """GPU 0: compute 0-40 us and 50-90 us on one stream, an all-reduce 30-60 us on another
  (hidden 30-40 and 50-60, exposed 40-50), idle 90-100 before the last kernel 100-110; the
  derived "XLA Ops" line repeats a kernel and must not count. GPU 1 and the host: ignored
  or separate."""
  gpu0 = _plane(
    1,
    "/device:GPU:0",
    {
      "Stream #13(compute)": [("fusion.1", 0, 40), ("fusion.2", 50, 40), ("fusion.1", 100, 10)],
      "Stream #20(nccl)": [("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 30)],
      "XLA Ops": [("fusion.1", 0, 40)],
    },
  )
  gpu1 = _plane(2, "/device:GPU:1", {"Stream #13(compute)": [("fusion.1", 0, 20)]})
  host = _plane(3, "/host:CPU", {"python": [("train_step", 0, 500)]})
  data = ProfileData.from_text_proto(gpu1 + gpu0 + host)  # planes out of order on purpose
  devices, kernels = profile_summary.summarize(data, steps=2, top=2)
  assert [d.device for d in devices] == ["GPU:0", "GPU:1"]
  d = devices[0]
  ms = 1e-3 / 2  # us -> ms per step over 2 steps
  assert d.span == pytest.approx(110 * ms)
  assert d.busy == pytest.approx(100 * ms)  # 0-90 and 100-110
  assert d.kernels == pytest.approx(90 * ms)
  assert d.collectives == pytest.approx(30 * ms)
  assert d.hidden == pytest.approx(20 * ms)
  assert d.exposed == pytest.approx(10 * ms)
  assert d.idle == pytest.approx(10 * ms)
  assert d.launches == pytest.approx(4 / 2)
  assert devices[1].span == pytest.approx(20 * ms)
  # fusion.1: 40 + 10 on GPU 0 and 20 on GPU 1 = 70 us over 2 steps; then fusion.2 (40 us).
  assert kernels == [("fusion.1", pytest.approx(35.0), 1.5), ("fusion.2", pytest.approx(20.0), 0.5)]
  _, every = profile_summary.summarize(data, steps=2, top=None)
  assert profile_summary.by_category(every) == [
    ("other fusions", pytest.approx(55.0), 2.0),  # fusion.1 and fusion.2: 70 + 40 us / 2
    ("collectives", pytest.approx(15.0), 0.5),
  ]
  table = profile_summary.format_table(devices, kernels, profile_summary.by_category(every))
  assert all(row.count("|") == profile_summary.HEADER.count("|") for row in table.splitlines()[:4])


def test_union_of_intervals():
  assert profile_summary.union_ns([]) == 0
  assert profile_summary.union_ns([(5, 9), (0, 2), (1, 3), (8, 10), (6, 7)]) == 3 + 5


@pytest.mark.slow  # a whole demo run with the profiler (~12 s); the summary's arithmetic is fast
def test_a_demo_run_writes_a_trace_of_its_window(tmp_path, capsys):
  """profile_steps=2 from step 1 of a 4-step run: one XSpace under <run dir>/profile that
  jax.profiler reads back; on the CPU it holds no device kernels, and the summary says so."""
  cfg = config(
    "experiment=demo",
    "logger=none",
    "max_steps=4",
    "eval_every=100",
    "checkpoint_every=100",
    "spectrum_every=0",
    "profile_steps=2",
    "profile_start=1",
  )
  summary = train.train(cfg, tmp_path)
  assert summary["status"] == "completed" and summary["steps"] == 4
  trace = profile_summary.find_trace(tmp_path)
  assert trace.is_relative_to(tmp_path / "profile")
  assert any(p.name.startswith("/host") for p in ProfileData.from_file(str(trace)).planes)
  profile_summary.main([str(tmp_path), "--steps", "2"])
  assert "no GPU or TPU kernels" in capsys.readouterr().out


def test_a_run_dir_without_a_trace_says_how_to_get_one(tmp_path):
  with pytest.raises(SystemExit, match="profile_steps=N"):
    profile_summary.main([str(tmp_path)])


@pytest.mark.parametrize("override", ["profile_steps=-1", "profile_start=1.5"])
def test_bad_profile_settings_are_refused(override):
  key, value = override.split("=")
  with pytest.raises(ConfigError, match=rf"{key}={value}( \(float\))?: must be an integer >= 0"):
    check_config(config("experiment=demo", override))


def test_the_trace_window_holds_exactly_its_steps(monkeypatch, tmp_path):
  """The trace starts before step ``start`` and stops after step ``start + steps - 1``, each
  after the state is ready; a window the run never reaches (a resume past it) never starts;
  a run stopped inside the window closes the trace."""
  from training import profiling

  calls = []
  monkeypatch.setattr(profiling.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
  monkeypatch.setattr(profiling.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
  monkeypatch.setattr(profiling.jax, "block_until_ready", lambda x: calls.append(("ready", x)))

  def run(trace, first, last, stop_at=None):
    for step in range(first, last):
      trace.before(step, step)
      calls.append(("step", step))
      if step == stop_at:
        break
      trace.after(step + 1, step)
    trace.close()

  run(profiling.StepTrace(tmp_path, start=2, steps=2), 0, 6)
  assert calls == [
    ("step", 0),
    ("step", 1),
    ("ready", 2),  # the state that step 2 takes (here each step's state is its number)
    ("start", str(tmp_path)),
    ("step", 2),
    ("step", 3),
    ("ready", 3),
    ("stop",),
    ("step", 4),
    ("step", 5),
  ]
  calls.clear()
  run(profiling.StepTrace(tmp_path, start=2, steps=2), 4, 6)  # resumed at step 4
  run(profiling.StepTrace(tmp_path, start=2, steps=0), 0, 6)  # off
  assert [c for c in calls if c[0] != "step"] == []
  calls.clear()
  run(profiling.StepTrace(tmp_path, start=1, steps=5), 0, 6, stop_at=2)  # stopped at step 2
  assert [c[0] for c in calls if c[0] != "step"] == ["ready", "start", "stop"]
