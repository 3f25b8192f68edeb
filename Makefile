# Two commands do everything on a fresh machine: `make train` and `make test`.
# Each bootstraps .venv from the pinned requirements.txt once (a stamp file makes reruns instant).
# A Python >= 3.12 (jax 0.11's wheels need it): PYTHON=/path/to/python, else the first of
# python3.13, python3.12, python3 that is one, else one that pyenv installed.
PYTHON ?= $(firstword $(foreach p,python3.13 python3.12 python3 \
  $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3),$(shell $(p) -c \
  'import sys; print(sys.version_info >= (3, 12))' 2>/dev/null | grep -qx True && echo $(p))))
VENV := .venv
PY := $(VENV)/bin/python
# GPU=1 (or cuda13): the venv gets JAX's CUDA 13 build too (requirements-cuda13.txt, NVIDIA
# driver >= 580); GPU=cuda12 the CUDA 12 one (older drivers). Same jax version as the CPU
# install; its own stamp, so `make venv GPU=1` on a CPU venv adds the plugin. Every target that
# bootstraps takes it: `make train GPU=1`, `make gpu-check GPU=1`.
GPU ?=
CUDA := $(if $(filter 1 cuda13,$(GPU)),cuda13,$(if $(filter cuda12,$(GPU)),cuda12,))
ifneq ($(GPU),)
ifeq ($(CUDA),)
$(error GPU=$(GPU): allowed are 1 (the same as cuda13), cuda13, cuda12)
endif
endif
STAMP := $(VENV)/.installed$(if $(CUDA),-$(CUDA))
REQUIREMENTS := -r requirements.txt $(if $(CUDA),-r requirements-$(CUDA).txt)
# torch (requirements-torch.txt, 4.7 GB): the tests comparing T5 with Hugging Face's torch model
# need it, so `make test` and `make test-all` install it; TORCH=1 adds it to any target's venv
# (`make venv TORCH=1`: to read a T5 checkpoint saved as pytorch_model.bin).
TORCH ?=
TORCH_STAMP := $(VENV)/.installed-torch
export WANDB_MODE ?= offline
# `make train` and `make test` are the offline defaults: no hub access, CPU for the tests.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: venv train test test-all bench gpu-check lint docs table1 table2 table3 table4 tables clean

venv: $(STAMP) $(if $(TORCH),$(TORCH_STAMP))

# A venv of an older Python (jax 0.11 has no wheels for it) is made anew.
$(STAMP): requirements.txt pyproject.toml $(if $(CUDA),requirements-$(CUDA).txt)
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.12 found (jax 0.11 needs one):" \
	  "install one, or name it: make PYTHON=/path/to/python3.12 ..."; exit 1; }
	$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	  || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --disable-pip-version-check $(REQUIREMENTS) > $(VENV)/pip.log 2>&1 \
	  || { grep -v "is ignored: it is neither" $(VENV)/pip.log; exit 1; }
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . \
	  >> $(VENV)/pip.log 2>&1 || { grep -v "is ignored: it is neither" $(VENV)/pip.log; exit 1; }
	$(PY) -c "import jax, flax, optax, hydra, ginger"
	touch $(STAMP)

$(TORCH_STAMP): $(STAMP) requirements-torch.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-torch.txt \
	  >> $(VENV)/pip.log 2>&1 || { grep -v "is ignored: it is neither" $(VENV)/pip.log; exit 1; }
	touch $(TORCH_STAMP)

# The main job on its embedded offline default: Ginger vs Adam on scikit-learn's digits,
# one run dir each under multirun/demo/, then both results side by side.
train: $(STAMP) $(if $(TORCH),$(TORCH_STAMP))
	$(OFFLINE) $(PY) train.py -m experiment=demo optimizer=adam,ginger
	$(PY) -m results.compare multirun/demo

# A test running longer than TEST_TIMEOUT seconds fails (pytest-timeout); tests/conftest.py
# keeps XLA's compilations in .cache/jax (shared by the tests, their subprocesses and reruns).
TEST_TIMEOUT ?= 900
# Two pytest-xdist workers (the suite is compile-bound and single-threaded per test); each
# test file stays on one worker (--dist loadfile), so module fixtures run once.
TEST_WORKERS ?= -n 2 --dist loadfile

# XLA:CPU compiles the suite's programs with LLVM's optimisations off and with its classic
# elemental emitters instead of the MLIR fusion emitters (`make test` only; jax 0.11 takes the
# second as a backend option): the suite is compile-bound, while the programs it runs are small
# (the demo compiles several times faster: docs/benchmarks.md). Values are those of the
# defaults to float rounding, which every test's tolerance must allow anyway (another CPU's
# vector width changes it too); `make test-all` keeps the defaults.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 \
  --xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true

test: $(TORCH_STAMP)
	$(OFFLINE) JAX_PLATFORMS=cpu XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest -q -m "not slow" --timeout=$(TEST_TIMEOUT) $(TEST_WORKERS) tests

test-all: $(TORCH_STAMP)
	$(OFFLINE) JAX_PLATFORMS=cpu $(PY) -m pytest -q --timeout=$(TEST_TIMEOUT) $(TEST_WORKERS) tests

bench: $(STAMP)
	$(PY) -m bench.optimizer_step

# On an NVIDIA GPU (with GPU=1 for JAX's CUDA build): the compiled Pallas kernels against the jnp
# passes and float64, the whole update, a bfloat16 state taking directions partly outside
# span(U), and Adam's and Ginger's ResNet-18 step times on synthetic images (bench/gpu_check.py).
# Exit 1 when a check fails, 2 without a GPU.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# configs/sweep/arm/*.yaml from sweeps/arms.py (tests/test_sweeps.py fails while one is stale), and
# docs/configuration.md, the reference of every config key, from configs/ (its defaults and
# YAML comments) and training/config_check.py (the allowed values); tests/test_configuration_doc.py
# fails while the committed file differs.
docs: $(STAMP)
	$(PY) -m sweeps.arms --write
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
R50_standin := cifar10_resnet50_30ep
LORA_standin := xsum1000_t5_small_random_lora
FULL_standin := xsum1000_t5_small_random_full
# lr_tune's experiments: at the stand-in scale both ResNets (8 epochs on 5,000 held-out images;
# each runs its tables at its own lrs), at the others the sweep's own (every model).
# LR_TUNE_EXP=standin/cifar100_resnet50 tunes one.
comma := ,
LR_TUNE_EXP ?= $(if $(filter standin,$(SCALE)),standin/cifar100_resnet18$(comma)standin/cifar100_resnet50)
# The clip control tunes its QNG on ResNet-18 alone at the stand-in scale.
QNG_CONTROL_TUNE_standin := +sweep/exp=standin/cifar100_resnet18
ifeq ($(filter $(SCALE),full smoke standin),)
$(error SCALE=$(SCALE): allowed are full, standin, smoke)
endif
ifeq ($(filter $(LAUNCHER),pool slurm local),)
$(error LAUNCHER=$(LAUNCHER): allowed are pool, slurm, local)
endif

.PHONY: lr_tune ablation curvature_every qng_control recipe steptime

lr_tune: $(STAMP)
	$(SWEEP_RUN) +sweep=lr_tune $(if $(LR_TUNE_EXP),+sweep/exp=$(LR_TUNE_EXP)) $(SWEEP_OVERRIDES)
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
	$(SWEEP_RUN) +sweep=lr_tune $(QNG_CONTROL_TUNE_$(SCALE)) +sweep/arm=qng_clip $(SWEEP_OVERRIDES)
	$(PY) -m sweeps.best_lr
	$(SWEEP_RUN) +sweep=qng_control $(SWEEP_OVERRIDES)

# Ginger tau=8 with the curvature updated every K in {1, 2, 4, 8} steps, and Adam, on ResNet-18
# (10 epochs at SCALE=standin): the accuracy and time cost of K (curvature_every_*.md).
curvature_every: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE))
	$(SWEEP_RUN) +sweep=curvature_every $(SWEEP_OVERRIDES)

# Beyond the paper: does the ranking survive the common recipe? Adam, Ginger tau 8, Muon,
# schedule-free AdamW and SOAP on ResNet-18 with warm-up, cosine decay and decoupled weight
# decay, each at its tuned lr (configs/sweep/recipe.yaml; sweep=recipe, in no paper table).
recipe: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE))
	$(SWEEP_RUN) +sweep=recipe $(SWEEP_OVERRIDES)

# Step times alone for the performance profiles and today's optimizers' table: each profiled
# optimizer for 600 steps on both ResNets at its tuned lr, one run at a time on its device
# (configs/sweep/steptime.yaml; sweep=steptime, in no table).
steptime: $(STAMP)
	$(BEST_LR) $(R18_$(SCALE)) $(R50_$(SCALE))
	$(SWEEP_RUN) +sweep=steptime $(SWEEP_OVERRIDES)

# Every table and plot, regenerated from run records alone, offline: your runs (outputs/,
# multirun/: the paper's tables, and stand-in tables for any other set of runs) into
# results/local/ (ignored by git), and the committed stand-in campaign (results/cifar10/runs/:
# run records packed by `python -m results.records add`) into results/cifar10/.
tables: $(STAMP)
	$(PY) -m results.tables --out results/local
	$(PY) -m results.tables results/cifar10/runs --out results/cifar10 --standin-only
	$(PY) -m results.recipe results/cifar10/runs --out results/cifar10
	rm -rf results/cifar10/plots  # nothing stale: a plot no longer made does not linger
	$(PY) -m results.plots results/cifar10/runs --out results/cifar10/plots
	$(PY) -m results.profiles results/cifar10/runs --out results/cifar10
