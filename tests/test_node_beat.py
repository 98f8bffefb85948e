"""A node's beat file (trainer.node_beat): rewritten by a thread, read by the watcher for its own
epoch only (the reads: tests/test_rundir.py)."""

from __future__ import annotations

import time
from pathlib import Path

from trainer.node_beat import NodeBeat
from trainer.rundir import RunDir


def test_a_beat_changes_while_its_node_lives_and_stops_when_closed(tmp_path: Path):
    mine, other = RunDir(tmp_path, 3), RunDir(tmp_path, 4)
    beat = NodeBeat(mine.beat_file(1), interval_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while not mine.beats():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first = mine.beats()[1]
        while mine.beats()[1] == first:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        beat.close()
    last = mine.beats()
    time.sleep(0.2)
    assert mine.beats() == last  # closed: silent
    assert other.beats() == {}  # another epoch's watcher reads none of it
