"""The commit protocol and the reader's trust rules, on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import manifest as m
from trainer.faults import flip_bytes

FP = "abc123"


def _fake_checkpoint(run_root: Path, step: int, *, keep_last: int = 3) -> Path:
    partial = m.partial_path(run_root, step)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 10))
    (partial / "__1_0.distcp").write_bytes(b"x" * (1000 + step))
    (partial / ".metadata").write_bytes(b"meta" * step)
    m.write_digest_sidecar(partial, 0, [partial / "__0_0.distcp"])
    m.write_digest_sidecar(partial, 1, [partial / "__1_0.distcp"])
    return m.commit(run_root, step, world_size=2, info={"config_hash": FP}, keep_last=keep_last)


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


def test_partial_is_never_trusted(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    m.partial_path(tmp_path, 10).mkdir()
    (m.partial_path(tmp_path, 10) / "__0_0.distcp").write_bytes(b"half")
    choice = m.choose_resume(tmp_path, fingerprint=FP)
    assert choice.step == 5 and choice.rejected == []
    assert m.remove_partials(tmp_path) == ["step_000000010.partial"]


def test_corrupt_newest_falls_back_with_reason(tmp_path: Path):
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 10)
    flip_bytes(newest / "__1_0.distcp")
    choice = m.choose_resume(tmp_path, fingerprint=FP)
    assert choice.step == 5
    assert len(choice.rejected) == 1 and choice.rejected[0][0] == 10
    assert "__1_0.distcp does not match its sha256" in choice.rejected[0][1]


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
