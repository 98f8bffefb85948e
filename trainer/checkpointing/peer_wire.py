"""One node copy between two ranks over a gloo group (the memory saves' peer copies and a
resume's transfer alike), and what the receiver expects of it before it allocates a byte.

A peer's message is untrusted input (issue 43, item 5): it announces a header's length and a
size, and a receiver that allocated whatever it announced could be made to fill the node's
memory. The receiver works out what a copy of that rank's shard of this model must be from its
own live state (:func:`expected`: the same model, each DTensor's local shape on that rank), and
refuses any other size (:func:`refusal`) before the bytes' buffer exists.
A refused copy's bytes are still read, in chunks into one buffer of at most :data:`CHUNK`
bytes, or the sender would wait on its send until the group's timeout.

On the wire: ``[header length, size]`` (int64; a length of 0: nothing comes), the header's JSON
(at most ``HEADER_LIMIT``), the bytes in chunks of :data:`CHUNK`. Each use has its own tags, so
the two never match each other's messages.
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpointing.node_format import HEADER_LIMIT, Announced, NodeCopyError, _Layout

REPLICA_TAGS = (1, 2, 3)
RESUME_TAGS = (4, 5, 6)
# The bytes travel in chunks of this size: a refused copy is read through one such buffer.
CHUNK = 16 << 20


@dataclass(frozen=True)
class Expected:
    """What a copy of rank ``rank``'s shard must be: its size in bytes (8-byte aligned)."""

    rank: int
    size: int


def expected(layout: _Layout, rank: int) -> Expected:
    """The copy of ``rank``'s shard of the state ``layout`` was made of (this rank's): plain
    tensors are alike on every rank, a DTensor's local shape is its placements' on ``rank``."""
    size = 0
    for s in layout.shards:
        shape = s.shape if s.global_shape is None else _local_shape(s, rank)
        size += (prod(shape) * s.itemsize + 7) // 8 * 8
    return Expected(rank, size)


def _local_shape(s: Any, rank: int) -> tuple[int, ...]:
    # Private, but DTensor's own rule (torch.chunk per sharded dim): the public one is only for
    # the calling rank's coordinate.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    where = (s.mesh.mesh == rank).nonzero()
    if len(where) != 1:
        raise NodeCopyError(f"rank {rank} is not in the mesh of this model's tensors")
    coordinate = [int(c) for c in where[0]]
    shape, _ = _compute_local_shape_and_global_offset(
        s.global_shape, s.mesh.shape, coordinate, s.placements
    )
    return tuple(int(n) for n in shape)


def refusal(header: Announced, size: int, want: Expected) -> str:
    """Why a copy announcing ``size`` bytes with ``header`` (its top fields) is not a copy of
    ``want``'s rank's shard ("" when it is), the field named. Pure: table-tested. Its entries
    (count, dtypes, shapes) are checked where it is restored, against the live state of the
    rank it belongs to, before that rank allocates for it (``restore_node.recv_shard``):
    validating a header of 1011 entries whole cost 10-36 ms here against 1.4-4.6 for its top
    fields (a loaded shared machine), on the thread whose CPU the memory cadence budgets."""
    if size != header.size:
        return f"size: it announced {size} bytes, its header {header.size}"
    if size != want.size:
        return f"size: {size} bytes, a shard of rank {want.rank} of this model is {want.size}"
    return ""


def send(
    blob: bytes, size: int, mm: mmap.mmap | None, dst: int, group: Any, *, tags: tuple[int, ...]
) -> list[Any]:
    """Post a shard, its header's JSON ``blob`` (empty: nothing comes) and ``size`` bytes mapped
    in ``mm``, to ``dst``; the sends' handles."""
    meta = torch.tensor([len(blob), size], dtype=torch.int64)
    works = [dist.isend(meta, dst, group=group, tag=tags[0])]
    if blob:
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        works.append(dist.isend(payload, dst, group=group, tag=tags[1]))
    if mm is not None and size:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on a copy-on-write map
            data = torch.frombuffer(mm, dtype=torch.uint8)[:size]
        for offset in range(0, size, CHUNK):
            chunk = data[offset : offset + CHUNK]
            works.append(dist.isend(chunk, dst, group=group, tag=tags[2]))
    return works


def receive_header(src: int, group: Any, *, tags: tuple[int, ...]) -> tuple[bytes, int] | None:
    """The header (JSON bytes, bounded) and the size of the shard ``src`` sends, or None when
    it says nothing comes; the bytes follow (:func:`receive_bytes`)."""
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


def receive_bytes(
    src: int, group: Any, size: int, into: mmap.mmap | None, *, tags: tuple[int, ...]
) -> None:
    """The ``size`` bytes ``src`` sends after its header: into ``into``, or (None: refused)
    read and dropped through one buffer of at most :data:`CHUNK` bytes."""
    if not size:
        return
    if into is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = torch.frombuffer(into, dtype=torch.uint8)[:size]
    else:
        whole = torch.empty(min(size, CHUNK), dtype=torch.uint8)
    for offset in range(0, size, CHUNK):
        n = min(CHUNK, size - offset)
        dst = whole[offset : offset + n] if into is not None else whole[:n]
        dist.recv(dst, src, group=group, tag=tags[2])
