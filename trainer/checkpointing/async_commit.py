"""An async save's second half: DCP's ``.metadata`` and the caller's commit, run on the
coordinator's commit thread while training goes on, and its outcome settled the same way on
every rank (a result means committed).

The ranks agree on a save in flight by name (:class:`SaveFlags`): every rank contributes its
share every step; summed over ranks (by the training loop's own all-reduce, beside the loss, or
by one small collective of the saver's), the same decision is taken on every rank: whether every
writer is done, whether one died, whether the coordinator's commit still runs and whether it
failed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpointing.errors import CheckpointCommitError, CheckpointStorageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveFlags:
    """One rank's share, or the sum over ranks (then each field counts ranks)."""

    not_done: int = 0  # the rank's writer has not finished the save in flight
    writer_dead: int = 0  # ... and its writer process is gone
    commit_running: int = 0  # the coordinator's commit of the finalized save still runs
    commit_failed: int = 0  # ... it ended, with an error

    def to_tensor(self) -> torch.Tensor:
        """Float (it rides in the loss's all-reduce), in field order."""
        return torch.tensor(astuple(self), dtype=torch.float32)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> SaveFlags:
        values = [round(float(v)) for v in t.reshape(-1).tolist()]
        if len(values) != len(fields(cls)):
            raise ValueError(f"save flags have {len(fields(cls))} values, got {len(values)}")
        return cls(*values)


@dataclass
class SaveResult:
    step: int
    directory: Path
    # Seconds the training thread spent on this save: ``save()`` plus any deferred hand-off.
    blocking_s: float
    # From ``save()`` until every rank's writer was done (the commit follows on its thread).
    total_s: float
    deferred_s: float = 0.0
    # On the coordinator, what the commit returned (the committed directory); None elsewhere.
    committed: Any = None


# The coordinator's commit of one save, run on the commit thread: built on the training thread
# from the finalized save, it must hold no process group (see ``trainer.gloo_release``).
CommitTask = Callable[[], Any]

CommitFor = Callable[[SaveResult], CommitTask]


def gather_write_results(
    writer: Any, dist_wrapper: Any, group: dist.ProcessGroup | None, step: int, directory: Path
) -> list[Any]:
    """DCP finalize's first half, every rank: every rank's write results, gathered on the
    coordinator; a rank's failed write fails every rank now, with the same error."""
    try:
        results: Any = writer.retrieve_write_results()
    except Exception as e:  # reported through the gather so every rank fails together
        results = e
    gathered: list[Any] = dist_wrapper.gather_object(results)
    outcome: list[Any] = [""]
    if dist_wrapper.is_coordinator:
        failures = [r for r in gathered if isinstance(r, BaseException)]
        if failures:
            outcome[0] = f"{len(failures)} rank(s) failed to write: {failures[0]}"
    dist.broadcast_object_list(outcome, group_src=dist_wrapper.coordinator_rank, group=group)
    if outcome[0]:
        raise CheckpointStorageError(
            f"checkpoint step {step} in {directory}: {outcome[0]}", step=step, directory=directory
        )
    return gathered


def write_metadata_then(
    writer: Any, metadata: Any, gathered: list[Any], task: CommitTask, *, step: int, directory: Path
) -> Any:
    """The commit thread: DCP finalize's second half (the coordinator writes ``.metadata``),
    then the caller's commit. A failed ``.metadata`` is the storage's failure, as is an
    ``OSError`` of the commit (a full disk)."""
    try:
        writer.finish(metadata, gathered)
    except Exception as e:
        raise CheckpointStorageError(
            f"writing DCP metadata failed: {e}", step=step, directory=directory
        ) from e
    return task()


class Committer:
    """The commit thread (started on the coordinator's first commit) and the one save in commit
    (``current``: every rank holds it and polls for its outcome; only the coordinator has the
    future)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.current: SaveResult | None = None
        self._coordinator = 0
        self._future: Future[Any] | None = None
        self._thread: ThreadPoolExecutor | None = None

    def flags(self) -> tuple[int, int]:
        """(running, failed): this rank's share of what every rank agrees on (coordinator only)."""
        future = self._future
        if future is None:
            return 0, 0
        finished = future.done()  # one look: running and failed must agree
        return (0 if finished else 1), (1 if finished and future.exception() is not None else 0)

    def start(self, result: SaveResult, coordinator_rank: int, task: CommitTask | None, *,
              writer: Any, metadata: Any, gathered: list[Any]) -> None:  # fmt: skip
        """Every rank holds the save; with ``task`` (the coordinator's) the thread runs it."""
        self.current, self._coordinator, self._future = result, coordinator_rank, None
        if task is None:
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="nvrx-commit")
        self._future = self._thread.submit(
            write_metadata_then,
            writer,
            metadata,
            gathered,
            task,
            step=result.step,
            directory=result.directory,
        )

    def _take(self) -> tuple[SaveResult | None, Future[Any] | None]:
        taken = self.current, self._future
        self.current, self._future = None, None
        return taken

    def settle(self, *, failed: bool, group: dist.ProcessGroup | None) -> SaveResult:
        """Every rank, once the coordinator's commit is over (the flags say so on every rank):
        its result, or the same error on every rank."""
        result, future = self._take()
        assert result is not None
        step, directory = result.step, result.directory
        if failed:
            error = future.exception() if future is not None else None
            message: list[Any] = [None]
            if error is not None:
                storage = isinstance(error, (OSError, CheckpointStorageError))
                message[0] = (storage, f"{type(error).__name__}: {error}")
            dist.broadcast_object_list(message, group_src=self._coordinator, group=group)
            storage, text = message[0]
            if storage:
                raise CheckpointStorageError(
                    f"checkpoint step {step} in {directory}: {text}", step=step, directory=directory
                ) from error
            if error is not None:
                raise error
            raise CheckpointCommitError(f"the coordinator could not commit step {step}: {text}")
        if future is not None:
            result.committed = future.result()
        return result

    def settle_quietly(self) -> None:
        """Fault paths (no collectives): let a running commit finish, and forget it; whether it
        committed is for the next resume to find on disk."""
        result, future = self._take()
        if result is None or future is None:
            return
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("commit of step %d not done after %s s", result.step, self.timeout_s)
        except Exception as e:
            log.warning("the commit of step %d failed: %s", result.step, e)

    def close(self) -> None:
        """Let a commit already running finish (a finished commit is not lost work)."""
        self.settle_quietly()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
