"""Checkpointing (arch §3), one concept per module (docs/layout.md lists them). This package's
names are the on-disk side's contract for the rest of the code (tasks/, flows/, tests): where
checkpoints are, their manifest, the commit and its recovery, the resume choice, the errors.
They import without torch (tasks read checkpoints in light processes); what runs in the
training process (torch, NVRx) is imported by module, not here.
"""

from __future__ import annotations

from trainer.checkpointing.commit import Recovery, commit, install, prune, recover
from trainer.checkpointing.errors import (
    CheckpointError,
    CheckpointStorageError,
    CheckpointTimeout,
    CheckpointWorkerDied,
    NoValidCheckpoint,
)
from trainer.checkpointing.layout import (
    DCP_METADATA,
    LATEST,
    checkpoints_dir,
    committed_path,
    committed_steps,
    fsync_path,
    is_safe_name,
    named,
    partial_path,
    read_latest,
    superseded_path,
)
from trainer.checkpointing.manifest import (
    DIGEST,
    FORMAT,
    FORMAT_V1,
    MANIFEST,
    MANIFEST_MAX_BYTES,
    WorkloadRef,
    as_sha256,
    check_entry,
    collect_file_entries,
    digest_of,
    digest_share,
    read_manifest,
    verify_checkpoint,
    workload_of,
    write_digest_sidecar,
)
from trainer.checkpointing.resume import candidates, choose_resume, resume_candidates

__all__ = [
    "DCP_METADATA",
    "DIGEST",
    "FORMAT",
    "FORMAT_V1",
    "LATEST",
    "MANIFEST",
    "MANIFEST_MAX_BYTES",
    "CheckpointError",
    "CheckpointStorageError",
    "CheckpointTimeout",
    "CheckpointWorkerDied",
    "NoValidCheckpoint",
    "Recovery",
    "WorkloadRef",
    "as_sha256",
    "candidates",
    "check_entry",
    "checkpoints_dir",
    "choose_resume",
    "collect_file_entries",
    "commit",
    "committed_path",
    "committed_steps",
    "digest_of",
    "digest_share",
    "fsync_path",
    "install",
    "is_safe_name",
    "named",
    "partial_path",
    "prune",
    "read_latest",
    "read_manifest",
    "recover",
    "resume_candidates",
    "superseded_path",
    "verify_checkpoint",
    "workload_of",
    "write_digest_sidecar",
]
