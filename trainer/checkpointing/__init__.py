"""Checkpointing (arch §3), one concept per module (docs/layout.md lists them). This package's
names are the on-disk side's contract for the rest of the code (tasks/, flows/, tests): where
checkpoints are, their manifest, the commit and its recovery, the resume choice, the errors.
Each is imported ``as`` itself (an explicit re-export). They import without torch (tasks read
checkpoints in light processes); what runs in the training process is imported by module.
"""

from __future__ import annotations

from trainer.checkpointing.commit import Recovery as Recovery
from trainer.checkpointing.commit import commit as commit
from trainer.checkpointing.commit import install as install
from trainer.checkpointing.commit import prune as prune
from trainer.checkpointing.commit import recover as recover
from trainer.checkpointing.errors import CheckpointError as CheckpointError
from trainer.checkpointing.errors import CheckpointStorageError as CheckpointStorageError
from trainer.checkpointing.errors import CheckpointTimeout as CheckpointTimeout
from trainer.checkpointing.errors import CheckpointWorkerDied as CheckpointWorkerDied
from trainer.checkpointing.errors import NoValidCheckpoint as NoValidCheckpoint
from trainer.checkpointing.layout import DCP_METADATA as DCP_METADATA
from trainer.checkpointing.layout import LATEST as LATEST
from trainer.checkpointing.layout import checkpoints_dir as checkpoints_dir
from trainer.checkpointing.layout import committed_path as committed_path
from trainer.checkpointing.layout import committed_steps as committed_steps
from trainer.checkpointing.layout import is_safe_name as is_safe_name
from trainer.checkpointing.layout import named as named
from trainer.checkpointing.layout import partial_path as partial_path
from trainer.checkpointing.layout import read_latest as read_latest
from trainer.checkpointing.layout import superseded_path as superseded_path
from trainer.checkpointing.manifest import DIGEST as DIGEST
from trainer.checkpointing.manifest import FORMAT as FORMAT
from trainer.checkpointing.manifest import FORMAT_V1 as FORMAT_V1
from trainer.checkpointing.manifest import MANIFEST as MANIFEST
from trainer.checkpointing.manifest import MANIFEST_MAX_BYTES as MANIFEST_MAX_BYTES
from trainer.checkpointing.manifest import FileEntry as FileEntry
from trainer.checkpointing.manifest import Manifest as Manifest
from trainer.checkpointing.manifest import WorkloadRef as WorkloadRef
from trainer.checkpointing.manifest import as_sha256 as as_sha256
from trainer.checkpointing.manifest import check_entry as check_entry
from trainer.checkpointing.manifest import collect_file_entries as collect_file_entries
from trainer.checkpointing.manifest import digest_share as digest_share
from trainer.checkpointing.manifest import parse_manifest as parse_manifest
from trainer.checkpointing.manifest import read_manifest as read_manifest
from trainer.checkpointing.manifest import verify_checkpoint as verify_checkpoint
from trainer.checkpointing.manifest import write_digest_sidecar as write_digest_sidecar
from trainer.checkpointing.resume import candidates as candidates
from trainer.checkpointing.resume import choose_resume as choose_resume
from trainer.checkpointing.resume import resume_candidates as resume_candidates
from trainer.run_files import fsync_path as fsync_path
