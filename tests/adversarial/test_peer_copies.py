"""Peer copies, node memory and the ranks' resume messages are hostile input (issue 43, item 5).

Each row is a hostile input and the refusal it must get, with the proof that nothing was
allocated or left behind: real files in ``/dev/shm``, real directories (this suite runs as root
here, so "another user's" is a real ``chown``), and one real drill of two gloo processes in
which one rank is the hostile peer (a garbled and an oversized resume message, a copy announcing
100x its size, a sender killed mid-transfer).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint.state_dict import get_state_dict

from tasks.backends import node_memory
from tests.helpers import free_port, small_trained_model
from trainer.checkpointing import coordination, node_copy, node_dir, node_format, peer_wire
from trainer.checkpointing.coordination import CoordinationError, OfferMessage, TierOffer
from trainer.checkpointing.node_copy import NodeMemory
from trainer.checkpointing.node_dir import NodeMemoryDirError, private_dir, refusal
from trainer.checkpointing.node_format import Header, NodeCopyError, _Layout
from trainer.checkpointing.tiers import Offer

OTHER_UID = 65534  # nobody


def _state(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(m, o)
    return {"model": msd, "optim": osd}


def _memory(root: Path, rank: int = 0, world_size: int = 2) -> NodeMemory:
    return NodeMemory(root, rank=rank, world_size=world_size, fingerprint="f", epoch=1)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A private directory in the real /dev/shm (node memory's home), removed after."""
    d = Path(tempfile.mkdtemp(prefix="nvrx-adv-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _saved(root: Path, rank: int) -> tuple[NodeMemory, dict[str, Any]]:
    """Rank ``rank``'s memory save of step 7, sealed: its node memory and header JSON."""
    mem = _memory(root / f"node-{rank}", rank=rank)
    mem.save(7, _state(*small_trained_model(rank)), {"loss": 1.0})
    mem.wait()
    return mem, json.loads(mem.header_path(0).read_text())


# -- a peer's announcement, judged before any allocation ---------------------------------------
def _inflate(h: dict[str, Any]) -> tuple[dict[str, Any], int]:
    return {**h, "size": h["size"] * 100}, h["size"] * 100


def _retype(h: dict[str, Any]) -> tuple[dict[str, Any], int]:
    entries = [dict(e) for e in h["entries"]]
    first = next(e for e in entries if e["dtype"])
    first["dtype"] = "torch.float64"
    return {**h, "entries": entries}, h["size"]


def _reshape(h: dict[str, Any]) -> tuple[dict[str, Any], int]:
    entries = [dict(e) for e in h["entries"]]
    first = next(e for e in entries if e["dtype"])
    first["shape"] = [first["shape"][0] * 2, first["shape"][1] // 2]
    return {**h, "entries": entries}, h["size"]


ANNOUNCED: list[tuple[str, Callable[[dict[str, Any]], tuple[dict[str, Any], int]], str]] = [
    ("honest", lambda h: (h, h["size"]), ""),
    ("100x the layout's size", _inflate, "size: "),
    ("a size its header does not say", lambda h: (h, h["size"] + 8), "its header"),
    ("another rank's copy", lambda h: ({**h, "rank": 0}, h["size"]), "rank 0"),
    ("another epoch", lambda h: ({**h, "epoch": 9}, h["size"]), "epoch 9"),
    ("no header", lambda h: ({"size": h["size"]}, h["size"]), "not a node-copy header: format"),
    ("a negative size field", lambda h: ({**h, "size": -1}, -1), "not a node-copy header: size"),
]
# What the rank a copy belongs to checks before it allocates for it (a resume's transfer):
# everything above, and every entry against its live state.
RESTORED = [
    *[r for r in ANNOUNCED if r[0] in ("honest", "100x the layout's size")],
    ("one entry fewer", lambda h: ({**h, "entries": h["entries"][1:]}, h["size"]), "entries"),
    ("another dtype", _retype, "torch.float64"),
    ("another shape (same bytes)", _reshape, "[16, 2]"),
]


@pytest.mark.parametrize("name, forge, refused", ANNOUNCED, ids=[r[0] for r in ANNOUNCED])
def test_a_peers_announcement_is_checked_against_the_layout_before_allocation(
    shm: Path, name: str, forge: Any, refused: str
):
    """Rank 0 judges what rank 1 announces against the shard rank 1 has of this model, worked
    out from rank 0's own layout, before a byte of it lands: refused rows name the field."""
    receiver, _ = _saved(shm, 0)
    _, honest = _saved(shm, 1)
    header, size = forge(honest)
    got, why = receiver.refusal(json.dumps(header).encode(), size, 1)
    assert (why == "") if not refused else (refused in why), why
    assert got is not None or refused
    assert not receiver.peer_dir(1).exists()  # judging touched nothing


@pytest.mark.parametrize("name, forge, refused", RESTORED, ids=[r[0] for r in RESTORED])
def test_a_transferred_shard_is_checked_against_the_live_state_before_allocation(
    shm: Path, name: str, forge: Any, refused: str
):
    from trainer.checkpointing.restore_node import layout_refusal

    _, honest = _saved(shm, 0)
    header, size = forge(honest)
    live = _state(*small_trained_model(1))
    try:
        why = layout_refusal(Header.model_validate(header), size, live)
    except NodeCopyError as e:
        why = str(e)
    assert (why == "") if not refused else (refused in why), why


def test_a_receiver_with_no_save_of_its_own_refuses_every_copy(shm: Path):
    _, honest = _saved(shm, 1)
    _, why = _memory(shm / "fresh").refusal(json.dumps(honest).encode(), honest["size"], 1)
    assert "no save of its own" in why


def test_a_dtensor_peers_shard_is_expected_in_its_own_local_shape():
    """FSDP shards unevenly: a rank's copy is checked against *its* local shape, the DTensor's
    placements on that rank, not the receiver's (a one-rank mesh stands for the rule)."""
    from torch.distributed.tensor import Shard

    s = node_format.Sharding(4, (3, 4), "torch.float32", (5, 4), _Mesh(), (Shard(0),))
    layout = _Layout(None, [], 0, None, torch.device("cpu"), (s,))
    assert peer_wire.expected(layout, 0).size == 3 * 4 * 4
    assert peer_wire.expected(layout, 1).size == 2 * 4 * 4
    with pytest.raises(NodeCopyError, match="rank 7 is not in the mesh"):
        peer_wire.expected(layout, 7)


class _Mesh:
    """What ``peer_wire`` reads of a DeviceMesh: its ranks and shape (two ranks, one dim)."""

    mesh = torch.tensor([0, 1])
    shape = (2,)


# -- restored leaves: every one of its type ---------------------------------------------------
SCALARS = [
    ("a learning rate as text", ("optim", "param_groups", 0, "lr"), "1e9", "str '1e9'"),
    ("a bool for a float", ("optim", "param_groups", 0, "lr"), True, "bool"),
    ("an int for a float", ("optim", "param_groups", 0, "eps"), 1, "int"),
    ("betas cut short", ("optim", "param_groups", 0, "betas"), [0.8], "a tuple of 2"),
    ("betas of text", ("optim", "param_groups", 0, "betas"), [0.8, "x"], "item 1"),
    ("an int for a bool", ("optim", "param_groups", 0, "amsgrad"), 0, "int"),
]


@pytest.mark.parametrize("name, path, value, refused", SCALARS, ids=[r[0] for r in SCALARS])
def test_a_mistyped_restored_leaf_is_refused_and_the_live_state_untouched(
    tmp_path: Path, name: str, path: tuple[Any, ...], value: Any, refused: str
):
    mem = _memory(tmp_path, world_size=1)
    mem.save(7, _state(*small_trained_model(0)), {})
    mem.wait()
    obj = json.loads(mem.header_path(0).read_text())
    (entry,) = [e for e in obj["entries"] if tuple(e["path"]) == path]
    entry["value"] = value
    header = Header.model_validate(obj)
    target = _state(*small_trained_model(1))
    before = json.dumps(target["optim"]["param_groups"])
    weights = [t.clone() for t in target["model"].values()]
    with pytest.raises(NodeCopyError, match=refused) as e:
        mem.load(header, target)
    assert "/".join(map(str, path)) in str(e.value)
    assert json.dumps(target["optim"]["param_groups"]) == before
    assert all(torch.equal(a, b) for a, b in zip(weights, target["model"].values(), strict=True))


# -- node memory's directory: this user's alone ------------------------------------------------
def _own(mode: int) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        d.mkdir()
        d.chmod(mode)
        return d

    return make


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="another user's directory: chown")


def _others(d: Path) -> Path:
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    return d


def _link(d: Path) -> Path:
    (d.parent / "elsewhere").mkdir(mode=0o700)
    d.symlink_to(d.parent / "elsewhere")
    return d


def _file(d: Path) -> Path:
    d.write_text("")
    return d


DIRS = [
    ("absent: made 0700", lambda d: d, ""),
    ("ours, 0700", _own(0o700), ""),
    ("ours, 0755 (an older trainer's)", _own(0o755), ""),
    ("group-writable", _own(0o770), "its mode is 0770"),
    ("world-writable", _own(0o777), "its mode is 0777"),
    pytest.param("another user's", _others, f"its owner is uid {OTHER_UID}", marks=needs_root),
    ("a link to a directory of ours", _link, "symbolic link"),
    ("a file", _file, "not a directory"),
]


@pytest.mark.parametrize("name, make, refused", DIRS)
def test_node_memorys_directory_is_refused_unless_this_users_alone(
    tmp_path: Path, name: str, make: Callable[[Path], Path], refused: str
):
    d = make(tmp_path / "nvrx-node-memory")
    if not refused:
        assert private_dir(d) == d
        st = os.lstat(d)
        assert st.st_uid == os.getuid() and not st.st_mode & 0o022
        assert refusal(st, os.getuid()) == ""
        return
    with pytest.raises(NodeMemoryDirError, match=refused) as e:
        private_dir(d)
    assert str(d) in str(e.value) and "remove it" in str(e.value)


@needs_root
def test_a_worker_refuses_node_memory_another_user_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The launcher's directory (``NVRX_NODE_MEMORY``) is checked where a worker takes it, and
    the local backend's predictable base is checked before anything is made inside it."""
    taken = _others(tmp_path / "taken")
    monkeypatch.setenv(node_memory.ENV, str(taken))
    with pytest.raises(NodeMemoryDirError, match="owner"):
        node_copy.from_env(rank=0, world_size=1, fingerprint="f", epoch=None)
    monkeypatch.setattr(node_memory, "base_dir", lambda: taken)
    with pytest.raises(NodeMemoryDirError, match="owner"):
        node_memory.prepare(tmp_path / "run", 1, "inv-aaaa")
    assert list(taken.iterdir()) == []


# -- what a receive that never finished leaves --------------------------------------------------
def test_a_bind_sweeps_what_a_killed_receiver_left_and_nothing_else(shm: Path):
    mem, _ = _saved(shm, 0)
    peer = mem.peer_dir(1)
    peer.mkdir()
    (peer / "gen-0.bin").write_bytes(b"\0" * 4096)  # a cut receive: no header vouches for it
    (peer / ".gen-0.json.k2x_9q0a.tmp").write_text("{")  # a header being written when killed
    (peer / "gen-1.bin").write_bytes(b"\0" * 8)  # a landed copy: kept
    (peer / "gen-1.json").write_text("{}")
    (peer / "notes.txt").write_text("")  # not a name node memory writes: left alone
    mem.bind_peers(object(), None, (1,))
    assert sorted(p.name for p in peer.iterdir()) == ["gen-1.bin", "gen-1.json", "notes.txt"]


def test_a_full_node_memory_is_said_and_leaves_no_file(shm: Path):
    """No anonymous-memory fallback: a copy that node memory has no room for is refused as
    such (the directory, its free bytes, the size), and its half-made file removed."""
    path = shm / "gen-0.bin"
    with pytest.raises(OSError) as e:
        node_dir.allocated_map(path, 1 << 50)  # more than any tmpfs here: ENOSPC at once
    assert not path.exists()
    said = node_dir.no_room(shm, 1 << 50, e.value)
    assert said.startswith(f"node memory is full: {shm} has ") and "bytes free" in said


# -- the ranks' resume messages: typed, bounded JSON -------------------------------------------
HONEST = OfferMessage(offer=TierOffer.of(Offer(node_steps=(6, 7))), node=1)
MESSAGES = [
    ("not JSON", b"\x80\x04\x95 a pickle", "rank 3 sent a OfferMessage that is not one"),
    ("an unknown field", b'{"offer": null, "node": 1, "run": "x"}', "run: Extra inputs"),
    ("a node as text", b'{"offer": null, "node": "1"}', "node: Input should be a valid int"),
    ("a missing field", b'{"offer": null}', "node: Field required"),
    (
        "a step below -1",
        HONEST.model_dump_json().replace('"own_step":-1', '"own_step":-5').encode(),
        "offer.own_step",
    ),
    (
        "three generations",
        HONEST.model_dump_json().replace("[6,7]", "[5,6,7]").encode(),
        "offer.node_steps",
    ),
    (
        "a reason past the cap",
        HONEST.model_dump_json().replace('"node_problem":null', f'"node_problem":"{"x" * 5000}"')
        .encode(),
        "offer.node_problem",
    ),
]  # fmt: skip


@pytest.mark.parametrize("name, blob, refused", MESSAGES, ids=[r[0] for r in MESSAGES])
def test_a_garbled_resume_message_is_refused_naming_the_rank_and_field(name, blob, refused):
    with pytest.raises(CoordinationError, match="rank 3") as e:
        coordination.decode(OfferMessage, blob, rank=3)
    assert refused in str(e.value) and isinstance(e.value.__cause__, ValidationError)


def test_an_honest_message_round_trips_and_long_reasons_are_cut_where_made():
    assert coordination.decode(OfferMessage, HONEST.model_dump_json().encode(), rank=0) == HONEST
    offer = TierOffer.of(Offer(own_problem="y" * 10_000)).offer()
    assert offer.own_problem is not None and len(offer.own_problem) == coordination.REASON_LIMIT


@pytest.mark.parametrize("length", [0, -1, coordination.OFFER_LIMIT + 1, 1 << 40])
def test_an_oversized_resume_message_is_refused_before_its_buffer(length):
    with pytest.raises(CoordinationError, match=f"rank 2 announced a {length}-byte message"):
        coordination._check_length(length, coordination.OFFER_LIMIT, rank=2)


# -- the drill: two real gloo processes, rank 1 the hostile peer -------------------------------
def _drill(rank: int, port: int, root: str, out: str) -> None:
    """Rank 0 is an honest receiver; rank 1 says, in turn: a garbled resume offer, an
    oversized one, a peer copy announcing 100x its size, an honest copy (the stream is still
    in step), a resume transfer announcing 100x, and a copy it is killed in the middle of."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    peer_wire.CHUNK = 256  # the shard travels in several chunks: the kill falls between two
    mem = _memory(Path(root) / f"node-{rank}", rank=rank)
    state = _state(*small_trained_model(rank))
    result: dict[str, Any] = {}
    allocated: list[str] = []  # every node-memory file made, by path (a spy on the real call)
    real = node_dir.allocated_map
    node_dir.allocated_map = lambda path, size: (allocated.append(str(path)), real(path, size))[1]
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(node_copy.__name__).addHandler(handler)

    # 1, 2: resume offers, garbled then oversized.
    for blob in (b'{"offer": null, "node": "x"}', b"{" * (coordination.OFFER_LIMIT + 1)):
        try:
            if rank == 0:
                coordination.gather(HONEST, group, limit=coordination.OFFER_LIMIT)
            else:
                coordination.gather_bytes(blob, group, limit=coordination.OFFER_LIMIT)
        except CoordinationError as e:
            result.setdefault("coordination", []).append(str(e))
    # 3: rank 1's step-5 copy announced at 100x its size.
    mem.save(5, state, {})
    mem.wait()
    if rank == 1:
        header = json.loads(mem.header_path(0).read_text())
        header["size"] *= 100
        big = mmap.mmap(-1, header["size"])
        for w in peer_wire.send(json.dumps(header).encode(), header["size"], big, 0, group,
                                tags=peer_wire.REPLICA_TAGS):  # fmt: skip
            w.wait()
    else:
        made = len(allocated)
        mem.bind_peers(group, None, (1,))
        mem.save(6, state, {})
        mem.wait()
        result["inflated"] = {
            "said": [s for s in said if "rank 1 was dropped" in s],
            "allocated_for_it": [p for p in allocated[made:] if "peer-rank" in p],
            "peer_dir": sorted(p.name for p in mem.peer_dir(1).glob("*")),
        }
    # 4: an honest copy lands: the refused one's bytes were read to their end.
    if rank == 1:
        mem.bind_peers(group, 0, ())
        mem.save(6, state, {})
        mem.wait()
    else:
        mem.save(7, state, {})
        mem.wait()
        result["honest"] = sorted(mem.peer_headers().get(1, {}))
    # 5: a resume transfer of rank 0's own shard, announced at 100x.
    if rank == 1:
        header = json.loads(mem.header_path(1).read_text())
        header.update(rank=0, size=header["size"] * 100)
        big = mmap.mmap(-1, header["size"])
        for w in peer_wire.send(json.dumps(header).encode(), header["size"], big, 0, group,
                                tags=peer_wire.RESUME_TAGS):  # fmt: skip
            w.wait()
    else:
        from trainer.checkpointing.restore_node import recv_shard

        try:
            recv_shard(mem, 1, group, state)
        except NodeCopyError as e:
            result["resume"] = str(e)
    # 6: rank 1 killed mid-transfer: its header and first chunk sent, then it is gone.
    dist.barrier()
    if rank == 1:
        mem.unbind()  # its copy goes by hand below
        mem.save(7, state, {})
        mem.wait()
        header = mem.header_path(0).read_text()
        size = json.loads(header)["size"]
        meta = torch.tensor([len(header), size], dtype=torch.int64)
        data = torch.frombuffer(mem.bin_path(0).read_bytes(), dtype=torch.uint8)
        tags = peer_wire.REPLICA_TAGS
        dist.send(meta, 0, group=group, tag=tags[0])
        dist.send(torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8), 0, group=group,
                  tag=tags[1])  # fmt: skip
        dist.send(data[: peer_wire.CHUNK].clone(), 0, group=group, tag=tags[2])
        os._exit(0)  # the node is lost: no more bytes, the connection closed
    made = len(allocated)
    mem.save(8, state, {})
    mem.wait(timeout=60)
    result["cut"] = {
        "allocated_for_it": [p for p in allocated[made:] if "peer-rank" in p],
        "peer_dir": sorted(p.name for p in mem.peer_dir(1).glob("*")),
        "said": [s for s in said if "peer copy failed" in s][-1:],
    }
    Path(out, "rank0.json").write_text(json.dumps(result))
    os._exit(0)  # its peer is gone: no orderly teardown of the group


def test_a_hostile_peer_is_refused_and_a_cut_transfer_leaves_nothing(shm: Path, tmp_path: Path):
    """Real gloo between two processes, node memory in the real /dev/shm."""
    import torch.multiprocessing as mp

    # Forked: the two ranks start with torch imported (a spawned one imports it again, ~6 s on
    # this machine's shared cores); each leaves with os._exit, never through the parent's code.
    args = (free_port(), str(shm), str(tmp_path))
    mp.start_processes(_drill, args=args, nprocs=2, start_method="fork")
    r = json.loads((tmp_path / "rank0.json").read_text())
    garbled, oversized = r["coordination"]
    assert "rank 1 sent a OfferMessage that is not one: node" in garbled
    assert f"rank 1 announced a {coordination.OFFER_LIMIT + 1}-byte message" in oversized
    # 100x: refused by its size before any file was made for it, nothing left.
    (said,) = r["inflated"]["said"]
    assert "size: " in said and "a shard of rank 1 of this model is" in said, said
    assert r["inflated"]["allocated_for_it"] == [] and r["inflated"]["peer_dir"] == []
    assert r["honest"] == [6]  # the stream stayed in step
    assert "size: it announced" in r["resume"] and "rank 1" in r["resume"]
    # The cut: its file was made (the transfer had begun), and is gone with the transfer.
    assert [Path(p).name for p in r["cut"]["allocated_for_it"]] == ["gen-0.bin"]
    assert r["cut"]["peer_dir"] == ["gen-1.bin", "gen-1.json"], r["cut"]  # step 6's, kept
    assert r["cut"]["said"], r
