"""GPUs for the local backend's simulated nodes (issue 27): each node its own devices, or a
refusal naming the fix; tested without a GPU, as pure functions of the counts, and on the
launch path with CUDA faked as present."""

from __future__ import annotations

import pytest

from tasks.backends.local_devices import DeviceSplitError, split_devices, visible_gpus
from trainer.config import Device


@pytest.mark.parametrize(
    ("device", "gpus", "nodes", "nproc", "split"),
    [
        # Two nodes of 2 ranks on 4 GPUs: disjoint, so no two ranks share cuda:0.
        (Device.AUTO, ["0", "1", "2", "3"], 2, 2, {0: "0,1", 1: "2,3"}),
        (Device.CUDA, ["0", "1", "2", "3", "4"], 2, 2, {0: "0,1", 1: "2,3"}),
        # The orchestrator's own CUDA_VISIBLE_DEVICES is what is handed out (ids or UUIDs).
        (Device.AUTO, ["GPU-a", "GPU-b"], 2, 1, {0: "GPU-a", 1: "GPU-b"}),
        # CPU workers: nothing to split.
        (Device.AUTO, [], 2, 1, None),
        (Device.CPU, ["0", "1"], 4, 1, None),
    ],
)
def test_each_simulated_node_gets_its_own_gpus(device, gpus, nodes, nproc, split):
    assert split_devices(device, gpus, nodes=nodes, nproc_per_node=nproc) == split


@pytest.mark.parametrize(
    ("device", "gpus", "nodes", "nproc"),
    [(Device.AUTO, ["0"], 2, 1), (Device.CUDA, [], 1, 1), (Device.AUTO, ["0", "1", "2"], 2, 2)],
)
def test_too_few_gpus_are_refused_naming_the_fix(device, gpus, nodes, nproc):
    with pytest.raises(DeviceSplitError) as err:
        split_devices(device, gpus, nodes=nodes, nproc_per_node=nproc)
    text = str(err.value)
    assert f"need {nodes * nproc} GPU(s)" in text and f"this machine has {len(gpus)}" in text
    assert "CUDA_VISIBLE_DEVICES=" in text and "eks backend" in text


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus(None, 3) == ["0", "1", "2"]
    assert visible_gpus("2, 3", 8) == ["2", "3"]
    assert visible_gpus("", 8) == []  # hidden: CPU


def test_the_local_launch_refuses_before_any_process_starts(dataset, tmp_path, monkeypatch):
    """One GPU (the count faked: this machine has none) for two simulated nodes: the launch
    raises before any node starts (no node log written)."""
    from tasks.backends import local, local_devices
    from tasks.backends.base import LaunchRequest
    from tests.helpers import make_config

    monkeypatch.setattr(local_devices, "cuda_device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = make_config(tmp_path / "run", dataset, steps=2)
    request = LaunchRequest(run_id="gpu", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1)
    with pytest.raises(DeviceSplitError, match="need 2 GPU"):
        local.LocalBackend().launch(request)
    assert not list((tmp_path / "run").glob("logs/attempt1-node*.log"))


def test_a_launch_failing_part_way_leaves_no_process(dataset, tmp_path, monkeypatch):
    """An elastic launch (its rendezvous store apart, its own network where allowed) whose
    second node cannot start: the first node, the store and the namespace holder are ended
    before the error reaches the caller."""
    from tasks.backends import local
    from tasks.backends.base import LaunchRequest
    from tasks.backends.local_nodes import NodeStarter
    from tasks.ownership import processes
    from tests.helpers import make_config

    real = NodeStarter.__call__

    def second_fails(self: NodeStarter, node: int):
        if node == 1:
            raise OSError("node 1: cannot start (injected)")
        return real(self, node)

    monkeypatch.setattr(NodeStarter, "__call__", second_fails)
    cfg = make_config(tmp_path / "run", dataset, steps=2)
    request = LaunchRequest(
        run_id="half", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1, min_nodes=1
    )
    stores: list = []  # the store the launch starts, seen after it failed
    real_store = local.start_store

    def start_store(*args, **kwargs):
        stores.append(real_store(*args, **kwargs))
        return stores[-1]

    monkeypatch.setattr(local, "start_store", start_store)
    with pytest.raises(OSError, match="injected"):
        local.LocalBackend(tmp_path / "state").launch(request)
    assert stores and stores[0].poll() is not None, "the rendezvous store outlived the launch"
    assert not processes.tagged(cfg.run_root), "a process of the launch outlived it"
