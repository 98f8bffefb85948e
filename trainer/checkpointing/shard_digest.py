"""A shard's digest, taken while the writer streams its bytes to the file (arch §3).

NVRx's writer process writes each shard file (in a child it forks, in 0.4.1) through torch DCP's
``_write_item``, which sends every byte through the storage writer's stream transforms
(``transform_save_stream(item, file)``). :func:`install` wraps the writer object's transforms
(no module is patched) so that the file each item reaches is a :class:`Tap`: every ``write``
updates the file's xxh3-128 and goes on unchanged. Nothing enters the DCP metadata: the files
stay plain DCP for any reader.

The child's digests come back through memory the writer process maps, shared, before the child
is forked (:func:`capture`: one slot per file), published at the end of every item. A slot is
trusted only if it counted exactly the file's size and nothing seeked or truncated; any other
file is hashed once after writing, with a log line (:mod:`~trainer.checkpointing.manifest`). So
a torch or NVRx without this seam, or one that spawns its writers, costs a read, never a wrong
digest.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.hashing import XXH3_128, Hasher, new_hasher

log = logging.getLogger(__name__)

DIGEST = XXH3_128  # what the taps compute: the durable manifest's digest

# A slot: bytes streamed (u64), state (u8: 0 nothing yet, 1 streamed, 2 tainted), the raw digest.
_SLOT = struct.Struct("<QB16s")
_STREAMED, _TAINTED = 1, 2


class Capture:
    """The slots of one save's files, in memory shared with the writer's forked children."""

    def __init__(self, files: list[Path]) -> None:
        self._slots = {str(p): i for i, p in enumerate(files)}
        # Anonymous and MAP_SHARED (mmap's default): a forked child's stores are seen here.
        self._map = mmap.mmap(-1, max(1, len(files)) * _SLOT.size)
        self._open: dict[int, _Running] = {}  # per process: a forked child fills its own

    def running(self, raw: Any) -> _Running | None:
        """The running digest of the file ``raw`` is (by name: NVRx opens the bucket's path),
        or None when it is not one of this save's."""
        name = getattr(raw, "name", None)
        slot = self._slots.get(name) if isinstance(name, str) else None
        if slot is None:
            return None
        run = self._open.get(slot)
        if run is None:
            run = self._open[slot] = _Running(self, slot, id(raw), new_hasher(DIGEST))
        elif run.raw_id != id(raw):  # opened again: what was streamed before is not the file
            run.taint()
        return run

    def publish(self, slot: int, run: _Running) -> None:
        state = _TAINTED if run.tainted else _STREAMED
        _SLOT.pack_into(self._map, slot * _SLOT.size, run.bytes, state, run.hasher.digest())

    def streamed(self) -> dict[str, tuple[int, str]]:
        """path -> (bytes streamed, hex digest) for every file whose bytes all passed a tap."""
        out = {}
        for name, slot in self._slots.items():
            nbytes, state, raw = _SLOT.unpack_from(self._map, slot * _SLOT.size)
            if state == _STREAMED:
                out[name] = (nbytes, raw.hex())
        return out

    def close(self) -> None:
        self._map.close()


@dataclass
class _Running:
    capture: Capture
    slot: int
    raw_id: int
    hasher: Hasher
    bytes: int = 0
    tainted: bool = False

    def taint(self) -> None:
        """The stream is no longer the file: said at once, so no earlier publish stands."""
        self.tainted = True
        self.capture.publish(self.slot, self)


class Tap:
    """The file object an item is written to: each write updates the file's digest, published
    at every flush (torch closes what each item was written to, which flushes here)."""

    def __init__(self, raw: Any, run: _Running) -> None:
        self._raw = raw
        self._run = run

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        try:
            # torch passes memoryviews of any format; their bytes are what reaches the file.
            view = memoryview(data).cast("B")
        except TypeError:
            view = None
        if n is None or view is None:  # nothing written, or bytes this tap cannot see
            self._run.taint()
        else:
            self._run.hasher.update(view[:n])
            self._run.bytes += n
        return int(n or 0)

    def flush(self) -> None:
        self._raw.flush()
        self._run.capture.publish(self._run.slot, self._run)

    def seek(self, *args: Any) -> int:
        self._run.taint()  # bytes could be overwritten: the stream is not the file
        return int(self._raw.seek(*args))

    def truncate(self, *args: Any) -> int:
        self._run.taint()
        return int(self._raw.truncate(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


_current: Capture | None = None


@contextlib.contextmanager
def capture(files: list[Path]) -> Iterator[Capture]:
    """In the writer process, around the save function that writes ``files``: taps opened in
    it (or its forked children) publish into the :class:`Capture`."""
    global _current
    cap = Capture(files)
    _current = cap
    try:
        yield cap
    finally:
        _current = None
        cap.close()


class DigestTransforms:
    """A storage writer's stream transforms, the raw file made a :class:`Tap` before the inner
    transforms wrap it (so the tap sees the bytes as they reach the file)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> Any:
        run = _current.running(raw_stream) if _current is not None else None
        stream = raw_stream if run is None else Tap(raw_stream, run)
        return self.inner.transform_save_stream(write_item, stream)

    def __getattr__(self, name: str) -> Any:
        # Anything else a newer torch asks of its transforms. Never for dunders or ``inner``
        # itself: unpickling looks those up before ``__init__`` ran.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


_said_no_seam = False


def _write_item_takes_transforms() -> bool:
    try:
        from torch.distributed.checkpoint.filesystem import _write_item
    except ImportError:
        return False
    return "transforms" in inspect.signature(_write_item).parameters


def install(writer: Any) -> bool:
    """Route ``writer``'s shard writes through taps (module doc). False, saying so once, where
    this torch or NVRx has no stream transforms to wrap: the writer process then hashes each
    file once after writing it."""
    transforms = getattr(writer, "transforms", None)
    if not callable(getattr(transforms, "transform_save_stream", None)) or (
        not _write_item_takes_transforms()
    ):
        global _said_no_seam
        if not _said_no_seam:  # once per process: every save would repeat it
            _said_no_seam = True
            log.warning(
                "checkpoint shards: this torch/NVRx has no stream transforms to digest the bytes "
                "as they are written; each shard file is hashed once after writing instead"
            )
        return False
    writer.transforms = DigestTransforms(transforms)
    return True
