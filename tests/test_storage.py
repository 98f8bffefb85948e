"""S3 pieces against a real SeaweedFS server over HTTP."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tasks.backends.local_nodes import free_port
from tasks.errors import HydrationError, StorageError
from tasks.hydrate import hydrate_dataset, upload_dataset
from tasks.storage.local_keys import FILES, keys_of
from tasks.storage.local_s3 import endpoint_is_up, local_s3
from tasks.storage.s3 import S3Settings, boto3_client, check_bucket, s3fs_filesystem
from tests.helpers import free_s3_port
from trainer.data import verify_dataset, write_synthetic_dataset


@pytest.fixture(scope="module")
def seeded(s3_settings: S3Settings, tmp_path_factory) -> tuple[S3Settings, str]:
    client = boto3_client(s3_settings)
    bucket = "hydrate-test"
    client.create_bucket(Bucket=bucket)
    local = tmp_path_factory.mktemp("src")
    write_synthetic_dataset(local, shards=3, tokens_per_shard=5000, seed=4)
    upload_dataset(client, local, bucket, "ds/v1")
    return s3_settings, bucket


def test_hydrate_is_verified_and_idempotent(seeded, tmp_path: Path):
    settings, bucket = seeded
    fs = s3fs_filesystem(settings)
    seen: list[str] = []
    first = hydrate_dataset(
        fs, bucket, "ds/v1", tmp_path / "fsx", progress=lambda d, t, n: seen.append(n)
    )
    assert (first.files, first.downloaded, first.skipped) == (3, 3, 0)
    assert seen == ["shard_00000.bin", "shard_00001.bin", "shard_00002.bin"]
    verify_dataset(tmp_path / "fsx")
    second = hydrate_dataset(fs, bucket, "ds/v1", tmp_path / "fsx")
    assert (second.downloaded, second.skipped, second.bytes_downloaded) == (0, 3, 0)
    # A damaged local copy is fetched again, nothing else.
    (tmp_path / "fsx" / "shard_00001.bin").write_bytes(b"junk")
    third = hydrate_dataset(fs, bucket, "ds/v1", tmp_path / "fsx")
    assert (third.downloaded, third.skipped) == (1, 2)


def test_hydrate_reads_untrusted_objects_only_as_far_as_the_manifest_says(
    seeded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An object far larger than its manifest entry is read one byte past it and refused (not
    downloaded whole: it could fill the shared filesystem); a manifest over the cap is refused
    before it is parsed; nothing is left in the destination either way."""
    import tasks.hydrate as hydrate
    from trainer import data

    settings, bucket = seeded
    client = boto3_client(settings)
    body = json.loads(client.get_object(Bucket=bucket, Key="ds/v1/dataset.json")["Body"].read())
    client.put_object(Bucket=bucket, Key="big/dataset.json", Body=json.dumps(body).encode())
    for e in body["files"]:
        client.put_object(Bucket=bucket, Key=f"big/{e['name']}", Body=b"\0" * (e["bytes"] + 10**6))
    read: list[int] = []
    real_open = hydrate.stream_capped

    def counting(fs, path, out, size):
        got = real_open(fs, path, out, size)
        read.append(got[0] - size)
        return got

    monkeypatch.setattr(hydrate, "stream_capped", counting)
    with pytest.raises(
        HydrationError, match=r"s3://hydrate-test/big/shard_0000\d.bin does not match"
    ):
        hydrate_dataset(s3fs_filesystem(settings), bucket, "big", tmp_path / "a")
    assert read and max(read) == 1  # one byte past the manifest's size, never the whole object
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == []
    monkeypatch.setattr(data, "MAX_MANIFEST_BYTES", 64)
    with pytest.raises(HydrationError, match="over the 64 bytes a manifest may hold"):
        hydrate_dataset(s3fs_filesystem(settings), bucket, "ds/v1", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_hydrate_missing_prefix_is_named(seeded, tmp_path: Path):
    settings, bucket = seeded
    with pytest.raises(HydrationError, match=r"s3://hydrate-test/nope/dataset.json not found"):
        hydrate_dataset(s3fs_filesystem(settings), bucket, "nope", tmp_path)


def test_hydrate_rejects_corrupt_source(seeded, tmp_path: Path):
    settings, bucket = seeded
    client = boto3_client(settings)
    body = json.loads(client.get_object(Bucket=bucket, Key="ds/v1/dataset.json")["Body"].read())
    for key in ("dataset.json",):
        client.put_object(Bucket=bucket, Key=f"bad/{key}", Body=json.dumps(body).encode())
    for e in body["files"]:
        client.put_object(Bucket=bucket, Key=f"bad/{e['name']}", Body=b"\0" * e["bytes"])
    with pytest.raises(
        HydrationError, match=r"s3://hydrate-test/bad/shard_00000.bin does not match"
    ):
        hydrate_dataset(s3fs_filesystem(settings), bucket, "bad", tmp_path)
    assert not (tmp_path / "dataset.json").exists()


def test_clear_errors(s3_settings: S3Settings):
    client = boto3_client(s3_settings)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        check_bucket(client, "no-such-bucket", endpoint=s3_settings.endpoint_url)
    down = S3Settings(endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StorageError, match="unreachable"):
        check_bucket(boto3_client(down), "x-bucket", endpoint=down.endpoint_url)


def test_local_server_started_on_demand_and_stopped(tmp_path: Path):
    port = free_s3_port()
    settings = S3Settings(endpoint_url=f"http://127.0.0.1:{port}")
    assert not endpoint_is_up(settings.endpoint_url)
    with local_s3(settings, tmp_path, user="outer") as server:
        assert server is not None and server.started_here
        assert endpoint_is_up(settings.endpoint_url)
        keyed = server.settings(settings)
        boto3_client(keyed).create_bucket(Bucket="on-demand")
        # (a client without the keys: tests/adversarial/test_local_services.py)
        with local_s3(settings, tmp_path, user="inner") as again:
            # Already up and identified as this state directory's: shared, not restarted.
            assert again is not None and not again.started_here and again.pid == server.pid
        assert endpoint_is_up(settings.endpoint_url)  # the outer user still holds it
    assert not endpoint_is_up(settings.endpoint_url)
    assert (tmp_path / "s3").is_dir()  # data under the state directory
    # Only this user can read the volumes (the objects in clear) or the keys.
    assert stat.S_IMODE(os.stat(tmp_path / "s3").st_mode) == 0o700
    keys = keys_of(tmp_path / "s3")
    assert stat.S_IMODE(os.stat(keys.root).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(keys.root / f).st_mode) for f in FILES} == {0o600}
    assert sorted(p.name for p in keys.root.iterdir()) == sorted(FILES)  # no temporary left
