"""Reading a file of the run root as the untrusted input it is.

Anything that can write the shared filesystem can put a FIFO where a control file belongs (a
read then blocks until a writer comes: forever, in the watcher's loop), a symlink to other
files, or a file too large to hold. Every read of the run root's state goes through
:func:`open_regular`: it never follows a link, never blocks, and hands back only a regular file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trainer.errors import TrainerError

# A result, a marker or a lease is a few hundred bytes; this leaves room for any of them.
SMALL_FILE_LIMIT = 1 << 20

_log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class UnsafeFile(TrainerError, OSError):
    """A run-root path that is not a plain regular file (a FIFO, a device, a directory, a
    symlink), or one larger than its reader allows."""


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[int]:
    """A read-only descriptor of ``path`` if it is a regular file; FileNotFoundError when it is
    absent, :class:`UnsafeFile` for anything else (``O_NONBLOCK``: a FIFO returns at once)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        # ELOOP: the last component is a symlink (O_NOFOLLOW); ENXIO: a socket or a FIFO
        # opened for writing without a reader.
        raise UnsafeFile(f"{path}: not a regular file ({e.strerror})") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeFile(f"{path}: not a regular file (mode {stat.filemode(mode)})")
        yield fd
    finally:
        os.close(fd)


def read_small(path: Path, *, limit: int = SMALL_FILE_LIMIT) -> bytes | None:
    """A small run-root file's bytes, or None when absent; :class:`UnsafeFile` for anything but
    a regular file of at most ``limit`` bytes."""
    try:
        with open_regular(path) as fd:
            size = os.fstat(fd).st_size
            if size > limit:
                raise UnsafeFile(f"{path}: {size} bytes, more than the {limit} allowed")
            data = _read_upto(fd, limit + 1)
    except FileNotFoundError:
        return None
    if len(data) > limit:  # grew between the fstat and the read
        raise UnsafeFile(f"{path}: more than the {limit} bytes allowed")
    return data


def _read_upto(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes from the current offset, however many reads that takes."""
    parts: list[bytes] = []
    while n > 0:
        chunk = os.read(fd, n)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def read_json_object(path: Path, *, limit: int = SMALL_FILE_LIMIT) -> dict[str, Any] | None:
    """A small JSON object file of the run root, or None when it is absent, unsafe, too large,
    or no JSON object (its readers decide as if it were not there; the log says why)."""
    try:
        data = read_small(path, limit=limit)
    except OSError as e:
        _log.warning("ignoring %s: %s", path, e)
        return None
    if data is None:
        return None
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        _log.warning("ignoring %s: not JSON (%s)", path, e)
        return None
    if not isinstance(obj, dict):
        _log.warning("ignoring %s: JSON %s, not an object", path, type(obj).__name__)
        return None
    return obj


def read_model(path: Path, model: type[M]) -> M | None:
    """A small JSON file of the run root as ``model``, or None (as above, or invalid: said)."""
    obj = read_json_object(path)
    if obj is None:
        return None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        _log.warning("ignoring %s: %s", path, e.errors()[0].get("msg"))
        return None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON in one rename: a reader sees the old or the new."""
    write_text_atomic(path, json.dumps(obj) + "\n")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory entry, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_temp(path: Path) -> tuple[int, Path]:
    """A new empty file beside ``path`` (its descriptor and name), for a write that ends in
    ``os.replace(tmp, path)``.

    Its name is unpredictable and it is created exclusively, never through a link (``mkstemp``:
    ``O_CREAT | O_EXCL | O_NOFOLLOW``): a link planted at a fixed temporary name used to be
    written through (any file the writer may write, replaced by ours), and two writers of one
    path (a lease's two owners, a retried task beside its first try) shared one temporary file.
    Named ``.<name>.<random>.tmp`` so readers that skip ``*.tmp`` still skip it."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    # mkstemp's 0600 would hide the file from the readers that an open() under the default
    # umask let read it (the watcher, an export running as another user of the volume).
    os.fchmod(fd, 0o644)
    return fd, Path(name)


def _replace(path: Path, data: bytes, *, durable: bool) -> None:
    """Write ``data`` to a new temporary file beside ``path`` and rename it over ``path``: the
    file is created exclusively under a random name, never through a link (``O_EXCL |
    O_NOFOLLOW``), by a descriptor of the directory that the rename takes it from. (The rename
    names ``path`` whole: strace's ``-P``, which the kill drills use, matches a rename by a
    path it names, and the temporary one is random.)"""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tmp = f".{path.name}.{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=directory)
        try:
            with open(fd, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path, src_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):  # a failed write leaves no temporary file behind
                os.unlink(tmp, dir_fd=directory)
            raise
        if durable:
            os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)


def write_durably(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data``, the file synced before the rename and its directory after:
    a crash, even of the machine, leaves the old file or the whole new one."""
    _replace(path, data.encode() if isinstance(data, str) else data, durable=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename: a reader sees the old or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, text.encode(), durable=False)
