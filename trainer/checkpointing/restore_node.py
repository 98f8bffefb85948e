"""Node memory and the peer copies, restored (issue 29, items 1 and 2; a restorer of its own
since issue 40, item 1). Each rank's shard of the chosen step comes from its own node memory,
or from the peer copy another node holds (sent to it on the checkpoint group first); digest,
finite values and layout are checked before anything is copied into the live state."""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainer.checkpointing import node_format, peer_wire, tiers
from trainer.checkpointing.manifest import as_loss
from trainer.checkpointing.node_copy import SOURCE, NodeMemory
from trainer.checkpointing.node_format import Header, NodeCopyError
from trainer.checkpointing.restoring import RestoreContext, Resumed
from trainer.workload import DataSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeRestorer:
    ctx: RestoreContext
    node: NodeMemory
    own: dict[int, Header]  # this rank's node memory, by step
    peers: dict[int, dict[int, Header]] = field(default_factory=dict)  # held here, by rank

    def restore(
        self, model: nn.Module, optim: Optimizer, sampler: DataSource, choice: tiers.Choice
    ) -> Resumed | None:
        """All ranks: step ``choice.step`` into the live state, each rank its own shard; None
        where some rank could not."""
        t0 = time.perf_counter()
        plan = choice.plan or (-1,) * self.ctx.world_size
        source = "peer" if any(h >= 0 for h in plan) else SOURCE
        failed, nbytes, info = "", 0, {}
        try:
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd}
            header, mm, where = self._shard_for(choice.step, plan, state)
            info = header.info
            nbytes = node_format.restore(header, mm, state, where)
            set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
            sampler.check_state(info.get("data_loader", {}), choice.step)
        except Exception as e:
            failed = f"{type(e).__name__}: {e}"
        why, total = self.ctx.failure(failed, nbytes)
        if why:
            reason = f"not from {tiers.DESCRIBED[source]}: restoring it failed: {why}"
            self.ctx.skipped(choice.step, source, reason)
            return None
        self.ctx.loaded(choice.step, source, t0, total)
        return Resumed(choice.step, as_loss(info.get("loss")), None)

    def _shard_for(
        self, step: int, plan: tuple[int, ...], state: dict[str, Any]
    ) -> tuple[Header, mmap.mmap, str]:
        """All ranks, in one order: the peer copies that must travel (a holder sends, the rank
        it belongs to receives, checked against ``state``, on the checkpoint group), then this
        rank's (header, bytes, where from). A failure is raised after every transfer of this
        rank ran."""
        rank, group = self.ctx.rank, self.ctx.group
        received: tuple[Header, mmap.mmap, str] | None = None
        failure: Exception | None = None
        for r, h in enumerate(plan):
            if h < 0 or h == r:
                continue
            if rank == h:
                header = self.peers.get(r, {}).get(step)
                send_shard(self.node, header, self.node.peer_dir(r), r, group)
            elif rank == r:
                try:
                    got, mm = recv_shard(self.node, h, group, state)
                    received = (got, mm, f"rank {h}'s peer copy")
                except Exception as e:
                    failure = e
        if failure is not None:
            raise failure
        h = plan[rank]
        if h >= 0 and h != rank:
            assert received is not None
            return received
        mine = self.own[step] if h < 0 else self.peers[rank][step]  # its node's own, or a peer's
        where = None if h < 0 else self.node.peer_dir(rank)
        return mine, self.node.map(mine, where), str(where or self.node.dir)


def send_shard(
    node: NodeMemory, header: Header | None, where: Path | None, dst: int, group: Any
) -> None:
    """``header``'s generation (in ``where``) to rank ``dst``, which calls :func:`recv_shard`;
    ``header`` None, or a file that cannot be read, sends word that nothing comes."""
    mm = None
    if header is not None:
        try:
            mm = node.map(header, where)
        except NodeCopyError as e:
            log.warning("rank %d: cannot send rank %d's copy: %s", node.rank, dst, e)
            header = None
    blob = header.model_dump_json().encode() if header is not None else b""
    size = header.size if header is not None else 0
    for w in peer_wire.send(blob, size, mm, dst, group, tags=peer_wire.RESUME_TAGS):
        if w is not None:
            w.wait()


def recv_shard(
    node: NodeMemory, src: int, group: Any, target: dict[str, Any]
) -> tuple[Header, mmap.mmap]:
    """A shard sent by ``src``'s :func:`send_shard`, in anonymous memory. Before that memory
    exists, its header is checked: this rank's, world size, fingerprint and epoch, and every
    entry against ``target`` (this rank's live state: count, paths, dtypes, shapes, the other
    leaves' types) and its size against the state's; a refused copy's bytes are read and
    dropped in bounded chunks. The bytes' digest is checked by the restore."""
    announced = peer_wire.receive_header(src, group, tags=peer_wire.RESUME_TAGS)
    if announced is None:
        raise NodeCopyError(f"rank {src} had no copy to send")
    blob, size = announced
    why = ""
    try:
        header = Header.model_validate_json(blob)
        why = node.mismatch(header) or layout_refusal(header, size, target)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the header"
        why = f"no node-copy header: {where}: {first['msg']} ({e.error_count()} errors)"
    except NodeCopyError as e:
        why = str(e)
    mm = None if why else mmap.mmap(-1, max(size, 1))
    peer_wire.receive_bytes(src, group, size, mm, tags=peer_wire.RESUME_TAGS)
    if why or mm is None:
        raise NodeCopyError(f"the copy rank {src} sent: {why}")
    return header, mm


def layout_refusal(header: Header, size: int, target: dict[str, Any]) -> str:
    """Why ``header`` (announcing ``size`` bytes) is not a copy of ``target``'s layout ("": it
    is); entries mismatched raise (``node_format.match``)."""
    _, want = node_format.plan(target)
    if size != header.size or size != want:
        return f"size: it announced {size} bytes, its header {header.size}, this state is {want}"
    node_format.match(header, target)
    return ""
