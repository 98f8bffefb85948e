"""Checkpoint manager: when to save, the commit, and resume with fallback.

Public ``resume`` / ``maybe_save`` / ``poll`` / ``finish`` own the guards; the async mechanics
live in :mod:`trainer.async_ckpt`, the layout and manifest in :mod:`trainer.manifest`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainer import __version__, manifest
from trainer.async_ckpt import AsyncCheckpointer, SaveResult
from trainer.config import ResumePolicy, TrainConfig
from trainer.events import EventLog
from trainer.workload import DataSource


class FatalError(Exception):
    """A failure no restart can fix (bad data, no valid checkpoint, config mismatch)."""


@dataclass
class Resumed:
    step: int  # 0 when starting fresh
    loss: float | None
    path: Path | None


class CheckpointManager:
    def __init__(
        self,
        cfg: TrainConfig,
        saver: AsyncCheckpointer,
        events: EventLog,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
    ) -> None:
        self.cfg = cfg
        self.saver = saver
        self.events = events
        # Rank 0, after each commit (step, committed directory): the loop's hooks.
        self.on_commit: Callable[[int, Path], None] = lambda step, path: None
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.fingerprint = cfg.fingerprint()
        self._inflight: dict[str, Any] = {}
        saver.bind(group, warmup_dir=manifest.checkpoints_dir(cfg.run_root) / ".writer-warmup")

    # -- resume --------------------------------------------------------------------------------
    def resume(self, model: nn.Module, optim: Optimizer, sampler: DataSource) -> Resumed:
        """All ranks. Rank 0 picks the newest valid checkpoint (emitting a ``resume`` event for
        every newer one it skips and why), everyone loads it, resharding if the world size
        changed."""
        decision: list[Any] = [None]
        if self.rank == 0:
            decision[0] = self._choose()
        dist.broadcast_object_list(decision, src=0, group=self.group)
        kind, payload = decision[0]
        if kind == "error":
            raise FatalError(payload)
        if kind == "fresh":
            return Resumed(0, None, None)
        step, path, info = payload
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)  # in place, resharding
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        try:
            sampler.check_state(info.get("data_loader", {}), step)
        except Exception as e:
            raise FatalError(str(e)) from e
        if self.rank == 0:
            self.events.emit(
                "resume",
                action="loaded",
                step=step,
                path=str(path),
                saved_world_size=info.get("world_size"),
                world_size=self.world_size,
                load_s=round(time.perf_counter() - t0, 4),
            )
        return Resumed(step, info.get("loss"), Path(path))

    def _choose(self) -> tuple[str, Any]:
        root = self.cfg.run_root
        if self.cfg.resume == ResumePolicy.FRESH and manifest.committed_steps(root):
            ckdir = manifest.checkpoints_dir(root)
            archived = ckdir.with_name(f"checkpoints.before-fresh-{int(time.time())}")
            shutil.move(str(ckdir), archived)  # explicit fresh start: keep, never delete
            self.events.emit("resume", action="fresh", archived=str(archived))
        removed = manifest.remove_partials(root)
        if removed:
            self.events.emit("resume", action="removed-partial", dirs=removed)
        try:
            choice = manifest.choose_resume(
                root,
                fingerprint=self.fingerprint,
                verify_digests=self.cfg.verify_checkpoint_on_resume,
            )
        except manifest.NoValidCheckpoint as e:
            self.events.emit("resume", action="failed", reason=str(e))
            return ("error", str(e))
        for step, why in choice.rejected:
            self.events.emit("resume", action="skipped", step=step, reason=why)
        if choice.step is None:
            return ("fresh", None)
        return ("load", (choice.step, str(choice.path), choice.manifest))

    # -- saving --------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.cfg.ckpt_interval == 0 or step == self.cfg.steps

    def maybe_save(
        self, step: int, model: nn.Module, optim: Optimizer, sampler: DataSource, loss: float
    ) -> float | None:
        """Every rank after finishing ``step``. Returns seconds training was blocked, if saved."""
        if not self.due(step):
            return None
        self.poll(block=True)  # the previous save is committed before the next starts
        partial = manifest.partial_path(self.cfg.run_root, step)
        if self.rank == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        dist.barrier(group=self.group)
        model_sd, optim_sd = get_state_dict(model, optim)
        blocking = self.saver.save({"model": model_sd, "optim": optim_sd}, partial, step)
        self._inflight = {
            "loss": loss,
            "data_loader": sampler.state_at(step).to_dict(),
        }
        return blocking

    def poll(self, *, block: bool = False) -> SaveResult | None:
        result = self.saver.poll(block=block)
        if result is not None:
            self._commit(result)
        return result

    def finish(self) -> None:
        self.poll(block=True)

    def _commit(self, result: SaveResult) -> None:
        if self.rank != 0:
            return
        t0 = time.perf_counter()
        info = {
            "config_hash": self.fingerprint,
            "trainer_version": __version__,
            # What produced it, whole: validation and export rebuild the model from this.
            "workload": self.cfg.workload_record(),
            "config": self.cfg.to_dict(),
            "rng": {"seed": self.cfg.seed, "scheme": "reseeded per (seed, step, rank)"},
            **self._inflight,
        }
        path = manifest.commit(
            self.cfg.run_root,
            result.step,
            world_size=self.world_size,
            info=info,
            keep_last=self.cfg.keep_last,
        )
        self.events.emit(
            "checkpoint",
            step=result.step,
            path=str(path),
            blocking_s=round(result.blocking_s, 4),
            total_s=round(result.total_s + time.perf_counter() - t0, 4),
        )
        self.on_commit(result.step, path)
