"""The EKS attempt runner with the real ``kubernetes`` client against kmock's Kubernetes emulator
over HTTP (no real API server can run here). A scenario driver plays the control plane: it
creates the Job's pods, moves their phases, marks a node unreachable, adds DisruptionTarget.
kmock has no controllers, selectors or validation; the manifests' schema is checked separately
(tests/test_eks_render.py)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flows.context import eks_train_config
from flows.models import PipelineParams
from tasks.backends.base import LaunchRequest
from tasks.backends.eks.backend import EksBackend
from tasks.backends.eks.clients import EksClients
from tasks.backends.eks.kube import Kube
from tasks.backends.eks.render import job_name
from tasks.classify import EndKind
from tasks.train_stage import AttemptReport, run_attempt
from tests.eks_cluster import NS, exists, mark_disrupted, node_obj, pod_obj, terminated
from tests.kube_chaos import ChaosProxy, Misbehaviour
from trainer import fence
from trainer.event_types import Event, Step, TrainStart
from trainer.events import EventLog
from trainer.rundir import Layout, RunDir

TAG = "inv001"  # the invocation's tag in the Job's name


def result_later(root: Path, steps: int, after_s: float = 1.0) -> None:
    """What the pods' trainer writes on the shared filesystem when it completes: with the
    attempt's epoch, which its pods get as NVRX_EPOCH (trainer.fence)."""

    def write() -> None:
        now = fence.current(RunDir(root))
        epoch = now.epoch if now else None
        result = {"status": "completed", "final_step": steps, "epoch": epoch}
        (root / "result.json").write_text(json.dumps(result))

    threading.Timer(after_s, write).start()


def eks_params(
    run_id: str, fsx: Path, nodes: int | str = 2, spares: int = 0, global_batch: int = 16
) -> PipelineParams:
    return PipelineParams(
        backend="eks",
        nodes=nodes,
        spares=spares,
        global_batch=global_batch,
        run_id=run_id,
        eks={"fsx_mount": str(fsx)},
    )


def attempt_on(
    kube: Kube,
    params: PipelineParams,
    attempt: int = 1,
    *,
    deadline_s: float = 8,
    on_event=lambda e: None,
    join_timeout_s: float | None = None,
    check_owner: Callable[[str], None] = lambda action: None,
    silence_s: float | None = None,
) -> AttemptReport:
    """One train attempt through the same code the train stage runs (run_attempt + EksBackend).
    ``join_timeout_s``: the survivors' rendezvous join timeout (how long a node-wait lasts)."""
    run_id = params.run_id or ""
    cfg = eks_train_config(params, run_id)
    if join_timeout_s is not None:
        cfg = dataclasses.replace(
            cfg, injob=dataclasses.replace(cfg.injob, rdzv_join_timeout_s=join_timeout_s)
        )
    if silence_s is not None:
        cfg = dataclasses.replace(
            cfg, injob=dataclasses.replace(cfg.injob, node_silence_s=silence_s)
        )
    backend = EksBackend(
        params.eks,
        nodes=params.launched_nodes,
        clients=EksClients(kube=kube, fsx=None, poll_s=0.2),
    )
    request = LaunchRequest(
        run_id=run_id,
        attempt=attempt,
        cfg=cfg,
        nodes=params.max_nodes,
        min_nodes=params.node_range.min,
        spares=params.spares,
        nproc_per_node=params.eks.gpus_per_node,
        deadline_s=deadline_s,
        invocation=TAG,
    )
    return run_attempt(backend, request, on_event=on_event, check_owner=check_owner)


class ControlPlane(threading.Thread):
    """Plays the Job controller and the kubelets for one scenario."""

    def __init__(
        self, kube: Kube, job: str, act: Callable[[Kube, str], None], pods: int = 2
    ) -> None:
        super().__init__(daemon=True)
        self.kube, self.job, self.act, self.pods = kube, job, act, pods

    def run(self) -> None:
        deadline = time.time() + 30
        while self.kube.read_job(NS, self.job) is None and time.time() < deadline:
            time.sleep(0.1)
        for i, n in enumerate(("ip-10-0-1-1", "ip-10-0-1-2", "ip-10-0-1-3")[: self.pods]):
            self.kube.core.create_namespaced_pod(
                NS, pod_obj(self.job, i, n), _preload_content=False
            )
        time.sleep(1.5)
        self.act(self.kube, self.job)


def succeed(k: Kube, job: str, indexes: tuple[int, ...] = (0, 1)) -> None:
    """Pods ``indexes`` complete and the Job with them (an elastic Job: index 0 alone)."""
    for i in indexes:
        k.core.patch_namespaced_pod_status(
            f"{job}-{i}-x", NS, terminated(0, "Completed", "Succeeded"), _preload_content=False
        )
    k.batch.patch_namespaced_job_status(
        job,
        NS,
        {"status": {"conditions": [{"type": "Complete", "status": "True"}]}},
        _preload_content=False,
    )


def lose_node(k: Kube, job: str) -> None:
    k.core.patch_node_status(
        "ip-10-0-1-2",
        node_obj("ip-10-0-1-2", "Unknown", "NodeStatusUnknown"),
        _preload_content=False,
    )
    mark_disrupted(k, f"{job}-1-x")


def exit_code(code: int, reason: str = "Error") -> Callable[[Kube, str], None]:
    def act(k: Kube, job: str) -> None:
        k.core.patch_namespaced_pod_status(
            f"{job}-0-x", NS, terminated(code, reason), _preload_content=False
        )
        k.core.patch_namespaced_pod_status(
            f"{job}-1-x", NS, terminated(143, "Error"), _preload_content=False
        )

    return act


def image_pull(k: Kube, job: str) -> None:
    for i in range(2):
        k.core.patch_namespaced_pod_status(
            f"{job}-{i}-x",
            NS,
            {
                "status": {
                    "phase": "Pending",
                    "containerStatuses": [
                        {
                            "name": "trainer",
                            "ready": False,
                            "state": {
                                "waiting": {
                                    "reason": "ImagePullBackOff",
                                    "message": 'Back-off pulling image "img:missing"',
                                }
                            },
                        }
                    ],
                }
            },
            _preload_content=False,
        )


def hang(k: Kube, job: str) -> None:
    pass  # pods stay Running past the deadline


def delete_outside(k: Kube, job: str) -> None:
    """`kubectl delete job` by someone else while the pods run: the attempt ends with that
    cause, at once (not at the deadline), and is not read as a node loss."""
    k.batch.delete_namespaced_job(job, NS, _preload_content=False)


SCENARIOS = [
    # completed and node-loss: test_an_api_servers_bad_day, through the misbehaving server
    ("injob-exhausted", exit_code(1), EndKind.INJOB_EXHAUSTED, True),
    ("do-not-requeue", exit_code(93), EndKind.DO_NOT_REQUEUE, True),
    ("oom", exit_code(137, "OOMKilled"), EndKind.BUG, True),
    ("image-pull", image_pull, EndKind.BUG, False),
    ("deadline", hang, EndKind.TIMEOUT, False),
    ("deleted-outside", delete_outside, EndKind.BUG, False),
]


@pytest.mark.parametrize(("name", "act", "kind", "kept"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_attempt_outcomes(kube: Kube, tmp_path: Path, name, act, kind, kept):
    params = eks_params(f"k-{name}", tmp_path)
    driver = ControlPlane(kube, job_name(params.run_id or "", 1, TAG), act)
    driver.start()
    if kind == EndKind.COMPLETED:
        result_later(tmp_path / "runs" / (params.run_id or ""), params.steps)
    report = attempt_on(kube, params, deadline_s=4 if kind == EndKind.TIMEOUT else 8)
    driver.join(5)
    assert report.outcome.kind == kind, report.outcome.message
    if name == "deleted-outside":
        assert "deleted outside the pipeline" in report.outcome.message
    job = report.released["job"]
    assert report.released["kept_job"] == kept
    assert (kube.read_job(NS, job) is not None) == kept  # failed Job kept for forensics


def force_delete_pod(k: Kube, job: str) -> None:
    """`kubectl delete pod --force --grace-period=0` on a healthy node: no DisruptionTarget."""
    k.delete_pod(NS, f"{job}-1-x")


def node_not_ready(k: Kube, job: str) -> None:
    """The kubelet reports NotReady (runtime down, PLEG unhealthy) and keeps reporting; the
    pods stay Running and nothing evicts them (the emulator runs no taint manager)."""
    k.core.patch_node_status(
        "ip-10-0-1-2", node_obj("ip-10-0-1-2", "False", "KubeletNotReady"), _preload_content=False
    )


EVERYTHING = Misbehaviour(
    "everything", expire_resumed=1, compacted=1, bursts=((0, 2, 429), (5, 3, 503), (12, 2, 500)),
    watch_errors=(429, 503), cut=3,
)  # fmt: skip
# The same without 429s (their Retry-After waits cost seconds, the 429 rows show them).
UNTHROTTLED = Misbehaviour(
    "unthrottled", expire_resumed=1, compacted=1, bursts=((5, 3, 503), (12, 2, 500)),
    watch_errors=(503,), cut=3,
)  # fmt: skip
# (misbehaviour, what the control plane does, the outcome, words of its message, what the
# proxy must have done). A healthy attempt completes through every one of the server's
# ordinary answers; a real end is still seen, with its cause, through all of them at once.
CHAOS = [
    (Misbehaviour("410-on-each-watch", expire_resumed=1, compacted=1), succeed,
     EndKind.COMPLETED, "", {f"410 {w} {r}" for w in ("expired", "compacted")
                             for r in ("pods", "nodes")}),
    (Misbehaviour("429-and-5xx", bursts=((0, 2, 429), (4, 3, 503), (9, 3, 500)),
                  watch_errors=(429, 500)), succeed, EndKind.COMPLETED, "", {"429", "500", "503"}),
    (Misbehaviour("slow-and-cut", slow_s=0.2, cut=4), succeed, EndKind.COMPLETED, "",
     {"slow", "cut mid-line"}),
    (EVERYTHING, lose_node, EndKind.NODE_LOSS, "unreachable", {"429", "503", "cut mid-line"}),
    (UNTHROTTLED, force_delete_pod, EndKind.BUG, "deleted outside the pipeline",
     {"503", "cut mid-line"}),
    (UNTHROTTLED, node_not_ready, EndKind.NODE_LOSS, "NotReady for", {"503", "cut mid-line"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("m", "act", "kind", "words", "done"),
    CHAOS,
    ids=[f"{c[0].name}-{c[1].__name__}" for c in CHAOS],
)
def test_an_api_servers_bad_day(kube: Kube, tmp_path: Path, m, act, kind, words, done):
    """The attempt's own client talks to the API server through a proxy that misbehaves as a
    real one does (tests/kube_chaos.py); the control plane acts directly. Every scenario ends
    with the outcome stated, before the deadline, and only a decided outcome deletes the Job."""
    from kubernetes import client

    proxy = ChaosProxy(kube.core.api_client.configuration.host, m)
    try:
        chaotic = Kube(client.ApiClient(client.Configuration(host=proxy.url)))
        params = PipelineParams(
            backend="eks", nodes=2, global_batch=16, run_id=f"k-chaos-{m.name}",
            eks={"fsx_mount": str(tmp_path), "unreachable_toleration_s": 2},  # the NotReady bound
        )  # fmt: skip
        name = job_name(params.run_id or "", 1, TAG)
        root = tmp_path / "runs" / (params.run_id or "")

        def pods_act(k: Kube, job: str) -> None:
            if kind == EndKind.COMPLETED:  # the pods' trainer wrote its result under the epoch
                result_later(root, params.steps, after_s=0.0)
            act(k, job)

        driver = ControlPlane(kube, name, pods_act)
        driver.start()
        report = attempt_on(chaotic, params, deadline_s=20)
        driver.join(5)
    finally:
        proxy.close()
    assert report.outcome.kind == kind, (report.outcome.message, proxy.seen)
    assert words in report.outcome.message
    assert done <= set(proxy.seen.counts), proxy.seen  # the misbehaviour really happened
    assert (kube.read_job(NS, name) is not None) == report.released["kept_job"]


def test_node_loss_then_next_attempt_succeeds(kube: Kube, tmp_path: Path):
    from tests.eks_cluster import seed_cluster

    seed_cluster(kube)  # the second attempt first waits for enough healthy nodes
    params = eks_params("k-retry", tmp_path)
    outcomes = []
    for attempt, act in ((1, lose_node), (2, succeed)):
        kube.core.patch_node_status("ip-10-0-1-2", node_obj("ip-10-0-1-2"), _preload_content=False)
        driver = ControlPlane(kube, job_name("k-retry", attempt, TAG), act)
        driver.start()
        if attempt == 2:
            result_later(tmp_path / "runs" / "k-retry", params.steps)
        r = attempt_on(kube, params, attempt, deadline_s=15)
        driver.join(5)
        outcomes.append((r.released["job"], r.outcome.kind))
    assert outcomes == [
        (f"nvrx-k-retry-a1-{TAG}", EndKind.NODE_LOSS),
        (f"nvrx-k-retry-a2-{TAG}", EndKind.COMPLETED),
    ]


def test_a_run_never_has_two_jobs(kube: Kube):
    """A dead flow runner's Job of this run (any attempt) is deleted before a new one starts;
    other runs' Jobs are left alone."""
    from tasks.backends.eks.backend import delete_run_jobs
    from tasks.backends.eks.render import render_job

    params = PipelineParams(backend="eks", nodes=2, global_batch=16, run_id="k-two")
    other = PipelineParams(backend="eks", nodes=2, global_batch=16, run_id="k-other")
    for p, attempt in ((params, 3), (other, 1)):
        run_id = p.run_id or ""
        cfg = eks_train_config(p, run_id)
        kube.apply(render_job(cfg, run_id=run_id, attempt=attempt, nodes=2, eks=p.eks))
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", "k-two") == ["nvrx-k-two-a3"]
    assert delete_run_jobs(kube, NS, "k-two") == ["nvrx-k-two-a3"]
    assert kube.read_job(NS, "nvrx-k-two-a3") is None
    assert kube.read_job(NS, "nvrx-k-other-a1") is not None
    assert delete_run_jobs(kube, NS, "k-two") == []


def test_an_interrupted_watch_deletes_the_job(kube: Kube, tmp_path: Path):
    """Cancelled or interrupted while watching (Prefect's SIGTERM bridge, Ctrl-C): the Job, its
    Service and NetworkPolicy do not stay behind holding the nodes."""
    params = eks_params("k-cancel", tmp_path)
    name = job_name("k-cancel", 1, TAG)
    root = tmp_path / "runs" / "k-cancel"

    applied: list[str] = []

    def interrupt(e: Event) -> None:
        if isinstance(e, Step) and kube.read_job(NS, name) is not None:
            applied.extend(k for k, read in _rendered(kube) if exists(read, name))
            raise KeyboardInterrupt("cancelled")  # as Prefect's SIGTERM bridge raises

    # A trainer event arrives once the Job exists: the stage's progress callback is interrupted.
    threading.Timer(1.0, lambda: worker_log(root).emit(Step(step=1, loss=1.0))).start()
    with pytest.raises(KeyboardInterrupt):
        attempt_on(kube, params, deadline_s=30, on_event=interrupt)
    assert kube.read_job(NS, name) is None
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", "k-cancel") == []
    # What was rendered with the Job was there, and went with it.
    assert applied == ["Service", "NetworkPolicy"]
    assert [k for k, read in _rendered(kube) if exists(read, name)] == []


def _rendered(kube: Kube) -> list[tuple[str, Callable[..., Any]]]:
    return [
        ("Service", kube.core.read_namespaced_service),
        ("NetworkPolicy", kube.networking.read_namespaced_network_policy),
    ]


def test_a_lease_taken_over_stops_the_watch_and_leaves_the_job(kube: Kube, tmp_path: Path):
    """Two orchestrators that both believe they hold the lease (a takeover across hosts, the
    lock lost): the stale one's watch stops at its next poll with LeaseLost, and the Job, its
    Service and NetworkPolicy, now the new owner's, are untouched."""
    import os

    from tasks.ownership.lease import LeaseLost, LeaseRecord, Owner, RunLease

    params = eks_params("k-lost", tmp_path)
    name = job_name("k-lost", 1, TAG)
    root = tmp_path / "runs" / "k-lost"
    root.mkdir(parents=True)
    old = RunLease(root, "k-lost", heartbeat_s=0.1)
    old.acquire()

    def take_over() -> None:  # the new owner, on another host, writes its record
        while kube.read_job(NS, name) is None:
            time.sleep(0.1)
        new = Owner("newowner", os.getpid(), "other-host", time.time(), time.time())
        (root / "owner.lease").write_text(LeaseRecord("k-lost", new, time.time()).to_json())

    driver = ControlPlane(kube, name, hang)  # its pods train on, Running
    driver.start()
    threading.Thread(target=take_over, daemon=True).start()
    try:
        with pytest.raises(LeaseLost, match="taken over by pid .* on other-host"):
            attempt_on(kube, params, deadline_s=60, check_owner=old.check)
    finally:
        old.release()
    driver.join(5)
    assert kube.read_job(NS, name) is not None  # the new owner's now
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", "k-lost") == [name]
    assert kube.core.read_namespaced_service(name, NS) is not None
    assert kube.networking.read_namespaced_network_policy(name, NS) is not None


def test_a_silent_pod_is_taken_away_as_a_lost_node(kube: Kube, tmp_path: Path):
    """A node that stops without dying on EKS (a partition, a stalled kubelet): its pod stays
    Running, but its beat on FSx stops while the other pod's goes on. The watcher deletes the
    silent pod through the API and ends the attempt as a node loss (a fixed-size Job: the
    stage retry)."""
    from tests.helpers import read_events
    from trainer.events import EventLog
    from trainer.node_beat import NodeBeat

    params = eks_params("k-silent", tmp_path)
    name = job_name("k-silent", 1, TAG)
    root = tmp_path / "runs" / "k-silent"

    def pods_train(k: Kube, job: str) -> None:
        """What the pods' workers do on FSx: say which nodes train, and beat (node 1 stops)."""
        now = fence.current(RunDir(root))
        epoch = now.epoch if now else None
        EventLog(root, epoch=epoch).emit(TrainStart(world_size=2, nodes=[0, 1]))
        beats = [NodeBeat(RunDir(root, epoch).beat_file(n), interval_s=0.1) for n in (0, 1)]
        time.sleep(0.5)
        beats[1].close(done=False)  # frozen: alive to the API, silent to the job
        threading.Timer(30, beats[0].close).start()

    driver = ControlPlane(kube, name, pods_train)
    driver.start()
    report = attempt_on(kube, params, deadline_s=60, silence_s=3.0)
    driver.join(5)
    assert report.outcome.kind == EndKind.NODE_LOSS, report.outcome.message
    [fault] = [e for e in read_events(root) if e["kind"] == "fault"]
    assert fault["node"] == 1 and fault["path"] == "stage-retry"
    assert "silent for" in fault["detail"]
    left = {p["metadata"]["name"] for p in kube.job_pods(NS, name)}
    assert f"{name}-1-x" not in left  # deleted through the API


@pytest.mark.parametrize("collection", ["pods", "jobs"])
def test_the_emulator_lists_an_empty_collection(kube: Kube, collection: str):
    """Before any pod or Job exists, a list answers 200 and no items, as a real API server's
    does (kmock alone answers 404): the attempt's pod watch lists then, and a 404 it backs off
    from made a pod created and deleted meanwhile invisible (the bad-day force-delete flake)."""
    list_fn = {"pods": kube.core.list_namespaced_pod, "jobs": kube.batch.list_namespaced_job}
    resp = list_fn[collection](NS, _preload_content=False)
    assert resp.status == 200 and json.loads(resp.data)["items"] == []


def test_every_kubernetes_call_has_a_request_timeout(monkeypatch):
    """An API server that accepts the connection and never answers cannot stall the flow: every
    call ends within the request timeout (here shortened to 1 s)."""
    import socket

    from kubernetes import client

    from tasks.backends.eks import kube as kube_mod

    monkeypatch.setattr(kube_mod, "REQUEST_TIMEOUT_S", (1.0, 1.0))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the backlog; nothing ever reads or replies
    try:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg.retries = 0
        k = Kube(client.ApiClient(cfg))
        for call in (
            lambda: k.read_job(NS, "x"),
            lambda: k.nodes(),
            lambda: k.jobs_labelled(NS, "a", "b"),
            lambda: k.delete_job(NS, "x"),
        ):
            t0 = time.monotonic()
            with pytest.raises(Exception, match="(?i)timed? ?out"):
                call()
            assert time.monotonic() - t0 < 10
    finally:
        silent.close()


def test_wait_for_nodes_gives_up_with_the_reason(kube: Kube):
    from tasks.backends.eks.backend import wait_for_nodes
    from tasks.errors import CapacityNotRestored
    from tests.eks_cluster import NODES, p5, seed_cluster
    from tests.test_eks_preflight import REQ

    seed_cluster(kube)
    kube.core.patch_node_status(NODES[1], p5(NODES[1], ready="Unknown"), _preload_content=False)
    waits: list[str] = []
    with pytest.raises(CapacityNotRestored) as err:
        wait_for_nodes(kube, REQ, timeout_s=0.6, poll_s=0.2, log=waits.append)
    assert "1 usable node(s), need 2" in str(err.value) and f"{NODES[1]}: not Ready" in str(
        err.value
    )
    assert "same run_id" in str(err.value) and waits
    kube.core.patch_node_status(NODES[1], p5(NODES[1]), _preload_content=False)
    assert wait_for_nodes(kube, REQ, timeout_s=5, poll_s=0.2).detail.startswith("2 usable")


def test_hydration_job_failure_names_the_job(kube: Kube):
    from tasks.backends.eks.hydrate import hydration_job, wait_for_job
    from tasks.backends.eks.params import EksParams
    from tasks.errors import HydrationError

    job = hydration_job(
        name="nvrx-r1-hydrate",
        eks=EksParams(namespace=NS, image="img"),
        data_dir="/fsx/datasets/b/p",
        manifest_sha256="ab" * 32,
    )
    kube.apply(job)
    kube.batch.patch_namespaced_job_status(
        "nvrx-r1-hydrate",
        NS,
        {
            "status": {
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ]
            }
        },
        _preload_content=False,
    )
    with pytest.raises(HydrationError) as err:
        wait_for_job(kube, NS, "nvrx-r1-hydrate", deadline_s=5, poll_s=0.1)
    assert "BackoffLimitExceeded" in str(err.value)
    assert "kubectl logs -n nvrx job/nvrx-r1-hydrate" in str(err.value)


def test_log_follow_survives_a_dropped_stream_without_duplicates():
    """kmock has no log subresource: a minimal HTTP endpoint plays the API server's
    ``pods/log?follow=true&timestamps=true``, dropping the first stream mid-line."""
    import http.server
    from datetime import UTC, datetime, timedelta

    from kubernetes import client

    base = datetime.now(UTC) - timedelta(seconds=5)
    lines = [f"{(base + timedelta(seconds=i)).isoformat()} line {i}" for i in range(5)]
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            if len(requests) == 1:  # three lines and half of the fourth, then the drop
                self.wfile.write(("\n".join(lines[:3]) + "\n" + lines[3][:12]).encode())
            else:  # reopened with sinceSeconds: overlapping lines come again
                self.wfile.write(("\n".join(lines[1:]) + "\n").encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    kube = Kube(client.ApiClient(cfg))
    got: list[str] = []
    stop = threading.Event()
    t = threading.Thread(target=kube.follow_log, args=(NS, "p", got.append, stop), daemon=True)
    t.start()
    deadline = time.time() + 10
    while len(requests) < 3 and time.time() < deadline:
        time.sleep(0.1)
    stop.set()
    t.join(5)
    server.shutdown()
    assert got == [f"line {i}" for i in range(5)]
    assert "follow=true" in requests[0] and "timestamps=true" in requests[0]
    assert "sinceSeconds" not in requests[0] and "sinceSeconds=" in requests[1]


def worker_log(root: Path) -> EventLog:
    """A worker's event log: its events carry the epoch the watcher published, as a pod's do
    (NVRX_EPOCH); the watcher counts no other's."""
    return EventLog(root, epoch=RunDir(root).adopted().epoch)


def lose_then_complete(lost: int, root: Path, world: list[int]) -> Callable[[Kube, str], None]:
    """The world ``world`` starts training (its train_start, as the trainer writes it on FSx);
    the node of pod ``lost`` goes (as the control plane shows it); the job trains on and the
    rendezvous host's pod completes, which ends an elastic Job (its success policy)."""

    def act(k: Kube, job: str) -> None:
        worker_log(root).emit(TrainStart(nodes=world, world_size=len(world)))
        time.sleep(1.0)
        mark_disrupted(k, f"{job}-{lost}-x")
        time.sleep(2.0)
        succeed(k, job, (0,))

    return act


# A real node loss on an elastic Job, as the watcher sees it: decided by tasks.loss_policy,
# absorbed in-job (the attempt goes on and completes) or, for the rendezvous host's pod, the
# end of the attempt. (nodes, spares, pods, lost index, path, outcome)
ELASTIC = [
    ("1:2", 0, 2, 1, "elastic", EndKind.COMPLETED),
    (2, 1, 3, 1, "spare", EndKind.COMPLETED),
    ("1:2", 0, 2, 0, "stage-retry", EndKind.NODE_LOSS),
]


@pytest.mark.parametrize(("nodes", "spares", "pods", "lost", "path", "kind"), ELASTIC)
def test_an_elastic_job_absorbs_a_real_node_loss(
    kube: Kube, tmp_path: Path, nodes, spares, pods, lost, path, kind
):
    from tests.helpers import read_events

    run_id = f"k-el-{pods}-{lost}"
    params = eks_params(run_id, tmp_path, nodes=nodes, spares=spares)
    job = job_name(run_id, 1, TAG)
    root = tmp_path / "runs" / run_id
    driver = ControlPlane(kube, job, lose_then_complete(lost, root, [0, 1]), pods=pods)
    driver.start()
    if kind == EndKind.COMPLETED:
        result_later(root, params.steps, after_s=3.0)
    report = attempt_on(kube, params, deadline_s=15)
    driver.join(5)
    assert report.outcome.kind == kind, report.outcome.message
    [fault] = [e for e in read_events(root) if e["kind"] == "fault"]
    assert (fault["fault_kind"], fault["node"], fault["path"]) == ("node-loss", lost, path)
    # The survivors are told to re-form (the marker) only when the in-job layer absorbs it.
    assert (root / Layout.NODE_LOST).exists() == (path != "stage-retry")


def test_below_the_minimum_the_survivors_wait_then_the_stage_retry(kube: Kube, tmp_path: Path):
    """2:3 loses indexes 2 and 1 and no replacement joins: the first loss is absorbed
    (elastic), the second leaves index 0 alone to wait (node-wait); when the wait (the
    survivors' join timeout, 4 s here, plus the watcher's grace) passes with no world re-formed,
    the attempt ends in a node loss: the stage retry's."""
    from tasks.train_stage import WAIT_GRACE_S
    from tests.helpers import read_events

    run_id = "k-el-wait"
    params = eks_params(run_id, tmp_path, nodes="2:3", global_batch=24)
    job = job_name(run_id, 1, TAG)
    root = tmp_path / "runs" / run_id

    def act(k: Kube, name: str) -> None:
        worker_log(root).emit(TrainStart(nodes=[0, 1, 2], world_size=3))
        time.sleep(1.0)
        mark_disrupted(k, f"{name}-2-x")
        time.sleep(1.0)
        mark_disrupted(k, f"{name}-1-x")

    driver = ControlPlane(kube, job, act, pods=3)
    driver.start()
    report = attempt_on(kube, params, deadline_s=60, join_timeout_s=4.0)
    driver.join(5)
    assert report.outcome.kind == EndKind.NODE_LOSS, report.outcome.message
    events = read_events(root)
    faults = [e for e in events if e["kind"] == "fault"]
    assert [(e["node"], e["path"]) for e in faults] == [(2, "elastic"), (1, "node-wait")]
    assert "wait up to 4 s" in faults[1]["detail"]
    # The watcher let the survivors wait the whole time before it stopped the attempt.
    [end] = [e for e in events if e["kind"] == "stage_attempt_end"]
    assert end["t"] - faults[1]["t"] >= 4.0 + WAIT_GRACE_S
    assert kube.jobs_labelled(NS, "nvrx.io/run-id", run_id) == []


def test_render_k8s_prints_what_the_flow_creates(kube: Kube, tmp_path: Path, capsys):
    """One code path (issue 28, item 5): the bundle `render-k8s` prints for a run, attempt,
    invocation and epoch is, object for object and field for field, what the train flow's
    launch created in the cluster; it carries the attempt's config (a ConfigMap the Job
    mounts), so `kubectl apply` of it needs nothing else."""
    import yaml

    from flows.cli import main
    from trainer.config import TrainConfig, load_config

    params = eks_params("k-bundle", tmp_path)
    name = job_name("k-bundle", 1, TAG)
    created: dict[str, dict] = {}

    def capture(k: Kube, job: str) -> None:
        for kind, read in (
            ("NetworkPolicy", k.networking.read_namespaced_network_policy),
            ("Service", k.core.read_namespaced_service),
            ("ConfigMap", k.core.read_namespaced_config_map),
            ("Job", k.batch.read_namespaced_job),
        ):
            created[kind] = json.loads(read(job, NS, _preload_content=False).data)
        result_later(tmp_path / "runs" / "k-bundle", params.steps, after_s=0.0)
        succeed(k, job)

    driver = ControlPlane(kube, name, capture)
    driver.start()
    report = attempt_on(kube, params, deadline_s=30)
    driver.join(5)
    assert report.outcome.kind == EndKind.COMPLETED, report.outcome.message
    env = created["Job"]["spec"]["template"]["spec"]["containers"][0]["env"]
    epoch = next(e["value"] for e in env if e["name"] == "NVRX_EPOCH")
    rc = main([
        "render-k8s", "--run-id", "k-bundle", "--attempt", "1", "--invocation", TAG,
        "--epoch", epoch, "--set", "backend=eks", "--set", "nodes=2", "--set", "global_batch=16",
        "--set", f"eks.fsx_mount={tmp_path}", "--set", "train_timeout_s=30",
    ])  # fmt: skip
    assert rc == 0
    rendered = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in rendered] == ["NetworkPolicy", "Service", "ConfigMap", "Job"]
    for doc in rendered:
        made = created[doc["kind"]]
        # the emulator stores what it was given; a real server adds metadata (uid, versions)
        made["metadata"] = {k: v for k, v in made["metadata"].items() if k in doc["metadata"]}
        made.pop("status", None)
        assert made == doc, doc["kind"]
    # the config the pods mount is the attempt's, as the flow recorded it on the shared FS
    [(key, text)] = created["ConfigMap"]["data"].items()
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(text)
    recorded = load_config(tmp_path / "runs" / "k-bundle" / "config" / key)
    assert isinstance(recorded, TrainConfig) and load_config(cfg_path) == recorded
    args = created["Job"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--config=/etc/nvrx-pipeline/attempt/{key}" in args
