"""Which tier a resume reads (issue 29, item 4): a pure choice over what every rank offers.

Each rank offers its process's own copy (the last durable save's snapshot, ``process_copy``)
and the steps its node memory holds for it (``node_copy``); rank 0 adds the newest committed
step. The newest step that every rank can restore wins, if no commit is newer; at equal steps
the process's own copy (no read at all) beats node memory, which beats the durable checkpoint.
Every tier some rank held and that was not used is said, with why: a resume event each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["memory", "node", "durable"]
# How a resume event's reason names a tier not used.
DESCRIBED: dict[str, str] = {
    "memory": "the process's own copy",
    "node": "node memory",
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

    node_held = any(o.node_steps or o.node_problem for o in offers)
    if node_held:
        common = set(offers[0].node_steps)
        for o in offers[1:]:
            common &= set(o.node_steps)
        if common:
            candidates.append((max(common), 1, "node"))
        else:
            missing = [
                f"rank {r}: {o.node_problem or 'steps ' + str(sorted(o.node_steps))}"
                for r, o in enumerate(offers)
            ]
            newest = max((s for o in offers for s in o.node_steps), default=0)
            skipped.append(
                Skipped(
                    "node",
                    newest,
                    "no step every rank holds in node memory (" + "; ".join(missing[:8]) + ")",
                )
            )

    usable = [c for c in candidates if c[0] >= newest_committed]
    for step, _, tier in candidates:
        if step < newest_committed:
            skipped.append(
                Skipped(
                    tier,
                    step,
                    f"step {newest_committed} is committed, newer than the copy's {step}",
                )
            )
    if not usable:
        return Choice("durable", newest_committed, newest_committed, tuple(skipped))
    # An older or equal tier not chosen is no news: the newest step wins by design.
    step, _, tier = max(usable)
    return Choice(tier, step, newest_committed, tuple(skipped))
