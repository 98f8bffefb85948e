"""How often a memory save runs (``checkpoint.memory.interval: auto``, issue 40 item 4): the
pure choice as a table, the cadence over an incarnation, and a real checkpoint manager whose
memory saves are made slower choosing a larger interval and saying so in its event."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import ckpt, free_port, make_config, read_events
from trainer.checkpointing.async_save import AsyncCheckpointer
from trainer.checkpointing.config import MemoryConfig
from trainer.checkpointing.manager import CheckpointManager
from trainer.checkpointing.memory_cadence import SAMPLE, MemoryCadence, choose
from trainer.checkpointing.node_copy import NodeMemory
from trainer.config import ConfigError
from trainer.events import EventLog


@pytest.mark.parametrize(
    ("step_s", "blocking_s", "background_s", "durable", "interval", "clamped"),
    [
        (0.035, 0.001, 0.003, 5, 5, "durable"),  # gpt-tiny: 4 ms a save, 0.7 ms of budget
        (0.035, 0.0002, 0.0003, 50, 1, ""),  # a save far below the budget: every step
        (40.0, 0.3, 1.2, 100, 2, ""),  # gpt-100m here: 1.5 s against 0.8 s of budget
        (40.0, 0.3, 2.0, 100, 3, ""),  # the same, a slower save: a larger interval
        (2.0, 0.5, 0.0, 100, 13, ""),  # blocking alone counts too
        (0.0, 0.1, 0.1, 7, 7, "durable"),  # no step time known: the durable interval
    ],
)
def test_the_smallest_interval_within_the_budget(
    step_s, blocking_s, background_s, durable, interval, clamped
):
    c = choose(step_s, blocking_s, background_s, budget=0.02, durable_interval=durable)
    assert (c.interval, c.clamped) == (interval, clamped)
    assert c.describe().startswith(f"every {interval} step(s): a save costs")


def test_the_cadence_measures_every_step_then_keeps_its_choice():
    cadence = MemoryCadence(MemoryConfig(), durable_interval=10, first_step=6)
    assert cadence.decision_step == 6 + SAMPLE
    assert [s for s in range(6, 10) if cadence.due(s, 100)] == [6, 7, 8, 9]  # measuring
    for _ in range(SAMPLE + 1):
        cadence.observe(step_s=1.0, blocking_s=0.05, background_s=0.05)
    chosen = cadence.decide(cadence.offer())
    assert chosen.interval == 5 and cadence.decision_step is None
    assert [s for s in range(10, 21) if cadence.due(s, 100)] == [10, 15, 20]
    assert not cadence.due(100, 100)  # nothing resumes after the last step
    pinned = MemoryCadence(MemoryConfig(interval=3), durable_interval=10, first_step=1)
    assert pinned.decision_step is None and [s for s in range(1, 10) if pinned.due(s, 99)] == [
        3,
        6,
        9,
    ]
    off = MemoryCadence(MemoryConfig(interval=0), durable_interval=10, first_step=1)
    assert not any(off.due(s, 99) for s in range(1, 10))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"interval": "often"}, "checkpoint.memory.interval"),
        ({"budget": 0}, "checkpoint.memory.budget"),
    ],
)
def test_bad_memory_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        MemoryConfig(**kwargs)
    assert err.value.field == field


class SlowNode(NodeMemory):
    """Node memory whose saves take ``delay_s`` longer on the training thread (a bigger state,
    a slower memory): everything else real."""

    delay_s = 0.0

    def save(self, *args: Any, **kwargs: Any) -> float:
        time.sleep(self.delay_s)
        return super().save(*args, **kwargs)


class _Sampler:
    vocab_size = 16

    def state_at(self, step: int) -> Any:
        class _S:
            def to_dict(self) -> dict[str, int]:
                return {"step": step}

        return _S()

    def check_state(self, state: dict[str, Any], step: int) -> None:
        pass


@pytest.fixture
def group() -> Iterator[Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _run(group: Any, delay_s: float, root: Path, shm: Path, dataset: Path) -> tuple[dict, list]:
    """A real manager, node memory and all-reduce (one rank), 50 ms steps: its
    ``memory_interval`` event and which steps had a memory save."""
    checkpoint = ckpt(40, memory="auto")
    cfg = make_config(root, dataset, steps=60, checkpoint=checkpoint)
    cfg.run_root.mkdir(parents=True)
    node = SlowNode(shm, rank=0, world_size=1, fingerprint=cfg.fingerprint(), epoch=None)
    node.delay_s = delay_s
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    saver = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    saved = []
    try:
        manager = CheckpointManager(
            cfg, saver, EventLog(cfg.run_root), rank=0, world_size=1, group=group, node=node
        )
        sampler: Any = _Sampler()
        assert manager.resume(model, optim, sampler).step == 0
        for step in range(1, 1 + SAMPLE + 12):
            model(torch.ones(1, 64)).sum().backward()
            optim.step()
            saved.append(manager.memory_due(step))
            manager.maybe_save(step, model, optim, sampler, 1.0, step_s=0.05)
        manager.finish()
    finally:
        with contextlib.suppress(Exception):
            node.close()
        saver.close()
    [chosen] = [e for e in read_events(cfg.run_root) if e["kind"] == "memory_interval"]
    return chosen, saved


def test_a_slower_memory_save_gets_a_larger_interval(group, dataset: Path, tmp_path: Path):
    """The same run twice, the second's memory saves made 50 ms slower: it measures that,
    chooses a larger interval, and its event says from which numbers."""
    shm = Path("/dev/shm") / f"nvrx-test-cadence-{os.getpid()}"
    try:
        fast, fast_saved = _run(group, 0.0, tmp_path / "fast", shm / "fast", dataset)
        slow, slow_saved = _run(group, 0.05, tmp_path / "slow", shm / "slow", dataset)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    for chosen, saved in ((fast, fast_saved), (slow, slow_saved)):
        assert chosen["step"] == 1 + SAMPLE and chosen["samples"] >= SAMPLE, chosen
        assert saved[: SAMPLE + 1] == [True] * (SAMPLE + 1)  # measuring: every step
        after = saved[SAMPLE + 1 :]
        assert sum(after) <= len(after) // chosen["interval"] + 1, (saved, chosen)
    assert slow["blocking_s"] >= 0.05 > fast["blocking_s"], (fast, slow)
    assert slow["interval"] > fast["interval"], (fast, slow)
    assert slow["interval"] == 40 and "capped at the durable interval" in slow["detail"], slow
    assert "a save costs" in fast["detail"] and "a budget of 2% of a step" in fast["detail"]
