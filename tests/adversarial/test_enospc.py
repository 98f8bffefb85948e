"""A full disk during a save, with real processes: strace fails one write of the save of step 6
with ENOSPC (in the checkpoint writer, in the manifest).

The save fails alone: its partial is discarded, the last commit (step 4) still verifies, the run
stops as fatal (exit 3: a restart would hit the same full disk) naming the error and the disk,
and ``events.jsonl`` still parses line by line. Run again once there is space: it resumes from
step 4 and ends bitwise equal to the fault-free run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.adversarial.conftest import Inject, RunOutcome, run_under, tiny_config
from trainer import checkpointing
from trainer.errors import ExitCode

pytestmark = pytest.mark.slow

WRITES = "write,pwrite64,writev,pwritev,pwritev2"
RENAMES = "rename,renameat,renameat2"


@dataclass(frozen=True)
class FullDisk:
    name: str
    path: str  # under <run_root>/checkpoints/step_000000006.partial
    writer: str  # who writes it
    # Run again once there is space. Both cases leave the same run root (asserted below: the
    # same listing, the same last commit), so one resume covers both (the CI budget).
    resume: bool = False
    syscalls: str = WRITES  # the calls that fail


# The writer's child and the trainer itself. (The DCP finalize's .metadata.tmp is written by
# the trainer too, and fails the same way as the manifest; the CI budget keeps one of the two.)
FULL_DISKS = [
    FullDisk("shard", "__0_0.distcp", "the async writer's forked child", resume=True),
    # The manifest's temporary name is random (no -P can name it): its rename into place fails
    # (ENOSPC: no room for the directory entry), which rank 0's commit handles the same way.
    FullDisk("manifest", "manifest.json", "rank 0's commit", syscalls=RENAMES),
]


@pytest.mark.parametrize("disk", FULL_DISKS, ids=[d.name for d in FULL_DISKS])
def test_full_disk_fails_the_save_not_the_checkpoints(
    disk: FullDisk, strace_ok: None, fault_free: RunOutcome, dataset: Path, tmp_path: Path
):
    cfg = tiny_config(tmp_path / "run", dataset)
    ckdir = checkpointing.checkpoints_dir(cfg.run_root)
    target = checkpointing.partial_path(cfg.run_root, 6) / disk.path
    out = run_under(cfg, Inject(disk.syscalls, target, "error=ENOSPC"))

    assert out.returncode == ExitCode.FATAL, out.log[-3000:]
    assert "No space left on device" in out.log and "Disk: " in out.log, out.log[-3000:]
    [failed] = out.of_kind("checkpoint_failed")
    assert failed["step"] == 6 and "No space left on device" in failed["error"]
    assert failed["path"] == str(ckdir) and Path(failed["disk"]).is_dir()
    assert failed["disk"] in out.log and failed["last_committed"] == 4
    assert out.result is not None and out.result["status"] == "failed"
    # Only that save is lost: no partial left, the last commit verifies in full.
    assert [e["step"] for e in out.of_kind("checkpoint")] == [2, 4]
    assert sorted(p.name for p in ckdir.iterdir()) == ["LATEST", "step_000000002", "step_000000004"]
    assert checkpointing.verify_checkpoint(checkpointing.committed_path(cfg.run_root, 4)).ok
    assert checkpointing.read_latest(cfg.run_root) == 4
    lines = (cfg.run_root / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == [e["kind"] for e in out.events]

    # Space is back: the next run resumes from the last commit and loses nothing.
    if not disk.resume:
        return
    again = run_under(cfg, None)
    assert again.returncode == 0, again.log[-3000:]
    assert [e["step"] for e in again.of_kind("resume") if e["action"] == "loaded"] == [4]
    assert again.result is not None
    assert again.result["params_sha256"] == fault_free.result["params_sha256"]  # type: ignore[index]
