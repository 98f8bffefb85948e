"""What the ranks tell each other at a resume, as typed and bounded JSON (issue 43, item 5).

``all_gather_object`` and ``broadcast_object_list`` unpickle whatever a peer sends, and a pickle
is a program: one broken or hostile rank would run code in every other. Here a message is a
pydantic model's JSON. Its length travels first (a fixed-size tensor) and every rank checks every
length against the message's cap, so each rank refuses an oversized one alike, before a buffer
of that size exists; each message is then validated against its model on receipt. A refusal
(:class:`CoordinationError`) names the rank that sent it and the field.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.checkpointing.errors import CheckpointError
from trainer.checkpointing.layout import NODE_MEMORY_GENERATIONS
from trainer.checkpointing.tiers import Offer

M = TypeVar("M", bound=BaseModel)

REASON_LIMIT = 4096  # characters of a reason a rank says (longer ones are cut where made)


class CoordinationError(CheckpointError):
    """A rank's message that is not what the protocol says: oversized, not JSON, or not its
    model. Not terminal: the layers restart around it, as around any rank's fault."""


def cut(text: str | None) -> str | None:
    """``text`` within :data:`REASON_LIMIT` (an honest rank's message always fits)."""
    if text is None or len(text) <= REASON_LIMIT:
        return text
    return text[: REASON_LIMIT - 1] + "…"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TierOffer(Message):
    """A rank's ``tiers.Offer``, as it travels."""

    own_step: int = Field(ge=-1)
    own_problem: str | None = Field(max_length=REASON_LIMIT)
    own_bytes: int = Field(ge=0)
    node_steps: tuple[int, ...] = Field(max_length=NODE_MEMORY_GENERATIONS)
    node_problem: str | None = Field(max_length=REASON_LIMIT)
    # (the rank that wrote one, its step): at most every rank's generations.
    peer_holds: tuple[tuple[int, int], ...] = Field(max_length=1 << 16)

    @classmethod
    def of(cls, offer: Offer) -> TierOffer:
        return cls(
            own_step=offer.own_step,
            own_problem=cut(offer.own_problem),
            own_bytes=offer.own_bytes,
            node_steps=offer.node_steps,
            node_problem=cut(offer.node_problem),
            peer_holds=offer.peer_holds,
        )

    def offer(self) -> Offer:
        return Offer(**self.model_dump())


class OfferMessage(Message):
    """A rank's offer (None: the run reads no memory tier) and the node it runs on (None: it
    has no node memory or no peer group, and takes no part in the peer copies)."""

    offer: TierOffer | None
    node: int | None


OFFER_LIMIT = 1 << 20  # a TierOffer of 2^16 peer copies fits


class Outcome(Message):
    """A rank's result of a restore, or of its share of a checkpoint's digests: why it failed
    ("" for not at all) and the bytes it read."""

    failed: str = Field(max_length=REASON_LIMIT)
    nbytes: int = Field(default=0, ge=0)


OUTCOME_LIMIT = 16 << 10


def gather(mine: M, group: Any, *, limit: int) -> list[M]:
    """All ranks of ``group``: every rank's ``mine``, by rank, each validated as its model."""
    blobs = gather_bytes(mine.model_dump_json().encode(), group, limit=limit)
    return [decode(type(mine), blob, rank=r) for r, blob in enumerate(blobs)]


def broadcast(mine: M | None, model: type[M], src: int, group: Any, *, limit: int) -> M:
    """All ranks of ``group``: rank ``src``'s ``mine``, validated as ``model`` on every rank."""
    blob = mine.model_dump_json().encode() if mine is not None else b""
    return decode(model, broadcast_bytes(blob, src, group, limit=limit), rank=src)


def decode(model: type[M], blob: bytes, *, rank: int) -> M:
    try:
        return model.model_validate_json(blob)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the message"
        raise CoordinationError(
            f"rank {rank} sent a {model.__name__} that is not one: {where}: {first['msg']} "
            f"({e.error_count()} errors; a rank of another trainer version, or a broken one)"
        ) from e


def gather_bytes(blob: bytes, group: Any, *, limit: int) -> list[bytes]:
    """All ranks: every rank's ``blob``, each at most ``limit`` bytes, checked on every rank
    before the payloads' buffers exist."""
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(blob)], dtype=torch.int64), group=group)
    sizes = [int(t[0]) for t in lengths]
    for r, n in enumerate(sizes):
        _check_length(n, limit, rank=r)
    width = max(max(sizes), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if blob:
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [out[r][:n].numpy().tobytes() for r, n in enumerate(sizes)]


def broadcast_bytes(blob: bytes, src: int, group: Any, *, limit: int) -> bytes:
    """All ranks: rank ``src``'s ``blob`` (at most ``limit`` bytes, checked before the buffer)."""
    length = torch.tensor([len(blob)], dtype=torch.int64)
    dist.broadcast(length, group_src=src, group=group)
    n = int(length[0])
    _check_length(n, limit, rank=src)
    data = torch.empty(max(n, 1), dtype=torch.uint8)
    if dist.get_rank(group) == src and blob:
        data[:n] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    dist.broadcast(data, group_src=src, group=group)
    return data[:n].numpy().tobytes()


def _check_length(n: int, limit: int, *, rank: int) -> None:
    if not 0 < n <= limit:
        raise CoordinationError(
            f"rank {rank} announced a {n}-byte message; a message here is 1 to {limit} bytes "
            "(a rank of another trainer version, or a broken one)"
        )
