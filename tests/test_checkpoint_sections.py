"""Which in-job section a checkpoint wait runs in (real gloo group, real writer process).

A due save or the final ``finish`` may wait seconds: for the save before it, or for a writer that
is still starting (it starts after the first step, so a resume a few steps before the end meets
one). That wait must run in the ``checkpoint`` section, never under the tight ``step`` section
that ft_launcher would take it for a hang."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port, make_config
from trainer import checkpointing
from trainer.checkpointing.async_save import AsyncCheckpointer
from trainer.checkpointing.manager import CheckpointManager
from trainer.events import EventLog
from trainer.layer_config import CHECKPOINT_SECTION


class RecordedSections:
    """The ``Sections`` protocol, recording which sections are open (ft_launcher's own client
    needs a launcher)."""

    def __init__(self, run_root: Path) -> None:
        self.open: list[str] = []
        self.run_root = run_root
        # Each section as it closed: its name and the steps committed by then.
        self.closed: list[tuple[str, list[int]]] = []

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.open.append(name)
        try:
            yield
        finally:
            self.open.remove(name)
            self.closed.append((name, checkpointing.committed_steps(self.run_root)))


@pytest.fixture
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def test_the_final_wait_runs_in_the_checkpoint_section(group, dataset: Path, tmp_path: Path):
    cfg = make_config(tmp_path / "run", dataset)
    cfg.run_root.mkdir(parents=True)
    sections = RecordedSections(cfg.run_root)
    saver = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    try:
        ckpt = CheckpointManager(
            cfg, saver, EventLog(cfg.run_root), rank=0, world_size=1, group=group, sections=sections
        )
        partial = checkpointing.partial_path(cfg.run_root, cfg.steps)
        partial.mkdir(parents=True)
        # A fresh writer: the save is handed to it while it is still starting, as after a
        # resume close to the end.
        saver.save({"w": torch.arange(4096.0)}, partial, cfg.steps)
        ckpt.finish()
        # The whole wait, the commit's included, ran inside the checkpoint section (the poll
        # opens it again, nested, where it waits): the step was committed before the outer
        # one closed, and no other section was opened.
        assert sections.closed[-1] == (CHECKPOINT_SECTION, [cfg.steps]), sections.closed
        assert {name for name, _ in sections.closed} == {CHECKPOINT_SECTION}, sections.closed
    finally:
        saver.close()
