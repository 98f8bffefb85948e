"""The one decoder of ``events.jsonl`` (trainer.event_read) and the run root's small files
(trainer.run_files): every hostile line or path is dropped and counted, never raised, and never
blocks the reader."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainer import event_read
from trainer.event_read import MAX_LINE, EventReader
from trainer.event_types import Step, TrainStart, ValidationError
from trainer.events import EventLog
from trainer.run_files import UnsafeFile, read_json_object, read_small
from trainer.rundir import read_events

GOOD = json.dumps({"t": 1.0, "kind": "step", "step": 1, "loss": 2.0, "step_s": 0.1})
GOOD2 = json.dumps({"t": 2.0, "kind": "step", "step": 2, "loss": 1.9, "step_s": 0.1})


def _step(**over: Any) -> str:
    return json.dumps({"t": 1.5, "kind": "step", "step": 3, "loss": 1.0, "step_s": 0.1, **over})


# (line, the reason it is dropped for)
BAD_LINES = [
    ("1", "not-an-event"),
    ("null", "not-an-event"),
    ('"step"', "not-an-event"),
    ("[]", "not-an-event"),
    ("{}", "not-an-event"),
    ('{"t": 1, "kind": "no_such_kind"}', "not-an-event"),
    (json.dumps({"t": 1.5, "kind": "step", "loss": 1.0}), "not-an-event"),  # no step
    (_step(step="5"), "not-an-event"),  # a string is not a step
    (_step(step=True), "not-an-event"),
    (_step(step=-1), "not-an-event"),
    (_step(step=2.5), "not-an-event"),
    (_step(t="yesterday"), "not-an-event"),
    (json.dumps({"kind": "step", "step": 3}), "not-an-event"),  # no time
    (json.dumps({"t": 1, "kind": "train_start", "world_size": 2, "nodes": "0,1"}), "not-an-event"),
    (json.dumps({"t": 1, "kind": "fatal"}), "not-an-event"),  # no error
    ('{"t": 1, "kind": "step", "step": 3', "not-json"),  # torn
    ("\xff\xfe not utf-8", "not-json"),
    ("x" * (MAX_LINE + 1), "too-long"),
]


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for line in lines:
            f.write(line.encode("utf-8", "surrogateescape") + b"\n")


@pytest.mark.parametrize(
    ("line", "reason"), BAD_LINES, ids=[r + str(i) for i, (_, r) in enumerate(BAD_LINES)]
)
def test_a_bad_line_is_dropped_and_counted(tmp_path: Path, line: str, reason: str):
    path = tmp_path / "events.jsonl"
    _write(path, [GOOD, line, GOOD2])
    reader = EventReader(path)
    events = reader.read_new()
    assert [e.step for e in events if isinstance(e, Step)] == [1, 2]
    assert reader.dropped.by_reason[reason] == 1 and reader.dropped.total == 1
    # The whole-log reader (every typed event at once) sees the same two, nothing else.
    assert [e.step for e in read_events(tmp_path) if isinstance(e, Step)] == [1, 2]


def test_lines_arrive_incrementally_and_a_partial_line_waits(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read_new() == []  # no file yet
    with open(path, "ab") as f:
        f.write(GOOD.encode() + b"\n" + GOOD2.encode()[:10])
    assert [e.step for e in reader.read_new()] == [1]  # type: ignore[union-attr]
    with open(path, "ab") as f:
        f.write(GOOD2.encode()[10:] + b"\n")
    assert [e.step for e in reader.read_new()] == [2]  # type: ignore[union-attr]
    assert reader.read_new() == [] and reader.dropped.total == 0


def test_an_over_long_line_spanning_reads_is_dropped_once(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(event_read, "CHUNK", 1024)  # the long line spans many reads
    path = tmp_path / "events.jsonl"
    _write(path, [GOOD, "y" * (3 * MAX_LINE), GOOD2])
    reader = EventReader(path)
    assert [e.step for e in reader.read_new()] == [1, 2]  # type: ignore[union-attr]
    assert reader.dropped.by_reason["too-long"] == 1


def test_a_rewritten_file_is_read_again_from_its_start(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    _write(path, [GOOD, GOOD2])
    reader = EventReader(path)
    assert len(reader.read_new()) == 2
    _write(path, [GOOD])
    assert [e.step for e in reader.read_new()] == [1]  # type: ignore[union-attr]
    assert reader.dropped.by_reason["unreadable"] == 1


def _within(fn: Callable[[], Any], seconds: float = 5.0) -> Any:
    """``fn()``'s value, failing the test if it blocks (a FIFO opened without O_NONBLOCK)."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} blocked"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def test_a_fifo_at_events_jsonl_neither_blocks_nor_raises(tmp_path: Path):
    os.mkfifo(tmp_path / "events.jsonl")
    reader = EventReader(tmp_path / "events.jsonl")
    assert _within(reader.read_new) == []
    assert reader.dropped.by_reason["unreadable"] == 1
    assert _within(lambda: read_events(tmp_path)) == []
    assert _within(lambda: EventReader(tmp_path / "events.jsonl", from_start=False).offset) == 0


def test_a_symlinked_events_file_is_not_followed(tmp_path: Path):
    elsewhere = tmp_path / "other-run" / "events.jsonl"
    _write(elsewhere, [GOOD, GOOD2])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").symlink_to(elsewhere)
    reader = EventReader(tmp_path / "run" / "events.jsonl")
    assert reader.read_new() == [] and reader.dropped.by_reason["unreadable"] == 1


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_writers_write_through_the_types(tmp_path: Path):
    log = EventLog(tmp_path)
    with pytest.raises(ValidationError, match="step"):
        Step(step="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'step' does not match its type"):
        # Built past its own validation: the log still refuses what would not decode.
        log.emit(Step.model_construct(t=1.0, kind="step", step="5"))
    log.emit(TrainStart(world_size=2, nodes=[0, 1], job_id="j"))
    (ev,) = EventReader(log.path).read_new()
    assert isinstance(ev, TrainStart) and ev.nodes == [0, 1] and ev.job_id == "j"


def test_a_writer_after_a_torn_line_is_still_read(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    path.write_text(GOOD + "\n" + GOOD2[:15])  # a writer killed mid-write
    EventLog(tmp_path).emit(Step(step=3, loss=1.0, step_s=0.1))
    reader = EventReader(path)
    assert [e.step for e in reader.read_new()] == [1, 3]  # type: ignore[union-attr]
    assert reader.dropped.by_reason["not-json"] == 1


# -- small files: result.json and markers ---------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[1, 2]", b"1", b"null", b'"completed"', b"\xff\xfe", b""],
    ids=["text", "list", "number", "null", "string", "bytes", "empty"],
)
def test_a_result_that_is_not_a_json_object_reads_as_none(tmp_path: Path, content: bytes):
    (tmp_path / "result.json").write_bytes(content)
    assert read_json_object(tmp_path / "result.json") is None


def test_unsafe_small_files_are_refused_without_blocking(tmp_path: Path):
    os.mkfifo(tmp_path / "result.json")
    assert _within(lambda: read_json_object(tmp_path / "result.json")) is None
    with pytest.raises(UnsafeFile):
        _within(lambda: read_small(tmp_path / "result.json"))
    big = tmp_path / "big.json"
    big.write_bytes(b"{" + b" " * 100 + b"}")
    with pytest.raises(UnsafeFile, match="more than the 50"):
        read_small(big, limit=50)
    assert read_small(tmp_path / "absent.json") is None
    (tmp_path / "link.json").symlink_to(big)
    assert read_json_object(tmp_path / "link.json") is None
    (tmp_path / "ok.json").write_text('{"status": "completed"}')
    assert read_json_object(tmp_path / "ok.json") == {"status": "completed"}
