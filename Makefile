# Everything a fresh machine needs: `make run` (the main job) and `make test` (the suite).
# torch is installed first and pinned: torch==2.13.0 is the CPU build on this kind of machine;
# a bare `torch` requirement may pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
RUN_ROOT ?= runs/demo
DATA_DIR ?= runs/data
PORT ?= 29500

.PHONY: all venv run test test-fast lint bench clean

all: test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The embedded default: 2 CPU ranks under ft_launcher, async checkpoints, and a short fault
# drill (one exception recovered in-process, one SIGKILL recovered by ft_launcher).
run: venv
	$(PY) -m trainer.data --out $(DATA_DIR)
	rm -rf $(RUN_ROOT)
	$(PY) -m trainer.launch --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:$(PORT) \
		--run-root $(RUN_ROOT) --data-dir $(DATA_DIR) --model tiny --steps 30 --ckpt-interval 5 \
		--inject exception@step=12,rank=1 --inject sigkill@step=22,rank=0
	$(PY) -m trainer.report $(RUN_ROOT)

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: venv
	$(PY) benchmarks/checkpoint_stall.py

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache
