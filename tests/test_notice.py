"""An eviction's notice (trainer.notice; trainer.agent.Notice), and the agent's exit poll. The
agent's SIGTERM handler says ``leaving`` in its beat, tells its workers (SIGUSR1) and waits for
them to leave before NVRx's launcher ends what is left. A worker hears the notice as a flag; a
SIGTERM still ends it at once, as every in-job restart's stop needs. Real processes, no
launcher (the drills run that: tests/test_fault_drills.py, tests/test_eks_pipeline.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest

from trainer.agent import Notice, term_timeout

# A worker: the notice installed as trainer/__main__.py does; exit 5 (ExitCode.LEFT) once told.
_WORKER = """
import sys, time
from trainer import notice
notice.install()
print("ready", flush=True)
deadline = time.monotonic() + 30
while not notice.given() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(5 if notice.given() else 1)
"""


def _worker() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


class _Beat:
    def __init__(self, order: list[Any]) -> None:
        self.order = order

    def leave(self) -> None:
        self.order.append("leaving")


class _Workers:
    def __init__(self, *procs: subprocess.Popen[str]) -> None:
        self.procs = procs

    def pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in enumerate(self.procs)}


def test_the_agent_says_leaving_tells_its_workers_and_waits_for_them():
    worker = _worker()
    order: list[Any] = []
    notice = Notice(_Beat(order), wait_s=20)
    notice.workers = _Workers(worker)

    def launcher(signum: int, frame: Any) -> None:  # NVRx's handler: ends what is left
        order.append(("launcher", worker.poll()))

    notice.on_sigterm(launcher, signal.SIGTERM, None)
    # The beat first, then the workers told; NVRx's handler only once they left (exit 5).
    assert order == ["leaving", ("launcher", 5)]
    notice.on_sigterm(launcher, signal.SIGTERM, None)  # a second SIGTERM: straight to NVRx's
    assert order[1:] == [("launcher", 5), ("launcher", 5)]


def test_a_worker_that_does_not_leave_is_waited_for_no_longer_than_the_term_timeout():
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        called: list[int | None] = []
        notice = Notice(None, wait_s=0.5)
        notice.workers = _Workers(hung)  # type: ignore[arg-type]
        # SIGUSR1's default action ends a process that never installed the notice: as before
        # this change (an eviction was a node loss), never a hang.
        notice.on_sigterm(lambda s, f: called.append(hung.poll()), signal.SIGTERM, None)
        assert called and hung.wait(timeout=10) == -signal.SIGUSR1
    finally:
        hung.kill()
        hung.wait()


def test_a_worker_not_told_still_ends_at_once_on_sigterm():
    """The launcher's SIGTERM to stop its workers for a restart keeps its default action."""
    worker = _worker()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.parametrize(
    ("args", "seconds"),
    [
        (["--nnodes=2", "--term-timeout=27", "-m", "trainer"], 27.0),
        (["--term_timeout", "12.5", "-m", "trainer"], 12.5),
        (["--term-timeout=oops"], 1800.0),  # NVRx's own default then
        (["--nnodes=2", "-m", "trainer"], 1800.0),
    ],
)
def test_the_wait_is_the_launchers_term_timeout(args: list[str], seconds: float):
    assert term_timeout(args) == seconds


def test_the_leaving_store_host_looks_every_tenth_of_a_second():
    """trainer.agent.patch_exit_poll: NVRx's store host looked once a second whether the other
    nodes left (up to 1 s on every attempt's end); the same calls, looked at every 0.1 s."""
    import time

    from nvidia_resiliency_ext.fault_tolerance import launcher

    from trainer.agent import patch_exit_poll

    assert patch_exit_poll() and patch_exit_poll()  # idempotent
    calls: list[str] = []

    class Handler:
        left_at = time.monotonic() + 0.35  # the last other node leaves then

        def _stop_heartbeats(self) -> None:
            calls.append("stop")

        def remove_this_node(self) -> None:
            calls.append("remove")

        def set_closed(self) -> None:
            calls.append("close")

        polls = 0

        def num_nodes(self) -> int:
            Handler.polls += 1
            return 1 if time.monotonic() < self.left_at else 0

    agent = launcher.LocalElasticAgent.__new__(launcher.LocalElasticAgent)
    agent._rdzv_handler, agent._is_store_host, agent._exit_barrier_timeout = Handler(), True, 30
    t0 = time.monotonic()
    agent.clean_rdzv_shutdown(close=True)
    assert calls == ["stop", "remove", "close"]
    assert time.monotonic() - t0 >= 0.35  # until the last node left, not before
    # Looked several times within those 0.35 s (NVRx's 1 s poll: once, then a second later).
    assert Handler.polls >= 3, Handler.polls
