"""The processes a run starts, found again after their owner died.

Every process the local backend starts carries two environment variables that all of its
descendants inherit (ft_launcher agents, rank monitors, workers, checkpoint writers, even the ones
ft_launcher starts in sessions of their own): ``NVRX_RUN_ROOT`` and ``NVRX_INVOCATION``. So "every
process of this run" and "every process of that invocation" are questions the process table
answers, with no chain of parents to trust.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil

RUN_ROOT_ENV = "NVRX_RUN_ROOT"
INVOCATION_ENV = "NVRX_INVOCATION"


@dataclass(frozen=True)
class Tagged:
    pid: int
    invocation: str
    process: psutil.Process


def tags(run_root: Path, invocation: str) -> dict[str, str]:
    return {RUN_ROOT_ENV: str(Path(run_root)), INVOCATION_ENV: invocation}


def tagged(run_root: Path) -> list[Tagged]:
    """Live processes of this run (any invocation), by their environment."""
    want = str(Path(run_root))
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        if env.get(RUN_ROOT_ENV) == want:
            out.append(Tagged(p.pid, env.get(INVOCATION_ENV, ""), p))
    return out


def carries(pid: int, create_time: float, run_root: Path, invocation: str) -> bool:
    """Is ``pid`` the very process recorded (its start time) and one that ``invocation``
    started for this run (its tags)? A lease names pids, but a lease is a file anyone with the
    shared filesystem can write: only the process's own environment says whose it is."""
    from tasks.ownership.lease import process_is

    if not process_is(pid, create_time):
        return False
    try:
        env = psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False
    return env.get(RUN_ROOT_ENV) == str(Path(run_root)) and env.get(INVOCATION_ENV) == invocation


def end(procs: list[psutil.Process], timeout_s: float = 10.0) -> None:
    """SIGKILL every one (they are already orphans or about to be: nothing to flush)."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=timeout_s)


def end_invocations(run_root: Path, *, keep: str | None = None) -> list[int]:
    """End every process of this run not started by invocation ``keep``; their pids."""
    victims = [t for t in tagged(run_root) if t.invocation != keep]
    end([t.process for t in victims])
    return [t.pid for t in victims]


def stop_session(proc: psutil.Process, timeout_s: float = 15.0) -> None:
    """Stop a server started in a session of its own (its pid leads the process group): SIGTERM
    to the whole group (it flushes and exits), SIGKILL if it lingers past ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except psutil.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            proc.wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        pass
