"""Fault drills with real processes: ft_launcher, 2 gloo ranks, FSDP2, NVRx in-process Wrapper.

Every scenario must finish all steps with parameters bitwise equal to the fault-free run, and the
events must say which layer recovered it and that it resumed from a real checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.helpers import (
    AUTO_INJOB,
    RunOutcome,
    assert_handed_off,
    make_config,
    read_events,
    run_ft_launcher,
    start_ft_launcher,
)
from trainer import checkpointing, fence
from trainer.faults import DAMAGE_KINDS
from trainer.history import RunHistory
from trainer.layer_config import InJobConfig
from trainer.rundir import Layout, RunDir
from trainer.timeline import recovery_phases

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Drill:
    name: str
    faults: tuple[str, ...]  # in the order they fire
    layers: tuple[str, ...]  # the layer that must recover each


# Checkpoints every 5 steps; a save first waits for the commit of the one before it, so step 5
# is committed once step 10's save has started, and step 10 once step 15's has. A stall at step
# 12 is recovered in-process, from step 5 or 10; a hang at step 18 by the in-job layer, from
# step 10 or 15: the respawned workers' first save, the last one, comes while their writer is
# still starting (it must wait in the checkpoint section, not under the step section). One run
# carries both: one drill run fewer (the CI budget), and each layer recovers a job another layer
# has already restarted. (A fault before step 10 replays from step 0: the first save is still in
# flight, measured in this drill at step 8.)
# `exception` (in-process) and `sigkill` (in-job) run through the whole pipeline instead, with
# the same bitwise and fired-once checks (tests/test_workload_pipeline.py); running them here as
# well cost ~2 min of the CI budget for no extra assertion.
# The tiers (issue 29), each recovery from the newest copy every rank holds:
# - an exception at step 11, right after step 10's save was handed to the writer: the in-process
#   restart reloads step 10 from the process's own copy of that save
#   (trainer.checkpointing.process_copy), read from nowhere, though step 10 is not committed yet;
#   the durable tier alone would go back to step 5 or to the start;
# - the stall at step 12: node memory holds step 11 (a memory save every step,
#   trainer.checkpointing.node_copy), newer than the process's copy;
# - the hang at step 18: the respawned ranks read step 17 or 16 from node memory. The hang is a
#   SIGSTOP of the whole process, its sealing thread too: rank 1 stops at the start of step 18,
#   often before step 17's digest and header are written (a fresh clone's CI stopped it there
#   in 3 runs of 4), and a copy with no header is no copy. The guarantee is the bound: the
#   newest step every rank holds, which is the step before the fault or, with that save cut
#   short, the one before it;
# - at step 19 rank 1's newest node copy (step 18) is damaged and the rank SIGKILLed: its
#   respawn finds the digest wrong and falls back to the durable tier. (After the hang, not
#   before: a respawned incarnation learns its hang bound from its own steps, and the 7 fast
#   steps between a respawn at 14 and the hang at 18 closed too few sections to learn from.)
DRILLS = [
    Drill(
        "exception-stall-corrupt-hang",
        (
            "exception@step=11,rank=1",
            "stall@step=12,rank=1",
            "hang@step=18,rank=1",
            "corrupt-memory@step=19,rank=1",
            "sigkill@step=19,rank=1",
        ),
        ("inprocess", "inprocess", "injob", "injob"),
    ),
]


@pytest.fixture(scope="module")
def baseline(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    cfg = make_config(tmp_path_factory.mktemp("drill") / "baseline", dataset)
    out = run_ft_launcher(cfg)
    assert out.returncode == 0, out.log[-3000:]
    assert out.result is not None and out.result["final_step"] == cfg.steps
    assert not out.of_kind("fault") and not out.of_kind("restart")
    # A CPU worker forks its checkpoint writer at its start (nvrx_compat.start_persistent_writer).
    assert [p["how"] for p in out.of_kind("phase") if p["phase"] == "writer_ready"] == ["fork"]
    return out


# The drills' timeouts are auto (trainer.timeouts): the start-up allowance (30 s) until 3 step
# sections have closed after the warm-up one, then learned: the hang must be caught by the
# learned bound, not the allowance.
LEARNING_INJOB = replace(AUTO_INJOB, learn_after_sections=3)


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_drill_recovers_bitwise(drill: Drill, baseline: RunOutcome, dataset: Path, tmp_path: Path):
    cfg = make_config(tmp_path / drill.name, dataset, faults=drill.faults, injob=LEARNING_INJOB)
    out = run_ft_launcher(cfg)
    assert out.returncode == 0, out.log[-4000:]
    assert out.result is not None
    assert out.result["final_step"] == cfg.steps
    assert out.result["params_sha256"] == baseline.result["params_sha256"]  # type: ignore[index]

    faults = out.of_kind("fault")
    assert [f["fault"] for f in faults] == list(drill.faults)  # each fired once across restarts
    restarts = out.of_kind("restart")
    assert restarts and {r["layer"] for r in restarts} == set(drill.layers)
    recovered = out.of_kind("recovered")
    assert [r["layer"] for r in recovered] == list(drill.layers)
    assert all(r["recovery_s"] > 0 for r in recovered)
    # Each recovery resumed from a committed checkpoint before its fault, never step 0.
    loaded = [e for e in out.of_kind("resume") if e["action"] == "loaded"]
    steps = [
        int(f.split("step=")[1].split(",")[0])
        for f in drill.faults
        if not f.startswith(DAMAGE_KINDS)  # damage restarts nothing
    ]
    assert len(loaded) >= len(steps), loaded
    # The last resume reads the durable tier (its node copies damaged): the newest commit,
    # usually 15. A fresh-clone run had only step 5: the saves of 10 and 15 were each overtaken
    # by the next fault before their commit (a memory-tier resume does not write its step to
    # the durable tier again; the process's own copy does). Still a commit, never step 0.
    assert 5 <= loaded[0]["step"] < steps[0] and 5 <= loaded[-1]["step"] < steps[-1], loaded
    # Each recovery's tier (see DRILLS), and fewer replayed steps than the durable tier alone:
    # newer than anything committed before its fault.
    records = {r.fault: r for r in RunHistory.of(out.typed).fault_records()}
    sources = {
        "exception@step=11,rank=1": ("memory", (10,)),
        "stall@step=12,rank=1": ("node", (11,)),
        "hang@step=18,rank=1": ("node", (17, 16)),  # 16: step 17's seal was stopped with it
    }
    for fault, (tier, steps_ok) in sources.items():
        rec = records[fault]
        assert rec.resume_source == tier and rec.resume_step in steps_ok, rec
        assert rec.load_bytes > 0, rec
        fault_t = next(f["t"] for f in faults if f["fault"] == fault)
        committed = [e["step"] for e in out.of_kind("checkpoint") if e["t"] < fault_t]
        assert rec.resume_step > max(committed, default=0), (rec, committed)
    # The damaged node copy was found out by its digest, said, and the durable tier read.
    damaged = records["sigkill@step=19,rank=1"]
    assert damaged.resume_source == "durable" and damaged.resume_step <= 15, damaged
    skipped = [e for e in out.of_kind("resume") if e["action"] == "skipped"]
    assert any(
        e["source"] == "node"
        and e["step"] == 18
        and "rank 1" in e["reason"]
        and "xxh3_128" in e["reason"]
        for e in skipped
    ), skipped
    # Hang detection learned the step time (issue 29, item 6; every timeout, issue 40 item 0):
    # rank 0 said its timeouts, each incarnation afresh; the hung rank's own bound is in its
    # fault event; the hang was caught within it (plus the respawn: teardown, rendezvous, a new
    # process), far inside the 30 s allowance.
    said = out.of_kind("timeouts")
    assert said and all(b["applied"] for b in said), said
    # Each incarnation says its launch values first (the start-up allowance), then what it
    # learned: the first of all is the allowance, and some are learned.
    assert said[0]["step_timeout_s"] == LEARNING_INJOB.startup_allowance_s, said[0]
    learned = [b for b in said if "step sections" in b["detail"]["step"]]
    assert learned, said
    ceiling = LEARNING_INJOB.startup_allowance_s
    for f in (f for f in faults if f["fault_kind"] == "hang"):
        bound = f["bound_s"]
        assert cfg.step_timeout_floor() <= bound < ceiling, (bound, learned)
        [phases] = [r for r in recovery_phases(out.typed) if r["fault"] == f["fault"]]
        assert phases["respawn_s"] < bound + 5.0 < ceiling, (phases, bound)


def _lock_is_free(run_root: Path) -> bool:
    import fcntl

    with open(run_root / Layout.FENCE_LOCK, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def _checkpoints_state(run_root: Path) -> dict[str, object]:
    """What a zombie must not change: the committed steps, LATEST, the result."""
    return {
        "committed": checkpointing.committed_steps(run_root),
        "latest": checkpointing.read_latest(run_root),
        "result": (run_root / "result.json").read_bytes(),
    }


def test_a_zombie_attempt_changes_nothing(baseline: RunOutcome, dataset: Path, tmp_path: Path):
    """Attempt 1 frozen (SIGSTOP, its whole session) while it writes step 10; attempt 2, under a
    new epoch, resumes from step 5 and finishes; attempt 1 thawed: it commits, prunes and
    removes nothing, says so with a ``fenced`` event and exits. The run is bitwise equal to the
    fault-free one."""
    cfg = make_config(tmp_path / "run", dataset)
    cfg.run_root.mkdir(parents=True)
    first = RunDir(cfg.run_root).publish(invocation="first", attempt=1)
    zombie = start_ft_launcher(cfg, env={fence.EPOCH_ENV: str(first.epoch)}, tag="-zombie")
    try:
        partial = checkpointing.partial_path(cfg.run_root, 10, first.epoch)
        deadline = time.monotonic() + 180
        while not partial.exists():
            assert zombie.poll() is None, "attempt 1 ended before it wrote step 10"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.killpg(zombie.pid, signal.SIGSTOP)
        # Frozen outside the fenced section (a freeze inside it holds the lock: thaw it briefly).
        while not _lock_is_free(cfg.run_root):
            os.killpg(zombie.pid, signal.SIGCONT)
            time.sleep(0.02)
            os.killpg(zombie.pid, signal.SIGSTOP)
        second = RunDir(cfg.run_root).publish(invocation="second", attempt=2)
        out = run_ft_launcher(cfg, env={fence.EPOCH_ENV: str(second.epoch)})
        assert out.returncode == 0, out.log[-3000:]
        assert out.result is not None and out.result["epoch"] == second.epoch
        assert out.result["params_sha256"] == baseline.result["params_sha256"]  # type: ignore[index]
        before = _checkpoints_state(cfg.run_root)
        os.killpg(zombie.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not [e for e in read_events(cfg.run_root) if e["kind"] == "fenced"]:
            assert time.monotonic() < deadline, "the zombie never said it was fenced"
            time.sleep(0.2)
        time.sleep(2)  # anything it would still do, it does now
        assert _checkpoints_state(cfg.run_root) == before
        fenced = [e for e in read_events(cfg.run_root) if e["kind"] == "fenced"]
        assert {e["epoch"] for e in fenced} == {first.epoch}
        assert all(e["current"] == second.epoch for e in fenced)
        for step in before["committed"]:  # type: ignore[attr-defined]
            assert checkpointing.verify_checkpoint(
                checkpointing.committed_path(cfg.run_root, step)
            ).ok
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(zombie.pid, signal.SIGCONT)
            os.killpg(zombie.pid, signal.SIGKILL)
        zombie.wait()


# Issue 42: the beat is the node's agent's, so the silence bound is a few beats (auto: 5 x the
# 1 s beat). The stated bound from the freeze to the loss: that, a beat, a poll, and the read.
BOUND_S = InJobConfig().seconds("node_silence_s") + 1.0 + 0.2 + 3.0


@dataclass(frozen=True)
class GrayNode:
    name: str
    spec: str
    spares: int
    path: str  # the loss's (tasks.loss_policy)
    attempts: int  # to completion
    said: str  # in the loss's detail
    taken: str = ""  # the watcher's loss fault, when not the drill's own

    @property
    def loss(self) -> str:
        return self.taken or self.spec


GRAY_NODES = [
    # A fixed-size job: the stage retry resumes from the commit.
    # `extended` (the CI budget): its parts run in make test: a silent node's loss in
    # freeze-spare, a fixed job's stage retry after a drilled loss in evict-fixed.
    pytest.param(
        GrayNode("freeze-fixed", "node-freeze@step=7,node=1", 0, "stage-retry", 2, "silent for"),
        marks=pytest.mark.extended,
        id="freeze-fixed",
    ),
    # A hot spare takes the frozen node's place in-job; the frozen node is ended, and the
    # attempt ends right after training does (it used to wait on the stopped processes, and
    # then read the healthy node that had finished as silent).
    GrayNode("freeze-spare", "node-freeze@step=7,node=1", 1, "spare", 1, "silent for"),
    # Evicted with notice (SIGTERM to its agent, SIGKILL after the grace): a node loss, not
    # in-job restarts exhausted (its launcher's exit 1 used to read so: no stage retry).
    GrayNode("evict-fixed", "node-evict@step=7,node=1", 0, "stage-retry", 2, "evicted with"),
    # `extended` (the CI budget): a spare's eviction and its hand-off run on the EKS stand-in
    # (tests/test_eks_pipeline.py, evict), the local hand-off in evict-fixed.
    pytest.param(
        GrayNode("evict-spare", "node-evict@step=7,node=1", 1, "spare", 1, "evicted with"),
        marks=pytest.mark.extended,
        id="evict-spare",
    ),
    # A node that corrupts every step (trainer.step_check): rejected, rejected again on replay,
    # named; the watcher takes it away and the spare trains on, bitwise: no corrupted update
    # was ever applied or committed.
    GrayNode(
        "corrupt-every-spare",
        "corrupt-grad@step=8,node=1,every",
        1,
        "spare",
        1,
        "check twice",
        taken="step-check@step=8,node=1",
    ),
]


@pytest.mark.parametrize(
    "case", GRAY_NODES, ids=[c.name if isinstance(c, GrayNode) else None for c in GRAY_NODES]
)
def test_a_frozen_or_evicted_node_is_taken_away_and_recovered_bitwise(
    case: GrayNode, baseline: RunOutcome, dataset: Path, tmp_path: Path
):
    """Node 1 of two frozen (SIGSTOP: its agent, worker and checkpoint writer, by its own agent:
    trainer.node_beat) after the first commit, as a hung host or a partition looks: alive to the
    process table, silent to the job; the watcher notices its agent's beat stop while the
    others' go on, within the bound. Or evicted with notice. Either way it is taken away as a
    lost node, the run is bitwise equal to the fault-free one, and none of its processes
    outlives the attempt."""
    from tasks.backends.base import LaunchRequest
    from tasks.backends.local import LocalBackend
    from tasks.classify import EndKind
    from tasks.ownership import processes
    from tasks.train_stage import run_attempt

    cfg = make_config(tmp_path / "run", dataset, faults=(case.spec,))
    # The deadline is far off: only the watcher's verdict can end attempt 1 in time.
    request = LaunchRequest(
        run_id="gray", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1, spares=case.spares,
        deadline_s=400,
    )  # fmt: skip
    reports = [run_attempt(LocalBackend(), request)]
    assert not processes.tagged(cfg.run_root), "a process of the node outlived its attempt"
    events = read_events(cfg.run_root)
    faults = [e for e in events if e["kind"] == "fault" and e.get("path")]  # the losses
    assert [(f["fault"], f["node"], f["path"]) for f in faults] == [(case.loss, 1, case.path)]
    assert case.said in faults[0]["detail"]
    if "freeze" in case.spec:
        assert "silent for" in faults[0]["detail"]
        quiet = float(faults[0]["detail"].split("silent for ")[1].split(" s")[0])
        assert quiet >= InJobConfig().seconds("node_silence_s") - 1  # never before the bound
        frozen_at = RunDir(cfg.run_root, 1).freeze_file(1).stat().st_mtime
        assert faults[0]["t"] - frozen_at <= BOUND_S, "noticed later than the bound"
    if "corrupt" in case.spec:
        checks = [(e["verdict"], e["nodes"]) for e in events if e["kind"] == "step_check"]
        assert checks[:2] == [("rejected", [1]), ("repeat", [1])], checks
    if case.attempts == 1:
        assert reports[0].outcome.kind == EndKind.COMPLETED, reports[0].outcome.message
        # The spare resumed from the peer copies of a memory save every step: at most the step
        # in flight is replayed (or one more where the node went before that save was sealed).
        t = faults[0]["t"]
        before = max(e["step"] for e in events if e["kind"] == "step" and e["t"] < t)
        resumed = [e for e in events if e["kind"] == "resume" and e["t"] > t]
        assert resumed[0]["action"] == "loaded" and resumed[0]["step"] >= before - 1
        # The attempt ends right after its training does: nothing left to wait on.
        [end] = [e for e in events if e["kind"] == "train_end"]
        [over] = [e for e in events if e["kind"] == "stage_attempt_end"]
        assert over["t"] - end["t"] < 15, "the attempt outlived its training"
    else:
        assert reports[0].outcome.kind == EndKind.NODE_LOSS, reports[0].outcome.message
        reports.append(run_attempt(LocalBackend(), replace(request, attempt=2)))
        assert reports[1].outcome.kind == EndKind.COMPLETED, reports[1].outcome.message
    result = json.loads((cfg.run_root / "result.json").read_text())
    assert result["params_sha256"] == baseline.result["params_sha256"]  # type: ignore[index]
    recovered = [e for e in read_events(cfg.run_root) if e["kind"] == "recovered"]
    assert [(r["fault"], r["layer"]) for r in recovered] == [(case.loss, case.path)]
    if "evict" in case.spec:  # its step saved within the grace: nothing before it replayed
        assert_handed_off(read_events(cfg.run_root), faults[0])
        # Each attempt's grace is sized from what the run measured (tasks.evict_grace).
        starts = [e for e in read_events(cfg.run_root) if e["kind"] == "stage_attempt"]
        assert "no step and save measured yet" in starts[0]["evict_grace"]
        assert all("which holds a step" in e["evict_grace"] for e in starts[1:]), starts


# The step check (trainer.step_check), played inside it: NaN in rank 1's own gradient shard
# between backward and the check, once. Step 10 is a save step: its rejected attempt is never
# saved, its replay is (and matches the fault-free run's step 10). A node that corrupts every
# step: the corrupt-every-spare row above (rejected, rejected again, taken away).
TRANSIENT = "corrupt-grad@step=10,rank=1"


def test_a_corrupted_step_is_never_applied_and_replays_bitwise(
    baseline: RunOutcome, dataset: Path, tmp_path: Path
):
    cfg = make_config(tmp_path / "transient", dataset, faults=(TRANSIENT,))
    out = run_ft_launcher(cfg, env={"NVRX_NODE": "0"})
    step = 10
    assert [f["fault"] for f in out.of_kind("fault")] == [TRANSIENT]  # said once
    checks = out.of_kind("step_check")
    assert [c["verdict"] for c in checks] == ["rejected", "transient"], checks
    assert all(c["step"] == step and c["ranks"] == [1] for c in checks), checks
    assert all(c["nodes"] == [0] and "non-finite" in c["reason"] for c in checks), checks
    assert not out.of_kind("restart")  # replayed in place, no layer restarted anything
    steps = out.of_kind("step")
    assert all(s["nodes"] and s["nodes"][0]["node"] == 0 for s in steps)  # Step.nodes, each step
    assert out.returncode == 0, out.log[-4000:]
    assert out.result is not None
    assert out.result["params_sha256"] == baseline.result["params_sha256"]  # type: ignore[index]
    # One step event per step, step 10's loss the fault-free run's; its save after the replay.
    assert [s["step"] for s in steps] == list(range(1, cfg.steps + 1))
    same = {s["step"]: s["loss"] for s in baseline.of_kind("step")}
    assert all(s["loss"] == same[s["step"]] for s in steps)
    saved = [e for e in out.of_kind("checkpoint") if e["step"] == step]
    assert saved and saved[0]["t"] > checks[1]["t"]
