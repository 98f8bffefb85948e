"""Fault drills with real processes: ft_launcher, 2 gloo ranks, FSDP2, NVRx in-process Wrapper.

Every scenario must finish all steps with parameters bitwise equal to the fault-free run, and the
events must say which layer recovered it and that it resumed from a real checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import RunOutcome, make_config, run_ft_launcher, start_ft_launcher
from trainer import fence, manifest
from trainer.events import read_events

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Drill:
    name: str
    fault: str
    layer: str  # the layer that must recover it


# Faults at step 14 with checkpoints every 5 steps: at least step 5 is committed by then.
# `exception` (in-process) and `sigkill` (in-job) run through the whole pipeline instead, with
# the same bitwise, fired-once and resume-point checks (tests/test_pipeline.py); running them
# here as well cost ~2 min of the CI budget for no extra assertion.
DRILLS = [
    Drill("stall", "stall@step=14,rank=1", "inprocess"),
    Drill("hang", "hang@step=14,rank=1", "injob"),
]


@pytest.fixture(scope="module")
def baseline(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    cfg = make_config(tmp_path_factory.mktemp("drill") / "baseline", dataset)
    out = run_ft_launcher(cfg)
    assert out.returncode == 0, out.log[-3000:]
    assert out.result is not None and out.result["final_step"] == cfg.steps
    assert not out.of_kind("fault") and not out.of_kind("restart")
    return out


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_drill_recovers_bitwise(drill: Drill, baseline: RunOutcome, dataset: Path, tmp_path: Path):
    cfg = make_config(tmp_path / drill.name, dataset, faults=(drill.fault,))
    out = run_ft_launcher(cfg)
    assert out.returncode == 0, out.log[-4000:]
    assert out.result is not None
    assert out.result["final_step"] == cfg.steps
    assert out.result["params_sha256"] == baseline.result["params_sha256"]  # type: ignore[index]

    faults = out.of_kind("fault")
    assert [f["fault"] for f in faults] == [drill.fault]  # fired exactly once across restarts
    restarts = out.of_kind("restart")
    assert restarts and {r["layer"] for r in restarts} == {drill.layer}
    recovered = out.of_kind("recovered")
    assert len(recovered) == 1 and recovered[0]["layer"] == drill.layer
    assert recovered[0]["recovery_s"] > 0
    loaded = [e for e in out.of_kind("resume") if e["action"] == "loaded"]
    assert loaded and 5 <= loaded[-1]["step"] < 14, "must resume from a committed checkpoint"


def _lock_is_free(run_root: Path) -> bool:
    import fcntl

    with open(run_root / fence.LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def _checkpoints_state(run_root: Path) -> dict[str, object]:
    """What a zombie must not change: the committed steps, LATEST, the result."""
    return {
        "committed": manifest.committed_steps(run_root),
        "latest": manifest.read_latest(run_root),
        "result": (run_root / "result.json").read_bytes(),
    }


def test_a_zombie_attempt_changes_nothing(baseline: RunOutcome, dataset: Path, tmp_path: Path):
    """Attempt 1 frozen (SIGSTOP, its whole session) while it writes step 10; attempt 2, under a
    new epoch, resumes from step 5 and finishes; attempt 1 thawed: it commits, prunes and
    removes nothing, says so with a ``fenced`` event and exits. The run is bitwise equal to the
    fault-free one."""
    cfg = make_config(tmp_path / "run", dataset)
    cfg.run_root.mkdir(parents=True)
    first = fence.publish(cfg.run_root, invocation="first", attempt=1)
    zombie = start_ft_launcher(cfg, env={fence.EPOCH_ENV: str(first.epoch)}, tag="-zombie")
    try:
        partial = manifest.partial_path(cfg.run_root, 10, first.epoch)
        deadline = time.monotonic() + 180
        while not partial.exists():
            assert zombie.poll() is None, "attempt 1 ended before it wrote step 10"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.killpg(zombie.pid, signal.SIGSTOP)
        # Frozen outside the fenced section (a freeze inside it holds the lock: thaw it briefly).
        while not _lock_is_free(cfg.run_root):
            os.killpg(zombie.pid, signal.SIGCONT)
            time.sleep(0.02)
            os.killpg(zombie.pid, signal.SIGSTOP)
        second = fence.publish(cfg.run_root, invocation="second", attempt=2)
        out = run_ft_launcher(cfg, env={fence.EPOCH_ENV: str(second.epoch)})
        assert out.returncode == 0, out.log[-3000:]
        assert out.result is not None and out.result["epoch"] == second.epoch
        assert out.result["params_sha256"] == baseline.result["params_sha256"]  # type: ignore[index]
        before = _checkpoints_state(cfg.run_root)
        os.killpg(zombie.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not [e for e in read_events(cfg.run_root) if e["kind"] == "fenced"]:
            assert time.monotonic() < deadline, "the zombie never said it was fenced"
            time.sleep(0.2)
        time.sleep(2)  # anything it would still do, it does now
        assert _checkpoints_state(cfg.run_root) == before
        fenced = [e for e in read_events(cfg.run_root) if e["kind"] == "fenced"]
        assert {e["epoch"] for e in fenced} == {first.epoch}
        assert all(e["current"] == second.epoch for e in fenced)
        for step in before["committed"]:  # type: ignore[attr-defined]
            assert manifest.verify_checkpoint(manifest.committed_path(cfg.run_root, step)).ok
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(zombie.pid, signal.SIGCONT)
            os.killpg(zombie.pid, signal.SIGKILL)
        zombie.wait()
