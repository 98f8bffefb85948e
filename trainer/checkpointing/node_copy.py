"""Node memory: each rank's newest memory saves, in memory that outlives the worker process
(issue 29, item 1: the second tier).

A memory save (every ``memory.interval`` steps, far more often than the durable save) copies the
rank's state into a file of node memory: ``/dev/shm`` on one machine, a memory-backed volume
(``emptyDir: {medium: Memory}``, counted in the pod's memory) on EKS, the directory the launcher
gives in ``NVRX_NODE_MEMORY``. It lives as long as the node does in the attempt: an in-job
respawn on the node finds it; a lost node takes it with it (the local backend deletes a lost
simulated node's directory, so the simulation is honest), and a new attempt starts empty.

Per rank: ``rank-R-of-W/gen-G.bin`` and ``gen-G.json``, a copy's bytes and header (their format:
:mod:`~trainer.checkpointing.node_format`); the peer copies a node holds for ranks of other nodes
are ``peer-rank-R-of-W/`` beside them. ``GENERATIONS`` generations alternate: a save first
removes the older generation's header, fills its bytes, digests them off the training thread
and only then writes the header (atomically). A header therefore vouches only for bytes that
were complete when it was written, and a crash mid-save leaves the other generation whole.
Nothing read is trusted before it is checked (``node_format.restore``); any failure names
itself, and the resume falls back to the next newest copy (``tiers.without``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer.checkpointing import node_dir, node_format, peer_wire
from trainer.checkpointing.layout import NODE_MEMORY_ENV
from trainer.checkpointing.node_dir import private_dir
from trainer.checkpointing.node_format import (
    EMPTY_ENTRIES,
    FORMAT,
    GENERATIONS,
    HEADER_LIMIT,
    Announced,
    Header,
    NodeCopyError,
    _Layout,
)
from trainer.checkpointing.peer_wire import REPLICA_TAGS
from trainer.checkpointing.staging import DeviceCopy
from trainer.run_files import read_json_object, write_durably

log = logging.getLogger(__name__)

SOURCE = "node"  # a resume event's tier


class NodeMemory:
    """One rank's node-memory tier: ``save`` on the training thread (a copy), the digest and the
    header on a thread of its own; ``headers`` and ``peer_headers`` at a resume."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        fingerprint: str,
        epoch: int | None,
    ) -> None:
        self.root = Path(root)
        self.dir = self.root / f"rank-{rank}-of-{world_size}"
        self.rank, self.world_size = rank, world_size
        self.fingerprint, self.epoch = fingerprint, epoch
        # Mapped generations: this rank's by generation, the peer copies' by (sender, generation).
        self._maps: dict[int | tuple[int, int], mmap.mmap] = {}
        self._thread: threading.Thread | None = None
        self._failed: str | None = None  # the newest save's failure, said once by the caller
        # The newest sealed save's thread's CPU seconds: its cost beside training (cadence).
        self._background_s: float | None = None
        self._newest_gen: int | None = None
        # The peer copy (issue 29, item 2): this incarnation's gloo group, the rank this shard
        # goes to and those whose shards come here. ``_token`` changes with each incarnation:
        # a thread of an earlier one still in flight writes nothing.
        self._peers: tuple[Any, int | None, tuple[int, ...]] | None = None
        self._token = 0
        self._layout: _Layout | None = None  # the last save's, kept for its state's version
        # The last save's layout whatever its version: what a peer's copy is checked against
        # before a byte of it is accepted (peer_wire.expected), by the rank it is of.
        self._shape: _Layout | None = None
        self._expected: dict[int, peer_wire.Expected] = {}
        # How the bytes leave the device: made at the first save, from where its state is.
        self._device: DeviceCopy | None = None

    # -- paths -----------------------------------------------------------------------------
    def bin_path(self, gen: int, where: Path | None = None) -> Path:
        return (where or self.dir) / f"gen-{gen}.bin"

    def header_path(self, gen: int, where: Path | None = None) -> Path:
        return (where or self.dir) / f"gen-{gen}.json"

    # -- saving ----------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Until the save in flight has its header and its peer copy went out (or failed);
        with ``timeout``, at most that long (a thread still running is left to itself: it
        belongs to an incarnation that ``unbind`` retired, and writes nothing)."""
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- the peer copy ---------------------------------------------------------------------
    def bind_peers(self, group: Any, send_to: int | None, recv_from: tuple[int, ...]) -> None:
        """This incarnation's peer copy: each memory save's shard also goes to ``send_to``
        (a rank on another node), and the shards of ``recv_from`` come here, off the training
        thread, through ``group`` (gloo)."""
        self._peers = (
            (group, send_to, tuple(recv_from)) if (send_to is not None or recv_from) else None
        )
        for src in recv_from:
            self.sweep(src)

    def unbind(self) -> None:
        """At a restart: the old incarnation's group goes (its last reference must, for its
        connections to close), and a thread of it still running writes nothing more."""
        self._token += 1
        self._peers = None
        self.wait(timeout=5.0)

    def _replicate(self, gen: int, sealed: tuple[str, int] | None, token: int) -> None:
        """Send this save's shard (``sealed``: its header's JSON and size) to the peer and
        receive the shards that come here; a save that failed still sends its message (an
        empty one), or the peer would wait for it."""
        peers = self._peers
        if peers is None or token != self._token:
            return
        group, send_to, recv_from = peers
        works = []
        if send_to is not None:
            mm = self._maps[gen] if sealed is not None else None
            blob, size = (sealed[0].encode(), sealed[1]) if sealed is not None else (b"", 0)
            works = peer_wire.send(blob, size, mm, send_to, group, tags=REPLICA_TAGS)
        for q in recv_from:
            self._receive(q, group, token)
        for w in works:
            if w is not None:
                w.wait()

    def _receive(self, src: int, group: Any, token: int) -> None:
        """One shard from ``src``, into the generation it announces as a save of this node's own
        does (its header removed, the bytes into its kept mapping, the checksum, the header).
        What it announced is checked against what a shard of ``src`` must be (:meth:`refusal`)
        before its file exists; a refused copy's bytes are read and dropped in bounded chunks.
        Anything wrong is logged and the copy dropped; a copy that did not land, a cut one
        included (its sender lost mid-way), leaves no file behind (the ``finally``)."""
        announced = peer_wire.receive_header(src, group, tags=REPLICA_TAGS)
        if announced is None:  # its save failed: nothing comes
            return
        blob, size = announced
        header, why = self.refusal(blob, size, src)
        mm: mmap.mmap | None = None
        landed = False
        try:
            if header is not None and not why:
                d = self.peer_dir(src)
                try:
                    d.mkdir(mode=0o700, exist_ok=True)
                    self.header_path(header.generation, d).unlink(missing_ok=True)
                    mm = self._buffer(header.generation, size, src=src)
                except OSError as e:
                    why = node_dir.no_room(d, size, e)
            peer_wire.receive_bytes(src, group, size, mm, tags=REPLICA_TAGS)
            if why or header is None or mm is None:
                raise NodeCopyError(why or "no header")
            digest = node_format.checksum(memoryview(mm)[:size])
            if digest != header.xxh3_128:
                raise NodeCopyError(f"its bytes do not match its header (xxh3_128 {digest[:12]}…)")
            if token != self._token:
                raise NodeCopyError("an earlier incarnation's copy")
            write_durably(self.header_path(header.generation, self.peer_dir(src)), blob.decode())
            landed = True
        except (NodeCopyError, OSError, UnicodeDecodeError) as e:
            log.warning("rank %d: the peer copy of rank %d was dropped: %s", self.rank, src, e)
        finally:
            if mm is not None and not landed and header is not None:
                self._discard(header.generation, src)

    def refusal(self, blob: bytes, size: int, src: int) -> tuple[Announced | None, str]:
        """The header ``src`` announced with ``size`` bytes (its top fields), and why its copy
        is refused ("": it is not): a header, of ``src``'s shard for this world, model and
        epoch, of exactly the size a shard of ``src`` of this model has (``peer_wire``). Before
        any allocation: nothing here is as large as what it announced but the bounded header."""
        try:
            header = Announced.model_validate_json(blob)  # its entries: where it is restored
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "the header"
            return None, f"its header is not a node-copy header: {where}: {first['msg']}"
        why = self.mismatch(header, rank=src)
        if why:
            return header, why
        layout = self._shape
        if layout is None:
            return header, "this rank has no save of its own to check it against yet"
        want = self._expected.get(src)
        if want is None:
            want = self._expected[src] = peer_wire.expected(layout, src)
        return header, peer_wire.refusal(header, size, want)

    def _discard(self, gen: int, src: int | None = None) -> None:
        """Generation ``gen``'s bytes (this rank's, or the peer copy of ``src``) and their
        mapping: gone from node memory."""
        mm = self._maps.pop(gen if src is None else (src, gen), None)
        if mm is not None:
            self._unmap(mm)
        where = None if src is None else self.peer_dir(src)
        self.bin_path(gen, where).unlink(missing_ok=True)

    def sweep(self, src: int) -> list[str]:
        """What a receive of ``src``'s copies that never finished left in its peer directory
        (this rank is the only one that receives them): bytes no header vouches for, and
        temporary files, each this user's and named as this module names them. Returns what
        went."""
        d = self.peer_dir(src)
        gone = node_dir.sweep(d, lambda gen: self.header_path(gen, d).exists())
        if gone:
            log.info("rank %d: removed what unfinished copies left in %s: %s", self.rank, d, gone)
        return gone

    def forget_other_worlds(self) -> list[str]:
        """Remove this node's copies of worlds of another size (an elastic job that shrank or
        grew): they can never be restored into this world, and offered at a later resume of a
        world of their size they would go back past what this one trained. Returns what went."""
        gone = [
            name
            for name in self._names()
            if name.startswith(("rank-", "peer-rank-"))
            and "-of-" in name
            and not name.endswith(f"-of-{self.world_size}")
        ]
        for name in gone:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return gone

    def _names(self) -> list[str]:
        """What node memory holds (at most 1024 names: it is untrusted input)."""
        try:
            return sorted(p.name for p in self.root.iterdir())[:1024]
        except OSError:
            return []

    def peer_dir(self, rank: int) -> Path:
        return self.root / f"peer-rank-{rank}-of-{self.world_size}"

    def take_failure(self) -> str | None:
        failed, self._failed = self._failed, None
        return failed

    def save(
        self, step: int, state: dict[str, Any], info: dict[str, Any], version: int | None = None
    ) -> float:
        """Copy ``state`` into the older generation; the seconds the training thread was blocked
        (the digest and header follow on a thread). ``version``: ``state`` is the same object,
        of the same structure, as at the last save of this version (``LiveState``): where each
        tensor goes is not worked out again."""
        t0 = time.perf_counter()
        self.wait()
        gen = 0 if self._newest_gen is None else (self._newest_gen + 1) % GENERATIONS
        sealed: tuple[Header, _Layout] | None = None  # None: the peers learn there is nothing
        try:
            self.dir.mkdir(parents=True, mode=0o700, exist_ok=True)
            self.header_path(gen).unlink(missing_ok=True)  # first: nothing vouches for it now
            layout = self._layout
            if version is None or layout is None or layout.version != version:
                layout = _Layout.of(state, version)
                self._layout = layout if version is not None else None
            if layout is not self._shape:  # what a peer's copy must be is worked out anew
                self._shape, self._expected = layout, {}
            if self._device is None or self._device.device != layout.device:
                self._close_device()
                self._device = DeviceCopy(layout.device)
            buf = self._buffer(gen, layout.size)
            with self._device.copier.copying():
                layout.copy_into(gen, buf, state, non_blocking=self._device.copier.non_blocking)
            header = Header.model_construct(
                format=FORMAT,
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                fingerprint=self.fingerprint,
                epoch=self.epoch,
                generation=gen,
                size=layout.size,
                xxh3_128="",  # the sealing thread's
                entries=[],  # the layout's JSON, spliced in on the sealing thread
                info=info,
                t=0.0,
            )
            sealed = (header, layout)
        except (OSError, TypeError, RuntimeError) as e:
            self._layout = None
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                e = OSError(node_dir.no_room(self.dir, self._shape.size if self._shape else 0, e))
            self._failed = f"the memory save of step {step} failed: {e}"
        self._thread = threading.Thread(
            target=self._seal,
            args=(gen, sealed, self._token),
            name=f"node-copy-{step}",
            daemon=True,
        )
        self._thread.start()
        return time.perf_counter() - t0

    def _buffer(self, gen: int, size: int, *, src: int | None = None) -> mmap.mmap:
        """Generation ``gen``'s bytes, mapped (this rank's, or the peer copy of rank ``src``);
        kept across saves (no new file, no page faulted in again), remade when the size
        changes or the file is gone."""
        key: int | tuple[int, int] = gen if src is None else (src, gen)
        path = self.bin_path(gen, None if src is None else self.peer_dir(src))
        mm = self._maps.get(key)
        if mm is not None and len(mm) == max(size, 1) and path.exists():
            return mm
        if mm is not None:
            self._unmap(mm)
        mm = node_dir.allocated_map(path, size)
        self._maps[key] = mm
        if src is None and self._device is not None:
            try:
                self._device.pin(mm)
            except RuntimeError:
                self._maps.pop(key, None)
                self._unmap(mm)
                raise
        return mm

    def _unmap(self, mm: mmap.mmap) -> None:
        if self._device is not None:
            self._device.unpin(mm)
        with contextlib.suppress(BufferError):  # a tensor still viewing it keeps it alive
            mm.close()

    def _close_device(self) -> None:
        """Unpin every buffer and remove the optimizer hook (no copy may be in flight)."""
        if self._device is not None:
            self._device.close()
            for mm in self._maps.values():
                self._device.unpin(mm)
            self._device = None
            self._layout = None  # its slices view the pinned maps

    def _seal(self, gen: int, sealed: tuple[Header, _Layout] | None, token: int) -> None:
        """The digest and the header, then the peer copy (off the training thread). The header
        is this process's own, written once as JSON (its entries' JSON kept with the layout):
        validating and dumping ~100 entries at every save cost a millisecond of this thread,
        which shares the cores and the GIL with training; every reader validates it whole."""
        if self._device is not None:  # a launched device-to-host copy, done first
            self._device.copier.synchronize()
        cpu0 = time.thread_time()
        written: tuple[str, int] | None = None
        if sealed is not None:
            header, layout = sealed
            try:
                digest = node_format.checksum(memoryview(self._maps[gen])[: header.size])
                top = header.model_copy(update={"xxh3_128": digest, "t": time.time()})
                text = top.model_dump_json().replace(
                    EMPTY_ENTRIES, f'"entries":{layout.entries_json()}', 1
                )
                write_durably(self.header_path(gen), text)
                self._newest_gen = gen
                written = (text, header.size)
            except (OSError, ValueError) as e:
                self._failed = f"the memory save of step {header.step} failed: {e}"
        try:
            self._replicate(gen, written, token)
        except Exception as e:  # a peer gone (its restart), a timeout: this copy is lost
            log.warning("rank %d: the peer copy failed: %s", self.rank, e)
        # CPU, not wall: waiting for the peer's message costs training nothing. (gloo's own
        # threads move the bytes and are not counted: the loopback copy is the kernel's.)
        self._background_s = time.thread_time() - cpu0

    def take_background(self) -> float | None:
        """The newest sealed save's background CPU seconds, once (None: none since)."""
        taken, self._background_s = self._background_s, None
        return taken

    def close(self) -> None:
        self.wait()
        self._close_device()
        self._layout = None  # its slices view the maps: they would stay open
        for mm in self._maps.values():
            self._unmap(mm)
        self._maps.clear()

    # -- resuming --------------------------------------------------------------------------
    def headers(self) -> tuple[dict[int, Header], str | None]:
        """The generations this rank could resume from, by step (their headers only: the
        bytes are checked by ``load``), and, when there are none, why, if the node held
        something (None for an empty node memory: no news)."""
        self.wait()
        found, why = self._scan(self.dir, self.rank)
        if found:  # the next save overwrites the older generation
            self._newest_gen = found[max(found)].generation
        return found, (None if found else why)

    def peer_headers(self) -> dict[int, dict[int, Header]]:
        """The peer copies this node holds: by the rank that wrote them, by step (headers only,
        each checked to be that rank's, of this world size, fingerprint and epoch)."""
        self.wait()
        out: dict[int, dict[int, Header]] = {}
        for name in self._names():
            m = re.fullmatch(rf"peer-rank-(\d+)-of-{self.world_size}", name)
            if m and (found := self._scan(self.root / name, int(m[1]))[0]):
                out[int(m[1])] = found
        return out

    def _scan(self, d: Path, rank: int) -> tuple[dict[int, Header], str | None]:
        """The valid headers in ``d`` (copies of ``rank``'s shard), by step, and why the last
        one refused was (None: none was)."""
        found: dict[int, Header] = {}
        why: str | None = None
        for gen in range(GENERATIONS):
            path = self.header_path(gen, d)
            obj = read_json_object(path, limit=HEADER_LIMIT)
            if obj is None:
                continue
            try:
                h = Header.model_validate(obj)
            except ValidationError as e:
                why = f"{path} is not a node-copy header ({e.error_count()} errors)"
                continue
            mismatch = self.mismatch(h, rank=rank)
            if mismatch:
                why = f"{path}: {mismatch}"
                continue
            found[h.step] = h
        return found, why

    def mismatch(self, h: Announced, *, rank: int | None = None) -> str:
        """Why ``h`` is not a copy of ``rank``'s shard (this rank's by default) for this world,
        model and epoch; empty when it is."""
        for name, want in (
            ("rank", self.rank if rank is None else rank),
            ("world_size", self.world_size),
            ("fingerprint", self.fingerprint),
            ("epoch", self.epoch),
        ):
            if getattr(h, name) != want:
                return f"written for {name} {getattr(h, name)!r}, this one is {want!r}"
        return ""

    def load(self, header: Header, target: dict[str, Any], where: Path | None = None) -> int:
        """Restore ``header``'s generation (in ``where``, this rank's directory by default) into
        ``target`` (``node_format.restore``); the bytes read."""
        path = str(self.bin_path(header.generation, where))
        return node_format.restore(header, self.map(header, where), target, path)

    def map(self, header: Header, where: Path | None) -> mmap.mmap:
        """``header``'s bytes, mapped copy-on-write (a restore never changes the file)."""
        path = self.bin_path(header.generation, where)
        try:
            with open(path, "rb", opener=node_dir.no_follow) as f:
                size = os.fstat(f.fileno()).st_size
                if size < header.size:
                    raise NodeCopyError(f"{path} holds {size} bytes, its header {header.size}")
                return mmap.mmap(f.fileno(), max(header.size, 1), access=mmap.ACCESS_COPY)
        except OSError as e:
            raise NodeCopyError(f"{path}: {e}") from e


def from_env(
    *, rank: int, world_size: int, fingerprint: str, epoch: int | None
) -> NodeMemory | None:
    """This rank's node memory, where the launcher gave the node a directory."""
    root = os.environ.get(NODE_MEMORY_ENV)  # absent: the node has no node-memory tier
    if not root:
        return None
    # This user's alone, or refused (node_dir): another user's would read or plant copies.
    return NodeMemory(
        private_dir(Path(root)),
        rank=rank,
        world_size=world_size,
        fingerprint=fingerprint,
        epoch=epoch,
    )
