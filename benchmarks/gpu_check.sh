#!/usr/bin/env bash
# One-GPU check of the CUDA path (world size 1), under 8 minutes in all, on a fresh GPU machine
# that has this repo:
#
#     bash benchmarks/gpu_check.sh OUT_DIR
#
# Makes its own venv (outside the repo: $GPU_CHECK_VENV, default ~/.cache/nvrx-gpu-check-venv;
# --system-site-packages, so a torch already on the machine is used as is), installs torch (the
# CUDA build pip gives on this machine; never the CPU pin of the Makefile) and this repo, then
# runs benchmarks/gpu_check.py part by part, each under its own `timeout`. Every part writes its
# JSON into OUT_DIR as soon as it is done (env.json, ckpt.json, drills.json) and its exit status
# into OUT_DIR/rc_<part> (124: killed by its timeout); summary.json comes last.
# GPU_CHECK_PYTHON=/path/to/python skips the setup (e.g. to try the plumbing on a CPU machine).
# On a machine that cannot reach a package index (this project's device machine), skip the setup
# and put what its image lacks on PYTHONPATH: nvidia-resiliency-ext, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions and defusedxml, as wheels for its Python
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 ...`), installed with
# `pip install --no-index --no-deps --target /tmp/site`, then
#     PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH GPU_CHECK_PYTHON=python3 bash benchmarks/gpu_check.sh OUT
# (2026-12-04 on an H200: benchmarks/results/gpu_check_h200.json).
set -uo pipefail

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${GPU_CHECK_VENV:-$HOME/.cache/nvrx-gpu-check-venv}
# whole script, setup included; below 8 min (480 s) with room for timeout --kill-after
BUDGET_S=${GPU_CHECK_BUDGET_S:-440}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: >"$LOG"
START=$SECONDS
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG" >&2; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
# the smaller of a part's own cap and what is left of the budget minus a reserve for later parts
cap() { local c=$1 reserve=$2 l; l=$(($(left) - reserve)); ((l < c)) && c=$l; ((c < 5)) && c=5; echo "$c"; }

# -- setup: venv, torch, this repo ---------------------------------------------------------------
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON # an interpreter that already has everything: no setup
    log "setup skipped: GPU_CHECK_PYTHON=$PY"
else
    log "setup: venv $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
        timeout 60 python3 -m venv --system-site-packages "$VENV" >>"$LOG" 2>&1 || log "venv failed"
    fi
    PY="$VENV/bin/python"
    [ -x "$PY" ] || PY=$(command -v python3)
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    TORCH_NOW=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null)
    if [ -n "$TORCH_NOW" ] && [ "${TORCH_NOW#* }" != "None" ]; then
        log "setup: a CUDA build of torch is already importable: $TORCH_NOW"
    else
        # none, or a CPU build (which would satisfy a plain `pip install torch`): get the CUDA one
        log "setup: pip install torch (present: ${TORCH_NOW:-none})"
        timeout "$(cap 200 240)" "$PY" -m pip install --quiet ${TORCH_NOW:+--ignore-installed} torch \
            >>"$LOG" 2>&1 || log "pip install torch failed or timed out (see $LOG)"
    fi
    log "setup: pip install -e $REPO"
    if ! timeout "$(cap 120 220)" "$PY" -m pip install --quiet -e "$REPO" >>"$LOG" 2>&1; then
        log "pip install -e failed; trying --no-deps (trainer needs torch, nvidia-resiliency-ext, numpy, psutil)"
        timeout 60 "$PY" -m pip install --quiet --no-deps -e "$REPO" >>"$LOG" 2>&1 || true
    fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$PY"):$PATH"
export TORCH_CPP_LOG_LEVEL=ERROR
"$PY" -c 'import torch, nvidia_resiliency_ext, trainer.checkpointing.async_save; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' \
    2>&1 | tee -a "$LOG" >&2

# -- the parts -----------------------------------------------------------------------------------
run_part() { # name timeout_s [extra args]
    local name=$1 t=$2
    shift 2
    log "part $name (timeout ${t}s)"
    (cd "$REPO" && timeout --kill-after=10 "$t" "$PY" benchmarks/gpu_check.py --out "$OUT" \
        --part "$name" "$@") >>"$LOG" 2>&1
    local rc=$?
    echo "$rc" >"$OUT/rc_$name"
    log "part $name: rc=$rc"
}

run_part env "$(cap 40 200)"
# llama-1b alone took 193 s with 2 samples on an H200; gpt-100m about 40 s
T=$(cap 250 150)
run_part ckpt "$T" --budget-s $((T - 35)) --samples 2
# 8 drills (4 per kernel mode) started at once: 106 s on an H200, 16 cores
T=$(cap 150 10)
run_part drills "$T" --budget-s $((T - 10)) --drill-parallel
run_part summary 30
cat "$OUT/summary.json" 2>/dev/null || log "no summary.json"
log "done in $((SECONDS - START))s"
