"""The load check's interpreter (``python -m tasks.validation.load_check --stdin``): a fresh
process that imports what a load needs, then reads its arguments from stdin, checks one
checkpoint and exits; so it can be started ahead of its checkpoint.

About 3.5 of the load check's ~4.5 s are its imports (torch, DCP, the trainer; 2 cores), on the
critical path between training and export. So the train stage starts one when the trainer
reports ``train_end`` (its processes still exit for ~3 s) and validation takes it (:func:`take`).
It is as fresh as one started when needed: it has read nothing but its modules, has the same
environment (credentials removed: ``tasks.validation.checkpoint.child_env``) and is used once.
One spare at a time; one not taken within :data:`MAX_AGE_S`, or started with another
environment, is ended and validation starts its own. A spare whose parent dies reads
end-of-file and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
MAX_AGE_S = 600.0
# Variables torch sets in its own process's environment on first use: the inductor's cache
# directory (torch/_inductor/runtime/cache_dir_utils.py), set in the pipeline's first run
# between the train end and validation (measured). The parent gaining one between the spare's
# start and its use does not make the spare's environment another (the child sets it alike).
_SELF_SET = frozenset({"TORCHINDUCTOR_CACHE_DIR"})


@dataclass
class _Spare:
    proc: subprocess.Popen[str]
    env: dict[str, str]
    started: float


_lock = threading.Lock()
_spare: _Spare | None = None


def spawn(env: dict[str, str]) -> subprocess.Popen[str]:
    """A new load-check interpreter, waiting for its arguments."""
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.validation.load_check", "--stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=_REPO,
    )


def prestart(env: dict[str, str]) -> None:
    """Have a spare interpreter ready for the next :func:`take` with ``env`` (idempotent)."""
    global _spare
    with _lock:
        if _spare is not None and _usable(_spare, env):
            return
        old, _spare = _spare, _Spare(spawn(env), dict(env), time.monotonic())
    if old is not None:
        _end(old.proc)


def take(env: dict[str, str]) -> subprocess.Popen[str] | None:
    """The spare, if one started with ``env`` is alive and young enough (then it is no longer
    the spare); else None (and a stale spare is ended)."""
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    if not _usable(spare, env):
        _end(spare.proc)
        return None
    return spare.proc


def run(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run the load check with ``args`` in the spare (or a new interpreter). Raises
    ``subprocess.TimeoutExpired`` after ``timeout_s``, the interpreter killed."""
    proc = take(env) or spawn(env)
    line = json.dumps(args) + "\n"
    try:
        out, err = proc.communicate(line, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def discard() -> None:
    """End the spare, if any (at exit, and in tests)."""
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is not None:
        _end(spare.proc)


def _usable(spare: _Spare, env: dict[str, str]) -> bool:
    return (
        spare.proc.poll() is None
        and _same_env(spare.env, env)
        and time.monotonic() - spare.started < MAX_AGE_S
    )


def _same_env(a: dict[str, str], b: dict[str, str]) -> bool:
    def own(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in _SELF_SET}

    return own(a) == own(b)


def _end(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.communicate(timeout=10)


atexit.register(discard)
