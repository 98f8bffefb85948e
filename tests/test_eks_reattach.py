"""A flow runner replaced mid-train on EKS (its pod evicted, its node lost): the same flow run,
executed again, continues the same run (its run id is derived from the flow run) and

- reattaches to the attempt's Job when it is still running and healthy: no second Job, no step
  trained twice, the GPUs never stop;
- relaunches from the newest checkpoint when the Job died meanwhile, after deleting it.

Both end bitwise equal to the fault-free run. The first execution is played by what it leaves
behind when it is SIGKILLed: a lease whose owner is dead, the attempt's ``stage_attempt`` event
and its Job, created by the same backend code (``EksBackend.launch``). kmock, the FSx Stubber,
SeaweedFS and the Prefect server as in ``test_eks_pipeline.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flows.context import RunPlan
from flows.models import PipelineParams, PipelineResult
from flows.pipeline import run_id_of_flow_run, training_pipeline
from tasks.backends.base import LaunchRequest
from tasks.backends.eks.backend import EksBackend
from tasks.backends.eks.clients import EksClients
from tasks.backends.eks.fsx import Backoff
from tasks.backends.eks.kube import Kube
from tasks.hydrate import hydrate_dataset
from tasks.ownership.lease import peek
from tasks.storage.s3 import S3Settings, s3fs_filesystem
from tests.eks_cluster import NS, seed_cluster, use_clients
from tests.helpers import lease_holder, read_events
from tests.pipeline_helpers import assert_exported
from tests.test_eks_pipeline import FS, Cluster, stubbed_fsx
from trainer.event_types import StageAttempt
from trainer.events import EventLog

pytestmark = pytest.mark.slow

DEAD = "0123456789abcdef"  # the dead owner's invocation
# (case, training Jobs whose node 1 is lost, expected path, workload). Only the healthy case
# needs training slow enough to still run when the flow run is executed again: 1.2 s a step
# until the reattach (its adopted stage_attempt), full speed after it (the 13 or so steps left
# then cost 16 s of sleep and proved nothing more).
CASES = [
    pytest.param(
        "healthy", set(), "reattached", "tests.adversarial.workloads:PACED_UNTIL_ADOPTED_GPT"
    ),
    # `extended` (not in `make test`): the health judgement (tests/test_eks_classify.py), the
    # deletion of a run's Jobs before a launch on kmock (tests/test_eks_backend.py), the
    # takeover decision and a dead owner's broken job ended and relaunched from its newest
    # commit with real processes (tests/adversarial/test_ownership.py) cover its parts.
    pytest.param("died", {1}, "relaunched", "gpt-tiny", marks=pytest.mark.extended),
]


def _dead_owner(run_root: Path, run_id: str) -> None:
    """The lease an evicted runner leaves: its holder SIGKILLed."""
    proc = lease_holder(run_root, run_id)
    proc.kill()
    proc.wait()


def _wait_until(what: str, ok: Callable[[], bool], timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if ok():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def _ready(kube: Kube) -> bool:
    return all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
        for n in kube.nodes()
    )


def _disrupted(kube: Kube, run_id: str) -> bool:
    pods = kube.job_pods(NS, f"nvrx-{run_id}-a1-{DEAD[:6]}")
    return any(
        c.get("type") == "DisruptionTarget"
        for p in pods
        for c in (p.get("status") or {}).get("conditions") or []
    )


@pytest.mark.parametrize(("case", "lose", "expect", "workload"), CASES, ids=["healthy", "died"])
def test_a_replaced_flow_runner_continues_the_run(
    kube: Kube,
    baseline: PipelineResult,
    s3_settings: S3Settings,
    prefect_server,
    tmp_path: Path,
    case: str,
    lose: set[int],
    expect: str,
    workload: str,
):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    seed_cluster(kube)
    form = PipelineParams(  # no run id: the flow run names the run
        backend="eks",
        state_dir=str(tmp_path / "state"),
        s3_endpoint=s3_settings.endpoint_url,
        steps=20,
        nodes=2,
        global_batch=8,
        workload=workload,
        eks={"gpus_per_node": 1, "fsx_mount": str(tmp_path / "fsx"), "file_system_id": FS},
        # On EKS metrics listen on 0.0.0.0 (a pod's port); tests here stay on 127.0.0.1.
        metrics_port=None,
    )
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(training_pipeline, parameters=form.flow_parameters())
    run_id = run_id_of_flow_run(flow_run.id)
    params = form.model_copy(update={"run_id": run_id})
    plan = RunPlan.build(params)
    ctx = plan.ctx
    clients = EksClients(
        kube=kube,
        fsx=None,
        fsx_backoff=Backoff(first_s=0.05, max_s=0.2, deadline_s=30),
        poll_s=0.2,
    )
    # -- the first execution, up to its death: data on FSx, the attempt's Job running ---------
    cluster = Cluster(kube, params, s3_settings, lose_node_in=lose)
    cluster.start()
    try:
        d = params.dataset
        hydrate_dataset(s3fs_filesystem(s3_settings), d.bucket, d.prefix, ctx.data_dir)
        _dead_owner(ctx.run_root, run_id)
        EventLog(ctx.run_root).emit(
            StageAttempt(stage="train", attempt=1, nodes=2, nproc_per_node=1, backend="eks")
        )
        request = LaunchRequest(
            run_id=run_id,
            attempt=1,
            cfg=plan.hydrated(ctx.data_manifest_sha256).train,
            nodes=2,
            nproc_per_node=1,
            invocation=DEAD,
            deadline_s=form.train_timeout_s,
        )
        first = EksBackend(params.eks, nodes=2, clients=clients).launch(request)
        first._close_watch()  # the runner died: nothing watches the Job any more
        if lose:  # the Job dies: a checkpoint at step 10, then node 1 lost (and replaced)
            _wait_until(
                "the node lost and replaced",
                lambda: cluster.trained == 1 and _ready(kube) and _disrupted(kube, run_id),
            )
        else:  # still training when the flow run is executed again
            _wait_until(
                "step 3",
                lambda: any(
                    e["kind"] == "step" and e["step"] >= 3 for e in read_events(ctx.run_root)
                ),
            )
        # -- the same flow run, executed again (what Prefect does after rescheduling it) ------
        fsx, stub = stubbed_fsx(params)
        clients.fsx = fsx
        with stub, use_clients(clients):
            state = run_flow(
                training_pipeline,
                flow_run=flow_run,
                parameters=form.flow_parameters(),
                return_type="state",
            )
    finally:
        cluster.stop.set()
        cluster.join(10)
    assert not cluster.errors, cluster.errors
    assert state.is_completed(), state.message
    result = state.result()
    assert result.run_id == run_id and result.final_step == 20
    assert result.params_sha256 == baseline.params_sha256  # bitwise equal to the fault-free run
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).name == run_id
    events = read_events(ctx.run_root)
    attempts = [e for e in events if e["kind"] == "stage_attempt"]
    steps = [e["step"] for e in events if e["kind"] == "step" and e.get("rank", 0) == 0]
    if expect == "reattached":
        # One Job all along, watched to its end: no relaunch, every step trained once.
        assert [a.get("adopted", False) for a in attempts] == [False, True]
        assert cluster.trained == 1
        assert sorted(steps) == list(range(1, 21)) and len(steps) == len(set(steps))
        assert not [e for e in events if e["kind"] == "resume" and e.get("action") == "loaded"]
    else:
        # The dead Job was deleted and the attempt relaunched from the newest checkpoint.
        assert [a.get("adopted", False) for a in attempts] == [False, False]
        assert cluster.trained == 2
        [stale] = [e for e in events if e["kind"] == "stale_jobs_deleted"]
        assert stale["jobs"] == [f"nvrx-{run_id}-a1-{DEAD[:6]}"]
        loaded = [e for e in events if e["kind"] == "resume" and e.get("action") == "loaded"]
        assert loaded and loaded[-1]["step"] >= 10  # the newest commit before the kill
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", run_id) == []
    assert peek(ctx.run_root) is None  # released: the lease of the dead owner was taken over
    assert_exported(result, s3_settings)
