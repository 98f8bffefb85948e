"""Node copies' format: what a memory save writes and a restore reads, in node memory and
peer copies alike.

A copy is two parts: the raw bytes of every tensor of the rank's state (its local shard of a
DTensor), packed 8-byte aligned (:func:`plan`), and a JSON header (:class:`Header`): step,
topology, config fingerprint, fence epoch, where each tensor lies, every non-tensor leaf's
value, the digest of the bytes and the save's loss and data-loader position. Nothing of a copy
is trusted before it is checked: the header is bounded and validated, the bytes must have the
header's size and digest, every floating-point tensor must be finite, and every entry must match
the live state's path, dtype and shape, and every other leaf its type (:func:`restore`). The
peer copy's wire is :mod:`~trainer.checkpointing.peer_wire`.
"""

from __future__ import annotations

import contextlib
import mmap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from torch.distributed.tensor import DTensor

from trainer.checkpointing.layout import NODE_MEMORY_GENERATIONS
from trainer.errors import TrainerError

GENERATIONS = NODE_MEMORY_GENERATIONS
HEADER_LIMIT = 16 << 20  # a header lists every tensor of a shard: bounded all the same
# 2: the bytes' checksum is xxh3-128 (issue 40, item 2), where 1 had sha256. A copy of another
# format is refused like any other mismatch, and the resume reads the next tier.
FORMAT: Final = 2


def checksum(buf: Any) -> str:
    """xxh3-128 of a copy's bytes: ~8 GB/s on one core here against sha256's 1.2
    (``benchmarks/results/checksum_speed.json``), off the GIL, reading a map in place. Against
    corruption only: who can write node memory can rewrite the header too; what is trusted is
    where the copy lives (the node, this attempt's fenced epoch), never the bytes."""
    return str(xxhash.xxh3_128_hexdigest(buf))


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

    format: Literal[2]
    step: int = Field(ge=1)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    fingerprint: str = Field(max_length=64)
    epoch: int | None
    generation: int = Field(ge=0, lt=GENERATIONS)
    size: int = Field(ge=0)
    xxh3_128: str = Field(pattern=r"^[0-9a-f]{32}$")


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
class Sharding:
    """A tensor's element size and local shape, and for a DTensor what every rank's local shape
    follows from (its global shape, mesh and placements)."""

    itemsize: int
    shape: tuple[int, ...]
    dtype: str
    global_shape: tuple[int, ...] | None = None
    mesh: Any = None  # a DeviceMesh
    placements: tuple[Any, ...] = ()

    @classmethod
    def of(cls, t: torch.Tensor) -> Sharding:
        local = _local(t)
        common = (local.element_size(), tuple(local.shape), str(local.dtype))
        if isinstance(t, DTensor):
            return cls(*common, tuple(t.shape), t.device_mesh, tuple(t.placements))
        return cls(*common)


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
    device: torch.device  # where the state's tensors are (staging.DeviceCopy: how they are copied)
    # Each tensor entry's sharding, in entry order: what another rank's copy of the same model
    # must hold (peer_wire.expected), worked out before a byte of it is accepted.
    shards: tuple[Sharding, ...] = ()
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
        device = torch.device("cpu")
        shards = []
        for leaf, e in zip(leaves(state), entries, strict=True):
            if e.dtype is not None:
                shards.append(Sharding.of(leaf.value))
            if e.dtype is None or not e.nbytes:
                continue
            t = _local(leaf.value)
            device = t.device
            if not t.is_contiguous():  # its bytes would be a copy: take them at each save
                views = None
                continue
            if views is not None:
                views.append((e.offset, e.nbytes, _bytes_of(t)))
        return cls(version, entries, size, views, device, tuple(shards))

    def copy_into(
        self, gen: int, buf: mmap.mmap, state: dict[str, Any], *, non_blocking: bool = False
    ) -> None:
        """Copy the state's tensors' bytes into ``buf`` (generation ``gen``'s buffer);
        ``non_blocking``: from CUDA into a pinned ``buf``, launched only (``DeviceCopy``)."""
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
        if non_blocking:  # device to host: one launch per tensor (foreach wants one device)
            for d, src in zip(dsts, srcs, strict=True):
                d.copy_(src, non_blocking=True)
            return
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


def restore(header: Header, mm: mmap.mmap, target: dict[str, Any], path: str) -> int:
    """Restore ``header``'s bytes, mapped in ``mm`` (a file's, or received from a peer),
    into ``target`` (the live model's and optimizer's state, from ``get_state_dict``): digest,
    finite values and layout checked first, so a failure leaves ``target`` untouched. Returns
    the bytes read. Closes ``mm``."""
    src: torch.Tensor | None = None
    try:
        digest = checksum(memoryview(mm)[: header.size])
        if digest != header.xxh3_128:
            raise NodeCopyError(
                f"{path}: xxh3_128 {digest[:12]}…, its header {header.xxh3_128[:12]}…"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on a copy-on-write map
            src = torch.frombuffer(mm, dtype=torch.uint8) if header.size else None
        pairs = match(header, target)
        views = []
        for entry, leaf in pairs:
            if entry.dtype is None:
                continue
            dtype = getattr(torch, entry.dtype.removeprefix("torch."))  # matched a live tensor's
            assert isinstance(dtype, torch.dtype) and src is not None and entry.shape is not None
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


def match(header: Header, target: dict[str, Any]) -> list[tuple[Entry, Leaf]]:
    """Each header entry with the live state's leaf it restores into, every path, dtype, shape
    and byte range checked."""
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
        if not is_tensor:
            why = scalar_mismatch(e.value, leaf.value)
            if why:
                raise NodeCopyError(f"{where}: {why}")
            continue
        if is_tensor:
            t = _local(leaf.value)
            if e.dtype != str(t.dtype) or e.shape != list(t.shape):
                raise NodeCopyError(
                    f"{where}: {e.dtype} {e.shape} in the copy, {t.dtype} {list(t.shape)} live"
                )
            if e.nbytes != t.numel() * t.element_size() or e.offset + e.nbytes > header.size:
                raise NodeCopyError(f"{where}: its bytes lie outside the copy")
    return list(zip(header.entries, live, strict=True))


def scalar_mismatch(value: Any, live: Any) -> str:
    """Why a copy's non-tensor ``value`` may not replace the live state's ``live`` ("" when it
    may): the same type exactly (a bool is no int, a list is the tuple it was saved from), item
    by item. A header's digest is a checksum: a forged learning rate ``"1e9"`` or ``True`` would
    otherwise go straight into the optimizer."""
    if isinstance(live, tuple):
        if not isinstance(value, list) or len(value) != len(live):
            return f"{_kind(value)} in the copy, a tuple of {len(live)} live"
        for i, (v, w) in enumerate(zip(value, live, strict=True)):
            why = scalar_mismatch(v, w)
            if why:
                return f"item {i}: {why}"
        return ""
    if type(value) is not type(live):
        return f"{_kind(value)} in the copy, {_kind(live)} live"
    return ""


def _kind(v: Any) -> str:
    return "a list" if isinstance(v, list) else f"{type(v).__name__} {str(v)[:40]!r}"
