"""The flow's ``on_cancellation`` / ``on_crashed`` hook when the flow's process could not unwind
(SIGKILLed after the runner's grace period, out of memory): it removes what the dead invocation
left, on both backends, and leaves a live owner's run alone. (tests/test_cancel.py cancels through
the Prefect API end to end; there the flow unwinds by itself and the hook finds nothing left.)"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from prefect.states import Cancelled, Crashed

from flows.context import RunContext, eks_train_config
from flows.models import PipelineParams
from flows.pipeline import _clean_up_after
from tasks.backends.eks.clients import EksClients
from tasks.backends.eks.kube import Kube
from tasks.backends.eks.render import render_all
from tasks.ownership import processes
from tests.eks_cluster import NS, use_clients
from tests.helpers import lease_holder, read_events

DEAD = "deadbeefdeadbeef"


def _tagged_sleeper(run_root: Path) -> psutil.Process:
    """A process of the run that outlived its invocation (a simulated node's worker)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, **processes.tags(run_root, DEAD)},
        start_new_session=True,
    )
    return psutil.Process(proc.pid)


def _flow_run(params: PipelineParams) -> SimpleNamespace:
    # The fields of Prefect's FlowRun the hook reads (what the runner passes it).
    return SimpleNamespace(id=uuid.uuid4(), parameters=params.flow_parameters(), deployment_id=None)


@pytest.mark.parametrize("owner_alive", [False, True], ids=["owner-dead", "owner-alive"])
def test_local_hook_ends_what_a_killed_flow_left(tmp_path: Path, owner_alive: bool):
    params = PipelineParams(run_id="hook-local", state_dir=str(tmp_path / "state"))
    ctx = RunContext.create(params)
    owner = lease_holder(ctx.run_root, "hook-local")
    leftover = _tagged_sleeper(ctx.run_root)
    try:
        if not owner_alive:
            owner.kill()
            owner.wait()
        _clean_up_after(None, _flow_run(params), Crashed())
        if owner_alive:  # a live invocation owns the run: nothing of it is touched
            assert leftover.is_running() and leftover.status() != psutil.STATUS_ZOMBIE
            assert not [e for e in read_events(ctx.run_root) if e["kind"] == "cleanup"]
        else:
            leftover.wait(timeout=10)
            assert processes.tagged(ctx.run_root) == []
            [event] = [e for e in read_events(ctx.run_root) if e["kind"] == "cleanup"]
            assert event["state"] == "CRASHED" and f"pid {leftover.pid}" in event["removed"]
    finally:
        for p in (owner.pid, leftover.pid):
            if psutil.pid_exists(p):
                psutil.Process(p).kill()
        owner.wait()


def test_eks_hook_deletes_every_job_of_the_run(kube: Kube, tmp_path: Path):
    run_id = "hook-eks"
    params = PipelineParams(
        backend="eks", run_id=run_id, global_batch=16, eks={"fsx_mount": str(tmp_path / "fsx")}
    )
    ctx = RunContext.create(params)
    for doc in render_all(
        eks_train_config(params, run_id),
        run_id=run_id,
        attempt=1,
        nodes=2,
        eks=params.eks,
        tag="dead00",
    ):
        kube.apply(doc)
    other = PipelineParams(backend="eks", run_id="hook-other", global_batch=16)
    for doc in render_all(
        eks_train_config(other, "hook-other"),
        run_id="hook-other",
        attempt=1,
        nodes=2,
        eks=other.eks,
    ):
        kube.apply(doc)
    owner = lease_holder(ctx.run_root, run_id)
    owner.kill()
    owner.wait()
    with use_clients(EksClients(kube=kube, fsx=None)):
        _clean_up_after(None, _flow_run(params), Cancelled())
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", run_id) == []
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", "hook-other") == ["nvrx-hook-other-a1"]
    [event] = [e for e in read_events(ctx.run_root) if e["kind"] == "cleanup"]
    assert event["removed"] == [f"nvrx-{run_id}-a1-dead00"]
