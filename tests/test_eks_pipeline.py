"""The whole pipeline with ``backend=eks``: the same flows and EKS code as production, against
the stand-ins this machine can run.

- Kubernetes: kmock's emulator over HTTP, driven by the real ``kubernetes`` client. kmock runs
  no controllers and no kubelets, so :class:`Cluster` plays them: it creates the Job's pods,
  and for each training Job runs the workload the pods would run (real ft_launcher, 2 real
  gloo ranks on CPU, the NVRX_* environment read from the Job's own spec), then reports the
  end as the kubelet and the Job controller would (pod phases, exit codes, conditions).
  A node loss is played as the node lifecycle controller does it: the node goes
  ``Ready=Unknown`` and the pod gets ``DisruptionTarget``/``DeletionByTaintManager``.
  An elastic Job (a node range, or hot spares) runs as its pods would: one real agent per pod
  (``JOB_COMPLETION_INDEX`` set, index 0 hosting the rendezvous store); after a node loss the
  cluster plays the Job controller's replacement of the lost index (its pod failure policy
  ignores the disruption) and index 0's success completing the Job (its success policy).
- FSx: ``botocore.stub.Stubber`` on the real FSx service model; the "file system" is a
  directory mounted (as the work pool template mounts the claim) at ``eks.fsx_mount``. The
  metadata import's effect (the manifest readable on the mount) and the hydration Job's (every
  file read, so lazily loaded) are played by copying the manifest, then the dataset, from S3.
- S3: SeaweedFS over HTTP; Prefect: the test server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import boto3
import psutil
import pytest
from botocore.stub import ANY, Stubber
from kubernetes.client import ApiException

from flows.context import RunContext, eks_train_config
from flows.models import PipelineParams, PipelineResult
from tasks.backends.eks.clients import EksClients
from tasks.backends.eks.fsx import Backoff
from tasks.backends.eks.kube import Kube
from tasks.backends.local_nodes import kill_tree
from tasks.hydrate import hydrate_dataset
from tasks.ownership import processes
from tasks.storage.s3 import S3Settings, s3fs_filesystem
from tests.eks_cluster import (
    NODES,
    NS,
    mark_disrupted,
    p5,
    pod_obj,
    seed_cluster,
    terminated,
    use_clients,
)
from tests.helpers import (
    FAST_INJOB,
    FAST_INPROCESS,
    REPO,
    assert_handed_off,
    free_port,
    read_events,
    worker_env,
    write_config,
)
from tests.k8s_admission import admit, policies
from tests.kube_chaos import ChaosProxy, Misbehaviour
from tests.pipeline_helpers import assert_exported, run_pipeline
from trainer.checkpointing.layout import NODE_MEMORY_ENV
from trainer.config import Device, TrainConfig, load_config
from trainer.data import load_manifest
from trainer.elastic import NodeRange
from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args

pytestmark = pytest.mark.slow

FS = "fs-0123456789abcdef0"


class Cluster(threading.Thread):
    """The control plane and kubelets of kmock's cluster, for one pipeline run."""

    def __init__(
        self,
        kube: Kube,
        params: PipelineParams,
        s3: S3Settings,
        lose_node_in: set[int],
        nodes: tuple[str, ...] = NODES,
        victims: int = 1,
        return_after_s: float | None = None,
        graceful_delete: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.kube, self.params, self.s3 = kube, params, s3
        # Training Jobs (1 = the first this cluster runs) that lose a node after a checkpoint:
        # node 1 of a fixed-size Job; a training node other than the rendezvous host of an
        # elastic one, which the Job controller then replaces.
        self.lose_node_in = lose_node_in
        self.nodes = nodes  # index i's pod runs on nodes[i]
        # Elastic Jobs: how many training nodes go (highest indexes first, a second apart), and
        # when the first one's replacement comes: once the survivors re-formed without them and
        # trained a step (None), or that many seconds after the losses (survivors below the
        # minimum wait).
        self.victims, self.return_after_s = victims, return_after_s
        # The kubelets honour a deletion's grace (an eviction's): SIGTERM to the pod's first
        # process, SIGKILL the pod's grace later. kmock keeps no deletionTimestamp, so a test
        # that evicts says so here (the watcher's other deletions have grace 0).
        self.graceful_delete = graceful_delete
        self.replaced: list[str] = []  # replacement pods the "Job controller" created
        self.exit_codes: dict[str, int] = {}  # of elastic Jobs' pods, as their kubelet saw
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
            # What the API server's admission policies answer the pipeline's token for it
            # (deploy/eks/admission-policy.yaml): the Job as the flow created it is admitted.
            filled = policies(fsx_mount=self.params.eks.fsx_mount)  # this test's mount
            denied = [m for p in filled.values() for m in admit(p, "CREATE", job)]
            assert not denied, (name, denied)
            if name.startswith("nvrx-hydrate-"):
                self.hydrate(name, job)
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

    def hydrate(self, name: str, job: dict[str, Any]) -> None:
        """The contents arrive (a lazily imported file loads on its first read), then the pod's
        own command runs: every file read and digested against the manifest the flow read."""
        d = self.params.dataset
        hydrate_dataset(s3fs_filesystem(self.s3), d.bucket, d.prefix, self.ctx.data_dir)
        [container] = job["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert command[:3] == ["python", "-m", "trainer.data"], command
        subprocess.run([sys.executable, *command[1:]], check=True, cwd=REPO, timeout=120)
        self.complete_job(name)

    def train(self, name: str, job: Any) -> None:
        container = job["spec"]["template"]["spec"]["containers"][0]
        if "--keep-alive" in container["args"]:
            self.train_elastic(name, job, *self.workload(name, job))
            return
        for i, node in enumerate(NODES):
            # A relaunch under a deleted Job's name: its pods go first (kmock has no garbage
            # collector to remove them with the Job).
            self.kube.delete_pod(NS, f"{name}-{i}-x")
            self.kube.core.create_namespaced_pod(NS, pod_obj(name, i, node), _preload_content=False)
        cfg, env = self.workload(name, job)
        # What the pods run, on this machine's CPUs: one launcher with both ranks.
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
            env={**worker_env(), **env, POD_ENV: name, **self.pod_memory(env, name)},
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
            _end_pod(name, proc)  # both "pods": the launcher and whatever left its tree
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

    def pod_memory(self, env: dict[str, str], pod: str) -> dict[str, str]:
        """The pod's own memory-backed /dev/shm: the rendered NVRX_NODE_MEMORY, moved into a
        directory of the pod's beside the run (pods of this machine would share /dev/shm, and
        a lost pod's memory must go with it)."""
        rendered = Path(env[NODE_MEMORY_ENV])
        shm = self.ctx.run_root.parent / f"{pod}-shm"
        # The kubelet mounts the emptyDir before the container starts: /dev/shm exists, and the
        # worker makes only its own directory in it (trainer.checkpointing.node_dir).
        shm.mkdir(mode=0o1777, parents=True, exist_ok=True)
        return {NODE_MEMORY_ENV: str(shm / rendered.relative_to("/dev/shm"))}

    def workload(self, name: str, job: Any) -> tuple[TrainConfig, dict[str, str]]:
        """The attempt's config as the pods read it (checked against what the flow rendered),
        run here on CPU with the drills' short timeouts; and the Job's NVRX_* environment."""
        container = job["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("NVRX_")}
        # The attempt's config as the kubelet mounts it: the file the Job's command names, in
        # the ConfigMap mounted there (the bundle carries it).
        [config_arg] = [a for a in container["args"] if a.startswith("--config=")]
        path = Path(config_arg.split("=", 1)[1])
        [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
        [volume] = [
            v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
        ]
        resp = self.kube.core.read_namespaced_config_map(
            volume["configMap"]["name"], NS, _preload_content=False
        )
        mounted = self.ctx.run_root.parent / f"{name}-{path.name}"
        mounted.write_text(json.loads(resp.data)["data"][path.name])
        written = load_config(mounted)
        # What render-k8s renders, plus what only the pipeline knows once hydration ran: the
        # digest of the manifest it verified (the pods then check sizes only).
        digest = written.data_manifest_sha256
        self.manifest_digests.append(digest)
        if digest is not None:
            assert digest == load_manifest(written.data_dir).digest()
        assert written == dataclasses.replace(
            eks_train_config(self.params, self.ctx.run_id), data_manifest_sha256=digest
        )
        cfg = dataclasses.replace(
            written,
            device=Device.CPU,
            inprocess=FAST_INPROCESS,
            injob=FAST_INJOB,
        )
        return cfg, env

    def train_elastic(self, name: str, job: Any, cfg: TrainConfig, env: dict[str, str]) -> None:
        """An elastic Job (a node range, or hot spares) as its pods run it: one agent per pod,
        each with its pod's JOB_COMPLETION_INDEX; index 0 hosts the rendezvous store (first at
        the endpoint, as ``$JOB-0.$SVC`` resolves to it); the others join it. Each pod's end is
        reported as the kubelet would, and index 0's success completes the Job (its
        ``successPolicy``); the Job controller then stops the rest."""
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        rendered = NodeRange.parse(_flag(args, "--nnodes"))
        launched = int(job["spec"]["completions"])
        endpoint = f"127.0.0.1:{free_port()}"
        spec = LaunchSpec(
            nnodes=rendered.max,
            min_nodes=rendered.min,
            spares=launched - rendered.max,
            nproc_per_node=int(_flag(args, "--nproc-per-node")),
            rdzv_endpoint=endpoint,
            rdzv_id=_rdzv_id(job),
        )
        argv = ft_launcher_argv(cfg, spec, trainer_args(cfg, write_config(cfg)))
        assert _flag(argv, "--nnodes") == _flag(args, "--nnodes")
        # Every pod's agent shares this machine's cores: threads sized as the local backend
        # sizes them for simulated nodes (results are bitwise equal for one thread count).
        workers = spec.nnodes * spec.nproc_per_node
        env = {**env, "NVRX_CPU_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}
        grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        pods = ElasticPods(self, name, argv, env, grace_s=grace if self.graceful_delete else 0)
        pods.start(0)
        _wait_listening(endpoint)
        for i in range(1, spec.nnodes):
            pods.start(i)
        if launched > spec.nnodes:
            # Spares' pods start once the world formed (the Job controller starts every index
            # at once; which agents the first round admits is then a race): the drills name the
            # training nodes, as the local backend's deferred spares make them.
            threading.Thread(
                target=self.start_spares, args=(pods, spec.nnodes, launched), daemon=True
            ).start()
        self.trained += 1
        if self.trained in self.lose_node_in:
            threading.Thread(target=self.lose_and_replace, args=(pods,), daemon=True).start()
        pods.watch(timeout=300)

    def start_spares(self, pods: ElasticPods, first: int, launched: int) -> None:
        deadline = time.time() + 180
        while not any(e["kind"] == "train_start" for e in read_events(self.ctx.run_root)):
            if time.time() > deadline:
                return
            time.sleep(0.1)
        for i in range(first, launched):
            pods.start(i)

    def lose_and_replace(self, pods: ElasticPods) -> None:
        """After step 5's checkpoint: training nodes other than index 0 go (each pod marked as
        the control plane marks a lost node's, its processes killed, the pod evicted); then the
        node group's replacement for the lowest of them is Ready and the Job controller's new
        pod for that index (its pod failure policy ignored the disruption) starts an agent that
        joins the rendezvous."""
        try:
            self.wait_for_checkpoint(step=5)
            [world] = [
                e["nodes"] for e in read_events(self.ctx.run_root) if e["kind"] == "train_start"
            ][-1:]
            victims = sorted((n for n in world if n != 0), reverse=True)[: self.victims]
            lost_at = time.time()
            pods.lose(victims)
            if self.return_after_s is not None:
                time.sleep(self.return_after_s)
            deadline = time.time() + 180
            # The survivors re-formed and trained a step (the loss is recovered, by the elastic
            # layer) before the replacement comes: a full run's replacement joined while the
            # shrunk world was still starting, and the grown world's restart closed the loss.
            while self.return_after_s is None and not any(
                e["kind"] == "recovered" and e["t"] > lost_at
                for e in read_events(self.ctx.run_root)
            ):
                if time.time() > deadline:
                    raise TimeoutError("the world did not re-form after the node loss")
                time.sleep(0.2)
            back = min(victims)
            node = self.nodes[back]
            self.kube.core.patch_node_status(node, p5(node), _preload_content=False)
            self.replaced.append(pods.start(back, suffix="y"))
        except BaseException as e:
            traceback.print_exc()
            self.errors.append(e)

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


class ElasticPods:
    """The pods of one elastic Job and the agent each runs (kubelets of kmock's nodes)."""

    def __init__(
        self, cluster: Cluster, job: str, argv: list[str], env: dict[str, str], grace_s: float
    ) -> None:
        self.cluster, self.kube, self.job, self.argv, self.env = (
            cluster,
            cluster.kube,
            job,
            argv,
            env,
        )
        self.grace_s = grace_s
        self.lock = threading.Lock()
        self.running: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}  # pod -> index, agent
        self.logs: list[Any] = []

    def start(self, index: int, suffix: str = "x") -> str:
        pod = f"{self.job}-{index}-{suffix}"
        self.kube.delete_pod(NS, pod)  # a relaunch under a deleted Job's name (no kmock GC)
        obj = pod_obj(self.job, index, self.cluster.nodes[index], suffix=suffix)
        self.kube.core.create_namespaced_pod(NS, obj, _preload_content=False)
        log = open(self.cluster.ctx.run_root.parent / f"{pod}.log", "w")  # noqa: SIM115
        self.logs.append(log)
        proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **worker_env(),
                **self.env,
                "JOB_COMPLETION_INDEX": str(index),
                POD_ENV: pod,
                **self.cluster.pod_memory(self.env, pod),
            },
            cwd=REPO,
            start_new_session=True,
        )
        with self.lock:
            self.running[pod] = (index, proc)
        return pod

    def lose(self, indexes: list[int]) -> None:
        """The nodes of ``indexes`` go at once (their agents and ranks die together: none can
        join another round), and the control plane shows each loss a second apart: the pod
        marked as a lost node's, then evicted by the taint manager."""
        with self.lock:
            gone = {i: (n, p) for n, (i, p) in self.running.items() if i in indexes}
            for pod, _ in gone.values():
                del self.running[pod]
        for _, proc in gone.values():
            kill_tree(proc.pid)
        for index in indexes:
            pod, proc = gone[index]
            _end_pod(pod, proc)
            # Its memory goes with the node.
            shutil.rmtree(self.cluster.ctx.run_root.parent / f"{pod}-shm", ignore_errors=True)
            node = self.cluster.nodes[index]
            unknown = p5(node, ready="Unknown")
            self.kube.core.patch_node_status(node, unknown, _preload_content=False)
            try:
                mark_disrupted(self.kube, pod)
            except ApiException as e:
                # The watcher found the node silent (its agent's beat stopped with it) and
                # deleted its pod first, as it would on a cluster whose node controller takes
                # 40 s to mark it: nothing left to mark.
                if e.status != 404:
                    raise
                continue
            time.sleep(1.0)
            self.kube.delete_pod(NS, pod)

    def end(self, pod: str, rc: int) -> None:
        self.cluster.exit_codes[pod] = rc
        done = terminated(0, "Completed", "Succeeded") if rc == 0 else terminated(rc)
        self.kube.core.patch_namespaced_pod_status(pod, NS, done, _preload_content=False)

    def watch(self, timeout: float) -> None:
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                if self.kube.read_job(NS, self.job) is None:
                    return  # the watcher deleted the Job: every pod goes
                present = {p["metadata"]["name"] for p in self.kube.job_pods(NS, self.job)}
                with self.lock:
                    running = dict(self.running)
                for pod, (index, proc) in running.items():
                    if pod not in present:  # deleted (a drill): the kubelet kills it
                        with self.lock:
                            self.running.pop(pod, None)
                        threading.Thread(
                            target=_end_pod, args=(pod, proc, self.grace_s), daemon=True
                        ).start()
                        continue
                    rc = proc.poll()
                    if rc is None:
                        continue
                    with self.lock:
                        self.running.pop(pod, None)
                    _end_pod(pod, proc)  # the container's other processes go with it
                    self.end(pod, rc)
                    if index == 0 and rc == 0:
                        self.succeed()
                        return
                time.sleep(0.2)
            raise TimeoutError(f"{self.job}: index 0 did not end within {timeout} s")
        finally:
            with self.lock:
                left = dict(self.running)
                self.running.clear()
            for pod, (_, proc) in left.items():
                _end_pod(pod, proc)
            for log in self.logs:
                log.close()

    def succeed(self) -> None:
        """Index 0 succeeded: the Job is complete (successPolicy); the controller stops the
        pods still running (an agent already ending, or a spare the closed rendezvous turns
        away, ends on its own first)."""
        self.cluster.complete_job(self.job)
        until = time.time() + 30
        with self.lock:
            left = dict(self.running)
            self.running.clear()
        for pod, (_, proc) in left.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, until - time.time()))
            self.end(pod, _end_pod(pod, proc))


# Which harness pod a process belongs to: every process of a pod ends with it, as a container's
# do, the agent's tree and whatever left it (a worker's async checkpoint writer, reparented to
# init, outlived its lost pod's agent in one run).
POD_ENV = "NVRX_TEST_POD"


def _end_pod(pod: str, proc: subprocess.Popen[bytes], grace_s: float = 0) -> int:
    """End every process of ``pod`` (its agent ``proc`` first; with a grace, as a kubelet does:
    SIGTERM to it, SIGKILL to all of them ``grace_s`` later); the agent's exit code."""
    if grace_s > 0:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    kill_tree(proc.pid)
    rc = proc.wait()
    escaped = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(POD_ENV) == pod:
                escaped.append(p)
    processes.end(escaped)
    return rc


def _flag(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"{name}="))


def _wait_listening(endpoint: str, timeout: float = 60) -> None:
    """Until the rendezvous host's store accepts connections."""
    import socket

    host, _, port = endpoint.rpartition(":")
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"no rendezvous store at {endpoint} within {timeout} s")


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

    def metadata_imported(parsed: dict[str, Any], **_: Any) -> None:
        """FSx's metadata import lists the repository's files on the file system, and the flow
        reads the manifest through its mount next (the content loads on that read). The
        shards' contents come with the hydration Job (Cluster.hydrate)."""
        tasks = parsed.get("DataRepositoryTasks") or []
        if tasks and tasks[0].get("Lifecycle") == "SUCCEEDED":
            data_dir = RunContext.create(params).data_dir
            data_dir.mkdir(parents=True, exist_ok=True)
            s3 = s3fs_filesystem(S3Settings(endpoint_url=params.s3_endpoint))
            s3.get(f"{d.bucket}/{d.prefix}/dataset.json", str(data_dir / "dataset.json"))

    fsx.meta.events.register("after-call.fsx.DescribeDataRepositoryTasks", metadata_imported)
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


def eks_params(run_id: str, s3: S3Settings, tmp_path: Path, **kw: Any) -> PipelineParams:
    return PipelineParams(
        backend="eks",
        run_id=run_id,
        # On EKS metrics listen on 0.0.0.0 (a pod's port); tests here stay on 127.0.0.1.
        metrics_port=None,
        state_dir=str(tmp_path / "state"),
        s3_endpoint=s3.endpoint_url,
        eks={"gpus_per_node": 1, "fsx_mount": str(tmp_path / "fsx"), "file_system_id": FS},
        **{"nodes": 2, "global_batch": 8, "steps": 20, **kw},
    )


def run_on_cluster(
    cluster: Cluster, chaos: ChaosProxy | None = None
) -> tuple[Any, PipelineResult | None]:
    """The pipeline, with ``cluster`` playing kmock's control plane and kubelets and FSx's
    API stubbed; every FSx call the flow makes is checked, none may be left unmade. ``chaos``:
    the flow's own client talks to the API server through it (the cluster acts directly)."""
    from kubernetes import client

    fsx, stub = stubbed_fsx(cluster.params)
    cluster.start()
    kube = cluster.kube
    if chaos is not None:
        kube = Kube(client.ApiClient(client.Configuration(host=chaos.url)))
    clients = EksClients(
        kube=kube,
        fsx=fsx,
        fsx_backoff=Backoff(first_s=0.05, max_s=0.2, deadline_s=30),
        poll_s=0.2,
    )
    try:
        with stub, use_clients(clients):
            state, result = run_pipeline(cluster.params)
            stub.assert_no_pending_responses()
    finally:
        cluster.stop.set()
        cluster.join(10)
    assert not cluster.errors, cluster.errors
    return state, result


# Node 1 lost as the control plane shows it (Node Ready=Unknown, the pod DisruptionTarget): the
# attempt of a fixed-size Job ends; the stage retry recovers. (Node 0 lost by the drill, which
# deletes its pod through the API, ends the attempt the same way: the watcher's decision for the
# rendezvous host and for a silent pod deleted through the API are tested on the stand-in
# without training processes, tests/test_eks_backend.py; the CI budget keeps one real run.)
LOSSES = [("node1-lost", {1}, [])]
BAD_DAY = Misbehaviour(
    "bad-day", expire_resumed=2, compacted=2, periodic=((29, 429), (37, 503), (53, 500)),
    watch_errors=(429, 503), cut=6,
)  # fmt: skip


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
    params = eks_params(run_id, s3_settings, tmp_path, drills={"faults": faults})
    cluster = Cluster(kube, params, s3_settings, lose_node_in=lose_node_in)
    # The flow's client meets an API server's bad day all along, with real agents training:
    # the loss is still seen and the healthy second attempt runs to completion.
    chaos = ChaosProxy(kube.core.api_client.configuration.host, BAD_DAY)
    try:
        state, result = run_on_cluster(cluster, chaos)
    finally:
        chaos.close()
    assert state.is_completed(), state.message
    assert {"410 expired pods", "410 expired nodes", "cut mid-line", "429", "500", "503"} <= set(
        chaos.seen.counts
    ), chaos.seen
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


@dataclasses.dataclass(frozen=True)
class InJobLoss:
    name: str
    params: dict[str, Any]
    path: str  # the layer that recovered the loss(es)
    worlds: tuple[int, ...]  # world sizes of the attempt's starts, in order
    paths: tuple[str, ...] = ()  # the path the watcher decided for each loss (default: path)
    victims: int = 1
    return_after_s: float | None = None  # see Cluster
    exact: bool = True  # the baseline's global batch and micro-batches: bitwise equal to it


# An elastic Job (1:2) shrinks to index 0 and grows back when the replacement pod joins. (A
# hot spare's takeover trains for real on the local backend, tests/test_elastic_pipeline.py;
# on the stand-in the watcher's decision for a Job with a spare is tested without training
# processes, tests/test_eks_backend.py: the CI budget.)
IN_JOB = [
    # The world of one is slowed (0.5 s a micro-batch, the same maths): without it, a CI run
    # ended the shrunk world's last step before the replacement pod's agent had started.
    pytest.param(
        InJobLoss(
            "shrink-and-grow",
            {"nodes": "1:2", "workload": "tests.adversarial.workloads:PACED_ALONE_GPT"},
            "elastic",
            (2, 1, 2),
        ),
        id="shrink-and-grow",
        # `extended` (not in `make test`): the stand-in's decision and absorption of a real
        # loss in an elastic Job (tests/test_eks_backend.py, its elastic rows), and the whole
        # pipeline shrinking and growing back bitwise on the local backend
        # (tests/test_elastic_pipeline.py) cover its parts; node-wait below keeps the
        # stand-in's whole-pipeline in-job loss in `make test`.
        marks=pytest.mark.extended,
    ),
    # 2:3 loses indexes 2 then 1: the first leaves the minimum (elastic), the second leaves
    # index 0 alone, which waits in the rendezvous (node-wait) instead of ending the attempt;
    # index 1's replacement joins 2 s later and the job re-forms on 2 nodes in-job. A global
    # batch divisible by 3 ranks: not the baseline's, so not compared bitwise.
    pytest.param(
        InJobLoss(
            "node-wait",
            {"nodes": "2:3", "global_batch": 6},
            "elastic",
            (3, 2),
            paths=("elastic", "node-wait"),
            victims=2,
            return_after_s=2.0,
            exact=False,
        ),
        id="node-wait",
    ),
]


@pytest.mark.parametrize("d", IN_JOB)
def test_node_loss_absorbed_in_job_on_eks(
    kube: Kube, baseline: PipelineResult, s3_settings: S3Settings, tmp_path: Path, d: InJobLoss
):
    """A real node loss on an elastic Indexed Job (one ft_launcher agent per pod): the watcher
    decides the path from the pods it sees, the in-job layer re-forms without the node, the
    Job controller's replacement pod joins back; one attempt, bitwise equal to the baseline."""
    seed_cluster(kube)
    spare_node = "ip-10-0-1-3"
    kube.core.create_node(p5(spare_node), _preload_content=False)
    params = eks_params(f"eks-{d.name}", s3_settings, tmp_path, **d.params)
    cluster = Cluster(
        kube,
        params,
        s3_settings,
        lose_node_in={1},
        nodes=(*NODES, spare_node),
        victims=d.victims,
        return_after_s=d.return_after_s,
    )
    state, result = run_on_cluster(cluster)
    assert state.is_completed(), state.message
    assert result is not None and result.status == "completed"
    assert result.final_step == 20 and result.stage_attempts["train"] == 1, "no stage retry"
    if d.exact:
        # One rank per pod: every world of these Jobs sums two micro-batch gradients per step
        # (arch §7), so the parameters and the loss are the fault-free baseline's, bitwise.
        assert result.params_sha256 == baseline.params_sha256
        assert result.final_loss == baseline.final_loss
    paths = d.paths or (d.path,)
    assert [(f.kind, f.path, f.recovered_by) for f in result.faults] == [
        ("node-loss", p, d.path) for p in paths
    ]
    assert all(f.recovery_s and f.recovery_s > 0 for f in result.faults)
    fault = result.faults[-1]
    starts = [e for e in read_events(cluster.ctx.run_root) if e["kind"] == "train_start"]
    worlds = [(e["world_size"], e["nodes"]) for e in starts]
    # A restart on the very same nodes counts once (see test_elastic_pipeline).
    assert tuple(w[0] for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]) == d.worlds
    # The Job controller's replacement for the lost index ran: it trained in the grown world
    # and ended with the job (a waiting agent turned away exits 0: its pod cannot fail the Job).
    [replacement] = cluster.replaced
    assert starts[-1]["nodes"] == [0, fault.node]
    assert cluster.exit_codes[replacement] == 0
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", params.run_id or "") == []
    assert result.checkpoint.validated and result.checkpoint.step == 20
    assert_exported(result, s3_settings)


# Issue 42 on the stand-in, each beside a hot spare that takes the node's place in-job: a pod's
# node frozen (its agent stops the pod: trainer.node_beat); evicted with notice (the pod deleted
# with its grace; the stand-in's kubelet sends SIGTERM, then SIGKILL); corrupting every step (the
# step check rejects it twice, the watcher condemns the node); slow (the straggler judge confirms
# it, the node is cordoned through the API).
@dataclasses.dataclass(frozen=True)
class GrayPod:
    drill: str
    said: str  # in the loss's detail
    taken: str = ""  # the watcher's loss fault's prefix, when not the drill itself
    params: tuple[tuple[str, Any], ...] = ()
    exact: bool = True  # 20 steps, bitwise equal to the baseline


SLOW_RULE = {"policy": "replace", "window": 5, "confirm_windows": 3, "confirm_s": 2.0,
             "warmup_steps": 3}  # fmt: skip
GRAY_PODS = [
    pytest.param(
        GrayPod("node-freeze@step=7,node=1", "silent for"),
        id="freeze",
        # The CI budget: the freeze is the pod's own agent's, as locally (test_fault_drills,
        # freeze-spare); a silent pod deleted through the API: test_eks_backend.
        marks=pytest.mark.extended,
    ),
    pytest.param(GrayPod("node-evict@step=7,node=1", "evicted with notice"), id="evict"),
    pytest.param(
        GrayPod("corrupt-grad@step=8,node=1,every", "check twice", taken="step-check@step=8"),
        id="corrupt-every",
        marks=pytest.mark.extended,  # the CI budget: the same path runs locally in make test
    ),
    pytest.param(
        GrayPod(
            "slow@step=4,node=1,factor=3", "slow node taken away", taken="slow@",
            params=(("straggler", SLOW_RULE), ("steps", 30)), exact=False,
        ),
        id="slow",
        marks=pytest.mark.extended,  # the CI budget: the same path runs locally in make test
    ),
]  # fmt: skip


@pytest.mark.parametrize("g", GRAY_PODS)
def test_a_gray_pod_is_replaced_by_a_spare_on_eks(
    kube: Kube, baseline: PipelineResult, s3_settings: S3Settings, tmp_path: Path, g: GrayPod
):
    seed_cluster(kube)
    spare_node = "ip-10-0-1-3"
    kube.core.create_node(p5(spare_node), _preload_content=False)
    params = eks_params(
        "eks-gray", s3_settings, tmp_path, spares=1, drills={"faults": [g.drill]}, **dict(g.params)
    )
    cluster = Cluster(
        kube, params, s3_settings, lose_node_in=set(), nodes=(*NODES, spare_node),
        graceful_delete="evict" in g.drill,
    )  # fmt: skip
    state, result = run_on_cluster(cluster)
    assert state.is_completed(), state.message
    assert result is not None and result.final_step == params.steps
    assert result.stage_attempts["train"] == 1, "no stage retry"
    if g.exact:
        assert result.params_sha256 == baseline.params_sha256
    losses = [(f.fault, f.path, f.recovered_by) for f in result.faults if f.path]
    assert len(losses) == 1 and losses[0][1:] == ("spare", "spare"), losses
    assert (losses[0][0] or "").startswith(g.taken or g.drill), losses
    events = read_events(cluster.ctx.run_root)
    [fault] = [e for e in events if e["kind"] == "fault" and e.get("path")]
    assert fault["node"] == 1 and g.said in fault["detail"], fault
    if "evict" in g.drill:  # the pod's agent got SIGTERM: its workers saved their step first
        assert_handed_off(events, fault)
    starts = [e for e in events if e["kind"] == "train_start"]
    assert starts[0]["nodes"] == [0, 1], "node 1 trained first"
    assert starts[-1]["nodes"] == [0, 2], "the spare trained in node 1's place"
    if g.drill.startswith("slow"):
        node = kube.core.read_node(NODES[1], _preload_content=False)
        assert json.loads(node.data)["spec"].get("unschedulable") is True, "cordoned"
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", params.run_id or "") == []
