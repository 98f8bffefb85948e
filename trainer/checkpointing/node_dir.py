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

import os
import stat
from pathlib import Path

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
