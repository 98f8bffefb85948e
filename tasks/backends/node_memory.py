"""The simulated nodes' node memory (trainer.checkpointing.node_copy), on this machine.

Each simulated node of an attempt gets a directory of its own in ``/dev/shm`` (memory, as an
EKS pod's memory-backed volume is), given to its workers in ``NVRX_NODE_MEMORY``. The simulation
is honest about what a node's memory survives: a worker respawn on the node keeps it; a lost node
loses it (``forget_node``); a new attempt starts with none (``prepare`` removes every earlier
attempt's of the run, and ``forget_attempt`` the attempt's own when it ends), as new nodes would.
What ends an attempt without its launcher (a takeover, a cleanup) removes it with ``forget``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from trainer.checkpointing.layout import NODE_MEMORY_ENV as ENV
from trainer.checkpointing.node_dir import private_dir

__all__ = ["ENV", "attempt_dir", "forget", "forget_attempt", "forget_node", "prepare"]


def base_dir() -> Path:
    """Where every run's node memory goes on this machine (memory: /dev/shm where writable)."""
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return where / f"nvrx-node-memory-{os.getuid()}"


def _run_dir(run_root: Path) -> Path:
    key = hashlib.sha256(str(Path(run_root).absolute()).encode()).hexdigest()[:16]
    return base_dir() / key


def attempt_dir(run_root: Path, attempt: int, invocation: str) -> Path:
    return _run_dir(run_root) / f"attempt{attempt}-{invocation[:8]}"


def prepare(run_root: Path, attempt: int, invocation: str) -> Path:
    """The attempt's directory, empty, with every earlier attempt's of the run removed (their
    nodes are gone: a stage retry runs on new ones). Each level is this user's alone
    (``node_dir.private_dir``: made 0700, or an existing one checked, else refused)."""
    run = _run_dir(run_root)
    private_dir(base_dir())  # another user's, or open to them: refused (node_dir)
    shutil.rmtree(run, ignore_errors=True)
    private_dir(run)
    return private_dir(attempt_dir(run_root, attempt, invocation))


def forget_node(run_root: Path, attempt: int, invocation: str, node: int) -> None:
    """A lost node's memory goes with it."""
    shutil.rmtree(attempt_dir(run_root, attempt, invocation) / f"node-{node}", ignore_errors=True)


def forget_attempt(run_root: Path, attempt: int, invocation: str) -> None:
    shutil.rmtree(attempt_dir(run_root, attempt, invocation), ignore_errors=True)
    with contextlib.suppress(OSError):
        _run_dir(run_root).rmdir()  # only if empty


def forget(run_root: Path, *, keep: str | None = None) -> list[Path]:
    """Every attempt's node memory of the run but invocation ``keep``'s (a live owner's): the
    attempts a takeover or a cleanup ended, whose launcher never removed it. Returns what went."""
    run = _run_dir(run_root)
    gone = [
        p
        for p in sorted(run.glob("attempt*"))
        if keep is None or not p.name.endswith(f"-{keep[:8]}")
    ]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        run.rmdir()  # only if empty
    return gone
