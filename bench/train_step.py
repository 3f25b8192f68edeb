"""Step time, throughput and peak memory of whole training steps, one fresh process per run.

    python -m bench.train_step --suite resnet18 --data .data/cifar10-jpeg.tar.xz
    python -m bench.train_step --suite t5 --data .data/xsum-1000.jsonl
    python -m bench.train_step --suite resnet18 --data ... --extra mesh.data=2 batch_size=256
    python -m bench.train_step --suite table1 --data ... --extra checkpoint_every=30
    python -m bench.train_step --suite resnet18 --data synthetic --extra deterministic=true

``--data synthetic`` makes the suite's data here (random CIFAR-10 images, or short XSUM-layout
documents padded to the same 512 tokens): the same shapes, so the same step times.

Each configuration runs ``train.py`` for ``--steps`` steps in its own process (so that the
device's peak-memory high-water mark belongs to that run alone) and the table is built from
the runs' summary.json: median step time after the compile interval, examples/s, the ratio
to Adam, and two memory figures: "step GB (XLA)", what the compiled training step keeps live on
a device (summary.json's step_memory_bytes: XLA's memory analysis, arguments + outputs -
aliased + temporaries, the CIFAR training set resident on the device included), and
"high-water GB", the device's lifetime peak_bytes_in_use of the run's process (compilation
and autotuning scratch included; blank on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TAUS = (1, 2, 4, 8, 16, 32)  # Table 1's
NEWCOMERS = ("muon", "schedule_free_adamw", "soap")  # both suites
SUITES = {
  # ResNet-18, batch 128, on CIFAR-10 (the same shapes as CIFAR-100 but for the last layer).
  "resnet18": {
    "base": ["experiment=cifar10_resnet18", "data.source=local", "batch_size=128"],
    "runs": {
      "adam": ["optimizer=adam"],
      "momentum": ["optimizer=momentum"],
      "qng tau=8": ["optimizer=qng", "tau=8"],
      "ginger tau=8 (d-pass: eval forward)": ["optimizer=ginger", "tau=8", "fisher_forward=eval"],
      "ginger tau=8 (d-pass: shared forward)": [
        "optimizer=ginger",
        "tau=8",
        "fisher_forward=shared",
      ],
      "ginger tau=8 (d-pass: shared forward, two backwards)": [
        "optimizer=ginger",
        "tau=8",
        "fisher_forward=shared",
        "fisher_backward=sequential",
      ],
      "ginger tau=8 (d-pass: shared forward, per-device backward)": [
        "optimizer=ginger",
        "tau=8",
        "fisher_forward=shared",
        "fisher_backward=local",
      ],
      # The cheaper d-passes: on a quarter of the batch, or on every fourth step only.
      "ginger tau=8 (d-pass: eval forward, first 32 examples)": [
        "optimizer=ginger",
        "tau=8",
        "fisher_forward=eval",
        "fisher_batch=32",
      ],
      "ginger tau=8 (d-pass: training-mode forward, first 32 examples)": [
        "optimizer=ginger",
        "tau=8",
        "fisher_forward=shared",
        "fisher_batch=32",
      ],
      "ginger tau=8 (d-pass: eval forward, every 4th step)": [
        "optimizer=ginger",
        "tau=8",
        "fisher_forward=eval",
        "curvature_every=4",
      ],
      # Today's optimizers beyond the paper's (their lr does not change a step's time).
      **{name: [f"optimizer={name}"] for name in NEWCOMERS},
      "kfac": ["optimizer=kfac"],  # not in the T5 suite: K-FAC refuses T5's shared weights
    },
  },
  # Every arm of Table 1's ResNet-18 half as the campaign runs it (eval d-pass, per-tensor
  # Ginger with the clip, global QNG): the memory column's figures, each run alone.
  "table1": {
    "base": ["experiment=cifar10_resnet18", "data.source=local", "batch_size=128"],
    "runs": {
      "adam": ["optimizer=adam"],
      "momentum": ["optimizer=momentum"],
      **{f"qng tau={t}": ["optimizer=qng", f"tau={t}"] for t in TAUS},
      **{f"ginger tau={t}": ["optimizer=ginger", f"tau={t}"] for t in TAUS},
    },
  },
  # t5-small shapes (random weights: timing only), batch 4, 512/128 tokens.
  "t5": {
    "base": [
      "experiment=xsum_t5_full",
      "model=t5_small_random",
      "data.source=local",
      "data.tokenizer=demo",
      "data.rouge_examples=0",
      "batch_size=4",
    ],
    "runs": {
      "full adam": ["optimizer=adam"],
      **{f"full {name}": [f"optimizer={name}"] for name in NEWCOMERS},
      "full ginger tau=1": ["optimizer=ginger", "tau=1"],
      "full ginger tau=8": ["optimizer=ginger", "tau=8"],
      "full ginger tau=32": ["optimizer=ginger", "tau=32"],
      "full ginger tau=8 (d-pass: first example)": ["optimizer=ginger", "tau=8", "fisher_batch=1"],
      "full ginger tau=8 (d-pass: every 4th step)": [
        "optimizer=ginger",
        "tau=8",
        "curvature_every=4",
      ],
      "lora adam": ["optimizer=adam"],
      "lora ginger tau=1": ["optimizer=ginger", "tau=1"],
      "lora ginger tau=8": ["optimizer=ginger", "tau=8"],
      "lora ginger tau=32": ["optimizer=ginger", "tau=32"],
      "lora ginger tau=32 (d-pass: first example)": [
        "optimizer=ginger",
        "tau=32",
        "fisher_batch=1",
      ],
    },
  },
}
LORA = (
  "model.lora={rank:8,alpha:32.0,train_1d:false,"
  "targets:'(self_attention|cross_attention)/(q|k|v|o)/kernel$'}"
)


def overrides(suite: str, name: str) -> list[str]:
  spec = SUITES[suite]
  extra = [o for o in spec["runs"][name] if not o.startswith("+model.lora")]
  if name.startswith("lora"):
    extra.append(LORA)
  return spec["base"] + extra


def run_dir_name(name: str) -> str:
  """A run's name as a folder name Hydra takes on its command line: spaces to '_', every
  character but letters, digits, '.', '_' and '-' dropped (',' would make it a list)."""
  return re.sub(r"[^A-Za-z0-9._-]", "", name.replace(" ", "_"))


def synthetic_data(suite: str) -> str:
  """A path to data of the suite's shapes made in a temporary folder (``--data synthetic``)."""
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
  from fakes import cifar_pickle_folder, xsum_jsonl

  root = Path(tempfile.mkdtemp(prefix="ginger-bench-"))
  if suite == "t5":
    return str(xsum_jsonl(root / "xsum.jsonl", 400))
  return str(cifar_pickle_folder(root, "cifar10", 2560, 500))


def run(
  suite: str, name: str, data: str, steps: int, out: Path, timeout: float, extra: list[str]
) -> dict:
  run_dir = out / suite / run_dir_name(name)
  cmd = [
    sys.executable,
    "train.py",
    *overrides(suite, name),
    f"data.path={data}",
    f"max_steps={steps}",
    f"eval_every={steps}",
    f"log_every={max(steps // 6, 1)}",
    f"checkpoint_every={10 * steps}",
    "logger=none",
    "resume=false",
    f"hydra.run.dir={run_dir}",
    *extra,
  ]
  done = run_child(cmd, name, timeout)
  return json.loads((run_dir / "summary.json").read_text()) if done else {}


def run_child(
  cmd: list[str], label: str, timeout: float, **kwargs
) -> subprocess.CompletedProcess | None:
  """Runs a benchmark's child process (output captured); on a timeout or a non-zero exit says
  so on stderr, with the output's tail, and returns None."""
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
  except subprocess.TimeoutExpired:
    print(f"TIMEOUT {label} after {timeout} s", file=sys.stderr)
    return None
  if done.returncode != 0:
    print(f"FAILED {label}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}", file=sys.stderr)
    return None
  return done


MEMORY_HEADER = "step GB (XLA) | high-water GB | opt state MB/device"
TABLE_HEADER = (
  f"| run | trained params | ms/step | examples/s | x Adam | {MEMORY_HEADER} | compile+run s |"
)


def memory_cells(summary: dict) -> str:
  """The MEMORY_HEADER table cells of a run (blank where the summary or the backend has
  nothing)."""

  def cell(key: str, scale: float, digits: int) -> str:
    value = summary.get(key)
    return "" if value is None else f"{value * scale:.{digits}f}"

  return " | ".join(
    (
      cell("step_memory_bytes", 1e-9, 2),
      cell("peak_memory_bytes", 1e-9, 2),
      cell("optimizer_state_bytes_per_device", 1e-6, 1),
    )
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", choices=list(SUITES), required=True)
  parser.add_argument("--data", required=True, help="local data path for the suite, or 'synthetic'")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--only", nargs="*", help="run names to keep (default: all)")
  parser.add_argument("--out", type=Path, default=Path("outputs/bench"))
  parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
  parser.add_argument(
    "--extra",
    nargs="*",
    default=[],
    help="more overrides for every run, e.g. mesh.data=2 batch_size=256",
  )
  args = parser.parse_args(argv)
  names = [n for n in SUITES[args.suite]["runs"] if not args.only or n in args.only]
  if args.data == "synthetic":
    args.data = synthetic_data(args.suite)
  print(f"# {datetime.date.today()} suite={args.suite} steps={args.steps} extra={args.extra}")
  print(TABLE_HEADER)
  print("|---" * (TABLE_HEADER.count("|") - 1) + "|", flush=True)
  adam = {}
  for name in names:
    start = time.perf_counter()
    s = run(args.suite, name, args.data, args.steps, args.out, args.timeout, args.extra)
    wall = time.perf_counter() - start
    if not s:
      print(f"| {name} | failed | | | | | | | {wall:.0f} |", flush=True)
      continue
    setting = name.split()[0] if args.suite == "t5" else ""
    t = s.get("step_time_s")
    if "adam" in name:
      adam[setting] = t
    ratio = f"{t / adam[setting]:.2f}" if t and adam.get(setting) else ""
    print(
      f"| {name} | {s.get('trained_parameters'):,} | {1e3 * t:.2f} | "
      f"{s.get('examples_per_s'):.0f} | {ratio} | {memory_cells(s)} | {wall:.0f} |",
      flush=True,
    )
  print(f"device={s.get('device') if s else None} versions={s.get('versions') if s else None}")


if __name__ == "__main__":
  main()
