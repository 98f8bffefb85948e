"""The whole pipeline with ``backend=eks``: the same flows and EKS code as production, against
the stand-ins this machine can run.

- Kubernetes: kmock's emulator over HTTP, driven by the real ``kubernetes`` client. kmock runs
  no controllers and no kubelets, so :class:`Cluster` plays them: it creates the Job's pods,
  and for each training Job runs the workload the pods would run (real ft_launcher, 2 real
  gloo ranks on CPU, the NVRX_* environment read from the Job's own spec), then reports the
  end as the kubelet and the Job controller would (pod phases, exit codes, conditions).
  A node loss is played as the node lifecycle controller does it: the node goes
  ``Ready=Unknown`` and the pod gets ``DisruptionTarget``/``DeletionByTaintManager``.
- FSx: ``botocore.stub.Stubber`` on the real FSx service model; the "file system" is a
  directory mounted (as the work pool template mounts the claim) at ``eks.fsx_mount``. The
  hydration Job's effect (lazy load + ``lfs hsm_restore``) is played by copying the dataset
  from S3 into it.
- S3: SeaweedFS over HTTP; Prefect: the test server.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber
from kubernetes.client import ApiException

from flows.context import RunContext, eks_train_config
from flows.models import PipelineParams, PipelineResult
from tasks.backends.eks.clients import EksClients, use_clients
from tasks.backends.eks.fsx import Backoff
from tasks.backends.eks.kube import Kube
from tasks.backends.local import kill_tree
from tasks.hydrate import hydrate_dataset
from tasks.storage.s3 import S3Settings, s3fs_filesystem
from tests.eks_cluster import NODES, NS, mark_disrupted, p5, pod_obj, seed_cluster, terminated
from tests.helpers import FAST_INJOB, FAST_INPROCESS, REPO, free_port, worker_env, write_config
from tests.pipeline_helpers import assert_exported, run_pipeline
from trainer.config import Device, load_config
from trainer.data import load_manifest, manifest_digest
from trainer.events import read_events
from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args

pytestmark = pytest.mark.slow

FS = "fs-0123456789abcdef0"


class Cluster(threading.Thread):
    """The control plane and kubelets of kmock's cluster, for one pipeline run."""

    def __init__(
        self, kube: Kube, params: PipelineParams, s3: S3Settings, lose_node_in: set[int]
    ) -> None:
        super().__init__(daemon=True)
        self.kube, self.params, self.s3 = kube, params, s3
        # Training Jobs (1 = the first this cluster runs) whose node 1 is lost after a checkpoint.
        self.lose_node_in = lose_node_in
        self.trained = 0
        self.manifest_digests: list[str | None] = []  # of each attempt's config
        self.ctx = RunContext.create(params)
        self.handled: set[str] = set()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for job in self.jobs():
                    name = job["metadata"]["name"]
                    # A relaunched attempt may reuse the name; its rendezvous id is new.
                    key = f"{name}/{_rdzv_id(job)}"
                    if key in self.handled:
                        continue
                    self.handled.add(key)
                    # Each Job on its own "nodes": a hydration Job runs beside a training one.
                    threading.Thread(target=self.run_job, args=(name, job), daemon=True).start()
                time.sleep(0.2)
        except BaseException as e:  # surfaced by the test
            traceback.print_exc()
            self.errors.append(e)

    def run_job(self, name: str, job: dict[str, Any]) -> None:
        try:
            if name.endswith("-hydrate"):
                self.hydrate(name)
            else:
                self.train(name, job)
        except BaseException as e:
            traceback.print_exc()
            self.errors.append(e)

    def jobs(self) -> list[dict[str, Any]]:
        try:
            resp = self.kube.batch.list_namespaced_job(NS, _preload_content=False)
        except ApiException as e:
            if e.status == 404:  # kmock: no Job created yet, so the resource is undeclared
                return []
            raise
        return list(json.loads(resp.data)["items"])

    def complete_job(self, name: str) -> None:
        self.kube.batch.patch_namespaced_job_status(
            name,
            NS,
            {"status": {"conditions": [{"type": "Complete", "status": "True"}]}},
            _preload_content=False,
        )

    def hydrate(self, name: str) -> None:
        d = self.params.dataset
        hydrate_dataset(s3fs_filesystem(self.s3), d.bucket, d.prefix, self.ctx.data_dir)
        self.complete_job(name)

    def train(self, name: str, job: Any) -> None:
        for i, node in enumerate(NODES):
            # A relaunch under a deleted Job's name: its pods go first (kmock has no garbage
            # collector to remove them with the Job).
            self.kube.delete_pod(NS, f"{name}-{i}-x")
            self.kube.core.create_namespaced_pod(NS, pod_obj(name, i, node), _preload_content=False)
        container = job["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("NVRX_")}
        # What the pods run, on this machine's CPUs: one launcher with both ranks, reading the
        # config the flow wrote for this attempt (what the Job's command names).
        [config_arg] = [a for a in container["args"] if a.startswith("--config=")]
        written = load_config(Path(config_arg.split("=", 1)[1]))
        # What render-k8s renders, plus what only the pipeline knows once hydration ran: the
        # digest of the manifest it verified (the pods then check sizes only).
        digest = written.data_manifest_sha256
        self.manifest_digests.append(digest)
        if digest is not None:
            assert digest == manifest_digest(load_manifest(written.data_dir))
        assert written == dataclasses.replace(
            eks_train_config(self.params, self.ctx.run_id), data_manifest_sha256=digest
        )
        cfg = dataclasses.replace(
            written,
            device=Device.CPU,
            inprocess=FAST_INPROCESS,
            injob=FAST_INJOB,
        )
        argv = ft_launcher_argv(
            cfg,
            # the rendezvous id the rendered command has (unique per attempt and invocation)
            LaunchSpec(
                nnodes=1,
                nproc_per_node=2,
                rdzv_endpoint=f"127.0.0.1:{free_port()}",
                rdzv_id=_rdzv_id(job),
            ),
            trainer_args(cfg, write_config(cfg)),
        )
        log = open(self.ctx.run_root.parent / f"{name}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**worker_env(), **env},
            cwd=REPO,
            start_new_session=True,
        )
        try:
            self.trained += 1
            if self.trained in self.lose_node_in:
                self.wait_for_checkpoint(step=10)
                kill_tree(proc.pid)  # the node's pods die with it: launcher and every rank
                self.lose_node(name)
                return
            rc = self.wait(name, proc, timeout=240)
            if rc is None:
                return  # a pod was deleted (the node-loss drill): the kubelet killed it
        finally:
            kill_tree(proc.pid)
            proc.wait()
            log.close()
        if rc == 0:
            for i in range(2):
                self.kube.core.patch_namespaced_pod_status(
                    f"{name}-{i}-x",
                    NS,
                    terminated(0, "Completed", "Succeeded"),
                    _preload_content=False,
                )
            self.complete_job(name)
        else:
            for i in range(2):
                self.kube.core.patch_namespaced_pod_status(
                    f"{name}-{i}-x", NS, terminated(rc), _preload_content=False
                )

    def wait(self, job: str, proc: subprocess.Popen, timeout: float) -> int | None:
        """The workload's exit code, or None when one of the Job's pods was deleted first (what
        a kubelet does then: kill the pod's containers)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            rc = proc.poll()
            if rc is not None:
                return rc
            if len(self.kube.job_pods(NS, job)) < len(NODES):
                kill_tree(proc.pid)
                return None
            time.sleep(0.2)
        raise TimeoutError(f"{job}: the workload did not end within {timeout} s")

    def wait_for_checkpoint(self, step: int) -> None:
        deadline = time.time() + 180
        while time.time() < deadline:
            if any(
                e["kind"] == "checkpoint" and e["step"] >= step
                for e in read_events(self.ctx.run_root)
            ):
                return
            time.sleep(0.2)
        raise TimeoutError(f"no checkpoint at step {step}")

    def lose_node(self, job: str) -> None:
        lost = NODES[1]
        unknown = p5(lost, ready="Unknown")
        self.kube.core.patch_node_status(lost, unknown, _preload_content=False)
        mark_disrupted(self.kube, f"{job}-1-x")
        # The node group replaces the node a little later: the flow must wait for it.
        time.sleep(3.0)
        self.kube.core.patch_node_status(lost, p5(lost), _preload_content=False)


def _rdzv_id(job: dict[str, Any]) -> str:
    """The rendezvous id the Job's command names (unique per attempt and invocation); none for
    the hydration Job."""
    args = job["spec"]["template"]["spec"]["containers"][0].get("args") or []
    return next((a.split("=", 1)[1] for a in args if a.startswith("--rdzv-id=")), "")


def stubbed_fsx(params: PipelineParams) -> tuple[Any, Stubber]:
    fsx = boto3.client(
        "fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    stub = Stubber(fsx)
    d = params.dataset
    fs_path, s3_path = f"/datasets/{d.bucket}/{d.prefix}", f"s3://{d.bucket}/{d.prefix}/"
    by_fs = {"Filters": [{"Name": "file-system-id", "Values": [FS]}]}
    # preflight
    stub.add_response(
        "describe_file_systems",
        {"FileSystems": [{"FileSystemId": FS, "Lifecycle": "AVAILABLE"}]},
        {"FileSystemIds": [FS]},
    )
    stub.add_response(
        "describe_data_repository_associations",
        {
            "Associations": [
                {"AssociationId": "dra-0fffffffffffffff0", "DataRepositoryPath": "s3://other/"}
            ]
        },
        by_fs,
    )
    # hydrate: not linked yet -> created once, then the import task runs to SUCCEEDED
    stub.add_response("describe_data_repository_associations", {"Associations": []}, by_fs)
    assoc = {
        "AssociationId": "dra-0123456789abcdef0",
        "FileSystemId": FS,
        "Lifecycle": "AVAILABLE",
        "FileSystemPath": fs_path,
        "DataRepositoryPath": s3_path,
    }
    stub.add_response(
        "create_data_repository_association",
        {"Association": assoc},
        {
            "FileSystemId": FS,
            "FileSystemPath": fs_path,
            "DataRepositoryPath": s3_path,
            "BatchImportMetaDataOnCreate": False,
            "ClientRequestToken": ANY,
        },
    )
    task = {
        "TaskId": "task-0123456789abcdef0",
        "Lifecycle": "PENDING",
        "Type": "IMPORT_METADATA_FROM_REPOSITORY",
        "CreationTime": "2026-11-29T00:00:00Z",
    }
    stub.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task},
        {
            "Type": "IMPORT_METADATA_FROM_REPOSITORY",
            "Paths": [fs_path.lstrip("/")],
            "FileSystemId": FS,
            "Report": ANY,
            "ClientRequestToken": ANY,
        },
    )
    stub.add_response(
        "describe_data_repository_tasks",
        {"DataRepositoryTasks": [{**task, "Lifecycle": "SUCCEEDED"}]},
        {"TaskIds": [task["TaskId"]]},
    )
    return fsx, stub


# Node 1 lost as the control plane shows it (Node Ready=Unknown, the pod DisruptionTarget), and
# node 0 (rank 0 and the rendezvous store, which NVRx cannot replace in-job) lost by the drill,
# which deletes its pod through the API. Both end the attempt; the stage retry recovers.
LOSSES = [("node1-lost", {1}, []), ("node0-drill", set(), ["node-loss@step=12,node=0"])]


@pytest.mark.parametrize(("case", "lose_node_in", "faults"), LOSSES, ids=[c[0] for c in LOSSES])
def test_node_loss_then_stage_retry_on_eks(
    kube: Kube,
    baseline: PipelineResult,
    s3_settings: S3Settings,
    tmp_path: Path,
    case: str,
    lose_node_in: set[int],
    faults: list[str],
):
    seed_cluster(kube)
    run_id = f"eks-{case}"
    params = PipelineParams(
        backend="eks",
        run_id=run_id,
        drills={"faults": faults},
        # On EKS metrics listen on 0.0.0.0 (a pod's port); tests here stay on 127.0.0.1.
        metrics_port=None,
        state_dir=str(tmp_path / "state"),
        s3_endpoint=s3_settings.endpoint_url,
        steps=20,
        nodes=2,
        global_batch=8,
        eks={"gpus_per_node": 1, "fsx_mount": str(tmp_path / "fsx"), "file_system_id": FS},
    )
    fsx, stub = stubbed_fsx(params)
    cluster = Cluster(kube, params, s3_settings, lose_node_in=lose_node_in)
    cluster.start()
    clients = EksClients(
        kube=kube, fsx=fsx, fsx_backoff=Backoff(first_s=0.05, max_s=0.2, deadline_s=30), poll_s=0.2
    )
    try:
        with stub, use_clients(clients):
            state, result = run_pipeline(params)
            stub.assert_no_pending_responses()  # every FSx call made, none extra
    finally:
        cluster.stop.set()
        cluster.join(10)
    assert not cluster.errors, cluster.errors
    assert state.is_completed(), state.message
    assert result is not None and result.status == "completed"
    # Both attempts were told the manifest hydration verified.
    assert len(cluster.manifest_digests) == 2 and None not in cluster.manifest_digests
    # Node loss ended attempt 1; attempt 2 resumed from the newest checkpoint on FSx and
    # finished bitwise equal to the fault-free run.
    assert result.stage_attempts["train"] == 2
    assert result.params_sha256 == baseline.params_sha256
    assert [(f.kind, f.recovered_by) for f in result.faults] == [("node-loss", "stage-retry")]
    events = read_events(RunContext.create(params).run_root)
    loaded = [
        i for i, e in enumerate(events) if e["kind"] == "resume" and e.get("action") == "loaded"
    ]
    assert loaded, "attempt 2 resumed from a checkpoint"
    # The newest commit before the loss, not a fixed step: the drill fires at step 12 whether or
    # not step 10's async save has committed yet (on a slow machine it may not have).
    committed = [e["step"] for e in events[: loaded[-1]] if e["kind"] == "checkpoint"]
    assert committed and events[loaded[-1]]["step"] == max(committed) >= 5
    if lose_node_in:  # the cluster waited for step 10's commit before losing the node
        assert max(committed) >= 10
    # The lost attempt's Job was deleted, the completed one too; the FSx claim holds the result.
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", run_id) == []
    assert result.checkpoint.validated and result.checkpoint.step == 20
    assert result.checkpoint.uri and result.checkpoint.uri.startswith(str(tmp_path / "fsx"))
    assert_exported(result, s3_settings)
