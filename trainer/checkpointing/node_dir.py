"""Node memory's directory: this user's alone, or refused (issue 43, item 5).

Node memory lives at a predictable name in a directory every local user may write (``/dev/shm``,
sticky): another user could create that name first, as a directory of theirs or a link to one,
and then read every copy of the model's state, or plant copies a resume would restore (their
headers' digests are checksums, not signatures). So each level is created exclusively
(``mkdir``, mode 0700: an existing one is never taken as made), and one that already exists is
used only if it is a real directory (not a link), owned by this user, and writable by no one
else. Inside a directory only its owner can write, the rank and peer directories need no check.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from trainer.checkpointing.layout import NODE_MEMORY_GENERATIONS as GENERATIONS
from trainer.errors import TerminalError

MODE = 0o700


class NodeMemoryDirError(TerminalError):
    """Node memory's directory is not this user's alone: no restart changes that."""


def refusal(st: os.stat_result, uid: int) -> str:
    """Why a directory with ``lstat`` result ``st`` may not hold this user's (``uid``) node
    memory; "" when it may. Pure: table-tested."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link (node memory is never reached through one)"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != uid:
        return f"its owner is uid {st.st_uid}, this process runs as uid {uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}: others may write it (want 0700)"
    return ""


def private_dir(path: Path) -> Path:
    """``path``: made now, mode 0700, or an existing directory checked (:func:`refusal`);
    :class:`NodeMemoryDirError` naming the path, what is wrong and the fix otherwise. Its parent
    must exist (each level is made, or checked, by its own call)."""
    path = Path(path)
    try:
        os.mkdir(path, MODE)
        return path
    except FileExistsError:
        pass
    why = refusal(os.lstat(path), os.getuid())
    if why:
        raise NodeMemoryDirError(
            f"node memory directory {path}: {why}. Another user may have made it to read or "
            f"plant checkpoint copies: remove it (or give the launcher another directory in "
            f"NVRX_NODE_MEMORY) and run again"
        )
    return path


# -- files in it -----------------------------------------------------------------------------
def allocated_map(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes, its pages allocated first (a full tmpfs raises ENOSPC
    here rather than SIGBUS at the first write), mapped read-write."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(size, 1))
        return mmap.mmap(fd, max(size, 1))
    except OSError:
        path.unlink(missing_ok=True)  # a full node memory keeps no half-allocated file
        raise
    finally:
        os.close(fd)


def no_room(d: Path, size: int, error: OSError) -> str:
    """A copy that node memory has no room for, said as such: no other memory takes it (a
    full node stays visible, never hidden in the process's anonymous memory)."""
    try:
        st = os.statvfs(d)
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "its free space unknown"
    if error.errno != errno.ENOSPC:
        return f"node memory {d} refused {size} bytes: {error}"
    return (
        f"node memory is full: {d} has {free}, the copy needs {size} bytes; it is dropped "
        "(make the node's memory larger: locally /dev/shm, on EKS eks.shm_gi)"
    )


def no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


# What a receive that never finished may leave in a peer directory: a generation's bytes (kept
# only where its header exists) and write_durably's temporary header.
_LEFTOVER = re.compile(
    rf"gen-([0-{GENERATIONS - 1}])\.bin|\.gen-[0-{GENERATIONS - 1}]\.json\.[a-z0-9_]+\.tmp"
)


def sweep(d: Path, vouched: Callable[[int], bool]) -> list[str]:
    """Remove from ``d`` what unfinished receives left: a generation's bytes no header vouches
    for (``vouched(gen)``), and temporary headers; each this user's and named as node_copy names
    them (the listing is untrusted: bounded). Returns the names removed."""
    gone: list[str] = []
    try:
        names = sorted(p.name for p in d.iterdir())[:1024]
    except OSError:
        return gone
    for name in names:
        m = _LEFTOVER.fullmatch(name)
        if m is None or (m[1] is not None and vouched(int(m[1]))):
            continue
        path = d / name
        try:
            if os.lstat(path).st_uid == os.getuid():
                path.unlink()
                gone.append(name)
        except OSError:
            continue
    return gone
