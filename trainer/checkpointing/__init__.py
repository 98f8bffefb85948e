"""Checkpointing (arch §3), one concept per module; this package's names are its contract
for the rest of the code (tasks/, flows/, tests), which never reaches into a module.

On disk (read and written by any process; imported here):

- :mod:`~trainer.checkpointing.layout`: where checkpoints are and what their names say;
- :mod:`~trainer.checkpointing.durable`: writes, renames and deletes a kill cannot half-do;
- :mod:`~trainer.checkpointing.manifest`: the manifest's format, and verifying a directory;
- :mod:`~trainer.checkpointing.commit`: the commit protocol and pruning;
- :mod:`~trainer.checkpointing.recovery`: settling what a crashed commit left;
- :mod:`~trainer.checkpointing.resume`: choosing the checkpoint to resume from;
- :mod:`~trainer.checkpointing.errors`: what all of them raise.

In the training process (torch, NVRx; imported by module, not here):

- :mod:`~trainer.checkpointing.staging`: the snapshot of the state into reusable CPU buffers;
- :mod:`~trainer.checkpointing.writer`: NVRx's persistent writer process, its lifecycle and
  what runs inside it;
- :mod:`~trainer.checkpointing.shard_digest`: a shard's digest, taken as the writer streams its
  bytes to the file;
- :mod:`~trainer.checkpointing.flags`: the cross-rank agreement on a save in flight, by name;
- :mod:`~trainer.checkpointing.async_save`: the asynchronous save (stage, plan, hand off,
  finalize);
- :mod:`~trainer.checkpointing.async_commit`: its second half, the commit thread and the outcome
  every rank settles on;
- :mod:`~trainer.checkpointing.process_copy`: the last save's snapshot, which an in-process
  restart reloads with no read;
- :mod:`~trainer.checkpointing.node_copy`: the memory saves in node memory and their peer copies
  (the store); :mod:`~trainer.checkpointing.node_format`: a copy's bytes and header, and its
  restore; :mod:`~trainer.checkpointing.node_transport`: one copy between two ranks;
- :mod:`~trainer.checkpointing.node_device`: how a memory save's bytes leave the device (CUDA:
  pinned buffers, a side stream, an event the sealing thread waits on);
- :mod:`~trainer.checkpointing.live_state`: the state dicts the memory saves copy from, kept
  while their structure holds;
- :mod:`~trainer.checkpointing.tiers`: which tier a resume reads;
- :mod:`~trainer.checkpointing.manager`: when to save, and the resume, for the training loop.
"""

from __future__ import annotations

from trainer.checkpointing.commit import (
    PRUNE_FULL_DIGEST_MAX_BYTES,
    Pruned,
    commit,
    install,
    prune,
    repair_latest,
)
from trainer.checkpointing.durable import (
    delete_dir,
    durable_rename,
    fsync_path,
    write_atomic,
)
from trainer.checkpointing.errors import (
    CheckpointCommitError,
    CheckpointError,
    CheckpointStorageError,
    CheckpointTimeout,
    CheckpointWorkerDied,
    CheckpointWriteError,
    NoValidCheckpoint,
)
from trainer.checkpointing.layout import (
    DCP_METADATA,
    DELETING_SUFFIX,
    LATEST,
    PARTIAL_SUFFIX,
    STEP_DIR_RE,
    SUPERSEDED_SUFFIX,
    checkpoints_dir,
    committed_path,
    committed_steps,
    is_safe_name,
    named,
    partial_path,
    read_latest,
    step_dirname,
    step_of,
    superseded_path,
)
from trainer.checkpointing.manifest import (
    DIGEST,
    DIGEST_SIDECAR,
    FORMAT,
    FORMAT_V1,
    MANIFEST,
    MANIFEST_MAX_BYTES,
    ManifestCheck,
    WorkloadRef,
    as_sha256,
    check_entry,
    collect_file_entries,
    digest_of,
    digest_share,
    drop_bookkeeping,
    is_bookkeeping,
    listed_bytes,
    read_manifest,
    verify_checkpoint,
    workload_of,
    write_digest_sidecar,
)
from trainer.checkpointing.recovery import (
    Recovery,
    recover,
)
from trainer.checkpointing.resume import (
    ResumeChoice,
    candidates,
    choose_resume,
    no_valid_checkpoint,
    resume_candidates,
)

__all__ = [
    "DCP_METADATA",
    "DELETING_SUFFIX",
    "DIGEST",
    "DIGEST_SIDECAR",
    "FORMAT",
    "FORMAT_V1",
    "LATEST",
    "MANIFEST",
    "MANIFEST_MAX_BYTES",
    "PARTIAL_SUFFIX",
    "PRUNE_FULL_DIGEST_MAX_BYTES",
    "STEP_DIR_RE",
    "SUPERSEDED_SUFFIX",
    "CheckpointCommitError",
    "CheckpointError",
    "CheckpointStorageError",
    "CheckpointTimeout",
    "CheckpointWorkerDied",
    "CheckpointWriteError",
    "ManifestCheck",
    "NoValidCheckpoint",
    "Pruned",
    "Recovery",
    "ResumeChoice",
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
    "delete_dir",
    "digest_of",
    "digest_share",
    "drop_bookkeeping",
    "durable_rename",
    "fsync_path",
    "install",
    "is_bookkeeping",
    "is_safe_name",
    "listed_bytes",
    "named",
    "no_valid_checkpoint",
    "partial_path",
    "prune",
    "read_latest",
    "read_manifest",
    "recover",
    "repair_latest",
    "resume_candidates",
    "step_dirname",
    "step_of",
    "superseded_path",
    "verify_checkpoint",
    "workload_of",
    "write_atomic",
    "write_digest_sidecar",
]
