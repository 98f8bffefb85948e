"""EKS attempts judged by the one judge (tasks.classify.judge) over recorded object sequences,
shaped as the API serialises them: the backend's part is only the observation (end_of)."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.backends.eks.classify import History, end_of, finished
from tasks.backends.eks.objects import healthy, observe_job, observe_node, observe_pod
from tasks.classify import EndKind, Evidence, Outcome, judge
from tasks.retry_policy import stage_retry_allowed
from trainer.rundir import RunResult

JOB = "nvrx-run1-a1"


def pod(
    index: int,
    *,
    phase: str = "Running",
    node: str | None = "ip-10-0-1-1",
    exit_code=None,
    reason=None,
    waiting=None,
    conditions=(),
    status_reason=None,
) -> dict[str, Any]:
    cs: dict[str, Any] = {"name": "trainer", "ready": phase == "Running"}
    if exit_code is not None:
        cs["state"] = {"terminated": {"exitCode": exit_code, "reason": reason or "Error"}}
    elif waiting:
        cs["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
    else:
        cs["state"] = {"running": {"startedAt": "2026-11-29T10:00:00Z"}}
    status: dict[str, Any] = {
        "phase": phase,
        "containerStatuses": [cs],
        "conditions": [dict(c) for c in conditions],
    }
    if status_reason:
        status["reason"] = status_reason
    return {
        "metadata": {
            "name": f"{JOB}-{index}-abcde",
            "labels": {
                "batch.kubernetes.io/job-completion-index": str(index),
                "batch.kubernetes.io/job-name": JOB,
            },
        },
        "spec": {"nodeName": node},
        "status": status,
    }


def node(name: str, ready: str = "True", reason: str = "KubeletReady") -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Ready", "status": ready, "reason": reason}]},
    }


def job(**conds: str) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": k, "status": v} for k, v in conds.items()]}}


def history(
    *steps: tuple[float, str, dict[str, Any]] | tuple[float, str, dict[str, Any], bool],
    completions: int = 2,
) -> History:
    h = History(completions=completions)
    for step in steps:
        t, kind, obj = step[0], step[1], step[2]
        deleted = bool(step[3]) if len(step) > 3 else False
        if kind == "pod":
            h.pods.append(observe_pod(obj, t, deleted=deleted))
        elif kind == "node":
            h.nodes.append(observe_node(obj, t, deleted=deleted))
        else:
            h.jobs.append(observe_job(obj, t, deleted=deleted))
    return h


DONE = RunResult(status="completed", final_step=20)


def _evidence(**kw: Any) -> Evidence:
    base: dict[str, Any] = dict(
        lost_nodes=frozenset(), timed_out=False, result=None, fatal=None, no_restart=None
    )
    return Evidence(**{**base, "target_steps": 20, **kw})


def verdict(h: History, now: float, ev: Evidence | None = None) -> Outcome | None:
    """The judge's verdict once the pods showed an end at ``now`` (None: still running), with
    the pods' trainer having written its completed result unless ``ev`` says otherwise."""
    seen = end_of(h, now=now, unschedulable_timeout_s=600)
    if seen is None:
        return None
    return judge(finished(seen, job="nvrx/j", fsx_mount="/fsx"), ev or _evidence(result=DONE))


RUNNING = [
    (0, "pod", pod(0)),
    (0, "pod", pod(1, node="ip-10-0-1-2")),
    (0, "node", node("ip-10-0-1-1")),
    (0, "node", node("ip-10-0-1-2")),
]
DISRUPTED = {"type": "DisruptionTarget", "status": "True"}

SCENARIOS = [
    ("still-running", RUNNING, None),
    (
        "completed",
        [
            *RUNNING,
            (50, "pod", pod(0, phase="Succeeded", exit_code=0, reason="Completed")),
            (
                51,
                "pod",
                pod(1, phase="Succeeded", exit_code=0, reason="Completed", node="ip-10-0-1-2"),
            ),
            (52, "job", job(Complete="True")),
        ],
        EndKind.COMPLETED,
    ),
    (
        "node-unreachable",
        [*RUNNING, (30, "node", node("ip-10-0-1-2", "Unknown", "NodeStatusUnknown"))],
        EndKind.NODE_LOSS,
    ),
    (
        "taint-manager-eviction",
        [
            *RUNNING,
            (
                330,
                "pod",
                pod(
                    1,
                    node="ip-10-0-1-2",
                    conditions=[{**DISRUPTED, "reason": "DeletionByTaintManager"}],
                ),
            ),
        ],
        EndKind.NODE_LOSS,
    ),
    (
        "pod-gc-after-node-deleted",
        [
            *RUNNING,
            (40, "node", node("ip-10-0-1-2"), True),
            (
                41,
                "pod",
                pod(
                    1,
                    phase="Failed",
                    node="ip-10-0-1-2",
                    conditions=[{**DISRUPTED, "reason": "DeletionByPodGC"}],
                ),
            ),
        ],
        EndKind.NODE_LOSS,
    ),
    (
        "spot-eviction",
        [
            *RUNNING,
            (20, "pod", pod(0, conditions=[{**DISRUPTED, "reason": "EvictionByEvictionAPI"}])),
        ],
        EndKind.NODE_LOSS,
    ),
    (
        "kubelet-termination",
        [
            *RUNNING,
            (
                20,
                "pod",
                pod(
                    0,
                    phase="Failed",
                    exit_code=137,
                    status_reason="Terminated",
                    conditions=[{**DISRUPTED, "reason": "TerminationByKubelet"}],
                ),
            ),
        ],
        EndKind.NODE_LOSS,
    ),
    (
        "pod-vanished-with-node",
        [
            *RUNNING,
            (60, "node", node("ip-10-0-1-2"), True),
            (60, "pod", pod(1, node="ip-10-0-1-2"), True),
        ],
        EndKind.NODE_LOSS,
    ),
    (
        "injob-exhausted",
        [*RUNNING, (90, "pod", pod(0, phase="Failed", exit_code=1))],
        EndKind.INJOB_EXHAUSTED,
    ),
    (
        "do-not-requeue",
        [*RUNNING, (90, "pod", pod(1, phase="Failed", exit_code=93, node="ip-10-0-1-2"))],
        EndKind.DO_NOT_REQUEUE,
    ),
    (
        "image-pull",
        [
            (
                0,
                "pod",
                pod(
                    0,
                    phase="Pending",
                    node=None,
                    waiting=("ImagePullBackOff", 'Back-off pulling image "registry/nvrx:bad"'),
                ),
            )
        ],
        EndKind.BUG,
    ),
    (
        "secret-missing",  # a declared secret not created in the namespace
        [
            (
                0,
                "pod",
                pod(
                    0,
                    phase="Pending",
                    waiting=("CreateContainerConfigError", 'secret "hf-token" not found'),
                ),
            )
        ],
        EndKind.BUG,
    ),
    (
        "job-deleted-outside",  # kubectl delete job: the Job gone, its pods going with it
        [
            *RUNNING,
            (10, "job", job()),
            (50, "job", job(), True),
            (51, "pod", pod(0), True),
            (51, "pod", pod(1, node="ip-10-0-1-2"), True),
        ],
        EndKind.BUG,
    ),
    (
        "job-deleted-pods-still-running",
        [*RUNNING, (10, "job", job()), (50, "job", job(), True)],
        EndKind.BUG,
    ),
    (
        "oom",
        [*RUNNING, (70, "pod", pod(0, phase="Failed", exit_code=137, reason="OOMKilled"))],
        EndKind.BUG,
    ),
]


@pytest.mark.parametrize(("name", "steps", "kind"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_recorded_histories(name, steps, kind):
    outcome = verdict(history(*steps), 1000)
    if kind is None:
        assert outcome is None
        return
    assert outcome is not None and outcome.kind == kind, outcome
    assert outcome.message


# (name, history, [(now, outcome kind or None, words of the message)]): decisions that wait on
# a bound, read at several clocks. The node's kubelet reports NotReady at t=100 (bound 60 s);
# a pod deleted by none of ours at t=200 decides after DELETED_GRACE_S (5 s).
NOT_READY = [*RUNNING, (100, "node", node("ip-10-0-1-2", "False", "KubeletNotReady"))]
DELETED = [*RUNNING, (150, "job", job()), (200, "pod", pod(1, node="ip-10-0-1-2"), True)]
TIMED = [
    ("not-ready-below-the-bound", NOT_READY, [(100, None, ""), (159, None, "")]),
    ("not-ready-past-the-bound", NOT_READY,
     [(160, EndKind.NODE_LOSS, "NotReady for 60 s"), (400, EndKind.NODE_LOSS, "ip-10-0-1-2")]),
    ("not-ready-flap", [*NOT_READY, (130, "node", node("ip-10-0-1-2"))],
     [(161, None, ""), (1000, None, "")]),
    ("not-ready-again-counts-anew",
     [*NOT_READY, (130, "node", node("ip-10-0-1-2")),
      (140, "node", node("ip-10-0-1-2", "False", "KubeletNotReady"))],
     [(161, None, ""), (200, EndKind.NODE_LOSS, "NotReady for 60 s")]),
    ("not-ready-after-success",  # the pod finished first: nothing was lost
     [*NOT_READY, (110, "pod", pod(1, phase="Succeeded", exit_code=0, node="ip-10-0-1-2"))],
     [(500, None, "")]),
    ("pod-force-deleted", DELETED,
     [(201, None, ""), (205, EndKind.BUG, "pod nvrx-run1-a1-1-abcde was deleted outside")]),
    ("pod-deleted-as-the-job-fails",  # the Job controller ending it says so (FailureTarget)
     [*DELETED, (201, "job", job(FailureTarget="True"))], [(300, None, "")]),
    ("pod-deleted-on-success",  # an elastic Job's success policy deletes the other pods
     [*DELETED, (202, "job", job(SuccessCriteriaMet="True"))], [(300, None, "")]),
    ("pod-deleted-with-its-node",
     [*DELETED, (200, "node", node("ip-10-0-1-2", "Unknown", "NodeStatusUnknown"))],
     [(201, EndKind.NODE_LOSS, "on lost node")]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "steps", "reads"), TIMED, ids=[t[0] for t in TIMED])
def test_decisions_that_wait_on_a_bound(name, steps, reads):
    h = history(*steps)
    h.not_ready_s = 60.0
    for now, kind, words in reads:
        outcome = verdict(h, now)
        got = outcome.kind if outcome else None
        assert got == kind, (now, outcome)
        if outcome is not None:
            assert words in outcome.message, (now, outcome.message)


def test_pods_the_pipeline_deleted_itself_are_not_deleted_outside():
    h = history(*DELETED)
    h.deleted_by_us.add("nvrx-run1-a1-1-abcde")
    assert verdict(h, 1000) is None


def test_messages_say_what_happened():
    steps = {name: s for name, s, _kind in SCENARIOS}
    pull = verdict(history(*steps["image-pull"]), 10)
    assert pull is not None and "registry/nvrx:bad" in pull.message and "eks.image" in pull.message
    secret = verdict(history(*steps["secret-missing"]), 10)
    assert secret is not None and 'secret "hf-token" not found' in secret.message
    oom = verdict(history(*steps["oom"]), 100)
    assert oom is not None and "OOMKilled" in oom.message
    gone = steps["job-deleted-outside"]
    deleted = verdict(history(*gone), 100)
    assert deleted is not None and "deleted outside the pipeline" in deleted.message
    lost = verdict(history(*SCENARIOS[3][1]), 100)
    assert lost is not None and lost.details["lost_nodes"] == ["ip-10-0-1-2"]


def test_unschedulable_only_after_its_timeout():
    msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    p = pod(
        0,
        phase="Pending",
        node=None,
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}
        ],
    )
    h = history((0, "pod", p), (100, "pod", p))
    assert verdict(h, 100) is None
    out = verdict(h, 700)
    assert out is not None and out.kind == EndKind.TIMEOUT and msg in out.message


# -- every pod's verdict, and the verdict file ----------------------------------------------------
def _ended(*codes: int) -> History:
    steps: list = [*RUNNING]
    for i, code in enumerate(codes):
        phase = "Succeeded" if code == 0 else "Failed"
        steps.append(
            (50 + i, "pod", pod(i, phase=phase, exit_code=code, node=f"ip-10-0-1-{i + 1}"))
        )
    return history(*steps)


@pytest.mark.parametrize("codes", [(0, 93), (143, 93), (93, 143), (137, 93)])
def test_any_pods_93_is_do_not_requeue(codes):
    """The first pod's 93 tears the step down and its peers are signalled (NVRx PR #397), or
    finish: whichever pod said it, no retry can help."""
    out = verdict(_ended(*codes), 100, _evidence())
    assert out is not None and out.kind == EndKind.DO_NOT_REQUEUE, out
    assert not stage_retry_allowed(out.error())


@pytest.mark.parametrize(
    ("codes", "without_file"), [((143, 1), EndKind.INJOB_EXHAUSTED), ((1, 1), None)]
)
def test_the_verdict_file_decides_over_masked_exit_codes(codes, without_file):
    """NVRx writes control/no_restart before exiting 93; the pods' codes may show only the
    teardown (143, 1). The file decides."""
    if without_file is not None:
        plain = verdict(_ended(*codes), 100, _evidence())
        assert plain is not None and plain.kind == without_file
    out = verdict(_ended(*codes), 100, _evidence(no_restart="ConfigError: global_batch"))
    assert out is not None and out.kind == EndKind.DO_NOT_REQUEUE and "global_batch" in out.message


def test_judge_checks_the_result_and_the_drill():
    ok = verdict(_ended(0, 0), 100, _evidence(result=DONE))
    assert ok is not None and ok.kind == EndKind.COMPLETED and ok.details["result"].final_step == 20
    missing = verdict(_ended(0, 0), 100, _evidence())
    assert missing is not None and missing.kind == EndKind.BUG and "/fsx" in missing.message
    short = verdict(_ended(0, 0), 100, _evidence(result=DONE.model_copy(update={"final_step": 7})))
    assert short is not None and short.kind == EndKind.BUG and "step 7 of 20" in short.message
    # The watcher stopped the Job before its pods showed an end (a drill's loss, the deadline).
    unseen = finished(None, job="j", fsx_mount="/fsx")
    drilled = judge(unseen, _evidence(lost_nodes=frozenset({0})))
    assert drilled.kind == EndKind.NODE_LOSS and drilled.details["lost_nodes"] == [0]
    assert judge(unseen, _evidence(timed_out=True)).kind == EndKind.TIMEOUT
    assert judge(unseen, _evidence()).kind == EndKind.BUG


def test_a_job_is_reattached_only_when_every_pod_runs_on_a_ready_node():
    spec = {"metadata": {"name": JOB}, "spec": {"completions": 2}, "status": {}}
    pods = [pod(0), pod(1, node="ip-10-0-1-2")]
    nodes = [node("ip-10-0-1-1"), node("ip-10-0-1-2")]
    assert healthy(spec, pods, nodes, t=0)[0]
    for bad_pods, bad_nodes, why in (
        (pods[:1], nodes, "no pod for index(es) [1]"),
        ([pods[0], pod(1, phase="Failed", exit_code=1, node="ip-10-0-1-2")], nodes, "Failed"),
        (pods, [nodes[0], node("ip-10-0-1-2", "Unknown")], "not Ready"),
        ([pods[0], pod(1, node="ip-10-0-1-2", conditions=[DISRUPTED])], nodes, "disrupted"),
    ):
        ok, reason = healthy(spec, bad_pods, bad_nodes, t=0)
        assert not ok and why in reason, reason
    failed = {**spec, "status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    assert not healthy(failed, pods, nodes, t=0)[0]
    # Completed while nobody watched: watched to its (immediate) end, its result stands.
    done = {**spec, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert healthy(done, [], nodes, t=0) == (
        True,
        f"Job {JOB} completed while no flow runner watched it: its result stands",
    )


def test_a_replacement_on_a_node_that_came_back_is_not_lost_with_it():
    """An elastic Job's lost index (absorbed) gets a new pod on its node once the node is Ready
    again: the node's earlier loss was its predecessor's, not the new pod's. The same node lost
    again takes the new pod with it."""
    from tasks.backends.eks.classify import lost_indexes

    n2 = "ip-10-0-1-2"
    replacement = pod(1, node=n2)
    replacement["metadata"]["name"] = f"{JOB}-1-fghij"
    steps = [
        *RUNNING,
        (30, "node", node(n2, "Unknown", "NodeStatusUnknown")),
        (
            31,
            "pod",
            pod(1, node=n2, conditions=[{**DISRUPTED, "reason": "DeletionByTaintManager"}]),
        ),
        (40, "node", node(n2)),
        (45, "pod", replacement),
    ]
    h = history(*steps)
    assert lost_indexes(h) == {f"{JOB}-1-abcde": 1}
    h.absorbed.add(f"{JOB}-1-abcde")
    assert lost_indexes(h) == {}
    assert verdict(h, 50) is None
    # A pod that was on the node when it went keeps counting as lost after it came back.
    back = history(*RUNNING, (30, "node", node(n2, "Unknown")), (40, "node", node(n2)))
    outcome = verdict(back, 50)
    assert outcome is not None and outcome.kind == EndKind.NODE_LOSS
    # The node lost again, under the replacement.
    h.nodes.append(observe_node(node(n2, "Unknown"), 60))
    assert lost_indexes(h) == {f"{JOB}-1-fghij": 1}
    again = verdict(h, 61)
    assert again is not None and again.kind == EndKind.NODE_LOSS
