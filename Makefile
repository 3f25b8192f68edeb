# Two commands do everything on a fresh machine: `make train` and `make test`.
# Each bootstraps .venv from the pinned requirements.txt once (a stamp file makes reruns instant).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
# `make train` and `make test` are the offline defaults: no hub access, CPU for the tests.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: venv train test test-all bench lint docs table1 table2 table3 table4 tables clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt > $(VENV)/pip.log 2>&1 \
	  || { grep -v "is ignored: it is neither" $(VENV)/pip.log; exit 1; }
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . \
	  >> $(VENV)/pip.log 2>&1 || { grep -v "is ignored: it is neither" $(VENV)/pip.log; exit 1; }
	$(PY) -c "import jax, flax, optax, hydra, ginger"
	touch $(STAMP)

# The main job on its embedded offline default: Ginger vs Adam on scikit-learn's digits,
# one run dir each under multirun/demo/, then both results side by side.
train: $(STAMP)
	$(OFFLINE) $(PY) train.py -m experiment=demo optimizer=adam,ginger
	$(PY) -m results.compare multirun/demo

# A test running longer than TEST_TIMEOUT seconds fails (pytest-timeout); tests/conftest.py
# keeps XLA's compilations in .cache/jax (shared by the tests, their subprocesses and reruns).
TEST_TIMEOUT ?= 900
# Two pytest-xdist workers (the suite is compile-bound and single-threaded per test); each
# test file stays on one worker (--dist loadfile), so module fixtures run once.
TEST_WORKERS ?= -n 2 --dist loadfile

# XLA:CPU compiles the suite's programs with LLVM's optimisations off and with its classic
# elemental emitters instead of the MLIR fusion emitters (`make test` only): the suite is
# compile-bound (2 cores: 13.8 -> 9.3 minutes for the first, 9.2 -> 6.5 for the second; the
# demo's Ginger step compiles in ~2.5 s instead of ~3.8), while the programs it runs are small.
# Values are those of the defaults to float rounding, which every test's tolerance must allow
# anyway (another CPU's vector width changes it too); `make test-all` keeps the defaults.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false

test: $(STAMP)
	$(OFFLINE) JAX_PLATFORMS=cpu XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest -q -m "not slow" --timeout=$(TEST_TIMEOUT) $(TEST_WORKERS) tests

test-all: $(STAMP)
	$(OFFLINE) JAX_PLATFORMS=cpu $(PY) -m pytest -q --timeout=$(TEST_TIMEOUT) $(TEST_WORKERS) tests

bench: $(STAMP)
	$(PY) -m bench.optimizer_step

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# docs/configuration.md, the reference of every config key, from configs/ (its defaults and
# YAML comments) and training/config_check.py (the allowed values); tests/test_configuration_doc.py
# fails while the committed file differs.
docs: $(STAMP)
	$(PY) -m training.config_doc --write

# ------------------------------------------------------------------------------ paper sweeps
# The Hydra multiruns of configs/sweep/ (every command, its cost and the lr protocol:
# sweeps/README.md). Knobs: SCALE=full (the paper's settings), standin (the paper's protocol on
# the real data these machines can have, shortened: CIFAR-10 for 30 epochs, t5-small shapes
# from random init on 1,000 XSUM documents; DATA=<folder with cifar10-jpeg.tar.xz and
# xsum-1000.jsonl>, default .data) or smoke (embedded data and tiny models, minutes on a CPU);
# SEEDS=0,1,2 (a sweep axis; results/tables.py averages seeds); GPUS=0,1,2,3 (default: every
# GPU nvidia-smi lists, or one job at a time without GPUs); SWEEP_ARGS="max_steps=2 ..." (more
# overrides). Jobs run through sweeps/gpu_pool.py: one process per job, one job per GPU
# (JOBS_PER_GPU=4: up to four, for runs whose accuracy alone counts; their times and memory stay
# out of the tables), completed runs skipped, a diverging run does not stop the sweep.
# LAUNCHER=slurm runs them as SLURM jobs instead, one GPU each (`train.py -m
# hydra/launcher=submitit_slurm`; PARTITION=<partition>, more in SWEEP_ARGS, e.g.
# "hydra.launcher.account=<account>"); LAUNCHER=local through submitit on this machine, every
# job at once (no GPU pinning: for CPU runs). Both wait for the last job and list failed ones.
# `python train.py -m +sweep=table1 scale=smoke seed=0,1` runs the same jobs in one process.
SCALE ?= full
SEEDS ?= 0
GPUS ?=
JOBS_PER_GPU ?=
SWEEP_ARGS ?=
DATA ?=
LAUNCHER ?= pool
PARTITION ?=
ifneq ($(DATA),)
export GINGER_DATA := $(DATA)
endif
# Smoke sweeps run on the CPU; the others on whatever JAX finds (the GPU), unless
# JAX_PLATFORMS is set in the environment or on the command line.
SWEEP_PLATFORMS = $(if $(JAX_PLATFORMS),$(JAX_PLATFORMS),$(if $(filter smoke,$(SCALE)),cpu,))
POOL_RUN = $(PY) -m sweeps.gpu_pool $(if $(GPUS),--devices $(GPUS)) \
  $(if $(JOBS_PER_GPU),--jobs-per-device $(JOBS_PER_GPU)) --
SUBMITIT_RUN = $(PY) train.py -m hydra/launcher=submitit_$(LAUNCHER) \
  $(if $(and $(PARTITION),$(filter slurm,$(LAUNCHER))),hydra.launcher.partition=$(PARTITION))
SWEEP_RUN = JAX_PLATFORMS=$(SWEEP_PLATFORMS) $(if $(filter pool,$(LAUNCHER)),$(POOL_RUN),$(SUBMITIT_RUN))
SWEEP_OVERRIDES = scale=$(SCALE) seed=$(SEEDS) $(SWEEP_ARGS)
BEST_LR = $(PY) -m sweeps.best_lr --experiments
# The experiment names of each scale (what configs/best_lr/ files are named after).
R18_full := cifar100_resnet18
R50_full := cifar100_resnet50
LORA_full := xsum_t5_lora
FULL_full := xsum_t5_full
R18_smoke := smoke_cifar100_resnet18
R50_smoke := smoke_cifar100_resnet50
LORA_smoke := smoke_xsum_t5_lora
FULL_smoke := smoke_xsum_t5_full
R18_standin := cifar10_resnet18_30ep
# ResNet-50 reuses ResNet-18's lr at the stand-in scale (configs/sweep/exp/standin/).
R50_standin := cifar10_resnet18_30ep
LORA_standin := xsum1000_t5_small_random_lora
FULL_standin := xsum1000_t5_small_random_full
# lr_tune at the stand-in scale tunes ResNet-18 only (8 epochs on 5,000 held-out images).
LR_TUNE_standin := +sweep/exp=standin/cifar100_resnet18
ifeq ($(filter $(SCALE),full smoke standin),)
$(error SCALE=$(SCALE): allowed are full, standin, smoke)
endif
ifeq ($(filter $(LAUNCHER),pool slurm local),)
$(error LAUNCHER=$(LAUNCHER): allowed are pool, slurm, local)
endif

.PHONY: lr_tune ablation curvature_every qng_control

lr_tune: $(STAMP)
	$(SWEEP_RUN) +sweep=lr_tune $(LR_TUNE_$(SCALE)) $(SWEEP_OVERRIDES)
	$(PY) -m sweeps.best_lr

table1: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE)) $(R50_$(SCALE))
	$(SWEEP_RUN) +sweep=table1 $(SWEEP_OVERRIDES)

table2: $(STAMP)
	$(BEST_LR) $(LORA_$(SCALE)) $(FULL_$(SCALE))
	$(SWEEP_RUN) +sweep=table2 $(SWEEP_OVERRIDES)

# Tables 3 and 4 are two views of the same 9 runs per seed (sweep=table34): either target runs
# them, and the second finds them completed.
table3 table4: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE))
	$(SWEEP_RUN) +sweep=table34 $(SWEEP_OVERRIDES)

ablation: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE))
	$(SWEEP_RUN) +sweep=ablation $(SWEEP_OVERRIDES)

# The clip control: QNG with Ginger's authors' clip (rho=1) and per-tensor blocks, its lr tuned
# by the paper's protocol (lr_tune's qng_clip arm), then tau 4 and 8 (comparisons_<set>.md).
qng_control: $(STAMP)
	$(SWEEP_RUN) +sweep=lr_tune $(LR_TUNE_$(SCALE)) +sweep/arm=qng_clip $(SWEEP_OVERRIDES)
	$(PY) -m sweeps.best_lr
	$(SWEEP_RUN) +sweep=qng_control $(SWEEP_OVERRIDES)

# Ginger tau=8 with the curvature updated every K in {1, 2, 4, 8} steps, and Adam, on ResNet-18
# (10 epochs at SCALE=standin): the accuracy and time cost of K (curvature_every_*.md).
curvature_every: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE))
	$(SWEEP_RUN) +sweep=curvature_every $(SWEEP_OVERRIDES)

# Every table and plot, regenerated from run records alone, offline: your runs (outputs/,
# multirun/: the paper's tables, and stand-in tables for any other set of runs) into
# results/local/ (ignored by git), and the committed stand-in campaign (results/cifar10/runs/:
# run records packed by `python -m results.records add`) into results/cifar10/.
tables: $(STAMP)
	$(PY) -m results.tables --out results/local
	$(PY) -m results.tables results/cifar10/runs --out results/cifar10 --standin-only
	$(PY) -m results.newcomers results/cifar10/runs --out results/cifar10
	rm -rf results/cifar10/plots  # nothing stale: a plot no longer made does not linger
	$(PY) -m results.plots results/cifar10/runs --out results/cifar10/plots
