"""A node's beat file (trainer.node_beat): rewritten by a thread of the node's agent, read by the
watcher for its own epoch only (the reads: tests/test_rundir.py); its last word on a normal exit,
and the freeze drill it carries out."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from trainer.node_beat import NodeBeat, is_done, is_leaving
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


def test_a_normal_exit_says_done(tmp_path: Path):
    run = RunDir(tmp_path, 3)
    beat = NodeBeat(run.beat_file(0), interval_s=0.05)
    beat.close()
    assert is_done(run.beats()[0]) and not is_done("123 4 5.0 up")
    silenced = NodeBeat(run.beat_file(1), interval_s=0.05)
    silenced.close(done=False)
    assert not is_done(run.beats()[1])


def test_a_node_told_to_go_says_so_at_once_and_in_every_beat_after(tmp_path: Path):
    run = RunDir(tmp_path, 3)
    beat = NodeBeat(run.beat_file(0), interval_s=0.05)
    try:
        beat.leave()
        assert is_leaving(run.beats()[0])  # written before the workers are told
        first = run.beats()[0]
        deadline = time.monotonic() + 10
        while run.beats()[0] == first:  # still a sign of life: never read as silent
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert is_leaving(run.beats()[0]) and not is_done(run.beats()[0])
    finally:
        beat.close()
    assert is_done(run.beats()[0]) and not is_leaving(run.beats()[0])


# The agent's beat in a process of its own, as trainer.agent starts it; with a child, as the
# agent has its workers.
_AGENT = """
import subprocess, sys, time
from pathlib import Path
from trainer.node_beat import NodeBeat
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
beat = NodeBeat(Path(sys.argv[1]), interval_s=0.05, freeze=Path(sys.argv[2]))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_the_freeze_drill_stops_the_agent_and_its_children(tmp_path: Path):
    run = RunDir(tmp_path, 2)
    proc = subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(run.beat_file(1)), str(run.freeze_file(1))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        child = psutil.Process(int(proc.stdout.readline()))
        agent = psutil.Process(proc.pid)
        assert agent.status() != psutil.STATUS_STOPPED
        run.request_freeze(1)
        deadline = time.monotonic() + 10
        while agent.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert child.status() == psutil.STATUS_STOPPED
        frozen = run.beats()[1]
        time.sleep(0.3)
        assert run.beats()[1] == frozen  # silent: nothing of the node runs
    finally:
        for p in (child, agent):
            p.kill()  # SIGKILL needs no SIGCONT
        proc.wait()
