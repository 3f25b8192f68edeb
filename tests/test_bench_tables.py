"""The benchmarks' printed tables: every row has the header's columns (a row wider than its
header shifts every value under the wrong name, as bench.scaling's once did)."""

import json
import math
import subprocess

import jax
import jax.numpy as jnp
import pytest

from bench import checkpoint_stall, kernel_tiling, scaling, train_step

SUMMARY = {
  "step_time_s": 0.01,
  "examples_per_s": 12800.0,
  "trained_parameters": 11_000_000,
  "step_memory_bytes": 1.4e9,
  "peak_memory_bytes": 3.5e9,
  "optimizer_state_bytes_per_device": 4.1e8,
}


def _columns(line: str) -> int:
  return line.strip().count("|") - 1


def _table_rows(out: str) -> list[str]:
  return [line for line in out.splitlines() if line.startswith("|")]


def _check(out: str, expect_rows: int) -> None:
  header, rule, *rows = _table_rows(out)
  assert _columns(rule) == _columns(header)
  assert len(rows) == expect_rows
  for row in rows:
    assert _columns(row) == _columns(header), (header, row)


def test_scaling_rows_match_the_header(monkeypatch, capsys):
  calls = []

  def fake_run(suite, name, data, steps, out, timeout, extra):
    calls.append(extra)
    # One failed run: its row must keep the columns too.
    return None if len(calls) == 2 else SUMMARY

  monkeypatch.setattr(train_step, "run", fake_run)
  scaling.main(["--data", "x", "--devices", "1", "2"])
  # Two optimizers x (1 device + 2 devices sharded and replicated).
  _check(capsys.readouterr().out, expect_rows=6)


def test_kernel_tiling_sweeps_pass_three_tiles(monkeypatch, capsys):
  """--rotate-tile-rows: each row's optimizer gets pass 3's tile in its tuning (0: the other
  passes'), one compiled update a row."""
  seen = []
  optimizer = kernel_tiling.ginger.ginger

  def spy(*args, tuning, **kw):
    seen.append((dict(tuning.rotate_tile_rows), tuning.max_tile_rows))
    return optimizer(*args, tuning=tuning, **kw)

  monkeypatch.setattr(kernel_tiling.ginger, "ginger", spy)
  monkeypatch.setattr(kernel_tiling, "time_update", lambda *a: (1e-3 * (1 + len(seen)), 0.0, ""))
  monkeypatch.setattr(kernel_tiling, "resnet18_shapes", lambda: [(8, 4)])
  argv = ["--taus", "32", "--tile-rows", "64", "--rotate-tile-rows", "0", "128", "--steps", "1"]
  kernel_tiling.main([*argv, "--no-round-two"])
  # The two rows: pass 3 on the other passes' 64 rows, then on 128.
  assert seen == [({}, 64), ({32: 128}, 64)]
  _check(capsys.readouterr().out, expect_rows=2)


def test_scaling_profile_traces_a_window_of_every_run(monkeypatch, capsys, tmp_path):
  """--profile N: every run traces N steps ending 10 before its last, and after the table each
  run gets a profile section (here none was written: it says so and goes on)."""
  calls = []
  monkeypatch.setattr(train_step, "run", lambda *a: calls.append(a[-1]) or SUMMARY)
  argv = ["--data", "x", "--devices", "1", "2", "--runs", "adam", "--out", str(tmp_path)]
  scaling.main([*argv, "--steps", "60", "--profile", "10"])
  assert all({"profile_steps=10", "profile_start=40"} <= set(extra) for extra in calls)
  out = capsys.readouterr().out
  _check(out.split("\n## Profile")[0], expect_rows=3)
  assert out.count("## Profile: adam") == 3 and out.count("profile_steps=N") == 3
  with pytest.raises(SystemExit):
    scaling.main([*argv, "--steps", "25", "--profile", "10"])  # no room for the window


def test_scaling_extra_reaches_every_run(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(train_step, "run", lambda *a: calls.append(a[-1]) or SUMMARY)
  scaling.main(["--data", "x", "--devices", "1", "2", "--runs", "adam", "--extra", "a=1", "b=2"])
  assert len(calls) == 3 and all(extra[-2:] == ["a=1", "b=2"] for extra in calls)
  assert "extra=['a=1', 'b=2']" in capsys.readouterr().out


def test_scaling_repeat_runs_rounds_and_prints_the_medians(monkeypatch, capsys, tmp_path):
  """--repeat 3: the whole set runs round after round (each run in its own dir), each row's
  efficiency is against its round's 1-device run, and the medians' table takes the medians."""
  calls = []
  # (devices, round) -> step seconds: round 1 is a slow host (every run 2x), one 2-device run
  # fails.
  step_s = {(1, 0): 0.010, (2, 0): 0.0125, (1, 1): 0.020, (2, 1): 0.025, (1, 2): 0.010}

  def fake_run(suite, name, data, steps, out, timeout, extra):
    n, round_ = int(extra[0].split("=")[1]), int(out.name.rsplit("round", 1)[1])
    calls.append((n, round_, out.name))
    if (n, round_) not in step_s:
      return None
    return SUMMARY | {
      "step_time_s": step_s[n, round_],
      "examples_per_s": 128 * n / step_s[n, round_],
    }

  monkeypatch.setattr(train_step, "run", fake_run)
  argv = ["--data", "x", "--devices", "1", "2", "--runs", "adam", "--out", str(tmp_path)]
  scaling.main([*argv, "--repeat", "3"])
  assert [(n, r) for n, r, _ in calls] == [(n, r) for r in range(3) for n in (1, 2, 2)]
  assert len({name for _, _, name in calls}) == 9  # no two runs share a dir
  out = capsys.readouterr().out
  runs, medians = out.split("## Medians over 3 rounds")
  _check(runs, expect_rows=9)
  _check(medians, expect_rows=3)
  # the slow round's 2-device runs are 80 % against its own 1-device run, not 40 %
  assert runs.count("| 80.0% |") == 4 and "40.0%" not in runs
  # medians: 1 device 10.00 ms; 2 devices sharded 12.50 and 25.00 (round 2 failed) -> 18.75 ms
  assert "| adam | 1 | replicated | 10.00 | 12800 | 100.0% | 10.00, 20.00, 10.00 |" in medians
  assert "| adam | 2 | sharded | 18.75 |" in medians
  with pytest.raises(SystemExit):
    scaling.main([*argv, "--repeat", "0"])


def test_train_step_rows_match_the_header(monkeypatch, capsys):
  monkeypatch.setattr(train_step, "run", lambda *a, **k: SUMMARY)
  train_step.main(["--suite", "resnet18", "--data", "x", "--only", "adam"])
  _check(capsys.readouterr().out, expect_rows=1)


def test_checkpoint_stall_rows_match_the_header(monkeypatch, capsys):
  """One row a run, the stall the difference of the medians; a failed child keeps the
  columns."""
  result = {
    "device": "gpu H200",
    "plain_s": 0.24,
    "saving_s": 0.65,
    "stall_s": 0.41,
    "save_s": 0.09,
    "wait_s": 0.05,
  }
  children = []

  def fake_child(cmd, label, timeout, **kwargs):
    children.append(json.loads(cmd[-1]))
    if len(children) == 2:
      return None
    return subprocess.CompletedProcess(cmd, 0, stdout="log line\n" + json.dumps(result) + "\n")

  monkeypatch.setattr(train_step, "run_child", fake_child)
  checkpoint_stall.main(["--data", "x", "--steps", "20", "--intervals", "3"])
  out = capsys.readouterr().out
  _check(out, expect_rows=2)
  assert "| adam | 0.240 | 0.650 | **0.410** | 0.090 | 0.050 |" in out
  assert "| ginger tau=8 K=16 | failed |" in out
  assert [c["overrides"] for c in children] == list(checkpoint_stall.RUNS.values())
  assert all(c["steps"] == 20 and c["intervals"] == 3 and c["data"] == "x" for c in children)


def test_compile_time_and_startup_children_compile_cold(monkeypatch):
  """bench.compile_time's and bench.startup's children run as ``python -m MODULE --child SPEC``
  from the repository root with JAX's cache and the run's own off (every compilation a cold
  one); the record is the output's last line, a failed child an empty record."""
  from bench import compile_time, startup

  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/warm")
  monkeypatch.setenv("GINGER_COMPILATION_CACHE_DIR", "/tmp/warm")
  children = []

  def fake_child(cmd, label, timeout, **kwargs):
    children.append((cmd, label, kwargs))
    if len(children) == 3:
      return None
    return subprocess.CompletedProcess(cmd, 0, stdout='log line\n{"compile_s": 1.5}\n')

  monkeypatch.setattr(train_step, "run_child", fake_child)
  assert compile_time.run("soap", "update", 60) == {"compile_s": 1.5}
  assert startup.run("adam", "concurrent", None, None, 60) == {"compile_s": 1.5}
  assert startup.run("adam", "one-by-one", None, None, 60) == {}
  modules = [cmd[2] for cmd, _, _ in children]
  assert modules == ["bench.compile_time", "bench.startup", "bench.startup"]
  assert json.loads(children[0][0][-1]) == {"optimizer": "soap", "what": "update"}
  assert [label for _, label, _ in children] == [
    "soap update",
    "adam (concurrent)",
    "adam (one-by-one)",
  ]
  for cmd, _, kwargs in children:
    assert cmd[3] == "--child" and kwargs["cwd"] == startup.ROOT
    assert "JAX_COMPILATION_CACHE_DIR" not in kwargs["env"]
    assert kwargs["env"]["GINGER_COMPILATION_CACHE_DIR"] == "none"


def test_every_run_has_a_run_dir_hydra_accepts():
  """A run's dir goes on Hydra's command line (hydra.run.dir=...): a ',' there is a list and
  Hydra refuses it (a run named "..., two backwards" failed on a GPU). Dir names keep letters,
  digits, '.', '_' and '-' only, and stay distinct within a suite."""
  import re

  for suite, spec in train_step.SUITES.items():
    dirs = [train_step.run_dir_name(name) for name in spec["runs"]]
    assert len(set(dirs)) == len(dirs), suite
    for d in dirs:
      assert re.fullmatch(r"[A-Za-z0-9._-]+", d), (suite, d)


def _race_run(folder, optimizer, seed, accuracies, **run):
  import json

  folder.mkdir(parents=True)
  summary = {
    "run": {"optimizer": optimizer, "seed": seed, **run},
    "steps_per_epoch": 10,
    "startup_s": {"lower_and_compile": 3.0},
    "step_time_s": 0.005,
  }
  (folder / "summary.json").write_text(json.dumps(summary))
  events = [{"event": "train", "step": 5, "wall_time_s": 1.0}]
  events += [
    {"event": "eval", "step": 10 * (i + 1), "wall_time_s": 10.0 * (i + 1), "val_accuracy": a}
    for i, a in enumerate(accuracies)
  ]
  (folder / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")


def test_race_reads_time_to_accuracy_from_run_records(tmp_path, capsys):
  """bench.race: the first evaluation at the target (epochs = its step / steps per epoch, time
  = its wall clock), the best one, one row per run grouped by its folder, then seed means: the
  best accuracy's mean and std, the mean step time and its ratio to Adam's in the group."""
  from bench import race

  _race_run(tmp_path / "warm" / "a0", "adam", 0, [50.0, 86.0, 85.5, 88.0])
  _race_run(tmp_path / "warm" / "a1", "adam", 1, [50.0, 70.0, 84.0, 85.0])
  _race_run(tmp_path / "warm" / "g0", "ginger", 0, [80.0, 84.9], tau=8, curvature_every=8)
  summary_path = tmp_path / "warm" / "g0" / "summary.json"  # a run that read its programs back
  summary = json.loads(summary_path.read_text())
  summary["startup_s"]["per_program"] = {"train_step": {"lower": 0.1, "program": "read"}}
  summary["step_time_s"] = 0.0075
  summary_path.write_text(json.dumps(summary))
  rows = race.collect([tmp_path / "warm"], target=85.0)
  assert [r.programs for r in rows] == ["", "", "read"]
  assert [(r.group, r.run, r.seed) for r in rows] == [
    ("warm", "adam", 0),
    ("warm", "adam", 1),
    ("warm", "ginger tau=8 K=8", 0),
  ]
  assert (rows[0].epochs_to_target, rows[0].s_to_target, rows[0].best, rows[0].s_to_best) == (
    2,
    20.0,
    88.0,
    40.0,
  )
  assert (rows[1].epochs_to_target, rows[1].s_to_target) == (4, 40.0)
  assert rows[2].epochs_to_target is None and rows[2].s_to_target is None
  race.main([str(tmp_path / "warm")])
  out = capsys.readouterr().out
  table, means, _ = out.strip().split("\n\n")
  _check(table, expect_rows=3)
  assert "| warm | adam | 2 / 2 | 3.0 | 30.0 | 40.0 | 86.50 ± 2.12 | 5.00 | 1.00 |" in means
  assert (
    "| warm | ginger tau=8 K=8 | 0 / 1 | not reached | not reached | 20.0 | 84.90 | 7.50 | 1.50 |"
    in means
  )


def test_race_reads_packed_runs_as_the_run_dirs_they_were(tmp_path):
  """Run dirs packed into an archive (results.records, as the committed races are) race as the
  plain run dirs they were packed from, without extracting them."""
  from bench import race
  from results import records

  plain = tmp_path / "multirun" / "race"
  _race_run(plain / "exp" / "a0", "adam", 0, [50.0, 86.0])
  _race_run(plain / "exp" / "g0", "ginger", 0, [80.0, 84.9], tau=8, curvature_every=8)
  packed = tmp_path / "runs" / "race"
  packed.mkdir(parents=True)
  records.add(packed / "exp.runs.jsonl.gz", [plain / "exp" / "a0", plain / "exp" / "g0"])
  assert not (packed / "exp").exists()
  rows = race.collect([packed], target=85.0)
  assert rows == race.collect([plain], target=85.0) and len(rows) == 2


def test_startup_rows_match_the_header():
  """bench.startup's table: one row per program (how it was lowered: traced, or with the
  run's own compilation_cache_dir exported or read back), a failed measurement one row."""
  from bench import startup

  program = {"stablehlo_ops": 100, "lower_s": 0.1, "compile_s": 1.0}
  results = {
    ("adam", "concurrent"): {
      "build_s": 2.0,
      "lower_and_compile_s": 1.2,
      "lower_and_compile_cpu_s": 1.5,
      "startup_s": 3.2,
      "programs": {"train step": program, "eval step (batch 500)": {**program, "program": "read"}},
    },
    ("ginger tau=8", "concurrent"): {},
  }
  out = startup.table(results)
  _check(out, expect_rows=3)
  assert "| traced |" in out and "| read |" in out


def test_optimizer_step_rows_match_the_header_with_state_dtypes(monkeypatch, capsys):
  """--state-dtypes: one Ginger row per state dtype, the optimizer built with it."""
  from bench import optimizer_step

  built = []

  def fake_make(
    name, tau, block, passes="jnp", state_dtype="float32", reorthonormalise_every=None, every=1,
    tuning=None,
  ):  # fmt: skip
    built.append((name, state_dtype))
    return name

  monkeypatch.setattr(optimizer_step, "make_optimizer", fake_make)
  monkeypatch.setattr(optimizer_step, "time_update", lambda *a, **kw: (1e-3, 0.1, ""))
  optimizer_step.main(
    ["--sizes", "1M", "--optimizers", "adam", "ginger", "--taus", "8", "--blocks", "global"]
    + ["--state-dtypes", "float32", "bfloat16"]
  )
  assert built == [("adam", "float32"), ("ginger", "float32"), ("ginger", "bfloat16")]
  _check(capsys.readouterr().out, expect_rows=3)


def _buckets_while_timing(monkeypatch, optimizer_step) -> list:
  """Replaces optimizer_step's timing by a record of each row's number of Ginger buckets (the
  plan as the state is built inside time_update; None for a row without them)."""
  seen = []

  def fake_time(tx, shapes, *a, **kw):
    state = tx.init([jnp.zeros(s) for s in shapes])[0]
    seen.append(len(state.u.layout.buckets) if hasattr(state, "u") else None)
    return 1e-3, 0.1, ""

  monkeypatch.setattr(optimizer_step, "time_update", fake_time)
  return seen


def test_optimizer_step_solo_rows_plans_large_blocks_alone_while_timing(monkeypatch, capsys):
  """--solo-rows N: each Ginger row is timed with blocks of >= N rows in buckets of their own
  (the plan is made when the state is built, inside time_update), labelled in the block
  column; 0 is the library's plan."""
  from bench import optimizer_step
  from ginger._src import common

  seen = _buckets_while_timing(monkeypatch, optimizer_step)
  monkeypatch.setitem(optimizer_step.SIZES, "tiny", lambda: [(64, 4), (64, 4), (3,)])
  optimizer_step.main(
    ["--sizes", "tiny", "--optimizers", "ginger", "--taus", "2", "--blocks", "per_tensor"]
    + ["--solo-rows", "0", "100", "--reorthonormalise-every", "0"]
  )
  out = capsys.readouterr().out
  _check(out, expect_rows=3)
  assert "| per_tensor solo>=100 (3 buckets) |" in out
  library = len(common.plan_layout([256, 256, 3], 2, "per_tensor", None).buckets)
  assert library < 3 and seen == [None, library, 3]  # Adam's row first; then both 256s alone


def test_optimizer_step_bucket_overhead_plans_fewer_buckets_while_timing(monkeypatch, capsys):
  """--bucket-overhead N: each Ginger row is timed with ``Tuning.bucket_overhead = N`` (a
  larger one merges more block sizes into fewer, more padded buckets), labelled with it and
  the number of buckets in the block column; 0 is the library's. The blocks here are below
  ``solo_rows``: the CPU plans them as a GPU does."""
  from bench import optimizer_step
  from ginger._src import common

  seen = _buckets_while_timing(monkeypatch, optimizer_step)
  monkeypatch.setitem(optimizer_step.SIZES, "tiny", lambda: [(1 << 12,), (3,), (5,), (7,)])
  optimizer_step.main(
    ["--sizes", "tiny", "--optimizers", "ginger", "--taus", "2", "--blocks", "per_tensor"]
    + ["--bucket-overhead", "0", "1", str(1 << 30), "--reorthonormalise-every", "0"]
  )
  out = capsys.readouterr().out
  _check(out, expect_rows=4)
  library = len(common.plan_layout([4096, 3, 5, 7], 2, "per_tensor", None).buckets)
  assert seen == [None, library, 4, 1]  # Adam's row; the library's; every size alone; one
  assert f"| per_tensor ({library} buckets) |" in out
  assert "| per_tensor overhead=1 (4 buckets) |" in out
  assert f"| per_tensor overhead={1 << 30} (1 buckets) |" in out


def test_optimizer_step_times_the_update_the_training_loop_runs(capsys):
  """--reorthonormalise-every 0 builds Ginger's update without its in-update
  re-orthonormalisation (an XLA conditional: a host round trip a step on GPUs), as train.py
  does; the header says which update was timed. The default is the library's."""
  from bench import optimizer_step

  def has_cond(tx) -> bool:
    params = [jnp.ones((64, 3))]
    jaxpr = jax.make_jaxpr(lambda s: tx.update(params, s, params, fisher_grads=params))
    return "cond[" in str(jaxpr(tx.init(params)))

  assert has_cond(optimizer_step.make_optimizer("ginger", 2, "per_tensor"))
  assert not has_cond(
    optimizer_step.make_optimizer("ginger", 2, "per_tensor", reorthonormalise_every=0)
  )
  optimizer_step.main(
    ["--sizes", "1M", "--optimizers", "adam", "--taus", "2", "--blocks", "global", "--scan", "1"]
    + ["--repeats", "1", "--reorthonormalise-every", "0"]
  )
  assert "reorthonormalise_every=0" in capsys.readouterr().out.splitlines()[0]


def test_race_labels_runs_by_their_numerics(tmp_path):
  """A bf16-state or bf16-compute run is its own row group in the race, not averaged with the
  float32 runs."""
  from bench import race

  ginger = dict(tau=8, curvature_every=16)
  _race_run(tmp_path / "r" / "f32", "ginger", 0, [86.0], **ginger)
  _race_run(tmp_path / "r" / "bf16", "ginger", 0, [84.0, 86.0], state_dtype="bfloat16", **ginger)
  _race_run(tmp_path / "r" / "adam", "adam", 0, [86.0], precision="bfloat16")
  _race_run(tmp_path / "r" / "bf16s1", "ginger", 1, [86.0], state_dtype="bfloat16", **ginger)
  rows = race.collect([tmp_path], target=85.0)
  assert sorted({r.run for r in rows}) == [
    "adam, bfloat16 compute",
    "ginger tau=8 K=16",
    "ginger tau=8 K=16, bfloat16 state",
  ]
  assert [r.seed for r in rows if r.run.endswith("bfloat16 state")] == [0, 1]


def test_race_differences_count_the_runs_that_miss_the_target(tmp_path, capsys):
  """The race's last table: per group, each run's seconds to the target against Adam's with a
  run that never reached it as infinitely slow (results.stats.race_difference), the p-value
  Holm-adjusted over the group's runs, and the reading; Adam's own row first."""
  from bench import race
  from results import stats

  ginger = dict(tau=8, curvature_every=8)
  for seed, accuracies in enumerate([[80.0, 86.0], [70.0, 80.0, 86.0], [86.0]]):
    _race_run(tmp_path / "cold" / f"a{seed}", "adam", seed, accuracies)
  for seed, accuracies in enumerate([[86.0], [80.0, 86.0], [84.0]]):
    _race_run(tmp_path / "cold" / f"g{seed}", "ginger", seed, accuracies, **ginger)
  rows = race.collect([tmp_path / "cold"], target=85.0)
  assert [r.s_to_target for r in rows if r.run != "adam"] == [10.0, 20.0, None]
  expected = stats.race_difference([10.0, 20.0, math.inf], [20.0, 30.0, 10.0])
  out = race.differences(rows)
  assert "| cold | adam (baseline) | 3 / 3 | 20.0 | | | |" in out.splitlines()
  line = next(x for x in out.splitlines() if "ginger tau=8 K=8" in x)
  assert line == (
    f"| cold | ginger tau=8 K=8 - adam | 2 / 3 | 20.0 | {expected.text(1)} "
    f"| {expected.p:.3f} | {expected.verdict} |"
  )
  race.main([str(tmp_path / "cold")])
  assert capsys.readouterr().out.strip().split("\n\n")[-1] == out


def test_race_keeps_a_baseline_that_never_reaches_the_target(tmp_path):
  """Adam misses the target in every seed, Ginger reaches it in two of three: both rows stay,
  Adam's with 0 / 3 and no median, Ginger's with a reading that counts every miss."""
  from bench import race

  for seed in range(3):
    _race_run(tmp_path / "c" / f"a{seed}", "adam", seed, [80.0, 84.0])
    ginger = [86.0] if seed < 2 else [84.0]
    _race_run(tmp_path / "c" / f"g{seed}", "ginger", seed, ginger, tau=8, curvature_every=8)
  lines = race.differences(race.collect([tmp_path / "c"], target=85.0)).splitlines()
  assert "| c | adam (baseline) | 0 / 3 | not reached | | | |" in lines
  assert "| c | ginger tau=8 K=8 - adam | 2 / 3 | 10.0 | -inf [-inf, +inf] | 0.400 | tie |" in lines


def test_race_compares_the_arms_of_a_sweep_folder(tmp_path, capsys):
  """A sweep's layout (experiment / arm,lr / overrides / run files, as the GPU pool writes it):
  the arms of one experiment are one group, so each Ginger arm gets its difference from Adam."""
  from bench import race

  exp = tmp_path / "curvature_every" / "cifar10_resnet18_30ep"
  for seed in range(3):
    adam = [80.0] * (seed + 1) + [86.0]
    _race_run(exp / "adam,lr=0.001" / f"epochs=30,seed={seed}", "adam", seed, adam)
    _race_run(
      exp / "ginger_tau8_k8,lr=0.0005" / f"epochs=30,seed={seed}",
      "ginger",
      seed,
      [86.0 - seed, 85.0 + seed],
      tau=8,
      curvature_every=8,
    )
  rows = race.collect([tmp_path / "curvature_every"], target=85.0)
  assert {r.group for r in rows} == {"curvature_every/cifar10_resnet18_30ep"}
  out = race.differences(rows)
  assert "| curvature_every/cifar10_resnet18_30ep | ginger tau=8 K=8 - adam | 3 / 3 |" in out


def test_table1_suite_holds_every_resnet18_arm_of_table1():
  """bench.train_step's table1 suite (the memory column's figures) runs each of Table 1's 14
  ResNet-18 arms, with the optimizer and tau the sweep's arm configs give."""
  from pathlib import Path

  import yaml

  sweep = yaml.safe_load(Path("configs/sweep/table1.yaml").read_text())
  arms = [a.strip() for a in sweep["hydra"]["sweeper"]["params"]["+sweep/arm"].split(",")]
  expected = set()
  for arm in arms:
    spec = yaml.safe_load(Path(f"configs/sweep/arm/{arm}.yaml").read_text())
    optimizer = next(
      d["override /optimizer"] for d in spec["defaults"] if "override /optimizer" in d
    )
    expected.add((optimizer, spec.get("tau")))
  runs = train_step.SUITES["table1"]["runs"]
  got = set()
  for overrides in runs.values():
    named = dict(o.split("=", 1) for o in overrides)
    got.add((named["optimizer"], int(named["tau"]) if "tau" in named else None))
  assert len(runs) == len(arms) == 14
  assert got == expected


def test_race_reads_records_older_than_the_startup_timings(tmp_path):
  """A record from before summary.json kept ``startup_s`` still races: its compile cell is
  blank, its time to the target counted as any other."""
  from bench import race

  _race_run(tmp_path / "old" / "a0", "adam", 0, [80.0, 86.0])
  summary_path = tmp_path / "old" / "a0" / "summary.json"
  summary = json.loads(summary_path.read_text())
  del summary["startup_s"]
  summary_path.write_text(json.dumps(summary))
  (row,) = race.collect([tmp_path / "old"], target=85.0)
  assert (row.compile_s, row.programs, row.s_to_target) == (None, "", 20.0)
  assert "| old | adam | 0 |  |  | 2 | 20.0 |" in race.table([row], 85.0)
