"""What checkpointing raises: two families, each caught whole or by kind. On disk: a
checkpoint that does not verify (:class:`CheckpointError`), none valid to resume from. While
saving: a writer that died or timed out, a commit or the storage that failed
(:class:`CheckpointWriteError`)."""

from __future__ import annotations

from pathlib import Path

from trainer.errors import TrainerError


class CheckpointError(TrainerError, RuntimeError):
    pass


class NoValidCheckpoint(CheckpointError):
    """Checkpoints exist but none verifies: refusing to silently start from step 0."""


class CheckpointWriteError(TrainerError, RuntimeError):
    pass


class CheckpointWorkerDied(CheckpointWriteError):
    """The async writer process died: the save in flight is lost (the previous commit is not)."""


class CheckpointTimeout(CheckpointWriteError):
    pass


class CheckpointCommitError(CheckpointWriteError):
    """The coordinator's commit of a written save failed for a reason that is not the storage's
    (a bug, a refused manifest): every rank raises it; the last commit stays valid."""


class CheckpointStorageError(CheckpointWriteError):
    """A rank's write (or the DCP ``.metadata``) failed, e.g. ENOSPC: the storage refused this
    save. Raised on every rank; the save in flight is lost, the last commit is not."""

    def __init__(self, message: str, *, step: int, directory: Path) -> None:
        super().__init__(message)
        self.step = step
        self.directory = directory
