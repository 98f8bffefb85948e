"""The EKS attempt runner with the real ``kubernetes`` client against kmock's Kubernetes emulator
over HTTP (no real API server can run here). A scenario driver plays the control plane: it
creates the Job's pods, moves their phases, marks a node unreachable, adds DisruptionTarget.
kmock has no controllers, selectors or validation; the manifests' schema is checked separately
(tests/test_eks_render.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from flows.context import eks_train_config
from flows.models import PipelineParams
from tasks.backends.eks.kube import Kube
from tasks.backends.eks.render import job_name
from tasks.backends.eks.stage import run_eks_attempt
from tasks.classify import EndKind
from tests.eks_cluster import NS, node_obj, pod_obj, terminated


class ControlPlane(threading.Thread):
    """Plays the Job controller and the kubelets for one scenario."""

    def __init__(self, kube: Kube, job: str, act: Callable[[Kube, str], None]) -> None:
        super().__init__(daemon=True)
        self.kube, self.job, self.act = kube, job, act

    def run(self) -> None:
        deadline = time.time() + 30
        while self.kube.read_job(NS, self.job) is None and time.time() < deadline:
            time.sleep(0.1)
        for i, n in enumerate(("ip-10-0-1-1", "ip-10-0-1-2")):
            self.kube.core.create_namespaced_pod(
                NS, pod_obj(self.job, i, n), _preload_content=False
            )
        time.sleep(1.5)
        self.act(self.kube, self.job)


def succeed(k: Kube, job: str) -> None:
    for i in range(2):
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
    k.core.patch_namespaced_pod_status(
        f"{job}-1-x",
        NS,
        {
            "status": {
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "DeletionByTaintManager",
                    }
                ]
            }
        },
        _preload_content=False,
    )


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


SCENARIOS = [
    ("completed", succeed, EndKind.COMPLETED, False),
    ("node-loss", lose_node, EndKind.NODE_LOSS, False),
    ("injob-exhausted", exit_code(1), EndKind.INJOB_EXHAUSTED, True),
    ("do-not-requeue", exit_code(93), EndKind.DO_NOT_REQUEUE, True),
    ("oom", exit_code(137, "OOMKilled"), EndKind.BUG, True),
    ("image-pull", image_pull, EndKind.BUG, False),
    ("deadline", hang, EndKind.TIMEOUT, False),
]


@pytest.mark.parametrize(("name", "act", "kind", "kept"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_attempt_outcomes(kube: Kube, name, act, kind, kept):
    params = PipelineParams(backend="eks", nodes=2, global_batch=16, run_id=f"k-{name}")
    cfg = eks_train_config(params, params.run_id or "")
    driver = ControlPlane(kube, job_name(params.run_id or "", 1), act)
    driver.start()
    report = run_eks_attempt(
        kube,
        cfg=cfg,
        run_id=params.run_id or "",
        attempt=1,
        nodes=2,
        eks=params.eks,
        deadline_s=8,
        poll_s=0.2,
    )
    driver.join(5)
    assert report.outcome.kind == kind, report.outcome.message
    assert report.kept_job == kept
    assert (kube.read_job(NS, report.job) is not None) == kept  # failed Job kept for forensics


def test_node_loss_then_next_attempt_succeeds(kube: Kube):
    params = PipelineParams(backend="eks", nodes=2, global_batch=16, run_id="k-retry")
    cfg = eks_train_config(params, "k-retry")
    outcomes = []
    for attempt, act in ((1, lose_node), (2, succeed)):
        kube.core.patch_node_status("ip-10-0-1-2", node_obj("ip-10-0-1-2"), _preload_content=False)
        driver = ControlPlane(kube, job_name("k-retry", attempt), act)
        driver.start()
        r = run_eks_attempt(
            kube,
            cfg=cfg,
            run_id="k-retry",
            attempt=attempt,
            nodes=2,
            eks=params.eks,
            deadline_s=15,
            poll_s=0.2,
        )
        driver.join(5)
        outcomes.append((r.job, r.outcome.kind))
    assert outcomes == [
        ("nvrx-k-retry-a1", EndKind.NODE_LOSS),
        ("nvrx-k-retry-a2", EndKind.COMPLETED),
    ]
