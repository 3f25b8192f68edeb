"""The stand-in scale (scale=standin): what each sweep's jobs train on, and for how long."""

from __future__ import annotations

import pytest

from sweeps import expand


def jobs(*overrides: str) -> list[expand.Job]:
  return expand.expand(["scale=standin", *overrides])


def test_image_tables_train_30_epochs_of_local_cifar10(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("GINGER_DATA", "/data")
  (job,) = jobs("+sweep=table1", "+sweep/exp=standin/cifar100_resnet18", "+sweep/arm=adam")
  c = job.config
  assert (c["name"], c["epochs"], c["max_steps"]) == ("cifar10_resnet18_30ep", 30, None)
  assert (c["data"]["name"], c["data"]["source"]) == ("cifar10", "local")
  assert c["data"]["path"] == "/data/cifar10-jpeg.tar.xz" and c["data"]["holdout"] == 0
  assert c["model"]["name"] == "resnet18" and c["batch_size"] == 128 and c["weight_decay"] == 0
  assert str(job.run_dir).startswith("multirun/table1/cifar10_resnet18_30ep/adam,lr=")


def test_lr_tuning_trains_8_epochs_on_held_out_images() -> None:
  tune = jobs("+sweep=lr_tune", "+sweep/exp=standin/cifar100_resnet18", "+sweep/arm=ginger")
  assert sorted(j.config["lr"] for j in tune) == [1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5]
  assert {(j.config["epochs"], j.config["data"]["holdout"]) for j in tune} == {(8, 5000)}
  assert {j.config["sweep"] for j in tune} == {"lr_tune"}


def test_resnet50_and_the_sensitivity_and_ablation_sweeps() -> None:
  (r50,) = jobs("+sweep=table1", "+sweep/exp=standin/cifar100_resnet50", "+sweep/arm=adam")
  assert (r50.config["name"], r50.config["model"]["name"]) == ("cifar10_resnet50_30ep", "resnet50")
  t34 = jobs("+sweep=table34")
  assert len(t34) == 9 and {j.config["epochs"] for j in t34} == {30}
  assert {j.config["data"]["name"] for j in t34 + jobs("+sweep=ablation")} == {"cifar10"}


def test_table2_runs_random_t5_small_shapes_on_real_xsum() -> None:
  full, lora = (
    jobs("+sweep=table2", f"+sweep/exp=standin/xsum_t5_{s}", "+sweep/arm=adam")[0].config
    for s in ("full", "lora")
  )
  for c in (full, lora):
    assert c["model"]["pretrained"] is None and c["model"]["size"]["d_model"] == 512
    assert c["model"]["name"] == "t5-small-random"  # never the paper's pretrained t5-small
    assert (c["data"]["source"], c["data"]["tokenizer"], c["epochs"]) == ("local", "demo", 2)
    assert c["data"]["path"].endswith("xsum-1000.jsonl")
  assert full["model"]["lora"] is None and lora["model"]["lora"]["rank"] == 8


def test_the_paper_image_sweeps_keep_the_authors_d_pass() -> None:
  """train.py's image experiments give the d-pass the authors' eval forward (the default), and
  every image sweep of the paper's tables pins it, so their runs stay the committed ones
  whatever the default; the T5 sweeps share the forward (no BatchNorm)."""
  from hydra import compose, initialize_config_dir

  with initialize_config_dir(config_dir=str(expand.ROOT / "configs"), version_base=None):
    single = compose(config_name="config", overrides=["experiment=cifar10_resnet18"])
  assert single.fisher_forward == "eval"
  for exp in ("cifar100_resnet18", "cifar100_resnet50"):  # the files every image sweep reads
    (job,) = jobs("+sweep=table1", f"+sweep/exp=standin/{exp}", "+sweep/arm=ginger_tau8")
    assert job.config["fisher_forward"] == "eval", exp
  (race,) = jobs("+sweep=curvature_every", "+sweep/arm=ginger_tau8_k8", "seed=0")
  assert race.config["fisher_forward"] == "eval"
  (t5,) = jobs("+sweep=table2", "+sweep/exp=standin/xsum_t5_full", "+sweep/arm=ginger_tau8")
  assert t5.config["fisher_forward"] == "shared"
