"""The load check's interpreter started ahead of its checkpoint (tasks.validation.load_process),
with real interpreters and a real committed checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import psutil
import pytest

from tasks.validation import load_process
from tasks.validation.checkpoint import child_env
from tasks.validation.load_report import LoadReport
from tests.helpers import SmallCheckpoint


@pytest.fixture(autouse=True)
def no_spare() -> Iterator[None]:
    load_process.discard()
    yield
    load_process.discard()


def _loads() -> list[psutil.Process]:
    """This test's load-check interpreters still alive."""
    return [
        p
        for p in psutil.Process().children()
        if "tasks.validation.load_check" in " ".join(p.cmdline()) and p.status() != "zombie"
    ]


def test_a_spare_started_ahead_loads_like_a_fresh_one(small_checkpoint: SmallCheckpoint):
    env = child_env(dict(os.environ))
    load_process.prestart(env)
    load_process.prestart(env)  # idempotent: one spare
    assert len(_loads()) == 1
    spare = load_process._spare
    assert spare is not None
    done = load_process.run([str(small_checkpoint.path)], env, 120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["loaded"] is True and out["tensors"] > 0 and out["nonfinite"] == [], out
    assert out["params_sha256"] == small_checkpoint.params_sha256
    # It was the spare that loaded (used once: no spare left), and it is gone.
    assert spare.proc.returncode == 0 and load_process._spare is None
    assert _loads() == []


def test_a_spare_started_with_another_environment_is_not_used():
    env = child_env(dict(os.environ))
    load_process.prestart({**env, "NVRX_OTHER": "1"})
    [spare] = _loads()
    assert load_process.take(env) is None  # ended, not handed out
    assert not spare.is_running() or spare.status() == "zombie"
    assert load_process._spare is None


def test_a_spare_nobody_takes_exits_and_bad_arguments_are_refused():
    env = child_env(dict(os.environ))
    left = load_process.spawn(env)
    out, _ = left.communicate("", timeout=120)  # its caller gone: end-of-file, no load
    assert left.returncode == 0 and out == ""
    bad = load_process.spawn(env)
    out, _ = bad.communicate('{"path": "/etc"}\n', timeout=120)
    assert bad.returncode == 2
    assert LoadReport.parse(out) == LoadReport.failed("arguments: not a JSON list of strings")


def test_a_load_past_its_timeout_is_ended(small_checkpoint: SmallCheckpoint):
    env = child_env(dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):  # its imports alone take longer
        load_process.run([str(small_checkpoint.path)], env, 0.2)
    assert _loads() == []


def test_a_variable_torch_sets_for_itself_does_not_waste_the_spare():
    env = child_env(dict(os.environ))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    load_process.prestart(env)
    [spare] = _loads()
    taken = load_process.take({**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_x"})
    assert taken is not None and taken.pid == spare.pid
    taken.kill()
    taken.communicate()
