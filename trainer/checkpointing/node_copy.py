"""Node memory: each rank's newest memory saves, in memory that outlives the worker process
(issue 29, item 1: the second tier).

A memory save (every ``memory_interval`` steps, far more often than the durable save) copies the
rank's state into a file of node memory: ``/dev/shm`` on one machine, a memory-backed volume
(``emptyDir: {medium: Memory}``, counted in the pod's memory) on EKS. The directory is given by
the launcher in ``NVRX_NODE_MEMORY`` and lives as long as the node does in the attempt: an in-job
respawn on the node finds it; a lost node takes it with it (the local backend deletes a lost
simulated node's directory, so the simulation is honest), and a new attempt starts empty.

Layout, per rank: ``rank-R-of-W/gen-G.bin`` (the raw bytes of every tensor, the rank's local
shard of a DTensor) and ``gen-G.json`` (the header: step, topology, config fingerprint, fence
epoch, where each tensor lies, every non-tensor leaf's value, the sha256 of the bytes and the
save's loss and data-loader position). ``GENERATIONS`` generations alternate: a save first
removes the older generation's header, fills its bytes, digests them off the training thread
and only then writes the header (atomically). A header therefore vouches only for bytes that were
complete when it was written, and a crash mid-save leaves the other generation whole.

What a reader trusts: nothing before checking it. The header is bounded and validated, it must
name this rank, world size, fingerprint and epoch; the bytes must have the header's size and
digest, every floating-point tensor must be finite, and every entry must match the live state's
path, dtype and shape. Any failure names itself, and the resume falls back to the next newest
copy (the older generation, another tier, at last the durable checkpoint: ``tiers.without``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from torch.distributed.tensor import DTensor

from trainer.checkpointing.durable import write_atomic
from trainer.checkpointing.layout import NODE_MEMORY_ENV, NODE_MEMORY_GENERATIONS
from trainer.errors import TrainerError
from trainer.run_files import read_json_object

log = logging.getLogger(__name__)

SOURCE = "node"  # a resume event's tier
ENV = NODE_MEMORY_ENV  # the node's directory, set by the launcher (absent: no node tier)
GENERATIONS = NODE_MEMORY_GENERATIONS
HEADER_LIMIT = 16 << 20  # a header lists every tensor of a shard: bounded all the same
FORMAT = 1

Scalar = int | float | bool | str | None
PathPart = str | int


class NodeCopyError(TrainerError, RuntimeError):
    """A node copy that cannot be restored from; the message says why."""


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: list[PathPart] = Field(max_length=64)
    # A tensor: its dtype, local shape and bytes [offset, offset + nbytes) of the .bin file.
    dtype: str | None = Field(default=None, max_length=32)
    shape: list[int] | None = Field(default=None, max_length=16)
    offset: int = Field(default=0, ge=0)
    nbytes: int = Field(default=0, ge=0)
    # Anything else (a learning rate, a parameter's name, Adam's betas): its value.
    value: Scalar | list[Scalar] = None  # a list: a tuple's items (lists are walked)


class Announced(BaseModel):
    """A copy's header's top fields: whose copy it is, its size and digest. A peer copy is
    checked against them as it arrives (NodeMemory._receive); its entries are validated whole
    (``Header``) when it is restored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: Literal[1]
    step: int = Field(ge=1)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    fingerprint: str = Field(max_length=64)
    epoch: int | None
    generation: int = Field(ge=0, lt=GENERATIONS)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Header(Announced):
    model_config = ConfigDict(extra="forbid", frozen=True)

    entries: list[Entry] = Field(max_length=1_000_000)
    info: dict[str, Any]
    t: float


# A header as this process writes it, its entries spliced in (NodeMemory._seal): the field
# comes before ``info``, whose values could hold the same text.
EMPTY_ENTRIES = '"entries":[]'
_ENTRIES: TypeAdapter[list[Entry]] = TypeAdapter(list[Entry])


@dataclass(frozen=True)
class Leaf:
    path: tuple[PathPart, ...]
    holder: Any  # the dict or list holding it (where a restored value goes)
    key: PathPart
    value: Any


def leaves(obj: Any, path: tuple[PathPart, ...] = ()) -> Iterator[Leaf]:
    """Every leaf of a state dict in traversal order (the order ``staging.local_tensors`` uses)."""
    items: Any
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from leaves(v, (*path, k))
        else:
            yield Leaf((*path, k), obj, k, v)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _dtype(name: str) -> torch.dtype | None:
    d = getattr(torch, name.removeprefix("torch."), None)
    return d if isinstance(d, torch.dtype) else None


def plan(state: dict[str, Any]) -> tuple[list[Entry], int]:
    """Where every leaf of ``state`` goes: tensors packed (8-byte aligned) into one buffer.
    On the training thread, so unvalidated (``model_construct``): the header that lists them
    is validated whole on the sealing thread."""
    entries: list[Entry] = []
    offset = 0
    for leaf in leaves(state):
        v = leaf.value
        if isinstance(v, torch.Tensor):
            t = _local(v)
            n = t.numel() * t.element_size()
            entries.append(
                Entry.model_construct(
                    path=list(leaf.path),
                    dtype=str(t.dtype),
                    shape=list(t.shape),
                    offset=offset,
                    nbytes=n,
                )
            )
            offset += (n + 7) // 8 * 8
        elif isinstance(v, (int, float, bool, str)) or v is None:
            entries.append(Entry.model_construct(path=list(leaf.path), value=v))
        elif isinstance(v, tuple) and all(_is_scalar(x) for x in v):
            entries.append(Entry.model_construct(path=list(leaf.path), value=list(v)))
        else:
            raise TypeError(
                f"node memory cannot hold {type(v).__name__} at {'/'.join(map(str, leaf.path))}"
            )
    return entries, offset


@dataclass(frozen=True)
class _Layout:
    """Where a state's tensors go in a memory save (:func:`plan`), with the tensors' bytes as
    views of their live storage when every one of them is contiguous, and the slices of each
    generation's buffer they go to: a save of the same state's version then only copies, in
    one call (no walk, no plan, no slicing)."""

    version: int | None
    entries: list[Entry]
    size: int
    views: list[tuple[int, int, torch.Tensor]] | None
    # Per generation: the buffer the slices view, and the slices (kept while it is the same).
    targets: dict[int, tuple[mmap.mmap, list[torch.Tensor]]] = field(default_factory=dict)
    _json: list[str] = field(default_factory=list)  # the entries' JSON, once made

    def entries_json(self) -> str:
        if not self._json:
            self._json.append(_ENTRIES.dump_json(self.entries).decode())
        return self._json[0]

    @classmethod
    def of(cls, state: dict[str, Any], version: int | None) -> _Layout:
        entries, size = plan(state)
        views: list[tuple[int, int, torch.Tensor]] | None = []
        for leaf, e in zip(leaves(state), entries, strict=True):
            if e.dtype is None or not e.nbytes:
                continue
            t = _local(leaf.value)
            if not t.is_contiguous():  # its bytes would be a copy: take them at each save
                views = None
                break
            assert views is not None
            views.append((e.offset, e.nbytes, _bytes_of(t)))
        return cls(version, entries, size, views)

    def copy_into(self, gen: int, buf: mmap.mmap, state: dict[str, Any]) -> None:
        """Copy the state's tensors' bytes into ``buf`` (generation ``gen``'s buffer)."""
        if self.views is None:
            sources = [
                (e.offset, e.nbytes, _bytes_of(_local(leaf.value)))
                for leaf, e in zip(leaves(state), self.entries, strict=True)
                if e.dtype is not None and e.nbytes
            ]
        else:
            sources = self.views
        if not sources:
            return
        kept = self.targets.get(gen)
        if kept is not None and kept[0] is buf and self.views is not None:
            dsts = kept[1]
        else:
            whole = torch.frombuffer(buf, dtype=torch.uint8)
            dsts = [whole[o : o + n] for o, n, _ in sources]
            if self.views is not None:
                self.targets[gen] = (buf, dsts)
        srcs = [src for _, _, src in sources]
        try:
            # One call for every tensor (a loop of copy_ costs ~2 us each in Python).
            torch._foreach_copy_(dsts, srcs)
        except AttributeError:  # a torch without it (it is private)
            for d, src in zip(dsts, srcs, strict=True):
                d.copy_(src)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool, str)) or v is None


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class NodeMemory:
    """One rank's node-memory tier: ``save`` on the training thread (a copy), the digest and the
    header on a thread of its own; ``offers`` and ``load`` at a resume."""

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
        self._maps: dict[int, mmap.mmap] = {}
        self._thread: threading.Thread | None = None
        self._failed: str | None = None  # the newest save's failure, said once by the caller
        self._newest_gen: int | None = None
        # The peer copy (issue 29, item 2): this incarnation's transport (a gloo group of its
        # own), the rank this one's shard goes to (on another node) and those whose shards come
        # here. ``_token`` changes with each incarnation: a thread of an earlier one that is
        # still in flight writes nothing.
        self._peers: tuple[Any, int | None, tuple[int, ...]] | None = None
        self._token = 0
        self._layout: _Layout | None = None  # the last save's, kept for its state's version

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
            works = _send(blob, size, mm, send_to, group, tags=REPLICA_TAGS)
        for q in recv_from:
            self._receive(q, group, token)
        for w in works:
            if w is not None:
                w.wait()

    def _receive(self, src: int, group: Any, token: int) -> None:
        """One shard from ``src``: into a temporary file, digest checked, then renamed in and
        its header written; anything wrong is logged and the copy dropped (the stream is read
        to its end all the same)."""
        import torch.distributed as dist

        announced = _receive_header(src, group, tags=REPLICA_TAGS)
        if announced is None:  # its save failed: nothing comes
            return
        blob, size = announced
        d = self.peer_dir(src)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".incoming-{token}.bin"
        no_room = ""
        try:
            mm = _allocated_map(tmp, size)
        except OSError as e:
            # The bytes are on their way all the same: take them into anonymous memory and
            # drop them, or the sender would wait on its send until the group's timeout.
            no_room = f"no room in node memory for it ({e})"
            tmp.unlink(missing_ok=True)
            mm = mmap.mmap(-1, max(size, 1))
        try:
            if size:
                dist.recv(
                    torch.frombuffer(mm, dtype=torch.uint8)[:size],
                    src,
                    group=group,
                    tag=REPLICA_TAGS[2],
                )
            # Its top fields only: its entries are validated whole when it is restored.
            header = Announced.model_validate_json(blob)
            why = self._mismatch(header, rank=src)
            digest = hashlib.sha256(memoryview(mm)[:size]).hexdigest()
            if not why and (header.size != size or digest != header.sha256):
                why = f"its bytes do not match its header (sha256 {digest[:12]}…)"
            why = no_room or why
            if why or token != self._token:
                raise NodeCopyError(why or "an earlier incarnation's copy")
            self.header_path(header.generation, d).unlink(missing_ok=True)
            os.replace(tmp, self.bin_path(header.generation, d))
            write_atomic(self.header_path(header.generation, d), blob.decode())
        except (NodeCopyError, ValidationError, OSError, UnicodeDecodeError) as e:
            log.warning("rank %d: the peer copy of rank %d was dropped: %s", self.rank, src, e)
            tmp.unlink(missing_ok=True)
        finally:
            with contextlib.suppress(BufferError):
                mm.close()

    def forget_other_worlds(self) -> list[str]:
        """Remove this node's copies of worlds of another size (an elastic job that shrank or
        grew): they can never be restored into this world, and offered at a later resume of a
        world of their size they would go back past what this one trained. Returns what went."""
        gone: list[str] = []
        suffix = f"-of-{self.world_size}"
        try:
            names = sorted(p.name for p in self.root.iterdir())[:1024]
        except OSError:
            return gone
        for name in names:
            mine = name.startswith(("rank-", "peer-rank-")) and "-of-" in name
            if mine and not name.endswith(suffix):
                shutil.rmtree(self.root / name, ignore_errors=True)
                gone.append(name)
        return gone

    def peer_dir(self, rank: int) -> Path:
        return self.root / f"peer-rank-{rank}-of-{self.world_size}"

    def take_failure(self) -> str | None:
        failed, self._failed = self._failed, None
        return failed

    def save(
        self, step: int, state: dict[str, Any], info: dict[str, Any], version: int | None = None
    ) -> float:
        """Copy ``state`` (this rank's, as ``get_state_dict`` gives it) into the older
        generation; returns the seconds the training thread was blocked. The digest and the
        header follow on a thread: until then the other generation is the newest.
        ``version``: ``state`` is the same object, of the same structure and values but for its
        tensors', as at the last save of this version (``live_state.LiveState``): where each
        tensor goes is not worked out again."""
        t0 = time.perf_counter()
        self.wait()
        gen = 0 if self._newest_gen is None else (self._newest_gen + 1) % GENERATIONS
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.header_path(gen).unlink(missing_ok=True)  # first: nothing vouches for it now
            layout = self._layout
            if version is None or layout is None or layout.version != version:
                layout = _Layout.of(state, version)
                self._layout = layout if version is not None else None
            buf = self._buffer(gen, layout.size)
            layout.copy_into(gen, buf, state)
            size = layout.size
        except (OSError, TypeError, RuntimeError) as e:
            self._layout = None
            self._failed = f"the memory save of step {step} failed: {e}"
            # The peers still expect this save's message: say there is nothing.
            self._start(step, gen, None)
            return time.perf_counter() - t0
        header = {
            "format": FORMAT,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "generation": gen,
            "size": size,
            "layout": layout,  # its entries' JSON, on the sealing thread
            "info": info,
        }
        self._start(step, gen, header)
        return time.perf_counter() - t0

    def _start(self, step: int, gen: int, header: dict[str, Any] | None) -> None:
        self._thread = threading.Thread(
            target=self._seal,
            args=(gen, header, self._token),
            name=f"node-copy-{step}",
            daemon=True,
        )
        self._thread.start()

    def _buffer(self, gen: int, size: int) -> mmap.mmap:
        """Generation ``gen``'s bytes, mapped (kept across saves; remade when the size changes).
        The file's pages are allocated first: writing into a sparse tmpfs file that cannot grow
        would kill the process with SIGBUS, where this raises ENOSPC."""
        mm = self._maps.get(gen)
        if mm is not None and len(mm) == max(size, 1):
            return mm
        if mm is not None:
            with contextlib.suppress(BufferError):  # a tensor still viewing it keeps it alive
                mm.close()
        mm = _allocated_map(self.bin_path(gen), size)
        self._maps[gen] = mm
        return mm

    def _seal(self, gen: int, header: dict[str, Any] | None, token: int) -> None:
        """The digest and the header, then the peer copy (off the training thread). The header
        is this process's own, written once as JSON (its entries' JSON kept with the layout):
        validating and dumping ~100 entries at every save cost a millisecond of this thread,
        which shares the cores and the GIL with training; every reader validates it whole."""
        sealed: tuple[str, int] | None = None
        if header is not None:
            try:
                mm = self._maps[gen]
                digest = hashlib.sha256(memoryview(mm)[: header["size"]]).hexdigest()
                layout: _Layout = header.pop("layout")
                top = Header.model_construct(
                    **header, entries=[], sha256=digest, t=time.time()
                ).model_dump_json()
                text = top.replace(EMPTY_ENTRIES, f'"entries":{layout.entries_json()}', 1)
                write_atomic(self.header_path(gen), text)
                self._newest_gen = gen
                sealed = (text, header["size"])
            except (OSError, ValueError) as e:
                self._failed = f"the memory save of step {header['step']} failed: {e}"
                sealed = None
        try:
            self._replicate(gen, sealed, token)
        except Exception as e:  # a peer gone (its restart), a timeout: this copy is lost
            log.warning("rank %d: the peer copy failed: %s", self.rank, e)

    def close(self) -> None:
        self.wait()
        self._layout = None  # its slices view the maps: they would stay open
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
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
        prefix, suffix = "peer-rank-", f"-of-{self.world_size}"
        try:
            names = sorted(p.name for p in self.root.iterdir())[:1024]
        except OSError:
            return out
        for name in names:
            middle = name[len(prefix) : -len(suffix)] if name.startswith(prefix) else ""
            if name.endswith(suffix) and middle.isdigit():
                found, _ = self._scan(self.root / name, int(middle))
                if found:
                    out[int(middle)] = found
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
            mismatch = self._mismatch(h, rank=rank)
            if mismatch:
                why = f"{path}: {mismatch}"
                continue
            found[h.step] = h
        return found, why

    def send_shard(self, header: Header | None, where: Path | None, dst: int, group: Any) -> None:
        """At a resume: ``header``'s generation to rank ``dst`` (which calls ``recv_shard``);
        ``header`` None, or a file that cannot be read, sends word that nothing comes."""
        mm = None
        if header is not None:
            try:
                mm = self._map(header, where)
            except NodeCopyError as e:
                log.warning("rank %d: cannot send rank %d's copy: %s", self.rank, dst, e)
                header = None
        blob = header.model_dump_json().encode() if header is not None else b""
        size = header.size if header is not None else 0
        for w in _send(blob, size, mm, dst, group, tags=RESUME_TAGS):
            if w is not None:
                w.wait()

    def recv_shard(self, src: int, group: Any) -> tuple[Header, mmap.mmap]:
        """At a resume: a shard sent by ``src``'s ``send_shard``, in anonymous memory, its
        header validated (this rank's, world size, fingerprint, epoch); the bytes are checked
        by :meth:`restore`."""
        import torch.distributed as dist

        announced = _receive_header(src, group, tags=RESUME_TAGS)
        if announced is None:
            raise NodeCopyError(f"rank {src} had no copy to send")
        blob, size = announced
        mm = mmap.mmap(-1, max(size, 1))
        if size:
            data = torch.frombuffer(mm, dtype=torch.uint8)[:size]
            dist.recv(data, src, group=group, tag=RESUME_TAGS[2])
        try:
            header = Header.model_validate_json(blob)
        except ValidationError as e:
            raise NodeCopyError(
                f"rank {src} sent no node-copy header ({e.error_count()} errors)"
            ) from e
        why = self._mismatch(header)
        if why or header.size != size:
            raise NodeCopyError(f"the copy rank {src} sent: {why or 'its size is not its header'}")
        return header, mm

    def _mismatch(self, h: Announced, *, rank: int | None = None) -> str:
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
        """Restore ``header``'s generation (in ``where``: this rank's directory by default, a
        peer copy's) into ``target`` (the live model's and optimizer's state, from
        ``get_state_dict``): digest, finite values and layout checked first, so a failure
        leaves ``target`` untouched. Returns the bytes read."""
        return self.restore(
            header, self._map(header, where), target, str(self.bin_path(header.generation, where))
        )

    def _map(self, header: Header, where: Path | None) -> mmap.mmap:
        path = self.bin_path(header.generation, where)
        try:
            with open(path, "rb", opener=_no_follow) as f:
                size = os.fstat(f.fileno()).st_size
                if size < header.size:
                    raise NodeCopyError(f"{path} holds {size} bytes, its header {header.size}")
                return mmap.mmap(f.fileno(), max(header.size, 1), access=mmap.ACCESS_COPY)
        except OSError as e:
            raise NodeCopyError(f"{path}: {e}") from e

    def restore(self, header: Header, mm: mmap.mmap, target: dict[str, Any], path: str) -> int:
        """Restore ``header``'s bytes, mapped in ``mm`` (a file's, or received from a peer),
        into ``target``; see :meth:`load`. Closes ``mm``."""
        src: torch.Tensor | None = None
        try:
            digest = hashlib.sha256(memoryview(mm)[: header.size]).hexdigest()
            if digest != header.sha256:
                raise NodeCopyError(
                    f"{path}: sha256 {digest[:12]}…, its header {header.sha256[:12]}…"
                )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer on a copy-on-write map
                src = torch.frombuffer(mm, dtype=torch.uint8) if header.size else None
            pairs = self._match(header, target)
            views = []
            for entry, leaf in pairs:
                if entry.dtype is None:
                    continue
                dtype = _dtype(entry.dtype)
                assert dtype is not None and src is not None and entry.shape is not None
                raw = src[entry.offset : entry.offset + entry.nbytes]
                view = raw.view(dtype).reshape(entry.shape)
                if view.is_floating_point() and not bool(torch.isfinite(view).all()):
                    where = "/".join(map(str, entry.path))
                    raise NodeCopyError(f"{path}: {where} is not finite")
                views.append((view, leaf))
            with torch.no_grad():
                for view, leaf in views:
                    _local(leaf.value).copy_(view)
            for entry, leaf in pairs:
                if entry.dtype is None:
                    value = entry.value
                    leaf.holder[leaf.key] = tuple(value) if isinstance(value, list) else value
            return header.size
        finally:
            del src
            with contextlib.suppress(BufferError):
                mm.close()

    def _match(self, header: Header, target: dict[str, Any]) -> list[tuple[Entry, Leaf]]:
        live = list(leaves(target))
        if len(live) != len(header.entries):
            raise NodeCopyError(
                f"the copy holds {len(header.entries)} entries, the live state {len(live)}"
            )
        for e, leaf in zip(header.entries, live, strict=True):
            where = "/".join(map(str, leaf.path))
            if tuple(e.path) != leaf.path:
                raise NodeCopyError(f"entry {'/'.join(map(str, e.path))} where {where} is")
            is_tensor = isinstance(leaf.value, torch.Tensor)
            if is_tensor != (e.dtype is not None):
                raise NodeCopyError(f"{where}: a tensor in one, not in the other")
            if is_tensor:
                t = _local(leaf.value)
                if e.dtype != str(t.dtype) or e.shape != list(t.shape):
                    raise NodeCopyError(
                        f"{where}: {e.dtype} {e.shape} in the copy, {t.dtype} {list(t.shape)} live"
                    )
                if e.nbytes != t.numel() * t.element_size() or e.offset + e.nbytes > header.size:
                    raise NodeCopyError(f"{where}: its bytes lie outside the copy")
        return list(zip(header.entries, live, strict=True))


# One shard on the wire (the memory saves' replication and a resume's transfer alike): its
# header's length and the bytes' size, the header (JSON), the bytes; a length of 0 says nothing
# comes. Each use has its own tags, so the two never match each other's messages.
REPLICA_TAGS = (1, 2, 3)
RESUME_TAGS = (4, 5, 6)


def _send(
    blob: bytes, size: int, mm: mmap.mmap | None, dst: int, group: Any, *, tags: tuple[int, ...]
) -> list[Any]:
    """Post a shard, its header's JSON ``blob`` (empty: nothing comes) and ``size`` bytes mapped
    in ``mm``, to ``dst``; the sends' handles."""
    import torch.distributed as dist

    meta = torch.tensor([len(blob), size], dtype=torch.int64)
    works = [dist.isend(meta, dst, group=group, tag=tags[0])]
    if blob:
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        works.append(dist.isend(payload, dst, group=group, tag=tags[1]))
    if mm is not None and size:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on a copy-on-write map
            data = torch.frombuffer(mm, dtype=torch.uint8)[:size]
        works.append(dist.isend(data, dst, group=group, tag=tags[2]))
    return works


def _receive_header(src: int, group: Any, *, tags: tuple[int, ...]) -> tuple[bytes, int] | None:
    """The header (JSON bytes, bounded) and the size of the shard ``src`` sends, or None when
    it says nothing comes; the bytes follow with ``tags[2]``."""
    import torch.distributed as dist

    meta = torch.zeros(2, dtype=torch.int64)
    dist.recv(meta, src, group=group, tag=tags[0])
    hlen, size = int(meta[0]), int(meta[1])
    if hlen == 0:
        return None
    if not 0 < hlen <= HEADER_LIMIT or size < 0:
        raise NodeCopyError(f"rank {src} announced a {hlen}-byte header and {size} bytes")
    blob = torch.empty(hlen, dtype=torch.uint8)
    dist.recv(blob, src, group=group, tag=tags[1])
    return blob.numpy().tobytes(), size


def _allocated_map(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes, its pages allocated first (a full tmpfs raises ENOSPC
    here rather than SIGBUS at the first write), mapped read-write."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(size, 1))
        return mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def from_env(
    *, rank: int, world_size: int, fingerprint: str, epoch: int | None
) -> NodeMemory | None:
    """This rank's node memory, where the launcher gave the node a directory."""
    root = os.environ.get(ENV)
    if not root:
        return None
    return NodeMemory(
        Path(root), rank=rank, world_size=world_size, fingerprint=fingerprint, epoch=epoch
    )
