"""Cancelling a flow run through the Prefect API while it trains (issue 14): a deployment served
by a real runner (its own process, :mod:`tests.served_flows`), a real Prefect server, real
processes. The runner stops the flow's process (SIGTERM, then SIGKILL after its grace period)
and runs the flow's ``on_cancellation`` hook in its own process; afterwards nothing of the run
may be left: no process of the run locally; no Job, Service, NetworkPolicy or Pod on kmock."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest

from flows.models import LOCAL_S3_ENDPOINT, PipelineParams
from flows.pipeline import run_id_of_flow_run
from tasks.backends.eks.kube import JOB_NAME_LABEL, Kube
from tasks.backends.eks.render import LABEL_RUN
from tasks.backends.local_nodes import kill_tree
from tasks.ownership import processes
from tasks.ownership.lease import LeaseRecord, process_is
from tasks.storage.local_s3 import SERVER_RECORD
from tasks.storage.s3 import S3Settings
from tests.eks_cluster import NODES, NS, exists, seed_cluster
from tests.helpers import free_s3_port, read_events
from tests.pipeline_helpers import make_params
from tests.served_flows import KMOCK_DEPLOYMENT, KMOCK_FLOW
from tests.test_eks_pipeline import FS, Cluster
from trainer.rundir import Layout

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SLOW_GPT = "tests.adversarial.workloads:SLOW_GPT"  # 0.5 s a step: cancelled long before the end
STEPS = 400


# -- a served deployment and one flow run of it ---------------------------------------------------
@contextlib.contextmanager
def served(
    which: str, deployment: str, prefect_api: str, log: Path, params: PipelineParams
) -> Iterator[UUID]:
    """``python -m tests.served_flows <which>`` (a real runner) until the block ends; yields the
    id of ``deployment`` once the runner has registered it. The runner's deployments allow the
    state directory and S3 endpoint of ``params`` besides their own (a deployment's run names
    no other: tasks.deployment_policy)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",  # pick the run up (and its cancel) within a second
        "PYTHONPATH": str(REPO),
        # the served deployments' own defaults (validated as the runner starts) and this run's
        "NVRX_ALLOWED_STATE_DIRS": f"{os.path.normpath(params.state_dir)},.state",
        "NVRX_ALLOWED_S3_ENDPOINTS": f"{params.s3_endpoint or 'aws'},{LOCAL_S3_ENDPOINT}",
    }
    with open(log, "w") as out:
        runner = subprocess.Popen(
            [sys.executable, "-m", "tests.served_flows", which],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
    try:

        def registered() -> UUID | None:
            assert runner.poll() is None, log.read_text()[-3000:]
            with get_client(sync_client=True) as client:
                try:
                    return client.read_deployment_by_name(deployment).id
                except ObjectNotFound:
                    return None

        yield wait_for(registered, 90, "the runner never registered the deployment", log)
    finally:
        kill_tree(runner.pid)
        runner.wait()


def wait_for(probe: Callable[[], Any], timeout_s: float, what: str, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"{what} (within {timeout_s} s)\n{tail}")
        time.sleep(0.3)


def start_run(deployment_id: UUID, parameters: dict[str, Any]) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.create_flow_run_from_deployment(deployment_id, parameters=parameters)


def read_run(flow_run_id: UUID) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def cancel_when_training(flow_run_id: UUID, run_root: Path, log: Path) -> Any:
    """Wait for recorded steps (the flow run still going), then cancel through the API as the
    UI's Cancel button does; returns the flow run once it is final."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    def training() -> bool:
        state = read_run(flow_run_id).state
        assert state is None or not state.is_final(), (state, log.read_text()[-4000:])
        return any(e["kind"] == "step" for e in read_events(run_root))

    wait_for(training, 150, "training never got going", log)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)

    def final() -> Any:
        run = read_run(flow_run_id)
        return run if run.state is not None and run.state.is_final() else None

    return wait_for(final, 90, "the flow run did not end after the cancel", log)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_cancelled_run_left_nothing_in_its_events(run_root: Path) -> None:
    events = read_events(run_root)
    ends = [e for e in events if e["kind"] == "stage_attempt_end"]
    assert not [e for e in ends if e.get("outcome") == "completed"], ends
    # The runner ran the pipeline's on_cancellation hook (it records what it removed).
    cleanups = [e for e in events if e["kind"] == "cleanup"]
    assert cleanups and str(cleanups[-1]["state"]).startswith("CANCEL"), events[-5:]
    lease = run_root / Layout.LEASE
    if lease.exists():  # its owner may have been SIGKILLed: then it must be dead
        rec = LeaseRecord.parse(lease.read_text())
        assert rec is None or not process_is(rec.owner.pid, rec.owner.create_time), rec


# -- local backend --------------------------------------------------------------------------------
def test_cancel_during_train_on_the_local_backend_leaves_no_process(
    prefect_server: str, tmp_path: Path
):
    s3 = S3Settings(
        endpoint_url=f"http://127.0.0.1:{free_s3_port()}"
    )  # the pipeline starts its own
    # No run id: the flow run's id names the run (and the flow run).
    params = make_params(tmp_path / "state", s3, steps=STEPS, workload=SLOW_GPT)
    assert params.run_id is None
    log = tmp_path / "runner.log"
    run_root: Path | None = None
    try:
        with served(
            "local", "nvrx-training-pipeline/on-demand", prefect_server, log, params
        ) as dep:
            flow_run = start_run(dep, params.flow_parameters())
            run_id = run_id_of_flow_run(flow_run.id)
            run_root = tmp_path / "state" / "fsx" / "runs" / run_id
            # Mid-train: the simulated nodes run and the state directory's S3 server is up.
            # (Checked before cancelling so the "none left" checks below mean something.)
            wait_for(lambda: processes.tagged(run_root), 150, "no simulated node ever started", log)
            server = json.loads((tmp_path / "state" / "s3" / SERVER_RECORD).read_text())
            assert process_is(int(server["pid"]), float(server["create_time"])), server
            ended = cancel_when_training(flow_run.id, run_root, log)
            assert ended.state.is_cancelled(), (ended.state, log.read_text()[-4000:])
            assert ended.name == run_id  # flow_run_name: the run id
            wait_for(
                lambda: not processes.tagged(run_root),
                30,
                "processes of the run outlive the cancel",
                log,
            )
        assert_cancelled_run_left_nothing_in_its_events(run_root)
        # The S3 server the run started for its state directory is stopped.
        assert not process_is(int(server["pid"]), float(server["create_time"])), server
    finally:
        if run_root is not None:  # never leave anything behind for the next test
            processes.end_invocations(run_root)


# -- EKS on kmock ---------------------------------------------------------------------------------
class GarbageCollectingCluster(Cluster):
    """The EKS test's control plane and kubelets, plus what a cancel needs of a cluster: when a
    training Job is deleted (propagation Background), its pods go (the garbage collector) and
    their containers are killed (the kubelet). Remembers every workload process it started."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.workloads: dict[int, psutil.Process] = {}

    def wait(self, job: str, proc: subprocess.Popen, timeout: float) -> int | None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._remember(proc.pid)
            rc = proc.poll()
            if rc is not None:
                return rc
            if self.kube.read_job(NS, job) is None:
                for pod in self.kube.job_pods(NS, job):
                    self.kube.delete_pod(NS, pod["metadata"]["name"])
                kill_tree(proc.pid)
                return None
            if len(self.kube.job_pods(NS, job)) < len(NODES) or self.stop.is_set():
                kill_tree(proc.pid)
                return None
            time.sleep(0.2)
        raise TimeoutError(f"{job}: the workload did not end within {timeout} s")

    def _remember(self, pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                self.workloads.setdefault(p.pid, p)


# `extended` (not in `make test`): the cancel through a served runner and the flow's hooks are
# the local drill's below (the same flow code, any backend); what EKS adds, its Job, Service and
# NetworkPolicy deleted when the watch is interrupted as Prefect's SIGTERM bridge interrupts it,
# is tests/test_eks_backend.py::test_an_interrupted_watch_deletes_the_job.
@pytest.mark.extended
def test_cancel_during_train_on_eks_leaves_no_job_service_or_pod(
    kube: Kube, prefect_server: str, s3_settings: S3Settings, tmp_path: Path
):
    seed_cluster(kube)
    run_id = "eks-cancel"
    params = PipelineParams(
        backend="eks",
        run_id=run_id,
        workload=SLOW_GPT,
        # On EKS metrics listen on 0.0.0.0 (a pod's port); tests here stay on 127.0.0.1.
        metrics_port=None,
        state_dir=str(tmp_path / "state"),
        s3_endpoint=s3_settings.endpoint_url,
        steps=STEPS,
        nodes=2,
        global_batch=8,
        eks={"gpus_per_node": 1, "fsx_mount": str(tmp_path / "fsx"), "file_system_id": FS},
    )
    run_root = tmp_path / "fsx" / "runs" / run_id
    cluster = GarbageCollectingCluster(kube, params, s3_settings, lose_node_in=set())
    cluster.start()
    kube_url = kube.core.api_client.configuration.host
    log = tmp_path / "runner.log"
    try:
        with served(
            "kmock", f"{KMOCK_FLOW}/{KMOCK_DEPLOYMENT}", prefect_server, log, params
        ) as dep:
            flow_run = start_run(
                dep, {"params": params.model_dump(mode="json"), "kube_url": kube_url}
            )

            def training_job() -> str | None:
                """The run's Job (found by its run label: its name carries the invocation's
                tag), once its pods exist."""
                assert not cluster.errors, cluster.errors
                names = kube.jobs_labelled(NS, LABEL_RUN, run_id)
                assert len(names) <= 1, names  # a run never has two Jobs
                return names[0] if names and kube.job_pods(NS, names[0]) else None

            job = wait_for(training_job, 150, "the run's training Job never got pods", log)
            wait_for(
                lambda: (
                    exists(kube.core.read_namespaced_service, job)
                    and exists(kube.networking.read_namespaced_network_policy, job)
                ),
                30,
                "the Job's Service and NetworkPolicy were never applied",
                log,
            )
            ended = cancel_when_training(flow_run.id, run_root, log)
            assert ended.state.is_cancelled(), (ended.state, log.read_text()[-4000:])
            assert ended.name == run_id
        # Nothing of the run on the cluster: the Job, what was rendered with it, its pods.
        assert kube.jobs_labelled(NS, LABEL_RUN, run_id) == []
        assert not exists(kube.core.read_namespaced_service, job)
        assert not exists(kube.networking.read_namespaced_network_policy, job)
        wait_for(lambda: not kube.job_pods(NS, job), 15, "pods of the deleted Job remain")
        pods = kube.core.list_namespaced_pod(NS, _preload_content=False)
        labels = [(p["metadata"].get("labels") or {}) for p in json.loads(pods.data)["items"]]
        assert [la for la in labels if la.get(JOB_NAME_LABEL) == job] == []
        # The pods' containers (the workload the Cluster ran for them) are gone too.
        assert cluster.workloads
        wait_for(
            lambda: not [p for p in cluster.workloads.values() if alive(p)],
            30,
            "workload processes outlive their pods",
        )
        assert_cancelled_run_left_nothing_in_its_events(run_root)
    finally:
        cluster.stop.set()
        cluster.join(15)
        processes.end([p for p in cluster.workloads.values() if alive(p)])
    assert not cluster.errors, cluster.errors
