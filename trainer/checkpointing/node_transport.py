"""The peer copy's wire (issue 29, item 2; split out in issue 40, item 1): one shard between two
ranks over a gloo group, for a memory save's replication to the next node and a resume's
transfer of a peer copy to the rank it belongs to alike.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any

import torch

from trainer.checkpointing.node_format import HEADER_LIMIT, NodeCopyError

# One shard on the wire (the memory saves' replication and a resume's transfer alike): its
# header's length and the bytes' size, the header (JSON), the bytes; a length of 0 says nothing
# comes. Each use has its own tags, so the two never match each other's messages.
REPLICA_TAGS = (1, 2, 3)
RESUME_TAGS = (4, 5, 6)


def send(
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


def receive_header(src: int, group: Any, *, tags: tuple[int, ...]) -> tuple[bytes, int] | None:
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
