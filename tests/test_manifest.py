"""The commit protocol and the reader's trust rules, on real files."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import read_events
from trainer import checkpointing as m
from trainer.checkpointing.config import DurableConfig
from trainer.config import ConfigError
from trainer.event_types import Resume, Step
from trainer.events import EventLog
from trainer.faults import flip_bytes

FP = "abc123"


def _metadata(step: int) -> bytes:
    """A real (empty) DCP metadata pickle, different per step: readers unpickle it through the
    restricted reader, so it must be the real thing."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    return pickle.dumps(Metadata(state_dict_metadata={f"s{step}": BytesStorageMetadata()}))


def _write_partial(run_root: Path, step: int, *, fill: bytes = b"x") -> Path:
    partial = m.partial_path(run_root, step)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 10))
    (partial / "__1_0.distcp").write_bytes(fill * (1000 + step))
    (partial / ".metadata").write_bytes(_metadata(step))
    m.write_digest_sidecar(partial, 0, [partial / "__0_0.distcp"])
    m.write_digest_sidecar(partial, 1, [partial / "__1_0.distcp"])
    return partial


def _fake_checkpoint(
    run_root: Path, step: int, *, keep_last: int | None = 3, fill: bytes = b"x"
) -> Path:
    _write_partial(run_root, step, fill=fill)
    return m.commit(run_root, step, world_size=2, info={"config_hash": FP}, keep_last=keep_last)


def _listing(run_root: Path) -> list[str]:
    return sorted(p.name for p in m.checkpoints_dir(run_root).iterdir())


def test_commit_layout(tmp_path: Path):
    path = _fake_checkpoint(tmp_path, 5)
    assert path == tmp_path / "checkpoints" / "step_000000005"
    assert not m.partial_path(tmp_path, 5).exists()
    assert m.read_latest(tmp_path) == 5
    man = json.loads((path / "manifest.json").read_text())
    assert man["step"] == 5 and man["world_size"] == 2 and man["config_hash"] == FP
    assert [f["name"] for f in man["files"]] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(path.glob(".digests-*"))
    assert m.verify_checkpoint(path).ok


def test_keeps_last_k(tmp_path: Path):
    for step in (5, 10, 15, 20):
        _fake_checkpoint(tmp_path, step, keep_last=2)
    assert m.committed_steps(tmp_path) == [15, 20]
    assert _listing(tmp_path) == ["LATEST", "step_000000015", "step_000000020"]


def test_prune_waits_for_the_newest_to_verify(tmp_path: Path):
    for step in (5, 10):
        _fake_checkpoint(tmp_path, step, keep_last=None)
    newest = _fake_checkpoint(tmp_path, 15, keep_last=None)
    flip_bytes(newest / "__1_0.distcp")  # damaged on its way to disk
    pruned = m.prune(tmp_path, 2)
    assert pruned.removed == [] and "__1_0.distcp does not match its xxh3_128" in pruned.refused
    assert m.committed_steps(tmp_path) == [5, 10, 15]
    # Its fallbacks survive: resume skips 15 and loads 10.
    assert m.choose_resume(tmp_path, fingerprint=FP).step == 10
    (newest / ".metadata").write_bytes(b"\0")  # the same holds at size-only depth
    assert m.prune(tmp_path, 2).refused


def test_keep_last_1_is_refused():
    with pytest.raises(ConfigError) as err:
        DurableConfig(keep_last=1)
    assert err.value.field == "checkpoint.durable.keep_last" and "2 or more" in str(err.value)


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no ``except Exception`` catches it."""


def _kill_at(monkeypatch: pytest.MonkeyPatch, n: int, seen: list[str]) -> None:
    """Make the n-th rename/replace/rmtree of the manifest module die before it happens."""
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}

    def wrap(name: str):
        def op(*args, **kwargs):
            # a temporary name's random part left out: ".manifest.json.tmp"
            seen.append(f"{name} {re.sub(r'[.][a-z0-9_]{8}[.]tmp$', '.tmp', Path(args[0]).name)}")
            if len(seen) == n:
                raise Killed(seen[-1])
            return real[name](*args, **kwargs)

        return op

    monkeypatch.setattr(os, "rename", wrap("rename"))
    monkeypatch.setattr(os, "replace", wrap("replace"))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree"))


# Every rename/removal of a commit that supersedes a committed step 10, in order.
SUPERSEDE_OPS = [
    "replace .manifest.json.tmp",  # the manifest, into the partial
    "rename step_000000010",  # the old copy aside, to .superseded
    "rename step_000000010.partial",  # the new copy in
    "replace .LATEST.tmp",
    "rename step_000000010.superseded",  # the old copy to .deleting...
    "rmtree step_000000010.deleting",  # ...then removed
]


def _commit_10_again(root: Path) -> None:
    m.commit(root, 10, world_size=2, info={"config_hash": FP})


def test_supersede_ops_are_all_covered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_checkpoint(tmp_path, 5)
    _fake_checkpoint(tmp_path, 10)
    _write_partial(tmp_path, 10, fill=b"y")
    seen: list[str] = []
    _kill_at(monkeypatch, 0, seen)
    _commit_10_again(tmp_path)
    assert seen == SUPERSEDE_OPS


@pytest.mark.parametrize("kill_at", range(1, len(SUPERSEDE_OPS) + 1), ids=SUPERSEDE_OPS)
def test_superseding_a_committed_step_never_loses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: int
):
    # An earlier life committed step 10 (resume skipped it, say); this life commits it again.
    _fake_checkpoint(tmp_path, 5)
    _fake_checkpoint(tmp_path, 10)
    _write_partial(tmp_path, 10, fill=b"y")
    seen: list[str] = []
    _kill_at(monkeypatch, kill_at, seen)
    with pytest.raises(Killed):
        _commit_10_again(tmp_path)
    monkeypatch.undo()
    # At the instant of the kill a reader still finds a valid step 10 (old or new copy)...
    assert m.choose_resume(tmp_path, fingerprint=FP).step == 10, seen
    # ...and after recovery it is committed under its own name, nothing else left over.
    actions = m.recover(tmp_path, fingerprint=FP)
    assert _listing(tmp_path) == ["LATEST", "step_000000005", "step_000000010"], (seen, actions)
    assert m.read_latest(tmp_path) == 10
    newest = m.committed_path(tmp_path, 10)
    assert m.verify_checkpoint(newest).ok
    # The new copy wins once its manifest is written (op 1 is that manifest's rename).
    new_copy = (newest / "__1_0.distcp").read_bytes()[:1] == b"y"
    assert new_copy == (kill_at > 1), (seen, actions)


def test_complete_partial_is_rolled_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_checkpoint(tmp_path, 5)
    _write_partial(tmp_path, 10)
    seen: list[str] = []
    _kill_at(monkeypatch, 2, seen)  # after its manifest's rename, at the partial's rename
    with pytest.raises(Killed):
        m.commit(tmp_path, 10, world_size=2, info={"config_hash": FP})
    monkeypatch.undo()
    assert seen == ["replace .manifest.json.tmp", "rename step_000000010.partial"]
    [action] = m.recover(tmp_path, fingerprint=FP)
    assert (action.action, action.step) == ("rolled-forward", 10)
    assert m.committed_steps(tmp_path) == [5, 10] and m.read_latest(tmp_path) == 10
    assert not list(m.committed_path(tmp_path, 10).glob(".digests-*"))
    assert m.choose_resume(tmp_path, fingerprint=FP).step == 10


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("no-manifest", "no manifest.json: the save never reached its commit"),
        ("truncated", "__0_0.distcp is 5 bytes"),
        ("other-config", "config hash"),
    ],
)
def test_incomplete_partial_is_discarded(tmp_path: Path, damage: str, reason: str):
    _fake_checkpoint(tmp_path, 5)
    partial = _write_partial(tmp_path, 10)
    if damage != "no-manifest":
        fp = "other" if damage == "other-config" else FP
        files = m.collect_file_entries(partial, 2)
        doc = {"format": m.FORMAT, "digest": m.DIGEST, "step": 10, "world_size": 2}
        doc.update(config_hash=fp, files=[e.record(m.DIGEST) for e in files])
        (partial / "manifest.json").write_text(json.dumps(doc))
    if damage == "truncated":
        (partial / "__0_0.distcp").write_bytes(b"short")
    [action] = m.recover(tmp_path, fingerprint=FP)
    assert (action.action, action.step) == ("removed-partial", 10)
    assert reason in action.reason
    assert _listing(tmp_path) == ["LATEST", "step_000000005"]


def test_superseded_copy_is_restored_when_its_replacement_never_came(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    old = _fake_checkpoint(tmp_path, 10)
    os.rename(old, m.superseded_path(tmp_path, 10))  # killed right after moving it aside
    m.partial_path(tmp_path, 10).mkdir()  # ... with its replacement still half-written
    assert m.choose_resume(tmp_path, fingerprint=FP).step == 10
    actions = {a.action for a in m.recover(tmp_path, fingerprint=FP)}
    assert actions == {"removed-partial", "restored-superseded"}
    assert m.committed_steps(tmp_path) == [5, 10] and m.verify_checkpoint(old).ok


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_kill_during_prune_leaves_no_half_deleted_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: int
):
    for step in (5, 10, 15):
        _fake_checkpoint(tmp_path, step, keep_last=None)
    seen: list[str] = []
    _kill_at(monkeypatch, kill_at, seen)
    with pytest.raises(Killed):
        m.prune(tmp_path, 1)  # removes 5 then 10
    monkeypatch.undo()
    for step in m.committed_steps(tmp_path):  # whatever still looks committed is whole
        assert m.verify_checkpoint(m.committed_path(tmp_path, step)).ok, seen
    m.recover(tmp_path, fingerprint=FP)
    assert not [n for n in _listing(tmp_path) if n.endswith(".deleting")]
    assert m.choose_resume(tmp_path, fingerprint=FP).step == 15


def test_partial_is_never_trusted(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    m.partial_path(tmp_path, 10).mkdir()
    (m.partial_path(tmp_path, 10) / "__0_0.distcp").write_bytes(b"half")
    choice = m.choose_resume(tmp_path, fingerprint=FP)
    assert choice.step == 5 and choice.rejected == []
    assert [a.dir for a in m.recover(tmp_path, fingerprint=FP)] == ["step_000000010.partial"]


def test_corrupt_newest_falls_back_with_reason(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 10)
    flip_bytes(newest / "__1_0.distcp")
    choice = m.choose_resume(tmp_path, fingerprint=FP)
    assert choice.step == 5
    assert len(choice.rejected) == 1 and choice.rejected[0][0] == 10
    assert "__1_0.distcp does not match its xxh3_128" in choice.rejected[0][1]


def test_digest_shares_cover_every_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A resume digests a checkpoint in parallel, one share per rank: together the shares read
    every file exactly once, so a flipped byte anywhere is found by exactly one rank; the
    other checks (sizes, the .metadata digest, the config hash) come first, without digests."""
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 10)
    ok, rejected, found = m.resume_candidates(tmp_path, fingerprint=FP)
    assert [s for s, _, _ in ok] == [10, 5] and rejected == [] and found == 2
    manifest = ok[0][2]
    from trainer.checkpointing import manifest as manifest_module

    real = manifest_module.file_digest
    for world in (1, 2, 3):
        seen: list[str] = []

        def counting(path: Path, digest: str, *, limit: int, _seen: list[str] = seen) -> str:
            _seen.append(Path(path).name)
            return real(path, digest, limit=limit)

        monkeypatch.setattr(manifest_module, "file_digest", counting)
        assert all(
            m.digest_share(newest, manifest, index=i, count=world) is None for i in range(world)
        )
        assert sorted(seen) == sorted(e.name for e in manifest.files), world
    monkeypatch.setattr(manifest_module, "file_digest", real)
    flip_bytes(newest / "__1_0.distcp")
    reasons = [m.digest_share(newest, manifest, index=i, count=2) for i in range(2)]
    assert [r is None for r in reasons].count(False) == 1
    assert "__1_0.distcp does not match its xxh3_128" in next(r for r in reasons if r)


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_other_damage_detected(tmp_path: Path, damage: str):
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 10)
    if damage == "truncate":
        (newest / "__0_0.distcp").write_bytes(b"short")
    elif damage == "delete":
        (newest / ".metadata").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    choice = m.choose_resume(tmp_path, fingerprint=FP)
    assert choice.step == 5 and choice.rejected[0][0] == 10


def test_metadata_digest_checked_even_without_full_verification(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 10)
    flip_bytes(newest / ".metadata")  # same size: only its digest tells (it is a pickle)
    flip_bytes(m.committed_path(tmp_path, 5) / "__0_0.distcp")  # not looked at without digests
    choice = m.choose_resume(tmp_path, fingerprint=FP, verify_digests=False)
    assert choice.step == 5 and ".metadata does not match its xxh3_128" in choice.rejected[0][1]


@pytest.mark.parametrize(
    "name",
    ["../escape", "a/b", "/abs", "..", ".", ".hidden", "x\0y", "x\n", "", 7, None],
)
def test_unsafe_file_names_invalidate_the_checkpoint(tmp_path: Path, name: object):
    path = _fake_checkpoint(tmp_path, 5)
    doc = json.loads((path / "manifest.json").read_text())
    doc["files"].append({"name": name, "bytes": 0, m.DIGEST: "0" * 32})
    (path / "manifest.json").write_text(json.dumps(doc))
    verdict = m.verify_checkpoint(path)
    assert not verdict.ok and "not a single safe path component" in verdict.reason


def test_manifest_of_another_step_is_rejected(tmp_path: Path):
    path = _fake_checkpoint(tmp_path, 5)
    os.rename(path, m.committed_path(tmp_path, 6))
    assert "holds a manifest of step 5" in m.verify_checkpoint(m.committed_path(tmp_path, 6)).reason
    assert m.committed_steps(tmp_path) == [6]
    (m.checkpoints_dir(tmp_path) / "step_000000007\n").mkdir()  # fullmatch: no trailing newline
    assert m.committed_steps(tmp_path) == [6]


def test_other_config_is_not_resumed(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    with pytest.raises(m.NoValidCheckpoint, match="config hash"):
        m.choose_resume(tmp_path, fingerprint="different")


def test_none_valid_refuses_to_start_over(tmp_path: Path):
    for step in (5, 10):
        flip_bytes(_fake_checkpoint(tmp_path, step) / "__0_0.distcp")
    with pytest.raises(m.NoValidCheckpoint, match="none is valid.*Refusing to start from step 0"):
        m.choose_resume(tmp_path, fingerprint=FP)


def test_no_checkpoints_means_fresh(tmp_path: Path):
    assert m.choose_resume(tmp_path, fingerprint=FP).step is None


def test_torn_last_event_line(tmp_path: Path):
    log = EventLog(tmp_path)
    log.emit(Step(step=1))
    with open(log.path, "ab") as f:
        f.write(b'{"kind": "checkpoint", "st')  # the writer died mid-write
    assert [e["kind"] for e in read_events(tmp_path)] == ["step"]
    log.emit(Resume(action="loaded"))  # must not be glued onto the fragment
    assert [e["kind"] for e in read_events(tmp_path)] == ["step", "resume"]
    assert log.path.read_bytes().endswith(b"\n") and log.path.read_text().count("\n") == 3
    with open(log.path, "ab") as f:
        f.write(b'\xe2\x82{"t": 1')  # torn inside a multi-byte character
    assert [e["kind"] for e in read_events(tmp_path)] == ["step", "resume"]
