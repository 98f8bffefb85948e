"""The in-process layer (trainer.inprocess_layer): NVRx's Wrapper and its finalize."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from nvidia_resiliency_ext.inprocess.exception import RestartAbort

from trainer.errors import ConfigError
from trainer.inprocess_layer import Finalize, InProcessLayer
from trainer.rundir import RunDir


def _ctx(tmp_path: Path, calls: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(run_root=tmp_path),
        started=time.time(),
        heartbeat=SimpleNamespace(end_sections=lambda: calls.append("end_sections")),
        saver=SimpleNamespace(
            abandon=lambda: calls.append("abandon"), drop_group=lambda: calls.append("drop")
        ),
        placement=SimpleNamespace(backend="gloo"),
    )


def test_finalize_ends_sections_then_drops_the_save(tmp_path: Path):
    calls: list[str] = []
    state = object()
    assert Finalize(_ctx(tmp_path, calls))(state) is state  # type: ignore[arg-type]
    assert calls == ["end_sections", "abandon"]


def test_a_lost_node_hands_over_before_anything_is_undone(tmp_path: Path):
    """The node-loss check is the first step, so a restart the full-world Wrapper would refuse
    drains nothing."""
    calls: list[str] = []
    ctx = _ctx(tmp_path, calls)
    RunDir(tmp_path).write_node_lost(node=1, t=ctx.started + 1)
    with pytest.raises(RestartAbort, match="in-job layer"):
        Finalize(ctx)(object())  # type: ignore[arg-type]
    assert calls == []


def test_a_terminal_error_escapes_and_a_fault_releases_gloo(tmp_path: Path):
    calls: list[str] = []

    def bad_config(ctx, call_wrapper):
        raise ConfigError("steps", "must be positive")

    layer = InProcessLayer(_ctx(tmp_path, calls), bad_config, rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(RestartAbort) as e:
        layer.attempt()
    assert isinstance(e.value.__cause__, ConfigError) and calls == []

    def fault(ctx, call_wrapper):
        raise RuntimeError("a rank's fault")

    layer = InProcessLayer(_ctx(tmp_path, calls), fault, rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        layer.attempt()
    assert calls == ["drop"]  # the save's group dropped, the process groups released
