"""One attempt of the train stage: launch, watch (progress, node-loss drills, deadline), classify.

Plain functions (no Prefect): the stage flow adds logging and artifacts through callbacks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.backends.base import Backend, Job, LaunchRequest
from tasks.classify import EndSnapshot, Outcome, classify
from trainer.events import EventLog, read_events
from trainer.faults import FaultSpec, claim, parse_fault
from trainer.resilience import clear_no_restart, read_no_restart

# After the watcher takes a node away, survivors first fail their collectives and then wait in
# rendezvous (bounded by ft_launcher's join_timeout). The watcher knows the node is gone, so it
# stops them after this grace instead of waiting out the rendezvous.
NODE_LOSS_GRACE_S = 2.0


class EventTail:
    """Reads the lines appended to ``events.jsonl`` since the attempt started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next read
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


@dataclass
class AttemptReport:
    attempt: int
    outcome: Outcome
    wall_s: float
    events: list[dict[str, Any]]


def _since_last_attempt_start(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    starts = [i for i, e in enumerate(events) if e["kind"] == "stage_attempt"]
    return events[starts[-1] + 1 :] if starts else []


def node_loss_faults(specs: list[str] | tuple[str, ...]) -> list[FaultSpec]:
    return [f for f in map(parse_fault, specs) if f.kind == "node-loss"]


def run_attempt(
    backend: Backend,
    request: LaunchRequest,
    *,
    deadline_s: float,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
    poll_s: float = 0.2,
    adopted: Job | None = None,
) -> AttemptReport:
    """Launch an attempt and watch it to its end, or, given ``adopted`` (an attempt a dead
    invocation launched, DESIGN §8), only watch it: no restart, its result stands."""
    cfg = request.cfg
    run_root = cfg.run_root
    run_root.mkdir(parents=True, exist_ok=True)
    events = EventLog(run_root)
    tail = EventTail(events.path)
    drills = node_loss_faults(cfg.faults)
    seen: list[dict[str, Any]] = []
    started = time.monotonic()
    if adopted is None:
        (run_root / "result.json").unlink(missing_ok=True)  # only this attempt's result counts
        clear_no_restart(run_root)  # nor an earlier attempt's verdict (the config was fixed)
        events.emit(
            "stage_attempt",
            stage="train",
            attempt=request.attempt,
            nodes=request.nodes,
            nproc_per_node=request.nproc_per_node,
            backend=backend.name,
        )
        job: Job = backend.launch(request)
    else:
        job = adopted
        # What the attempt said before we came: a fatal error there decides its outcome too.
        seen = _since_last_attempt_start(read_events(run_root))
        events.emit(
            "stage_attempt",
            stage="train",
            attempt=request.attempt,
            nodes=request.nodes,
            nproc_per_node=request.nproc_per_node,
            backend=backend.name,
            adopted=True,
        )
    timed_out = False
    loss_at: float | None = None
    try:
        while True:
            for e in tail.read_new():
                seen.append(e)
                on_event(e)
                if e["kind"] == "step":
                    for spec in drills:
                        if e["step"] >= spec.step and claim(run_root, spec):
                            node = spec.node or 0
                            # Reaches on_event through the tail, like every other event.
                            events.emit(
                                "fault",
                                fault=str(spec),
                                fault_kind="node-loss",
                                step=e["step"],
                                node=node,
                                rank=None,
                            )
                            job.lose_node(node)
                            loss_at = time.monotonic()
            status = job.status()
            if not status.running:
                break
            if loss_at is not None and time.monotonic() - loss_at > NODE_LOSS_GRACE_S:
                break
            if time.monotonic() - started > deadline_s:
                timed_out = True
                break
            time.sleep(poll_s)
    finally:
        job.stop()
    for e in tail.read_new():
        seen.append(e)
        on_event(e)
    status = job.status()
    result_path = run_root / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    fatal = next((e.get("error") for e in seen if e["kind"] == "fatal"), None)
    snapshot = EndSnapshot(
        exit_codes={
            n: None if n in status.stopped_nodes else code for n, code in status.exit_codes.items()
        },
        lost_nodes=frozenset(status.lost_nodes),
        timed_out=timed_out,
        result=result,
        fatal=fatal,
        no_restart=read_no_restart(run_root),
        target_steps=cfg.steps,
        log_hint=str(run_root / "logs" / f"attempt{request.attempt}-node*.log"),
    )
    outcome = classify(snapshot)
    wall = time.monotonic() - started
    events.emit(
        "stage_attempt_end",
        stage="train",
        attempt=request.attempt,
        outcome=outcome.kind.value,
        message=outcome.message,
        wall_s=round(wall, 3),
    )
    return AttemptReport(request.attempt, outcome, wall, seen)
