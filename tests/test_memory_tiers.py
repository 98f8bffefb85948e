"""Issue 29's memory tiers as code: the choice of tier over recorded offers (a table), and node
memory (trainer.checkpointing.node_copy) against every way its files can mislead a resume."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tasks.backends import node_memory
from tests.helpers import small_trained_model
from trainer.checkpointing import node_format
from trainer.checkpointing.live_state import LiveState
from trainer.checkpointing.node_copy import NodeMemory
from trainer.checkpointing.node_format import NodeCopyError
from trainer.checkpointing.restore_node import recv_shard, send_shard
from trainer.checkpointing.tiers import NO_COPY, Offer, choose, without
from trainer.faults import flip_bytes

OWN10 = Offer(own_step=10, own_problem=None, own_bytes=8)


@pytest.mark.parametrize(
    "offers, committed, tier, step, skipped",
    [
        # A first start: nothing anywhere, nothing said.
        ([Offer(), Offer()], 0, "durable", 0, []),
        # An in-process restart, no node memory: the process's own copy.
        ([OWN10, OWN10], 5, "memory", 10, []),
        # Node memory newer than the own copy wins (fewer steps replayed).
        ([Offer(10, None, 8, (10, 11)), Offer(10, None, 8, (10, 11))], 5, "node", 11, []),
        # Equal steps: the own copy, which reads nothing.
        ([Offer(10, None, 8, (9, 10)), Offer(10, None, 8, (9, 10))], 5, "memory", 10, []),
        # A respawn: no own copy (no news), node memory's newest step every rank holds.
        ([Offer(node_steps=(16, 17)), Offer(node_steps=(15, 16))], 15, "node", 16, []),
        # A commit newer than every copy: the durable tier, and why the copies were not used.
        ([Offer(node_steps=(11, 12)), Offer(node_steps=(11, 12))], 15, "durable", 15, ["node"]),
        ([OWN10, OWN10], 15, "durable", 15, ["memory"]),
        # A lost node's ranks hold nothing: no common step, said with each rank's reason.
        ([Offer(node_steps=(16, 17)), Offer(node_problem=None)], 15, "durable", 15, ["node"]),
        # A bad header on one rank: said, and the durable tier read.
        ([Offer(node_steps=(17,)), Offer(node_problem="gen-0.json: written for epoch 3")], 15,
         "durable", 15, ["node"]),
        # Own copies of different steps, or one damaged: said.
        ([OWN10, Offer(5, None, 8)], 0, "durable", 0, ["memory"]),
        ([OWN10, Offer(-1, "it holds values that are not finite", 8)], 0, "durable", 0,
         ["memory"]),
    ],
)  # fmt: skip
def test_the_newest_step_every_rank_holds_wins(offers, committed, tier, step, skipped):
    choice = choose(offers, committed)
    assert (choice.tier, choice.step, choice.newest_committed) == (tier, step, committed)
    assert [s.tier for s in choice.skipped] == skipped, choice.skipped


def test_a_skipped_tier_says_why():
    choice = choose([Offer(node_steps=(16, 17)), Offer(node_problem="bad header")], 15)
    (s,) = choice.skipped
    assert "rank 1: bad header" in s.why and "rank 0: steps [16, 17]" in s.why
    (s,) = choose([Offer(node_steps=(12,)), Offer(node_steps=(12,))], 15).skipped
    assert s.why == "step 15 is committed, newer than the copy's 12"
    assert choose([Offer(), Offer(own_problem=NO_COPY)], 0).skipped == ()


def _state(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(m, o)
    return {"model": msd, "optim": osd}


def _memory(root: Path, **kw) -> NodeMemory:
    args = {"rank": 0, "world_size": 1, "fingerprint": "f" * 16, "epoch": 2, **kw}
    return NodeMemory(root, **args)


def test_a_respawned_process_restores_the_newest_copy_bitwise(tmp_path: Path):
    m, o = small_trained_model(0)
    mem = _memory(tmp_path)
    for step in (3, 4, 5):  # three saves, two generations: 4 and 5 remain
        for p in m.parameters():
            p.data.add_(step)
        mem.save(step, _state(m, o), {"loss": 1.5, "data_loader": {"step": step}})
    mem.close()
    fresh = _memory(tmp_path)  # a new process: nothing in memory but the files
    found, why = fresh.headers()
    assert sorted(found) == [4, 5] and why is None
    m2, o2 = small_trained_model(1)
    target = _state(m2, o2)
    assert fresh.load(found[5], target) == found[5].size
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    s1, s2 = o.state_dict(), o2.state_dict()
    for k in s1["state"]:
        assert all(torch.equal(s1["state"][k][n], s2["state"][k][n]) for n in s1["state"][k])
    assert s2["param_groups"][0]["betas"] == (0.8, 0.95)
    assert found[5].info == {"loss": 1.5, "data_loader": {"step": 5}}


def _train(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    m(torch.randn(2, 4)).sum().backward()
    o.step()


def _equal_states(a: dict, b: dict) -> bool:
    pairs = zip(node_format.leaves(a), node_format.leaves(b), strict=True)
    return all(
        x.path == y.path
        and (torch.equal(x.value, y.value) if torch.is_tensor(x.value) else x.value == y.value)
        for x, y in pairs
    )


def test_the_kept_state_reads_the_live_values_and_is_retaken_when_its_structure_changes():
    """The memory saves' state dicts (live_state.LiveState) are reused between steps only while
    they still are what get_state_dict would give: the same values after steps, and taken anew
    when a learning rate changes, the optimizer's state is replaced (a restore) or a
    parameter's storage is swapped."""
    m, o = small_trained_model(0)
    live = LiveState()
    kept = live.get(m, o)
    seen = {live.version}
    for _ in range(3):
        _train(m, o)
        assert live.get(m, o) is kept and live.version in seen
        assert _equal_states(kept, _state(m, o))
    changes = [
        lambda: o.param_groups[0].update(lr=5e-4),  # a scheduler
        lambda: o.load_state_dict(copy.deepcopy(o.state_dict())),  # a restore: new tensors
        lambda: setattr(next(m.parameters()), "data", torch.zeros(8, 4)),  # swapped storage
    ]
    for change in changes:
        change()
        again = live.get(m, o)
        assert again is not kept and live.version not in seen
        assert _equal_states(again, _state(m, o))
        kept = again
        seen.add(live.version)
    live.forget()
    assert live.get(m, o) is not kept and live.version not in seen
    # A new one (the manager of an in-process restart) never repeats a version: a node memory
    # kept across it must not take its layout of the replaced tensors for the new state's.
    other = LiveState()
    other.get(m, o)
    assert other.version not in seen


def test_a_memory_save_of_a_kept_state_copies_its_newest_values(tmp_path: Path):
    """The layout kept for a version (no walk, no plan) still copies the values of the step
    the save follows, bitwise; a restore with a new manager (an in-process restart: a new
    LiveState, the same node memory) copies the new tensors; a new version is planned anew."""
    m, o = small_trained_model(0)
    live, mem = LiveState(), _memory(tmp_path)

    def save(step: int) -> None:
        _train(m, o)
        mem.save(step, live.get(m, o), {"data_loader": {}}, version=live.version)
        mem.wait()

    def restored(step: int) -> dict:
        found, _ = _memory(tmp_path).headers()
        m2, o2 = small_trained_model(1)
        target = _state(m2, o2)
        _memory(tmp_path).load(found[step], target)
        return target

    for step in (1, 2, 3):
        save(step)
    assert _equal_states(restored(3), _state(m, o))
    o.load_state_dict(copy.deepcopy(o.state_dict()))  # the restore: new state tensors
    live = LiveState()  # the restarted incarnation's manager
    save(4)
    assert not _equal_states(restored(3), _state(m, o))  # step 3's, not the live step 4's
    assert _equal_states(restored(4), _state(m, o))
    o.param_groups[0]["lr"] = 1e-2  # a new version: planned again (lr is in the header)
    save(5)
    target = restored(5)
    assert _equal_states(target, _state(m, o))
    assert target["optim"]["param_groups"][0]["lr"] == 1e-2
    mem.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA memory save needs a GPU")
def test_a_cuda_memory_save_is_launched_and_sees_its_own_step(tmp_path: Path):
    """CUDA (staging.DeviceCopy): the copy is only launched (pinned buffers, a side stream); the
    optimizer steps that follow at once, with no host wait, must not reach it (the step
    pre-hook orders them after it), and the sealed copy restores that step's state bitwise."""
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).to(dev)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    live, mem = LiveState(), _memory(tmp_path)

    def train() -> None:
        o.zero_grad()
        m(torch.randn(64, 1024, device=dev)).square().sum().backward()
        o.step()

    for step in (1, 2, 3):
        train()
        mem.save(step, live.get(m, o), {"data_loader": {}}, version=live.version)
        expected = {k: v.detach().cpu() for k, v in _flat(_state(m, o)).items()}
        for _ in range(3):  # steps queued behind the copy, the host never waiting
            train()
        mem.wait()
        assert mem.take_failure() is None
        found, _ = _memory(tmp_path).headers()
        target = _state(*_cudasmall_trained_model(dev))
        _memory(tmp_path).load(found[step], target)
        got = {k: v.detach().cpu() for k, v in _flat(target).items()}
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)
    mem.close()


def _cudasmall_trained_model(dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).to(dev)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 1024, device=dev)).sum().backward()
    o.step()
    return m, o


def _flat(state: dict) -> dict[str, torch.Tensor]:
    return {
        "/".join(map(str, leaf.path)): leaf.value
        for leaf in node_format.leaves(state)
        if torch.is_tensor(leaf.value)
    }


@pytest.mark.parametrize(
    "damage, expect",
    [
        ("flip", "xxh3_128"),
        ("truncate", "holds"),
        ("nan", "not finite"),
        ("layout", "live"),
    ],
)
def test_a_damaged_copy_is_refused_and_the_live_state_untouched(tmp_path, damage, expect):
    m, o = small_trained_model(0)
    state = _state(m, o)
    if damage == "nan":
        with torch.no_grad():
            next(iter(m.parameters()))[0, 0] = float("nan")
    mem = _memory(tmp_path)
    mem.save(7, _state(m, o), {"loss": 1.0})
    mem.wait()
    (header,) = mem.headers()[0].values()
    path = mem.bin_path(header.generation)
    if damage == "flip":
        flip_bytes(path)
    elif damage == "truncate":
        os.truncate(path, header.size - 8)
    m2, o2 = small_trained_model(1) if damage != "layout" else (torch.nn.Linear(4, 3), None)
    o2 = o2 or torch.optim.AdamW(m2.parameters())
    target = _state(m2, o2)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(NodeCopyError, match=expect):
        _memory(tmp_path).load(header, target)
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters(), strict=True))
    del state


@pytest.mark.parametrize(
    "who, expect",
    [
        ({"epoch": 3}, "epoch"),
        ({"fingerprint": "0" * 16}, "fingerprint"),
        ({"world_size": 2}, None),  # another topology: another directory, nothing found
    ],
)
def test_a_copy_of_another_attempt_or_topology_is_not_offered(tmp_path, who, expect):
    m, o = small_trained_model(0)
    mem = _memory(tmp_path)
    mem.save(7, _state(m, o), {})
    mem.close()
    found, why = _memory(tmp_path, **who).headers()
    assert found == {}
    assert (why is None) if expect is None else (expect in why)


def _saved_header(tmp_path: Path) -> tuple[NodeMemory, Path, dict[str, Any]]:
    """A memory save of step 7 made and sealed: the node memory, its header's path and JSON."""
    m, o = small_trained_model(0)
    mem = _memory(tmp_path)
    mem.save(7, _state(m, o), {})
    mem.wait()
    header_path = mem.header_path(0)
    return mem, header_path, json.loads(header_path.read_text())


def test_a_copy_of_the_sha256_format_is_not_offered(tmp_path: Path):
    """Format 1 (sha256, before issue 40) left in node memory by an older trainer: refused by
    name at the scan, so the resume reads the next tier; the same copy as format 2 is read."""
    mem, header_path, obj = _saved_header(tmp_path)
    assert obj["format"] == node_format.FORMAT == 2
    assert obj["xxh3_128"] == node_format.checksum(mem.bin_path(0).read_bytes()[: obj["size"]])
    old = {k: v for k, v in obj.items() if k != "xxh3_128"}
    header_path.write_text(json.dumps({**old, "format": 1, "sha256": "0" * 64}))
    found, why = _memory(tmp_path).headers()
    assert found == {} and why is not None and "not a node-copy header" in why
    header_path.write_text(json.dumps(obj))
    assert set(_memory(tmp_path).headers()[0]) == {7}


def test_a_forged_header_is_refused_bounded_and_named(tmp_path: Path):
    _, header_path, obj = _saved_header(tmp_path)
    obj["entries"][0]["offset"] = 10**12  # points outside the bytes
    header_path.write_text(json.dumps(obj))
    (header,) = _memory(tmp_path).headers()[0].values()
    with pytest.raises(NodeCopyError, match="outside"):
        _memory(tmp_path).load(header, _state(*small_trained_model(1)))
    header_path.write_text(json.dumps({**obj, "step": "x"}))
    found, why = _memory(tmp_path).headers()
    assert found == {} and "not a node-copy header" in why
    header_path.write_bytes(b"{" + b" " * (node_format.HEADER_LIMIT + 1) + b"}")
    assert _memory(tmp_path).headers()[0] == {}


def test_a_save_torn_midway_leaves_the_other_generation(tmp_path: Path):
    """The header goes first and comes back last: a kill between leaves no header vouching
    for the half-written bytes, and the older generation is what a resume finds."""
    m, o = small_trained_model(0)
    mem = _memory(tmp_path)
    mem.save(4, _state(m, o), {})
    mem.save(5, _state(m, o), {})
    mem.wait()
    mem.header_path(0).unlink()  # step 4's slot, being rewritten for step 6 when killed
    found, _ = _memory(tmp_path).headers()
    assert sorted(found) == [5]
    assert found[5].generation == 1


def test_the_local_backend_gives_each_node_memory_and_takes_a_lost_nodes(tmp_path: Path):
    root = tmp_path / "run"
    first = node_memory.prepare(root, 1, "inv-aaaa")
    assert str(first).startswith("/dev/shm/") and first.is_dir()
    (first / "node-0").mkdir()
    (first / "node-1").mkdir()
    node_memory.forget_node(root, 1, "inv-aaaa", 1)
    assert [p.name for p in first.iterdir()] == ["node-0"]
    # A new attempt runs on new nodes: nothing of the last one's memory is left.
    second = node_memory.prepare(root, 2, "inv-bbbb")
    assert not first.exists() and second.is_dir()
    node_memory.forget_attempt(root, 2, "inv-bbbb")
    assert not second.exists() and not second.parent.exists()


def test_a_cleanup_and_a_takeover_remove_node_memory_no_launcher_removed(tmp_path: Path):
    """Attempts ended without their launcher (issue 41): a cleanup removes every invocation's
    node memory (no live owner here); a takeover that ends the dead owner's attempt, all of it;
    one that adopts it, none."""
    from tasks.backends.local import LocalBackend
    from tasks.ownership import takeover
    from tasks.ownership.lease import LeaseRecord, Owner

    root = tmp_path / "run"
    previous = LeaseRecord("r", Owner("inv-dead", 1, "h", 0.0, 0.0), 0.0)
    dead = node_memory.prepare(root, 3, "inv-dead")
    adopt = takeover.Plan(takeover.Action.ADOPT, "healthy", 3)
    assert takeover.carry_out(adopt, previous, root) == [] and dead.is_dir()
    end = takeover.Plan(takeover.Action.END, "attempt 3: node(s) [1] gone", 3)
    assert takeover.carry_out(end, previous, root) == [] and not dead.exists()
    swept = node_memory.prepare(root, 1, "inv-gone")
    removed = LocalBackend(tmp_path / "state").cleanup("r", root)
    assert removed == ["node memory attempt1-inv-gone"] and not swept.parent.exists()
    # A live owner's is kept.
    live = node_memory.prepare(root, 2, "inv-live")
    (live.parent / "attempt1-inv-gone").mkdir()
    assert node_memory.forget(root, keep="inv-live") == [live.parent / "attempt1-inv-gone"]
    assert live.is_dir()
    node_memory.forget(root)
    assert not live.parent.exists()


@pytest.mark.parametrize(
    "rank_nodes, ring",
    [
        ([0, 1], [1, 0]),
        ([0, 0, 1, 1], [2, 3, 0, 1]),  # the same local rank on the next node
        ([0, 0, 1, 1, 2, 2], [2, 3, 4, 5, 0, 1]),
        ([0, 2], [1, 0]),  # a spare (node 2) in node 1's place
        ([5, 5], [None, None]),  # one node: no other failure domain
        ([0, None, 1], [2, None, 0]),  # a rank without node memory takes no part
        ([0, 0, 0, 1], [3, 3, 3, 0]),  # uneven: the next node's ranks in turn
    ],
)
def test_a_peer_copy_goes_to_another_node(rank_nodes, ring):
    from trainer.checkpointing.tiers import peer_ring

    assert peer_ring(rank_nodes) == ring
    for r, p in enumerate(peer_ring(rank_nodes)):
        assert p is None or rank_nodes[p] != rank_nodes[r]


@pytest.mark.parametrize(
    "offers, committed, tier, step, plan",
    [
        # A spare in node 1's place: rank 1 has nothing; node 0 holds rank 1's peer copies.
        ([Offer(node_steps=(12, 13), peer_holds=((1, 12), (1, 13))), Offer()], 10, "peer", 13,
         (-1, 0)),
        # The peer copies lag one step: the newest step complete across both.
        ([Offer(node_steps=(12, 13), peer_holds=((1, 11), (1, 12))), Offer()], 10, "peer", 12,
         (-1, 0)),
        # Every rank's own node memory holds the step: no transfer, "node".
        ([Offer(node_steps=(12, 13), peer_holds=((1, 13),)), Offer(node_steps=(13,))], 10,
         "node", 13, (-1, -1)),
        # Peer copies older than a commit: the durable tier.
        ([Offer(node_steps=(8, 9), peer_holds=((1, 9),)), Offer()], 10, "durable", 10, ()),
        # A rank's shard in no node's memory: the durable tier, said.
        ([Offer(node_steps=(12, 13)), Offer()], 10, "durable", 10, ()),
    ],
)  # fmt: skip
def test_a_lost_nodes_shards_come_from_their_peer_copies(offers, committed, tier, step, plan):
    choice = choose(offers, committed)
    assert (choice.tier, choice.step, choice.plan) == (tier, step, plan), choice


SPARE = [Offer(node_steps=(12, 13), peer_holds=((1, 12), (1, 13))), Offer()]
BOTH = [Offer(own_step=10, own_problem=None, node_steps=(16, 17)),
        Offer(own_step=10, own_problem=None, node_steps=(16, 17))]  # fmt: skip


@pytest.mark.parametrize(
    "offers, committed, fails, path",
    [
        # The newest peer copy damaged: the older generation, still on the surviving node.
        (SPARE, 10, 1, [("peer", 13), ("peer", 12)]),
        # Both generations damaged: the durable tier.
        (SPARE, 10, 2, [("peer", 13), ("peer", 12), ("durable", 10)]),
        # An older generation older than a commit is no candidate: straight to the durable tier.
        (SPARE, 13, 1, [("peer", 13), ("durable", 13)]),
        # Node memory fails twice, then the process's own copy (older, read from nowhere)...
        (BOTH, 5, 2, [("node", 17), ("node", 16), ("memory", 10)]),
        # ...and when that fails too, the durable tier.
        (BOTH, 5, 3, [("node", 17), ("node", 16), ("memory", 10), ("durable", 5)]),
    ],
)  # fmt: skip
def test_a_failed_restore_falls_back_to_the_next_newest_candidate(offers, committed, fails, path):
    """Issue 29, item 4: a restore that fails on some rank removes its candidate (tiers.without)
    and the choice is made again: an older generation, another tier, at last the durable
    checkpoint; each failure removes one, so the fallback ends."""
    choice = choose(offers, committed)
    seen = [(choice.tier, choice.step)]
    for _ in range(fails):
        offers = without(offers, choice.tier, choice.step, "restoring it failed")
        choice = choose(offers, committed)
        seen.append((choice.tier, choice.step))
    assert seen == path


def _peer_pair(rank: int, world: int, port: int, root: str, out: str) -> None:
    """One of two ranks (two "nodes"): two memory saves replicated to the other, then rank 0
    sends rank 1's peer copy back to it, once intact and once with a flipped byte."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    m, o = small_trained_model(rank)
    mem = NodeMemory(Path(root) / f"node-{rank}", rank=rank, world_size=2, fingerprint="f", epoch=1)
    mem.bind_peers(group, 1 - rank, (1 - rank,))
    for step in (6, 7):
        mem.save(step, _state(m, o), {"loss": float(step)})
    mem.wait()
    dist.barrier()
    result: dict = {"peer_steps": sorted(mem.peer_headers().get(1 - rank, {}))}
    held = mem.peer_headers().get(1, {})
    for damaged in (False, True):
        if rank == 0:
            if damaged:
                flip_bytes(mem.bin_path(held[7].generation, mem.peer_dir(1)))
            send_shard(mem, held[7], mem.peer_dir(1), 1, dist.group.WORLD)
        else:
            target = _state(*small_trained_model(5))
            header, mm = recv_shard(mem, 0, dist.group.WORLD, target)
            try:
                node_format.restore(header, mm, target, "rank 0's peer copy")
                mine = _state(m, o)["model"].values()
                pairs = zip(target["model"].values(), mine, strict=True)
                result[str(damaged)] = [torch.equal(a, b) for a, b in pairs]
            except NodeCopyError as e:
                result[str(damaged)] = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_peer_copy_travels_checked_and_a_damaged_one_is_refused(tmp_path: Path):
    """Real gloo, two processes: each memory save reaches the other "node" (its digest checked
    on arrival), a resume's transfer brings the lost rank's shard back bitwise, and a peer copy
    damaged on its node is refused by the rank it belongs to."""
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    mp.spawn(_peer_pair, args=(2, free_port(), str(tmp_path), str(tmp_path)), nprocs=2)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["peer_steps"] == [6, 7] and r1["peer_steps"] == [6, 7]
    assert r1["False"] == [True, True, True, True]
    assert "xxh3_128" in r1["True"], r1


def test_copies_of_another_world_size_are_forgotten(tmp_path: Path):
    """An elastic job that shrank and grew again must not be offered the larger world's old
    copies: they would go back past what the smaller world trained."""
    m, o = small_trained_model(0)
    two = _memory(tmp_path, world_size=2)
    two.save(7, _state(m, o), {})
    two.wait()
    (tmp_path / "peer-rank-1-of-2").mkdir()
    one = _memory(tmp_path, world_size=1)
    one.save(9, _state(m, o), {})
    one.wait()
    assert sorted(one.forget_other_worlds()) == ["peer-rank-1-of-2", "rank-0-of-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0-of-1"]
    assert sorted(_memory(tmp_path, world_size=1).headers()[0]) == [9]
