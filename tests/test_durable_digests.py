"""The durable checkpoint's digests: xxh3-128 taken as the writer streams the bytes, the manifest
formats (v2 names its digest; v1, sha256, still read), and what a reader refuses."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.helpers import as_pre_v2_checkpoint
from trainer import checkpointing as m
from trainer.checkpointing import manifest as manifest_module
from trainer.checkpointing import shard_digest
from trainer.faults import flip_bytes
from trainer.hashing import SHA256, XXH3_128, file_digest, new_hasher

FP = "abc123"


def _metadata(step: int) -> bytes:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    return pickle.dumps(Metadata(state_dict_metadata={f"s{step}": BytesStorageMetadata()}))


def _checkpoint(run_root: Path, step: int) -> Path:
    """A committed checkpoint of two shards, through the real sidecars and commit."""
    partial = m.partial_path(run_root, step)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(os.urandom(3000 + step))
    (partial / "__1_0.distcp").write_bytes(os.urandom(2000))
    (partial / ".metadata").write_bytes(_metadata(step))
    for rank in (0, 1):
        m.write_digest_sidecar(partial, rank, [partial / f"__{rank}_0.distcp"])
    return m.commit(run_root, step, world_size=2, info={"config_hash": FP}, keep_last=None)


# -- digests ----------------------------------------------------------------------------------
def test_streamed_xxh3_is_the_digest_of_the_whole(tmp_path: Path):
    data = os.urandom(3 << 20) + b"tail"
    h = new_hasher(XXH3_128)
    for start in range(0, len(data), 777_777):  # uneven pieces, as writes come
        h.update(memoryview(data)[start : start + 777_777])
    assert h.hexdigest() == xxhash.xxh3_128_hexdigest(data)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert file_digest(path, XXH3_128) == h.hexdigest()
    assert file_digest(path, SHA256) == hashlib.sha256(data).hexdigest()
    assert file_digest(path, XXH3_128, limit=len(data)) == h.hexdigest()
    with pytest.raises(ValueError, match="more than the 100 bytes"):
        file_digest(path, XXH3_128, limit=100)  # a file larger than its manifest says
    with pytest.raises(ValueError, match="unknown digest 'md5'"):
        new_hasher("md5")


# -- the verdicts, as a table -----------------------------------------------------------------
def _edit(change: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        path = ckpt / m.MANIFEST
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))

    return damage


def _then(*steps: Callable[[Path], object]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        for step in steps:
            step(ckpt)

    return damage


def _flip(ckpt: Path) -> None:
    flip_bytes(ckpt / "__0_0.distcp")


def _truncate(ckpt: Path) -> None:
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])


def _rename_digest(doc: dict[str, Any]) -> None:
    entry = doc["files"][0]
    entry[SHA256] = entry.pop(XXH3_128) * 2


MANIFEST_JSON = "manifest.json: "
# case: (what is done to the newest checkpoint, does it verify, what the reason says: the file
# and the field)
CASES: dict[str, tuple[Callable[[Path], object], bool, str]] = {
    "v2 xxh3 (as committed)": (lambda c: None, True, ""),
    "v1 sha256 (written before v2)": (as_pre_v2_checkpoint, True, ""),
    "v1 sha256, no digest field": (
        _then(as_pre_v2_checkpoint, _edit(lambda d: d.pop("digest"))),
        True,
        "",
    ),
    "v2 naming sha256": (
        _then(as_pre_v2_checkpoint, _edit(lambda d: d.update(format=m.FORMAT))),
        True,
        "",
    ),
    "flipped byte, v2": (_flip, False, "__0_0.distcp does not match its xxh3_128 in the manifest"),
    "flipped byte, v1": (
        _then(as_pre_v2_checkpoint, _flip),
        False,
        "__0_0.distcp does not match its sha256 in the manifest",
    ),
    "truncated file": (_truncate, False, "__0_0.distcp is "),
    "unknown algorithm": (
        _edit(lambda d: d.update(digest="md5")),
        False,
        MANIFEST_JSON + "field 'digest' is 'md5', not a digest this reader knows "
        "(sha256, xxh3_128)",
    ),
    "no algorithm in v2": (
        _edit(lambda d: d.pop("digest")),
        False,
        MANIFEST_JSON + "field 'digest' is None",
    ),
    "v1 naming xxh3": (
        _edit(lambda d: d.update(format=m.FORMAT_V1)),
        False,
        MANIFEST_JSON + "field 'digest' is 'xxh3_128', but format nvrx-ckpt-v1 digests files "
        "with sha256",
    ),
    "malformed digest": (
        _edit(lambda d: d["files"][0].update({XXH3_128: "XYZ" * 11})),
        False,
        MANIFEST_JSON + "files[0] gives '.metadata' a malformed xxh3_128 (field 'xxh3_128'): "
        "'XYZXYZ",
    ),
    "digest under another name": (
        _edit(_rename_digest),
        False,
        MANIFEST_JSON + "files[0] gives '.metadata' a malformed xxh3_128 (field 'xxh3_128'): None",
    ),
    "unknown format": (
        _edit(lambda d: d.update(format="nvrx-ckpt-v9")),
        False,
        MANIFEST_JSON + "field 'format' is 'nvrx-ckpt-v9'",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verdicts(tmp_path: Path, case: str):
    _checkpoint(tmp_path, 5)
    newest = _checkpoint(tmp_path, 10)
    damage, ok, says = CASES[case]
    damage(newest)
    verdict = m.verify_checkpoint(newest)
    assert verdict.ok == ok and says in verdict.reason, verdict.reason
    # A resume reads the same: the newest if it verifies, else the one before, saying why.
    choice = m.choose_resume(tmp_path, fingerprint=FP)
    assert choice.step == (10 if ok else 5)
    assert [why for _, why in choice.rejected] == ([] if ok else [verdict.reason])
    if ok:  # the digest shares a resume's ranks take agree
        assert all(
            m.digest_share(newest, verdict.manifest, index=i, count=2) is None for i in range(2)
        )


def test_a_commit_writes_v2_with_xxh3(tmp_path: Path):
    ckpt = _checkpoint(tmp_path, 5)
    man = json.loads((ckpt / m.MANIFEST).read_text())
    assert (man["format"], man["digest"]) == ("nvrx-ckpt-v2", "xxh3_128")
    for e in man["files"]:
        assert set(e) == {"name", "bytes", "xxh3_128"}
        assert e["xxh3_128"] == xxhash.xxh3_128_hexdigest((ckpt / e["name"]).read_bytes())


def test_the_manifest_read_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ckpt = _checkpoint(tmp_path, 5)
    size = (ckpt / m.MANIFEST).stat().st_size
    monkeypatch.setattr(manifest_module, "MANIFEST_MAX_BYTES", size - 1)
    verdict = m.verify_checkpoint(ckpt)
    assert not verdict.ok and f"{ckpt / m.MANIFEST}: {size} bytes, more than the" in verdict.reason
    monkeypatch.undo()
    (ckpt / m.MANIFEST).unlink()
    os.mkfifo(ckpt / m.MANIFEST)  # an open for reading would wait for a writer forever
    verdict = m.verify_checkpoint(ckpt)
    assert not verdict.ok and "not a regular file" in verdict.reason


def test_a_file_grown_past_its_manifest_is_not_read_on(tmp_path: Path):
    ckpt = _checkpoint(tmp_path, 5)
    man = m.read_manifest(ckpt)
    entry = next(e for e in man.files if e.name == "__0_0.distcp")
    with open(ckpt / "__0_0.distcp", "ab") as f:
        f.write(b"more")  # after the size check, say
    why = manifest_module.mismatch(ckpt / "__0_0.distcp", entry, XXH3_128)
    assert (
        why == f"{ckpt / '__0_0.distcp'} holds more than the {entry.bytes} bytes its manifest gives"
    )


def test_the_export_manifest_is_v1_sha256(tmp_path: Path):
    ckpt = _checkpoint(tmp_path, 5)
    man = m.read_manifest(ckpt)
    shas = {e.name: file_digest(ckpt / e.name, SHA256) for e in man.files}
    out = m.as_sha256(man, shas)
    assert (out["format"], out["digest"]) == ("nvrx-ckpt-v1", "sha256")
    assert [set(e) for e in out["files"]] == [{"name", "bytes", "sha256"}] * 3
    (ckpt / m.MANIFEST).write_text(json.dumps(out))
    assert m.verify_checkpoint(ckpt).ok  # a pulled export reads as any checkpoint


# -- the taps ---------------------------------------------------------------------------------
class _Plain:
    """torch's stream transforms without extensions: the item goes to the file as it is."""

    def transform_save_stream(self, write_item: Any, raw: Any) -> tuple[Any, list[str]]:
        return raw, []


def _write_items(path: Path, items: list[bytes], transforms: Any, *, seek: bool = False) -> None:
    with open(path, "wb") as raw:
        for i, item in enumerate(items):
            stream, _ = transforms.transform_save_stream(None, raw)
            stream.write(memoryview(item))
            if seek and i == 1:
                stream.seek(0)
                stream.write(b"!")
                stream.seek(0, os.SEEK_END)
            stream.flush()  # torch closes what an item went to: the flush reaches the tap


def test_a_tap_digests_what_reaches_the_file(tmp_path: Path):
    items = [os.urandom(n) for n in (10, 1 << 20, 7, 3 << 20)]
    a, b, c, other = (tmp_path / n for n in ("a", "b", "c", "other"))
    transforms = pickle.loads(pickle.dumps(shard_digest.DigestTransforms(_Plain())))
    with shard_digest.capture([a, b, c]) as cap:
        _write_items(a, items, transforms)
        _write_items(b, items, transforms, seek=True)  # overwritten in place: not the stream
        with open(c, "wb") as raw:
            stream, _ = transforms.transform_save_stream(None, raw)
            stream.write(b"abc")
            stream.flush()
            stream.seek(0)  # after its last flush: what was published must not stand
            raw.write(b"x")
        _write_items(other, items, transforms)  # not one of this save's files: untouched
        streamed = cap.streamed()
    assert streamed == {str(a): (a.stat().st_size, file_digest(a, XXH3_128))}
    assert file_digest(other, XXH3_128) == xxhash.xxh3_128_hexdigest(b"".join(items))


def _child_writes(path: Path, items: list[bytes]) -> None:
    _write_items(path, items, shard_digest.DigestTransforms(_Plain()))


def test_a_forked_writer_publishes_to_the_parent(tmp_path: Path):
    """NVRx 0.4.1 writes each file in a child it forks: what the child streams comes back."""
    path, items = tmp_path / "shard", [os.urandom(5000), os.urandom(70000)]
    with shard_digest.capture([path]) as cap:
        child = multiprocessing.get_context("fork").Process(
            target=_child_writes, args=(path, items)
        )
        child.start()
        child.join(30)
        assert child.exitcode == 0
        streamed = cap.streamed()
    assert streamed == {str(path): (75000, xxhash.xxh3_128_hexdigest(b"".join(items)))}


def test_a_file_no_tap_saw_whole_is_read_back_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(os.urandom(4096))
    monkey = {str(shard): (4000, "0" * 32)}  # a stream that missed bytes
    manifest_module._read_back_logged = False
    with caplog.at_level("WARNING"):
        m.write_digest_sidecar(tmp_path, 0, [shard], streamed=monkey)
    [entry] = json.loads((tmp_path / ".digests-rank0.json").read_text())
    assert entry == {"name": shard.name, "bytes": 4096, XXH3_128: file_digest(shard, XXH3_128)}
    assert "4000 bytes streamed of 4096 as it was written; hashing it once after writing" in (
        caplog.text
    )


def test_install_says_when_there_is_no_seam(caplog: pytest.LogCaptureFixture):
    class Writer:
        pass

    shard_digest._said_no_seam = False
    with caplog.at_level("WARNING"):
        assert not shard_digest.install(Writer())
    assert "hashed once after writing instead" in caplog.text
    with_seam = Writer()
    with_seam.transforms = _Plain()  # type: ignore[attr-defined]
    assert shard_digest.install(with_seam)
    assert isinstance(with_seam.transforms, shard_digest.DigestTransforms)  # type: ignore[attr-defined]
