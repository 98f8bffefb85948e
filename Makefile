# Everything a fresh machine needs: `make run` (the main job) and `make test` (the suite).
# torch is installed first and pinned: torch==2.13.0 is the CPU build on this kind of machine;
# a bare `torch` requirement may pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STATE_DIR ?= .state
PORT ?= 29500
# apt-get needs root: CI runs as root; elsewhere go through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all venv lock browser promtool monitor run run-trainer serve up down test test-fast test-extended lint bench bench-ettr screenshots clean

all: test

# constraints.txt pins every other package (and pip), so every fresh machine resolves the same
# versions, whatever pip it starts with; `make lock` rewrites it from this venv.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip -c constraints.txt
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -c constraints.txt
	$(PY) -m pip install --quiet -e '.[dev]' -c constraints.txt
	touch $@

lock: venv
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude-editable --all | \
		grep -v -iE '^(torch|setuptools|wheel)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

venv: $(VENV)/.installed

# Headless Chromium for the real-browser UI test: Debian's package, driven by Playwright's Python
# client against that binary (no browser download; `playwright install` is never needed).
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }
	@chromium --version 2>/dev/null

# The whole pipeline on the embedded default (local S3 server, 2 simulated nodes, gloo) with a
# short fault drill: one exception (in-process), one SIGKILL (in-job), one node loss (stage retry).
run: venv
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(VENV)/bin/nvrx-pipeline run \
		--set state_dir=$(STATE_DIR) --set steps=30 \
		--inject exception@step=8,rank=1 --inject sigkill@step=16,rank=0 \
		--inject node-loss@step=24,node=1

# The trainer alone under one ft_launcher (no Prefect, no S3).
run-trainer: venv
	$(PY) -m trainer.data --out $(STATE_DIR)/trainer-demo/data
	rm -rf $(STATE_DIR)/trainer-demo/run
	$(PY) -m trainer.launch --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:$(PORT) \
		--set run_root=$(STATE_DIR)/trainer-demo/run --set data_dir=$(STATE_DIR)/trainer-demo/data \
		--set steps=30 --inject exception@step=12,rank=1 --inject sigkill@step=22,rank=0
	$(PY) -m trainer.report $(STATE_DIR)/trainer-demo/run

serve: venv
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(VENV)/bin/nvrx-pipeline serve

# A Prefect server (the UI, http://127.0.0.1:4200) and the S3 server kept up across runs of
# $(STATE_DIR): `make run` then uses them, and its run, report and export stay reachable.
up: venv
	$(VENV)/bin/nvrx-pipeline up --state-dir $(STATE_DIR)

down: venv
	$(VENV)/bin/nvrx-pipeline down --state-dir $(STATE_DIR)

# A Prometheus scraping the demo's two metrics endpoints, with the shipped alert rules, at
# http://127.0.0.1:9090 (foreground; Ctrl-C ends it). Run `make run` in another terminal.
monitor: promtool
	mkdir -p $(STATE_DIR)/prometheus
	prometheus --config.file=deploy/prometheus/prometheus-local.yml \
		--storage.tsdb.path=$(STATE_DIR)/prometheus --web.listen-address=127.0.0.1:9090

# Debian's prometheus package for its promtool: the shipped alert rules are checked and
# unit-tested with it. RUNLEVEL=1: the package's service is not started (no server is needed).
promtool:
	@command -v promtool >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) env RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus; }
	@promtool --version 2>/dev/null | head -1

# Two passes: the unit and stand-in tests (mostly waiting on timers, sockets and subprocesses,
# not on the CPU) three at a time; then the real-process drills one at a time, since their
# tight hang timeouts read CPU contention as a hang (suite_time.json: parallel_experiment).
test: venv browser promtool
	$(PY) -m pytest -q -m "not slow and not extended" -n 3
	$(PY) -m pytest -q -m "slow and not extended" --durations=25

test-fast: venv promtool
	$(PY) -m pytest -q -m "not slow and not extended"

# Real-process drills kept out of `make test` for its time budget (their parts are covered by
# cheaper tests, see docs/architecture.md section 8): run them when changing those paths.
test-extended: venv browser promtool
	$(PY) -m pytest -q -m extended

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# ~45 min on 2 cores. Results (committed: benchmarks/scale_model.py reads them) under
# benchmarks/results/, timeline plots under benchmarks/plots/.
bench: venv
	mkdir -p benchmarks/results benchmarks/plots
	$(PY) benchmarks/checkpoint_stall.py --mb-per-rank 100 400 --out benchmarks/results/checkpoint_stall.json
	$(PY) benchmarks/recovery_time.py --samples 5 --out benchmarks/results/recovery_time.json --plot benchmarks/plots
	$(PY) benchmarks/node_loss.py --samples 3 --out benchmarks/results/node_loss.json
	$(PY) benchmarks/pipeline_overhead.py --out benchmarks/results/pipeline_overhead.json
	$(PY) benchmarks/layer_overhead.py --out benchmarks/results/layer_overhead.json
	$(PY) benchmarks/transfer_throughput.py --out benchmarks/results/transfer_throughput.json
	$(PY) benchmarks/fold_events.py --out benchmarks/results/fold_events.json

# The long one: >= 10 min of training with a fault every ~2 min, ours and the torchrun baseline.
bench-ettr: venv
	mkdir -p benchmarks/results benchmarks/plots
	$(PY) benchmarks/ettr.py --minutes 10 --clean-minutes 10 --out benchmarks/results/ettr.json --plot benchmarks/plots

# Refresh the Prefect UI screenshots in docs/img (the browser test takes them).
screenshots: venv browser
	NVRX_SCREENSHOT_DIR=docs/img $(PY) -m pytest -q tests/test_ui_browser.py

clean:
	rm -rf .state .pytest_cache .ruff_cache .mypy_cache
