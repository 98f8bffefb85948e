from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.data import (
    DataError,
    check_vocab_fits,
    dtype_for_vocab,
    load_manifest,
    verify_dataset,
    write_synthetic_dataset,
)
from trainer.sampler import StepSampler


def test_dataset_is_reproducible(tmp_path: Path):
    a = write_synthetic_dataset(tmp_path / "a", shards=2, tokens_per_shard=1000, seed=7)
    b = write_synthetic_dataset(tmp_path / "b", shards=2, tokens_per_shard=1000, seed=7)
    c = write_synthetic_dataset(tmp_path / "c", shards=2, tokens_per_shard=1000, seed=8)
    assert a.files == b.files != c.files


def test_step_data_independent_of_world_size(dataset: Path):
    sampler = StepSampler(dataset, seq_len=64, global_batch=8, seed=3)
    for step in (1, 2, 500):  # 500 crosses an epoch boundary
        whole = sampler.sample_ids(step, 0, 1)
        halves = sampler.sample_ids(step, 0, 2) + sampler.sample_ids(step, 1, 2)
        quarters = [i for r in range(4) for i in sampler.sample_ids(step, r, 4)]
        assert whole == halves == quarters
    x, y = sampler.batch(1, 0, 2)
    assert x.shape == y.shape == (4, 64)
    assert np.array_equal(x[:, 1:], y[:, :-1])


def test_windows_cross_shard_boundaries(tmp_path: Path):
    write_synthetic_dataset(tmp_path, shards=3, tokens_per_shard=100, seed=1)
    sampler = StepSampler(tmp_path, seq_len=30, global_batch=2, seed=0)
    flat = np.concatenate(
        [np.fromfile(tmp_path / f"shard_{i:05d}.bin", dtype="<u2") for i in range(3)]
    )
    assert np.array_equal(sampler.stream.window(90, 31), flat[90:121])


@pytest.fixture
def copy(dataset: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(dataset, dst)
    return dst


def test_missing_shard_named(copy: Path):
    (copy / "shard_00002.bin").unlink()
    with pytest.raises(DataError, match=r"shard_00002.bin is missing"):
        verify_dataset(copy)


def test_short_shard_named(copy: Path):
    path = copy / "shard_00001.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"shard_00001.bin is short"):
        verify_dataset(copy)


def test_corrupt_shard_named(copy: Path):
    path = copy / "shard_00003.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard_00003.bin is corrupt"):
        verify_dataset(copy)
    verify_dataset(copy, digests=False)  # size-only check cannot see it


def test_a_hydrated_dataset_is_checked_by_manifest_digest_and_sizes(copy: Path):
    """After hydration verified every shard, a worker's start-up reads no shard: it checks that
    the manifest is the one hydration verified, and the sizes."""
    verified = load_manifest(copy).digest()
    path = copy / "shard_00003.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # a flip after hydration: not read again (the accepted trade)
    path.write_bytes(bytes(data))
    verify_dataset(copy, manifest_sha256=verified)
    path.write_bytes(bytes(data[:-10]))  # sizes are still checked
    with pytest.raises(DataError, match=r"shard_00003.bin is short"):
        verify_dataset(copy, manifest_sha256=verified)
    # A manifest other than the verified one: refused, naming the fix.
    manifest = json.loads((copy / "dataset.json").read_text())
    manifest["vocab_size"] -= 1
    (copy / "dataset.json").write_text(json.dumps(manifest, indent=4))
    with pytest.raises(DataError, match=r"changed since hydration verified .* run the pipeline"):
        verify_dataset(copy, manifest_sha256=verified)
    # The digest is of the content, not the file's formatting (S3 object vs hydrated copy).
    manifest["vocab_size"] += 1
    (copy / "dataset.json").write_text(json.dumps(manifest))
    assert load_manifest(copy).digest() == verified


def test_missing_or_malformed_manifest(copy: Path):
    (copy / "dataset.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="malformed"):
        verify_dataset(copy)
    (copy / "dataset.json").unlink()
    with pytest.raises(DataError, match="manifest .* is missing"):
        verify_dataset(copy)


def test_too_small_for_one_batch(tmp_path: Path):
    write_synthetic_dataset(tmp_path, shards=1, tokens_per_shard=100)
    with pytest.raises(DataError, match="too small"):
        StepSampler(tmp_path, seq_len=64, global_batch=8, seed=0)


def test_dtype_for_vocab_and_fits():
    assert dtype_for_vocab(512) == dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == dtype_for_vocab(128256) == "uint32"
    for bad in (0, -3, 2.5, True, "512"):
        with pytest.raises(DataError, match="vocab_size"):
            dtype_for_vocab(bad)  # type: ignore[arg-type]
    check_vocab_fits(65536, "uint16")
    check_vocab_fits(128256, "uint32")
    with pytest.raises(DataError, match=r"^vocab_size: vocab_size 65537 does not fit dtype uint16"):
        check_vocab_fits(65537, "uint16")
    with pytest.raises(DataError, match=r"dtype: 'int32' .* allowed: uint16, uint32"):
        check_vocab_fits(100, "int32")


def test_uint32_dataset_round_trips_through_the_sampler(tmp_path: Path):
    m = write_synthetic_dataset(tmp_path, shards=2, tokens_per_shard=3000, vocab_size=128256)
    assert m.dtype == "uint32" and m.files[0].bytes == 3000 * 4
    flat = np.concatenate(
        [np.fromfile(tmp_path / f"shard_{i:05d}.bin", dtype="<u4") for i in range(2)]
    )
    assert flat.max() > 65535  # ids a uint16 dataset could not hold
    sampler = StepSampler(tmp_path, seq_len=50, global_batch=4, seed=0)
    assert sampler.vocab_size == 128256
    x, y = sampler.batch(1, 0, 1)
    assert x.dtype == y.dtype == np.int64
    for row, i in zip(x, sampler.sample_ids(1, 0, 1), strict=True):
        assert np.array_equal(row, flat[i * 50 : i * 50 + 50])
    assert np.array_equal(sampler.stream.window(2990, 20), flat[2990:3010])  # across shards


def test_explicit_dtype_and_default_digests_unchanged(tmp_path: Path):
    a = write_synthetic_dataset(tmp_path / "a", shards=1, tokens_per_shard=1000)
    b = write_synthetic_dataset(tmp_path / "b", shards=1, tokens_per_shard=1000, dtype="uint16")
    c = write_synthetic_dataset(tmp_path / "c", shards=1, tokens_per_shard=1000, dtype="uint32")
    assert a == b and a.dtype == "uint16"
    assert c.dtype == "uint32" and c.files[0].bytes == 4000
    # Same tokens whatever the width.
    assert np.array_equal(
        np.fromfile(tmp_path / "a" / "shard_00000.bin", dtype="<u2"),
        np.fromfile(tmp_path / "c" / "shard_00000.bin", dtype="<u4"),
    )
    with pytest.raises(DataError, match="vocab_size 70000 does not fit dtype uint16"):
        write_synthetic_dataset(tmp_path / "d", vocab_size=70000, dtype="uint16")


def _rewrite_manifest(path: Path, **changes) -> None:
    m = json.loads((path / "dataset.json").read_text())
    m.update(changes)
    (path / "dataset.json").write_text(json.dumps(m))


def test_uint16_manifest_with_a_llama3_vocab_is_refused(copy: Path):
    _rewrite_manifest(copy, vocab_size=128256)
    with pytest.raises(DataError) as e:
        load_manifest(copy)
    msg = str(e.value)
    for part in ("vocab_size 128256", "dtype uint16", "65536", "write the shards as uint32"):
        assert part in msg, msg
    with pytest.raises(DataError, match="vocab_size 128256"):
        StepSampler(copy, seq_len=64, global_batch=8, seed=0)


@pytest.mark.parametrize("dtype", ["int16", "uint8", "float32", None, "<u2"])
def test_unknown_dtype_names_the_field_and_allowed_values(copy: Path, dtype):
    _rewrite_manifest(copy, dtype=dtype)
    with pytest.raises(DataError, match=r"dtype: .* allowed: uint16, uint32"):
        verify_dataset(copy)


@pytest.mark.parametrize("vocab", [0, -1, "512", 512.0, None])
def test_vocab_size_must_be_a_positive_int(copy: Path, vocab):
    _rewrite_manifest(copy, vocab_size=vocab)
    with pytest.raises(DataError, match="vocab_size must be a positive integer"):
        load_manifest(copy)


def test_shard_bytes_must_be_tokens_times_itemsize(copy: Path):
    # A uint16 dataset relabelled uint32: sizes still match the files, token counts do not.
    _rewrite_manifest(copy, dtype="uint32")
    with pytest.raises(DataError, match=r"\(shard_00000.bin\): 131072 bytes, but 65536 tokens"):
        verify_dataset(copy, digests=False)


# Names in the manifest are joined onto the dataset directory: one plain component each.
@pytest.mark.parametrize(
    "name",
    ["/etc/passwd", "../shard.bin", "a/b", "a\\b", "shard\x00.bin", "shard.bin\n", ".hidden", ""],
)
def test_unsafe_shard_names_are_refused_naming_the_field(copy: Path, name: str):
    path = copy / "dataset.json"
    manifest = json.loads(path.read_text())
    manifest["files"][2]["name"] = name
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError) as err:
        load_manifest(copy)
    assert f"dataset manifest {path}: files[2].name: {name!r}" in str(err.value)


def test_duplicate_shard_names_are_refused(copy: Path):
    path = copy / "dataset.json"
    manifest = json.loads(path.read_text())
    manifest["files"][1]["name"] = manifest["files"][0]["name"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"files\[1\].name: 'shard_00000.bin' .* listed twice"):
        load_manifest(copy)


def test_the_preload_reads_every_byte_with_progress_and_stops_at_the_manifest(
    copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """The hydration Job's command: every shard read (on FSx: loaded from S3) and digested by
    several readers, progress said, the manifest pinned to the one the flow read; a shard is
    never read past its manifest size, and an oversized manifest is refused unread."""
    from trainer import data
    from trainer.hashing import sha256_capped

    m = load_manifest(copy)
    verified = m.digest()
    seen: list[data.ReadProgress] = []
    verify_dataset(copy, digests=True, manifest_sha256=verified, readers=3, progress=seen.append)
    total = sum(f.bytes for f in m.files)
    assert (seen[-1].files, seen[-1].bytes) == (len(m.files), total)
    assert seen[-1].total_bytes == total and "files" in seen[-1].line()
    assert data.main(["--verify", "--out", str(copy), "--manifest-sha256", verified]) == 0
    assert f"read {len(m.files)}/{len(m.files)} files" in capsys.readouterr().out
    # another manifest than the flow read: the Job fails, naming it
    assert data.main(["--verify", "--out", str(copy), "--manifest-sha256", "0" * 64]) == 2
    assert "changed since hydration verified" in capsys.readouterr().err
    # a corrupt shard among several readers: named
    path = copy / "shard_00002.bin"
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="shard_00002.bin is corrupt"):
        verify_dataset(copy, readers=4)
    # the capped read itself: one byte past the expected size is refused, unread beyond it
    with pytest.raises(ValueError, match="more than the 10 bytes"):
        sha256_capped(path, 10)
    # a manifest over the cap: refused before it is parsed
    monkeypatch.setattr(data, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(DataError, match="over the 100 bytes a manifest may hold"):
        load_manifest(copy)
