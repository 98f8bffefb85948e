"""Node memory and the peer copies, restored (issue 29, items 1 and 2; a restorer of its own
since issue 40, item 1). Each rank's shard of the chosen step comes from its own node memory,
or from the peer copy another node holds (sent to it on the checkpoint group first); digest,
finite values and layout are checked before anything is copied into the live state."""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainer.checkpointing import node_format, tiers
from trainer.checkpointing.node_copy import SOURCE, NodeMemory
from trainer.checkpointing.node_format import Header
from trainer.checkpointing.restoring import RestoreContext, Resumed, loss_of
from trainer.workload import DataSource


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
            header, mm, where = self._shard_for(choice.step, plan)
            info = header.info
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd}
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
        return Resumed(choice.step, loss_of(info), None)

    def _shard_for(self, step: int, plan: tuple[int, ...]) -> tuple[Header, mmap.mmap, str]:
        """All ranks, in one order: the peer copies that must travel (a holder sends, the rank
        it belongs to receives, on the checkpoint group), then this rank's (header, bytes,
        where from). A failure is raised after every transfer of this rank ran."""
        rank, group = self.ctx.rank, self.ctx.group
        received: tuple[Header, mmap.mmap, str] | None = None
        failure: Exception | None = None
        for r, h in enumerate(plan):
            if h < 0 or h == r:
                continue
            if rank == h:
                header = self.peers.get(r, {}).get(step)
                self.node.send_shard(header, self.node.peer_dir(r), r, group)
            elif rank == r:
                try:
                    got, mm = self.node.recv_shard(h, group)
                    received = (got, mm, f"rank {h}'s peer copy")
                except Exception as e:
                    failure = e
        if failure is not None:
            raise failure
        h = plan[rank]
        if h < 0:
            mine = self.own[step]
            return mine, self.node.map(mine, None), str(self.node.dir)
        if h == rank:
            mine = self.peers[rank][step]
            where = self.node.peer_dir(rank)
            return mine, self.node.map(mine, where), str(where)
        assert received is not None
        return received
