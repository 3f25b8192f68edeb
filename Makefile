# Two commands do everything on a fresh machine: `make train` and `make test`.
# Each bootstraps .venv from the pinned requirements.txt once (a stamp file makes reruns instant).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: venv train test test-all bench lint table1 table2 table3 table4 tables clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" || true
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" || true
	$(PY) -c "import jax, flax, optax, hydra, ginger"
	touch $(STAMP)

# The main job on its embedded offline default: Ginger vs Adam on scikit-learn's digits,
# one run dir each under multirun/demo/, then both results side by side.
train: $(STAMP)
	$(PY) train.py -m experiment=demo optimizer=adam,ginger
	$(PY) -m results.compare multirun/demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m bench.optimizer_step

lint: $(STAMP)
	$(PY) -m ruff check .
