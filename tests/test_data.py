from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.data import DataError, StepSampler, verify_dataset, write_synthetic_dataset


def test_dataset_is_reproducible(tmp_path: Path):
    a = write_synthetic_dataset(tmp_path / "a", shards=2, tokens_per_shard=1000, seed=7)
    b = write_synthetic_dataset(tmp_path / "b", shards=2, tokens_per_shard=1000, seed=7)
    c = write_synthetic_dataset(tmp_path / "c", shards=2, tokens_per_shard=1000, seed=8)
    assert a["files"] == b["files"] != c["files"]


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
