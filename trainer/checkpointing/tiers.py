"""Which tier a resume reads (issue 29, item 4): a pure choice over what every rank offers.

Each rank offers its process's own copy (the last durable save's snapshot, ``process_copy``)
and the steps its node memory holds for it (``node_copy``); rank 0 adds the newest committed
step. The newest step that every rank can restore wins, if no commit is newer; at equal steps
the process's own copy (no read at all) beats node memory, which beats the durable checkpoint.
Every tier some rank held and that was not used is said, with why: a resume event each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Tier = Literal["memory", "node", "peer", "durable"]
# How a resume event's reason names a tier not used.
DESCRIBED: dict[str, str] = {
    "memory": "the process's own copy",
    "node": "node memory",
    "peer": "the peer copies",
    "durable": "the durable checkpoint",
}
NO_COPY = "this process holds none"  # a new process: its first start, a respawn


@dataclass(frozen=True)
class Offer:
    """One rank's offer."""

    own_step: int = -1  # -1: no usable copy of its own
    own_problem: str | None = NO_COPY
    own_bytes: int = 0
    node_steps: tuple[int, ...] = ()
    node_problem: str | None = None  # why it offers no node step (None: no node memory at all)
    # The peer copies its node holds (issue 29, item 2): (the rank that wrote one, its step).
    peer_holds: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Skipped:
    tier: Tier
    step: int
    why: str


@dataclass(frozen=True)
class Choice:
    tier: Tier
    step: int  # for "durable": the newest committed step (the durable resume decides itself)
    newest_committed: int = 0
    skipped: tuple[Skipped, ...] = ()
    # "node" and "peer": where each rank's shard comes from, by rank: -1 its own node memory,
    # else the rank whose node holds its peer copy (itself: the copy is on its own node).
    plan: tuple[int, ...] = ()


def choose(offers: list[Offer], newest_committed: int) -> Choice:
    """The tier to resume from (see the module's docstring). ``offers`` by rank."""
    candidates: list[tuple[int, int, Tier]] = []  # (step, preference, tier)
    skipped: list[Skipped] = []

    own_steps = {o.own_step for o in offers}
    own_why = next((o.own_problem for o in offers if o.own_problem), None)
    own_held = any(o.own_problem != NO_COPY for o in offers)
    own_step = own_steps.pop() if len(own_steps) == 1 else -1
    if own_why is None and own_step <= 0:
        own_why = f"the ranks hold different steps ({sorted({o.own_step for o in offers})})"
    if own_why is None:
        candidates.append((own_step, 2, "memory"))
    elif own_held:
        skipped.append(Skipped("memory", max(own_step, 0), own_why))

    node_held = any(o.node_steps or o.node_problem or o.peer_holds for o in offers)
    plans: dict[int, tuple[int, ...]] = {}
    if node_held:
        step, plan = _newest_complete(offers)
        if step > 0:
            tier: Tier = "node" if all(h < 0 for h in plan) else "peer"
            candidates.append((step, 1 if tier == "node" else 0, tier))
            plans[step] = plan
        else:
            missing = [
                f"rank {r}: {o.node_problem or 'steps ' + str(sorted(o.node_steps))}"
                for r, o in enumerate(offers)
            ]
            newest = max((s for o in offers for s in o.node_steps), default=0)
            why = "no step every rank holds in node memory, its own or a peer's"
            skipped.append(Skipped("node", newest, f"{why} ({'; '.join(missing[:8])})"))

    usable = [c for c in candidates if c[0] >= newest_committed]
    skipped += [
        Skipped(tier, step, f"step {newest_committed} is committed, newer than the copy's {step}")
        for step, _, tier in candidates
        if step < newest_committed
    ]
    if not usable:
        return Choice("durable", newest_committed, newest_committed, tuple(skipped))
    # An older or equal tier not chosen is no news: the newest step wins by design.
    step, _, tier = max(usable)
    return Choice(tier, step, newest_committed, tuple(skipped), plans.get(step, ()))


def without(offers: list[Offer], tier: Tier, step: int, why: str = "") -> list[Offer]:
    """``offers`` less a candidate whose restore failed on some rank: the process's own copies
    (``tier`` "memory"), or step ``step`` of node memory and the peer copies ("node", "peer":
    some rank's shard of it could not be restored, so no rank's can serve). Choosing again
    over what is left gives the next newest step (an older generation, another tier, or the
    durable checkpoint): each failure removes a candidate, so the fallback ends."""
    if tier == "memory":
        return [replace(o, own_step=-1, own_problem=why) for o in offers]
    if tier == "durable":
        return offers
    return [
        replace(
            o,
            node_steps=tuple(s for s in o.node_steps if s != step),
            peer_holds=tuple(h for h in o.peer_holds if h[1] != step),
        )
        for o in offers
    ]


def _newest_complete(offers: list[Offer]) -> tuple[int, tuple[int, ...]]:
    """The newest step of which every rank's shard is in some node's memory, and where each
    comes from: its own node memory first, else a peer copy (its own node's first, then the
    lowest rank's holding one). (0, ()) when there is none."""
    holders: dict[tuple[int, int], list[int]] = {}
    for h, o in enumerate(offers):
        for src, step in o.peer_holds:
            holders.setdefault((src, step), []).append(h)
    steps = sorted(
        {s for o in offers for s in o.node_steps} | {s for _, s in holders}, reverse=True
    )
    for step in steps:
        plan = []
        for r, o in enumerate(offers):
            if step in o.node_steps:
                plan.append(-1)
                continue
            found = holders.get((r, step))
            if not found:
                break
            plan.append(r if r in found else min(found))
        else:
            return step, tuple(plan)
    return 0, ()


def peer_ring(rank_nodes: list[int | None]) -> list[int | None]:
    """Where each rank's peer copy goes (issue 29, item 2): the rank at the same position on
    the next node (nodes in order of their ids, ranks in order on each), so that every rank
    sends one copy and receives one, never on its own node. None: a one-node world, or a rank
    with no node memory (``rank_nodes`` None: it neither sends nor receives)."""
    by_node: dict[int, list[int]] = {}
    for r, n in enumerate(rank_nodes):
        if n is not None:
            by_node.setdefault(n, []).append(r)
    nodes = sorted(by_node)
    out: list[int | None] = [None] * len(rank_nodes)
    for k, n in enumerate(nodes):
        nxt = nodes[(k + 1) % len(nodes)]
        if nxt == n:
            continue
        for i, r in enumerate(by_node[n]):
            out[r] = by_node[nxt][i % len(by_node[nxt])]
    return out
