"""A simulated node's processes (:mod:`tasks.backends.local`): each node an ``ft_launcher``
agent in a session of its own under a tiny shell that records its exit code, found again by pid
and start time by an invocation that adopts it; the elastic job's rendezvous store apart from
every node; and the process-tree kill that simulates a lost node (a frozen one stops itself:
trainer.node_beat).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tasks.backends import node_memory
from tasks.backends.netns import start_ready
from tasks.ownership import processes
from tasks.ownership.lease import RunLease, process_is
from tasks.ownership.takeover import NodeRecord
from trainer.run_files import read_small
from trainer.rundir import Layout

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[psutil.Process]:
    """A process and every descendant, parents first (collected before any is signalled:
    children re-parent on death)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant."""
    processes.end(_tree(pid))


# Each simulated node runs under a tiny shell that writes the agent's exit code to a file: an
# invocation that adopts the node after its first owner died is not its parent and could not
# learn the exit code otherwise. (mktemp: a temporary name no one can plant a link at.)
_EXIT_WRAPPER = (
    'rc=0; "$@" || rc=$?; tmp=$(mktemp "$NVRX_EXIT_FILE.XXXXXXXX") && '
    'printf "%s\\n" "$rc" > "$tmp" && chmod 644 "$tmp" && mv -f "$tmp" "$NVRX_EXIT_FILE"; '
    'exit "$rc"'
)


def exit_file(run_root: Path, attempt: int, node: int) -> Path:
    """Where simulated node ``node`` of ``attempt`` leaves its agent's exit code."""
    return run_root / Layout.attempt_log(attempt, f"node{node}.exit")


@dataclass
class NodeProcess:
    """One simulated node: its session leader, found again by pid and start time."""

    node: int
    pid: int
    create_time: float
    exit_file: Path
    popen: subprocess.Popen[bytes] | None = None  # None: adopted from a dead owner

    def poll(self) -> int | None:
        if self.popen is not None:
            code = self.popen.poll()
        elif process_is(self.pid, self.create_time):
            return None
        else:
            try:
                code = int((read_small(self.exit_file, limit=64) or b"").strip())
            except (OSError, ValueError):
                return -int(signal.SIGKILL)  # gone without a word: killed
        # The shell reports an agent killed by signal N as 128 + N; say it as Popen would.
        return -(code - 128) if code is not None and code > 128 else code

    def wait(self) -> None:
        if self.popen is not None:
            self.popen.wait()
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(self.pid).wait(timeout=30)

    def record(self, attempt: int) -> dict[str, Any]:
        return {
            "kind": "node",
            "attempt": attempt,
            "node": self.node,
            "pid": self.pid,
            "create_time": self.create_time,
            "exit_file": str(self.exit_file),
        }

    @classmethod
    def from_record(cls, r: NodeRecord, run_root: Path) -> NodeProcess:
        """A validated lease record; its exit file is where the launcher writes it for that
        attempt and node, whatever the record says."""
        return cls(r.node, r.pid, r.create_time, exit_file(run_root, r.attempt, r.node))


@dataclass(frozen=True)
class NodeStarter:
    """Starts simulated node ``n`` of one attempt (again, for a node back after a loss or a
    deferred spare): ``argv`` under the exit-code shell, in a session of its own."""

    run_root: Path
    attempt: int
    enter: list[str]  # the command that enters the attempt's network ([]: the host's)
    argv: list[str]  # ft_launcher's
    env: dict[str, str]
    memory: Path  # the attempt's node memory, one directory per node
    gpus: dict[int, str] | None  # each node's CUDA_VISIBLE_DEVICES; None: CPU workers
    recorder: RunLease | None = None  # notes what it starts (arch §6)

    def __call__(self, node: int) -> NodeProcess:
        log_path = self.run_root / Layout.attempt_log(self.attempt, f"node{node}.log")
        exit_path = exit_file(self.run_root, self.attempt, node)
        exit_path.unlink(missing_ok=True)
        # A node's memory starts empty: a first start, or a node back after a loss.
        node_mem = self.memory / f"node-{node}"
        node_mem.mkdir(mode=0o700, exist_ok=True)
        # Appended: a node that returns after a loss keeps its first life's log above.
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [*self.enter, *("/bin/sh", "-c", _EXIT_WRAPPER, f"nvrx-node{node}", *self.argv)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **self.env,
                    "NVRX_EXIT_FILE": str(exit_path),
                    "NVRX_NODE": str(node),
                    node_memory.ENV: str(node_mem),
                    **({} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": self.gpus[node]}),
                },
                cwd=REPO,
                start_new_session=True,  # one "node" = one session we can take down whole
            )
        created = psutil.Process(popen.pid).create_time()
        proc = NodeProcess(node, popen.pid, created, exit_path, popen)
        if self.recorder is not None:
            self.recorder.record(proc.record(self.attempt))
        return proc


def start_store(
    endpoint: str, env: dict[str, str], log: Path, *, enter: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """The rendezvous store of an elastic job, in a session of its own (and in the attempt's
    network when ``enter`` says how), listening when this returns. It carries the run's tags,
    so whatever ends the run's processes ends it too."""
    host, _, port = endpoint.rpartition(":")
    argv = [*(enter or []), sys.executable, "-m", "tasks.backends.rdzv_store", "--host", host]
    failed = f"the rendezvous store did not listen on {endpoint} within 60 s"
    return start_ready([*argv, "--port", port], failed, log=log, env=env, cwd=REPO, timeout_s=60)
