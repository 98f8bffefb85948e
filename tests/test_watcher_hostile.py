"""The train-stage watcher (tasks.train_stage.run_attempt) against hostile run-root files: bad
event lines, a result that is not JSON, FIFOs where it reads. Each attempt goes on to its real
outcome and the deadline holds; the run's metrics keep serving and count what was dropped.

The job is scripted (each poll appends what a trainer would write), so that these cases cost
no processes: the watcher, the decoder, the files and the classification are all real."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tasks.backends.base import LaunchRequest
from tasks.classify import EndKind, Observation, Outcome
from tasks.train_stage import run_attempt
from tests.helpers import free_port, make_config, read_events, sample, scrape
from trainer import fence
from trainer.event_types import Event, StageAttempt, Step
from trainer.events import EventLog
from trainer.rundir import Layout, RunDir

STEPS = 4
Action = Callable[[Path], None]


def append(*lines: str) -> Action:
    def act(run_root: Path) -> None:
        with open(run_root / "events.jsonl", "a") as f:
            f.write("".join(line + "\n" for line in lines))

    return act


def epoch_of(run_root: Path) -> int:
    """The epoch of this attempt (its workers get it as NVRX_EPOCH), as its watcher said."""
    starts = [e for e in read_events(run_root) if e["kind"] == "stage_attempt"]
    return int(starts[-1]["epoch"])


def step(n: int, *, epoch: int | None = None) -> Action:
    """A worker's step event, carrying its epoch (this attempt's unless given)."""

    def act(run_root: Path) -> None:
        mine = epoch_of(run_root) if epoch is None else epoch
        event = {"t": time.time(), "kind": "step", "step": n, "loss": 1.0, "step_s": 0.01}
        append(json.dumps({**event, "epoch": mine}))(run_root)

    return act


def train_start(nodes: list[int], *, epoch: int) -> Action:
    event = {"t": time.time(), "kind": "train_start", "world_size": 2, "nodes": nodes}
    return append(json.dumps({**event, "epoch": epoch}))


def result(status: str = "completed", *, epoch: int | None = None) -> Action:
    """result.json as the worker writes it: under its fence (RunDir.write_result)."""

    def act(run_root: Path) -> None:
        mine = epoch_of(run_root) if epoch is None else epoch
        body = {"status": status, "final_step": STEPS, "final_loss": 1.0, "epoch": mine}
        with contextlib.suppress(fence.Fenced), _fence(run_root, mine).hold("write result.json"):
            (run_root / "result.json").write_text(json.dumps(body))

    return act


def _fence(run_root: Path, epoch: int) -> fence.Fence:
    def refused() -> None:  # a worker exits 4 here; the script goes on
        pass

    return RunDir(run_root, epoch).fence(on_fenced=refused)


def marker(content: Callable[[int], bytes]) -> Action:
    """A no_restart marker, given this attempt's epoch."""
    return lambda root: plant(str(Layout.NO_RESTART), content(epoch_of(root)))(root)


def fatal(*, epoch: int | None = None) -> Action:
    def act(run_root: Path) -> None:
        mine = epoch_of(run_root) if epoch is None else epoch
        append(json.dumps({"t": time.time(), "kind": "fatal", "error": "bad", "epoch": mine}))(
            run_root
        )

    return act


def plant(name: str, content: bytes | None) -> Action:
    """Put ``content`` at ``name`` (None: a FIFO)."""

    def act(run_root: Path) -> None:
        path = run_root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        if content is None:
            os.mkfifo(path)
        else:
            path.write_bytes(content)

    return act


TRAINING = [step(n) for n in range(1, STEPS + 1)]
EARLIER = 2  # epochs published before the attempt's (earlier attempts', whose zombies write)
BAD = [
    "1",
    "null",
    "[]",
    '{"t": 1, "kind": "step"}',
    '{"t": 1, "kind": "step", "step": "3", "loss": 1.0}',
    '{"t": 1, "kind": "train_start", "world_size": 2, "nodes": "all"}',
    '{"t": 1, "kind": "fatal"}',
    '{"t": 1, "kind": "step", "ste',
    "x" * 70_000,
]


@dataclass
class ScriptedJob:
    run_root: Path
    script: list[Action]
    attempt: int = 1
    name: str = "scripted"
    poll_s: float = 0.02
    loss_grace_s: float = 0.0
    store_host: int | None = None
    stopped: bool = False
    observed: list[Event] = field(default_factory=list)

    def running(self) -> bool:
        if self.stopped:
            return False
        if self.script:
            self.script.pop(0)(self.run_root)
            return True
        return False

    def observe(self, event: Event) -> None:
        self.observed.append(event)

    def alive_nodes(self) -> frozenset[int]:
        return frozenset({0})

    def losses(self) -> frozenset[int]:
        return frozenset()

    def absorb(self, node: int) -> None:
        raise AssertionError("no loss here")

    lose_node = restore_node = absorb

    def stop(self) -> None:
        self.stopped = True

    def observation(self) -> Observation:
        return Observation(exit_codes={0: None if self.stopped else 0})

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        return {}


@dataclass
class ScriptedBackend:
    script: list[Action]
    name: str = "scripted"
    job: ScriptedJob | None = None

    def reattach(self, request: LaunchRequest) -> None:
        return None

    def launch(self, request: LaunchRequest) -> ScriptedJob:
        self.job = ScriptedJob(request.cfg.run_root, list(self.script))
        return self.job


# (case, what the job writes, poll by poll; the outcome it really has)
CASES: list[tuple[str, list[Action], EndKind]] = [
    ("bad-lines", [append(*BAD), *TRAINING, append(*BAD), result()], EndKind.COMPLETED),
    ("garbage-result-then-real", [plant("result.json", b"\x00garbage"), *TRAINING, result()],
     EndKind.COMPLETED),
    ("result-not-an-object", [*TRAINING, plant("result.json", b'["completed"]')], EndKind.BUG),
    ("result-is-a-fifo", [*TRAINING, plant("result.json", None)], EndKind.BUG),
    ("no-restart-is-a-fifo", [plant(str(Layout.NO_RESTART), None), *TRAINING, result()],
     EndKind.COMPLETED),
    ("node-lost-is-a-fifo", [plant(str(Layout.NODE_LOST), None), *TRAINING, result()],
     EndKind.COMPLETED),
    # Another epoch's verdicts (an earlier attempt's, another run's pod on the same FSx) are
    # no verdict on this attempt; its own are.
    ("stray-marker-of-another-epoch",
     [plant(str(Layout.NO_RESTART), b'{"t": 1.0, "rank": 0, "reason": "not yours", "epoch": 999}'),
      *TRAINING, result()], EndKind.COMPLETED),
    ("fatal-of-another-epoch", [*TRAINING, fatal(epoch=999), result()], EndKind.COMPLETED),
    ("result-of-another-epoch", [*TRAINING, result(epoch=999)], EndKind.BUG),
    ("own-fatal", [*TRAINING, fatal(), result("failed")], EndKind.DO_NOT_REQUEUE),
    # Issue 41: a marker nothing of this attempt wrote is no verdict; its own is.
    ("marker-without-an-epoch",
     [marker(lambda e: b'{"t": 1.0, "rank": 0, "reason": "whose?"}'), *TRAINING, result()],
     EndKind.COMPLETED),
    ("marker-not-json", [marker(lambda e: b"do not restart"), *TRAINING, result()],
     EndKind.COMPLETED),
    ("own-marker",
     [*TRAINING, marker(lambda e: b'{"t": 1.0, "rank": 0, "reason": "bad data", "epoch": %d}' % e),
      result("failed")], EndKind.DO_NOT_REQUEUE),
    # Another epoch's world and steps: no progress, no world, no drill of this attempt's.
    ("train-start-and-steps-of-another-epoch",
     [train_start([0, 1], epoch=EARLIER), step(1), step(7, epoch=EARLIER), *TRAINING[1:],
      step(99, epoch=EARLIER + 1000), result()], EndKind.COMPLETED),
    # epoch.json lost or corrupt mid-attempt: the live writer's result stands (it repairs
    # the record); a zombie of an earlier epoch still writes nothing.
    ("epoch-json-lost", [*TRAINING[:2], lambda root: (root / Layout.EPOCH).unlink(),
                         *TRAINING[2:], result()], EndKind.COMPLETED),
    ("epoch-json-corrupt", [*TRAINING[:2], plant(str(Layout.EPOCH), b"\x00{"),
                            *TRAINING[2:], result()], EndKind.COMPLETED),
    ("zombie-after-epoch-json-lost",
     [*TRAINING, lambda root: (root / Layout.EPOCH).unlink(), result(),
      result(epoch=EARLIER)], EndKind.COMPLETED),
]  # fmt: skip


@pytest.mark.parametrize(("case", "script", "kind"), CASES, ids=[c[0] for c in CASES])
def test_hostile_files_do_not_change_an_attempts_outcome(
    tmp_path: Path, dataset: Path, case: str, script: list[Action], kind: EndKind
):
    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    request = LaunchRequest(
        run_id="hostile", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
    )
    for n in range(EARLIER):  # earlier attempts, each on record in the event log
        epoch = RunDir(cfg.run_root).publish(invocation="earlier", attempt=n + 1).epoch
        EventLog(cfg.run_root, epoch=epoch).emit(StageAttempt(stage="train", attempt=n + 1))
    backend = ScriptedBackend(script)
    seen: list[Event] = []
    report = run_attempt(backend, request, on_event=seen.append)
    assert report.outcome.kind == kind, report.outcome.message
    if kind == EndKind.COMPLETED:  # the live attempt's result, no zombie's
        assert json.loads((cfg.run_root / "result.json").read_text())["epoch"] == EARLIER + 1
    assert backend.job is not None and not backend.job.stopped  # it ended by itself
    steps = [e.step for e in seen if isinstance(e, Step)]
    assert steps == list(range(1, STEPS + 1))  # every good line, no bad one
    assert backend.job.observed == seen


def test_the_deadline_holds_with_a_fifo_at_events_jsonl(tmp_path: Path, dataset: Path):
    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    cfg.run_root.mkdir(parents=True)
    os.mkfifo(cfg.run_root / "events.jsonl")
    # A job that never ends by itself (whose trainer could not write its events either).
    forever: list[Action] = [lambda root: None] * 100_000
    request = LaunchRequest(
        run_id="fifo", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=1.0
    )
    backend = ScriptedBackend(forever)
    started = time.monotonic()
    report = run_attempt(backend, request)  # type: ignore[arg-type]
    assert report.outcome.kind == EndKind.TIMEOUT, report.outcome.message
    assert backend.job is not None and backend.job.stopped
    assert time.monotonic() - started < 20


def test_metrics_keep_serving_through_bad_lines(tmp_path: Path, dataset: Path):
    from tasks.metrics import serving

    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    cfg.run_root.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with serving(cfg.run_root, "hostile", port=port, addr="127.0.0.1", poll_s=0.05):
        request = LaunchRequest(
            run_id="hostile", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
        )
        script = [append(*BAD), *TRAINING, append(*BAD), result()]
        report = run_attempt(ScriptedBackend(script), request)  # type: ignore[arg-type]
        assert report.outcome.kind == EndKind.COMPLETED
        deadline = time.monotonic() + 10
        while True:
            s = scrape(url)
            # Both batches of bad lines read (the last event before the result).
            if sample(s, "nvrx_event_lines_dropped_total", reason="too-long") == 2:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
    dropped = {r: sample(s, "nvrx_event_lines_dropped_total", reason=r) for r in
               ("not-json", "not-an-event", "too-long")}  # fmt: skip
    assert dropped == {"not-json": 2, "not-an-event": 14, "too-long": 2}
    assert sample(s, "nvrx_train_step", run_id="hostile") == STEPS


def test_a_lost_lease_stops_the_watch_and_leaves_the_job_running(tmp_path: Path, dataset: Path):
    from tasks.ownership.lease import LeaseLost
    from tests.helpers import read_events

    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    polls: list[str] = []

    def check_owner(action: str) -> None:
        polls.append(action)
        if len(polls) > 3:
            raise LeaseLost(f"taken over; not going to {action}")

    request = LaunchRequest(
        run_id="lost", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
    )
    backend = ScriptedBackend([*TRAINING, result()])
    with pytest.raises(LeaseLost):
        run_attempt(backend, request, check_owner=check_owner)  # type: ignore[arg-type]
    assert backend.job is not None and not backend.job.stopped  # the new owner's now
    assert polls[0] == "start an attempt"
    assert not [e for e in read_events(cfg.run_root) if e["kind"] == "stage_attempt_end"]


@dataclass
class FlakyJob(ScriptedJob):
    """A backend whose every other poll fails (an API server's 5xx, a hiccup of /proc) and whose
    loss report always does."""

    polls: int = 0

    def running(self) -> bool:
        self.polls += 1
        if self.polls % 2:
            raise OSError("the backend did not answer")
        return super().running()

    def losses(self) -> frozenset[int]:
        raise RuntimeError("the node watch broke")


def test_errors_while_observing_never_stop_the_job(tmp_path: Path, dataset: Path):
    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    request = LaunchRequest(
        run_id="flaky", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
    )

    class Backend(ScriptedBackend):
        def launch(self, request: LaunchRequest) -> ScriptedJob:
            self.job = FlakyJob(request.cfg.run_root, [*TRAINING, result()])
            return self.job

    def on_event(e: Event) -> None:
        raise ValueError("the flow's callback broke")

    backend = Backend([])
    report = run_attempt(backend, request, on_event=on_event)
    assert report.outcome.kind == EndKind.COMPLETED, report.outcome.message
    assert backend.job is not None and not backend.job.stopped  # it ended by itself
    assert [e.step for e in backend.job.observed if isinstance(e, Step)] == [1, 2, 3, 4]


def test_a_stuck_lease_read_holds_neither_the_watch_nor_the_outcome(tmp_path: Path, dataset: Path):
    """The lease file on a hung mount: its poll never answers, the attempt still ends with its
    real outcome, not stopped and not taken for a lost lease."""
    import threading

    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    hung = threading.Event()  # never set: the read blocks for good

    def check_owner(action: str) -> None:
        if action.startswith("watch"):
            hung.wait()

    request = LaunchRequest(
        run_id="hung", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
    )
    backend = ScriptedBackend([*TRAINING, result()])
    started = time.monotonic()
    report = run_attempt(backend, request, check_owner=check_owner)  # type: ignore[arg-type]
    assert report.outcome.kind == EndKind.COMPLETED, report.outcome.message
    assert backend.job is not None and not backend.job.stopped
    assert time.monotonic() - started < 10  # one read's timeout, not one per poll


def test_a_frozen_fence_lock_holder_costs_a_stage_retry_not_the_run(
    tmp_path: Path, dataset: Path, monkeypatch
):
    """A real process holds the fence lock and is frozen (SIGSTOP) past the lock's timeout
    (1 s here for 60 s; the issue's 90 s hold): the attempt is not launched and its error is
    a stage retry's; once the holder thaws, the retry publishes and completes."""
    import signal
    import subprocess
    import sys

    from tasks.errors import FenceBusy
    from tasks.retry_policy import stage_retry_allowed

    cfg = make_config(tmp_path / "run", dataset, steps=STEPS)
    holds = "import sys; from trainer import fence\nwith fence.locked(sys.argv[1]):\n"
    holds += " print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", holds, str(cfg.run_root / Layout.FENCE_LOCK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        holder.send_signal(signal.SIGSTOP)
        monkeypatch.setattr(fence, "LOCK_TIMEOUT_S", 1.0)
        request = LaunchRequest(
            run_id="frozen", attempt=1, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
        )
        backend = ScriptedBackend([*TRAINING, result()])
        with pytest.raises(FenceBusy, match="attempt 1 not launched") as err:
            run_attempt(backend, request)  # type: ignore[arg-type]
        assert stage_retry_allowed(err.value) and backend.job is None
        assert fence.current(RunDir(cfg.run_root)) is None  # no epoch published
        holder.send_signal(signal.SIGCONT)  # it thaws, ends its mutation, lets go
        holder.communicate(timeout=30)
        retry = LaunchRequest(
            run_id="frozen", attempt=2, cfg=cfg, nodes=1, nproc_per_node=1, deadline_s=30
        )
        report = run_attempt(backend, retry)  # type: ignore[arg-type]
        assert report.outcome.kind == EndKind.COMPLETED, report.outcome.message
    finally:
        holder.kill()
        holder.wait()
