"""A node's beat file (trainer.node_beat): rewritten by a thread, read by the watcher for its own
epoch only, and never a way to block or mislead it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.node_beat import BEATS_DIR, NodeBeat, beat_name, clear_other_epochs, read_beats


def test_a_beat_changes_while_its_node_lives_and_stops_when_closed(tmp_path: Path):
    beat = NodeBeat(tmp_path, epoch=3, node=1, interval_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while not read_beats(tmp_path, 3):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first = read_beats(tmp_path, 3)[1]
        while read_beats(tmp_path, 3)[1] == first:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        beat.close()
    last = read_beats(tmp_path, 3)
    time.sleep(0.2)
    assert read_beats(tmp_path, 3) == last  # closed: silent
    assert read_beats(tmp_path, 4) == {}  # another epoch's watcher reads none of it


def test_only_the_epochs_small_regular_files_are_read(tmp_path: Path):
    beats = tmp_path / BEATS_DIR
    beats.mkdir(parents=True)
    (beats / beat_name(5, 0)).write_text("1 1\n")
    (beats / beat_name(4, 1)).write_text("stale\n")  # a zombie of the attempt before
    os.mkfifo(beats / beat_name(5, 2))  # would block a plain open
    (beats / beat_name(5, 3)).write_text("x" * 10_000)  # too large to be a beat
    (beats / "e5-node4.tmp").write_text("not a beat name\n")
    os.symlink(beats / beat_name(5, 0), beats / beat_name(5, 5))
    assert read_beats(tmp_path, 5) == {0: "1 1\n"}
    clear_other_epochs(tmp_path, 5)
    assert not (beats / beat_name(4, 1)).exists()
    assert (beats / beat_name(5, 0)).exists()
    assert read_beats(tmp_path / "absent", 5) == {}
