"""The committed checkpoint, restored: the tier every other one falls back to, and the only one
a new attempt, a changed world or an explicit ``resume=fresh`` reads.

Rank 0 settles what a crash left and lists the checkpoints that pass every check but their
files' digests (:class:`Candidates`, broadcast); every rank digests its share of the newest
one's files (a resume reads the checkpoint once, in parallel); the first that every share
vouches for is loaded by everyone with torch DCP, resharding if the world size changed. Rank 0
emits a ``resume`` event for every newer one skipped and why.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from pydantic import Field
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainer import untrusted
from trainer.checkpointing import coordination, tiers
from trainer.checkpointing.commit import recover
from trainer.checkpointing.config import ResumePolicy
from trainer.checkpointing.errors import CheckpointError
from trainer.checkpointing.layout import checkpoints_dir, step_of
from trainer.checkpointing.manifest import (
    MANIFEST_MAX_BYTES,
    Manifest,
    digest_share,
    parse_manifest,
)
from trainer.checkpointing.restoring import FatalError, RestoreContext, Resumed
from trainer.checkpointing.resume import no_valid_checkpoint, resume_candidates
from trainer.event_types import Resume
from trainer.rundir import RunDir
from trainer.workload import DataSource

SOURCE = "durable"


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint that passed every check but its files' digests."""

    step: int
    path: str
    manifest: Manifest


@dataclass(frozen=True)
class Candidates:
    """Rank 0's decision. Newest first; ``rejected``: (step, why) of those that failed a check
    already; none ``found`` (committed directories seen): start at step 0. ``failed``: nothing
    can be resumed from, and starting over would lose what was recorded."""

    ok: tuple[Candidate, ...] = ()
    rejected: tuple[tuple[int, str], ...] = ()
    found: int = 0
    failed: str = ""


class _Sent(coordination.Message):
    step: int = Field(ge=0)
    path: str = Field(max_length=4096)
    manifest: dict[str, Any]  # as read: parsed again on receipt, as from the file


class Decision(coordination.Message):
    """:class:`Candidates` as rank 0 broadcasts them (typed JSON, not a pickle: the
    ``coordination`` module); every rank parses each manifest again on receipt."""

    ok: tuple[_Sent, ...] = Field(max_length=1024)
    rejected: tuple[tuple[int, str], ...] = Field(max_length=1024)
    found: int = Field(ge=0)
    failed: str = Field(max_length=coordination.REASON_LIMIT)

    @classmethod
    def of(cls, made: Candidates) -> Decision:
        return cls(
            ok=tuple(_Sent(step=c.step, path=c.path, manifest=c.manifest.raw) for c in made.ok),
            rejected=tuple((s, coordination.cut(why) or "") for s, why in made.rejected),
            found=made.found,
            failed=coordination.cut(made.failed) or "",
        )

    def candidates(self) -> Candidates:
        try:
            ok = tuple(
                Candidate(c.step, c.path, parse_manifest(c.path, c.manifest)) for c in self.ok
            )
        except CheckpointError as e:
            raise coordination.CoordinationError(
                f"rank 0 sent a manifest that is not one: {e}"
            ) from e
        return Candidates(ok, self.rejected, self.found, self.failed)


# Every candidate's manifest (each read at most MANIFEST_MAX_BYTES), a few of them.
DECISION_LIMIT = 4 * MANIFEST_MAX_BYTES


@dataclass(frozen=True)
class DurableRestorer:
    ctx: RestoreContext
    fingerprint: str

    def restore(
        self, model: nn.Module, optim: Optimizer, sampler: DataSource, choice: tiers.Choice
    ) -> Resumed:
        """All ranks: the newest committed checkpoint every rank's share vouches for, loaded;
        step 0 where there is none and none was recorded; :class:`FatalError` otherwise."""
        mine = Decision.of(self.decide()) if self.ctx.rank == 0 else None
        made = coordination.broadcast(
            mine, Decision, 0, self.ctx.group, limit=DECISION_LIMIT
        ).candidates()
        if made.failed:
            raise FatalError(made.failed)
        if not made.found:
            return Resumed(0, None, None)
        return self._load(model, optim, sampler, self._verify(made))

    def decide(self) -> Candidates:
        """Rank 0: settle what a crash left and list what may be resumed from."""
        cfg = self.ctx.cfg
        root = cfg.run_root
        if cfg.checkpoint.resume == ResumePolicy.FRESH:
            self._start_fresh()
        verify = cfg.checkpoint.durable.verify_on_resume
        with self.ctx.fence.hold("settle what a crash left in the checkpoints"):
            settled = recover(root, fingerprint=self.fingerprint, verify_digests=verify)
        for r in settled:
            self.ctx.events.emit(Resume(action=r.action, dir=r.dir, step=r.step, reason=r.reason))
        ok, rejected, found = resume_candidates(root, fingerprint=self.fingerprint)
        recorded = None if found else RunDir(root).recorded_commit()
        if recorded is not None:
            ckdir = checkpoints_dir(root)
            why = (
                f"run {root}: its events.jsonl records committed checkpoints up to step "
                f"{recorded}, but {ckdir} holds no checkpoint (missing or emptied). Refusing to "
                f"start from step 0: restore {ckdir}, or start over explicitly with resume=fresh."
            )
            self.ctx.events.emit(Resume(action="failed", reason=why, recorded_step=recorded))
            return Candidates(failed=why)
        return Candidates(tuple(Candidate(s, str(p), m) for s, p, m in ok), tuple(rejected), found)

    def _verify(self, made: Candidates) -> Candidate:
        """All ranks, newest candidate first: each rank digests its share of the files
        (:func:`digest_share`) and the ranks agree; the first candidate every share vouches for
        is chosen. Rank 0 records every newer checkpoint skipped, and why."""
        ctx = self.ctx
        rejected = list(made.rejected)
        for c in made.ok:
            mine = None
            if ctx.cfg.checkpoint.durable.verify_on_resume:
                mine = digest_share(Path(c.path), c.manifest, index=ctx.rank, count=ctx.world_size)
            sent = coordination.Outcome(failed=coordination.cut(mine) or "")
            reasons = coordination.gather(sent, ctx.group, limit=coordination.OUTCOME_LIMIT)
            bad = next((r.failed for r in reasons if r.failed), None)
            if bad is None:
                if ctx.rank == 0:
                    for s, why in sorted(((s, w) for s, w in rejected if s > c.step), reverse=True):
                        ctx.events.emit(Resume(action="skipped", step=s, reason=why))
                return c
            rejected.append((c.step, bad))
        why = no_valid_checkpoint(ctx.cfg.run_root, made.found, rejected)
        if ctx.rank == 0:
            ctx.events.emit(Resume(action="failed", reason=why))
        raise FatalError(why)

    def _load(
        self, model: nn.Module, optim: Optimizer, sampler: DataSource, c: Candidate
    ) -> Resumed:
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, process_group=self.ctx.group, **untrusted.dcp_load_args(c.path))
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        try:
            sampler.check_state(c.manifest.data_loader, c.step)
        except Exception as e:
            raise FatalError(str(e)) from e
        nbytes = sum(e.bytes for e in c.manifest.files)  # what the load read
        self.ctx.loaded(
            c.step, SOURCE, t0, nbytes, path=c.path, saved_world_size=c.manifest.world_size
        )
        return Resumed(c.step, c.manifest.loss, Path(c.path))

    def _start_fresh(self) -> None:
        """Explicit fresh start: archive (never delete) what is there; the ``fresh`` event also
        tells later resumes that commits recorded before it are not expected on disk."""
        root = self.ctx.cfg.run_root
        ckdir = checkpoints_dir(root)
        archived = None
        # Only if it holds steps: the writer's warm-up alone is no checkpoint (if the move
        # catches the warm-up mid-write, that failure is only logged).
        with self.ctx.fence.hold("start fresh"):
            if ckdir.is_dir() and any(step_of(p) is not None for p in ckdir.iterdir()):
                archived = ckdir.with_name(f"checkpoints.before-fresh-{int(time.time())}")
                shutil.move(str(ckdir), archived)
            RunDir(root).record_commit(None)
        self.ctx.events.emit(Resume(action="fresh", archived=archived and str(archived)))
