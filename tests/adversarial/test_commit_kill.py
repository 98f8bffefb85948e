"""kill -9 of rank 0 at each syscall of a checkpoint commit, with real processes.

The trainer (world size 1) runs under strace, which SIGKILLs it on entering one exact syscall of
the commit of step 6 (or the prune it does). A second life, without strace, must resume from at
least the newest step whose rename completed and end bitwise equal to the fault-free run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.adversarial.conftest import KILL, Inject, RunOutcome, run_under, tiny_config
from trainer import checkpointing

pytestmark = pytest.mark.slow

RENAMES = "rename,renameat,renameat2"
STEP = 6  # the commit under attack; it also prunes step 2


@dataclass(frozen=True)
class KillPoint:
    name: str
    syscalls: str
    path: str  # under <run_root>/checkpoints
    when: int
    loads: int  # the step the second life must resume from
    recovery: str | None  # the resume event action that must say what was found, if any


KILL_POINTS = [
    # The manifest's tmp -> manifest.json rename: the partial has no manifest, never trusted.
    # (Temporary names are random: a file's rename into place is matched by the path it names.)
    KillPoint(
        "manifest-rename",
        RENAMES,
        "step_000000006.partial/manifest.json",
        1,
        4,
        "removed-partial",
    ),
    # .partial -> committed: the partial is complete (manifest verifies): rolled forward. (Only
    # a plain rename: the files written in the partial are renamed by its descriptor, renameat.)
    KillPoint("partial-rename", "rename", "step_000000006.partial", 1, 6, "rolled-forward"),
    # LATEST's tmp -> LATEST (third commit: 2, 4, 6): 6 is committed, LATEST repaired.
    KillPoint("latest-rename", RENAMES, "LATEST", 3, 6, None),
    # Prune: step 2 -> step 2.deleting, then its files, then the directory. A kill in the
    # first file's unlink leaves a half-deleted .deleting leftover, which recovery removes.
    KillPoint(
        "prune-unlink", "unlink,unlinkat", "step_000000002.deleting", 1, 6, "removed-leftover"
    ),
    # (A kill entering the prune's rename leaves step 2 whole, pruned by the next commit; the
    # final rmdir of the emptied .deleting directory leaves what prune-unlink leaves. Both
    # states are recovered in tests/test_manifest.py without processes; the CI budget keeps
    # the real kill where the state is the worst.)
]


@pytest.mark.parametrize("point", KILL_POINTS, ids=[k.name for k in KILL_POINTS])
def test_kill_at_commit_syscall(
    point: KillPoint, strace_ok: None, fault_free: RunOutcome, dataset: Path, tmp_path: Path
):
    cfg = tiny_config(tmp_path / "run", dataset)
    ckdir = checkpointing.checkpoints_dir(cfg.run_root)
    inject = Inject(point.syscalls, ckdir / point.path, "signal=KILL", point.when)
    killed = run_under(cfg, inject)
    assert killed.returncode == -9, killed.log[-3000:]
    committed = [e["step"] for e in killed.of_kind("checkpoint")]
    assert committed == [2, 4], "killed in the commit of step 6, no later"

    # At the instant of the kill, a reader finds a valid checkpoint at least as new as the
    # newest completed rename (for `partial-rename`: 4, until recovery rolls 6 forward).
    choice = checkpointing.choose_resume(cfg.run_root, fingerprint=cfg.fingerprint())
    assert choice.step is not None and choice.step >= min(point.loads, 4)

    resumed = run_under(cfg, None)
    assert resumed.returncode == 0, resumed.log[-3000:]
    resumes = resumed.of_kind("resume")
    assert [e["step"] for e in resumes if e["action"] == "loaded"] == [point.loads], resumes
    if point.recovery is not None:
        assert any(e["action"] == point.recovery for e in resumes), resumes
    assert resumed.result is not None
    assert resumed.result["params_sha256"] == fault_free.result["params_sha256"]  # type: ignore[index]
    # Nothing half-done is left behind, and the newest K are kept.
    assert sorted(p.name for p in ckdir.iterdir()) == ["LATEST", "step_000000008", "step_000000010"]
    assert checkpointing.read_latest(cfg.run_root) == 10


@pytest.mark.parametrize("pid", [7544, 12345, 4194303])
def test_the_held_call_is_found_whatever_the_pid_width(pid: int):
    """strace -f pads the pid to 5 columns ("%-5d "): a 4-digit pid is followed by two spaces.
    Reading one space only made every drill time out on a fresh machine's low pids."""
    trace = f'{pid:<5d} rename("/r/probe", "/r/probe.renamed"'
    assert Inject("rename", Path("/r/probe"), KILL).held_thread(trace) == pid
    assert Inject("rename", Path("/r/probe"), KILL, when=2).held_thread(trace) is None
