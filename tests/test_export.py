"""Export against a real SeaweedFS server over HTTP: verified, manifest last, resumable,
refusing bad checkpoints, clear errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.backends.local_nodes import free_port
from tasks.errors import ExportError, StorageError
from tasks.export import ExportOptions, export_checkpoint
from tasks.storage.local_s3 import LocalS3Server
from tasks.storage.s3 import S3Settings, boto3_client
from tests.helpers import SmallCheckpoint, as_pre_v2_checkpoint, free_s3_port
from trainer import checkpointing
from trainer.faults import flip_bytes

BUCKET = "export-test"


@pytest.fixture(scope="module")
def ckpt_src(small_checkpoint: SmallCheckpoint) -> Path:
    return small_checkpoint.path


@pytest.fixture
def ckpt(ckpt_src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / ckpt_src.name
    shutil.copytree(ckpt_src, dst)
    return dst


@pytest.fixture(scope="module")
def client(s3_settings: S3Settings) -> Any:
    c = boto3_client(s3_settings)
    c.create_bucket(Bucket=BUCKET)
    return c


def remote_objects(client: Any, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"].removeprefix(prefix)] = client.get_object(Bucket=BUCKET, Key=o["Key"])[
                "Body"
            ].read()
    return out


def _shas(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}


def test_happy_path_manifest_last(ckpt: Path, client, s3_settings):
    order: list[tuple[str, str]] = []
    report = export_checkpoint(
        client,
        ckpt,
        BUCKET,
        "happy",
        "run1",
        endpoint=s3_settings.endpoint_url,
        on_object=lambda n, a: order.append((n, a)),
    )
    assert report.uri == f"s3://{BUCKET}/happy/run1/step_5/" and report.verified
    assert report.verification == "sha256"  # the server checked each object's digest
    assert order[-1] == ("manifest.json", "uploaded")
    local = checkpointing.read_manifest(ckpt)
    objs = remote_objects(client, "happy/run1/step_5/")
    assert set(objs) == {e.name for e in local.files} | {"manifest.json"}
    # The checkpoint's manifest, with what a reader outside checks: every file's sha256 (v1).
    remote = json.loads(objs["manifest.json"])
    assert (local.digest, remote["format"], remote["digest"]) == (
        "xxh3_128",
        "nvrx-ckpt-v1",
        "sha256",
    )
    assert remote == checkpointing.as_sha256(local, _shas(ckpt))
    for e in remote["files"]:
        assert hashlib.sha256(objs[e["name"]]).hexdigest() == e["sha256"]
    again = export_checkpoint(
        client, ckpt, BUCKET, "happy", "run1", endpoint=s3_settings.endpoint_url
    )
    assert (again.uploaded, again.skipped) == (0, report.objects)
    assert again.verification == "unchanged"


class _FailAfter:
    """A real client that breaks after ``k`` object uploads (a dropped connection mid-export),
    and records the order of the calls that change the prefix."""

    def __init__(self, real: Any, k: int) -> None:
        self.real, self.left = real, k
        self.calls: list[tuple[str, str]] = []

    def _upload(self, op: str, **kw: Any) -> Any:
        if self.left <= 0:
            from botocore.exceptions import EndpointConnectionError

            raise EndpointConnectionError(endpoint_url="http://injected")
        self.left -= 1
        self.calls.append((op, kw["Key"].rsplit("/", 1)[-1]))
        return getattr(self.real, op)(**kw)

    def put_object(self, **kw: Any) -> Any:
        return self._upload("put_object", **kw)

    def create_multipart_upload(self, **kw: Any) -> Any:
        return self._upload("create_multipart_upload", **kw)

    def delete_object(self, **kw: Any) -> Any:
        self.calls.append(("delete_object", kw["Key"].rsplit("/", 1)[-1]))
        return self.real.delete_object(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_interrupted_export_resumes(ckpt: Path, client, s3_settings):
    n_files = len(checkpointing.read_manifest(ckpt).files)
    with pytest.raises(StorageError, match="unreachable"):
        export_checkpoint(
            _FailAfter(client, 1),
            ckpt,
            BUCKET,
            "cut",
            "run1",
            endpoint=s3_settings.endpoint_url,
            options=ExportOptions(max_workers=1),
        )
    partial = remote_objects(client, "cut/run1/step_5/")
    assert "manifest.json" not in partial and len(partial) == 1  # nothing a reader would trust
    uploads: list[str] = []
    report = export_checkpoint(
        client,
        ckpt,
        BUCKET,
        "cut",
        "run1",
        endpoint=s3_settings.endpoint_url,
        on_object=lambda n, a: uploads.append(n) if a == "uploaded" else None,
    )
    assert report.uploaded == n_files  # the n-1 missing shards + the manifest, once
    assert "manifest.json" in uploads and uploads.count("manifest.json") == 1
    assert set(partial) - set(uploads) == set(partial)  # the one already there was not re-sent
    assert len(remote_objects(client, "cut/run1/step_5/")) == n_files + 1


def test_mismatched_object_is_replaced(ckpt: Path, client, s3_settings):
    export_checkpoint(client, ckpt, BUCKET, "mm", "run1", endpoint=s3_settings.endpoint_url)
    name = sorted(p.name for p in ckpt.glob("*.distcp"))[0]
    sha = _shas(ckpt)[name]
    client.put_object(
        Bucket=BUCKET, Key=f"mm/run1/step_5/{name}", Body=b"garbage", Metadata={"sha256": sha}
    )
    report = export_checkpoint(
        client, ckpt, BUCKET, "mm", "run1", endpoint=s3_settings.endpoint_url
    )
    # The shard, and the manifest again: it was withdrawn before the shard changed.
    assert (report.uploaded, report.skipped) == (2, report.objects - 2)
    body = client.get_object(Bucket=BUCKET, Key=f"mm/run1/step_5/{name}")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == sha


@pytest.mark.parametrize("manifest", ["v2", "v1"])
def test_refuses_corrupt_checkpoint(ckpt: Path, client, s3_settings, manifest: str):
    if manifest == "v1":
        as_pre_v2_checkpoint(ckpt)
    victim = sorted(ckpt.glob("*.distcp"))[0]
    flip_bytes(victim)
    digest = "xxh3_128" if manifest == "v2" else "sha256"
    with pytest.raises(
        ExportError, match=rf"refusing to export .*{victim.name}: it does not match its {digest}"
    ):
        export_checkpoint(client, ckpt, BUCKET, "bad", "run1", endpoint=s3_settings.endpoint_url)
    assert remote_objects(client, "bad/") == {}


def test_a_checkpoint_of_manifest_v1_exports_as_before(ckpt: Path, client, s3_settings):
    """A checkpoint committed before manifest v2 (sha256 per file) goes up with its own
    manifest, byte for byte, as exports did before."""
    as_pre_v2_checkpoint(ckpt)
    report = export_checkpoint(
        client, ckpt, BUCKET, "old", "run1", endpoint=s3_settings.endpoint_url
    )
    assert report.verified and report.verification == "sha256"
    objs = remote_objects(client, "old/run1/step_5/")
    assert objs["manifest.json"] == (ckpt / "manifest.json").read_bytes()
    for e in checkpointing.read_manifest(ckpt).files:
        assert objs[e.name] == (ckpt / e.name).read_bytes()


def test_sse_s3(ckpt: Path, client, s3_settings):
    export_checkpoint(
        client,
        ckpt,
        BUCKET,
        "sse",
        "run1",
        endpoint=s3_settings.endpoint_url,
        options=ExportOptions(sse="AES256"),
    )
    head = client.head_object(Bucket=BUCKET, Key="sse/run1/step_5/manifest.json")
    assert head.get("ServerSideEncryption") == "AES256"
    with pytest.raises(ExportError, match="kms_key_id needs"):
        ExportOptions(sse="AES256", kms_key_id="k")


def test_clear_errors(ckpt: Path, client, s3_settings, tmp_path: Path):
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        export_checkpoint(
            client, ckpt, "no-such-bucket", "p", "r", endpoint=s3_settings.endpoint_url
        )
    down = S3Settings(endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StorageError, match="unreachable"):
        export_checkpoint(boto3_client(down), ckpt, BUCKET, "p", "r", endpoint=down.endpoint_url)
    with pytest.raises(StorageError, match=r"prefix 'a/\.\./b'"):
        export_checkpoint(client, ckpt, BUCKET, "a/../b", "r", endpoint=s3_settings.endpoint_url)


def test_wrong_credentials(ckpt: Path, tmp_path: Path):
    """A keyed server (the state directory's: tasks.storage.local_keys) refuses other keys, and
    the error names neither secret."""
    from tasks.storage.local_keys import ensure_keys, read_credentials

    keys = ensure_keys(tmp_path / "s3")
    good = read_credentials(keys.credentials)
    server = LocalS3Server(f"http://127.0.0.1:{free_s3_port()}", tmp_path / "s3", keys=keys)
    server.start()
    try:
        settings = S3Settings(endpoint_url=server.endpoint, keys_file=keys.credentials)
        boto3_client(settings).create_bucket(Bucket=BUCKET)
        wrong = boto3_client(settings, credentials={**good, "aws_secret_access_key": "wrong"})
        with pytest.raises(StorageError, match="refused the credentials") as err:
            export_checkpoint(wrong, ckpt, BUCKET, "p", "r", endpoint=server.endpoint)
        assert "wrong" not in str(err.value)
        assert good["aws_secret_access_key"] not in str(err.value)
    finally:
        server.stop()


def test_consolidated_safetensors(ckpt: Path, client, s3_settings):
    from safetensors.torch import load

    from trainer.digest import tensor_dict_sha256

    report = export_checkpoint(
        client,
        ckpt,
        BUCKET,
        "cons",
        "run1",
        endpoint=s3_settings.endpoint_url,
        options=ExportOptions(consolidated=True),
    )
    objs = remote_objects(client, "cons/run1/step_5/")
    remote_manifest = json.loads(objs["manifest.json"])
    entry = remote_manifest["consolidated"]["model.safetensors"]
    assert hashlib.sha256(objs["model.safetensors"]).hexdigest() == entry["sha256"]
    weights = load(objs["model.safetensors"])
    assert tensor_dict_sha256(weights) == entry["params_sha256"]
    assert {k: v for k, v in remote_manifest.items() if k != "consolidated"} == (
        checkpointing.as_sha256(checkpointing.read_manifest(ckpt), _shas(ckpt))
    )
    assert report.objects == len(checkpointing.read_manifest(ckpt).files) + 2


# -- verified against the manifest, and no stale manifest window ---------------------------------
def _verdict_before_change(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checkpoint verifies (and its sha256 is taken), then a shard changes before its upload
    (a writer still busy, bit rot, a bug): the export must not publish the changed bytes as
    the manifest's."""
    from tasks.export import checked_digests

    verdict = checkpointing.verify_checkpoint(ckpt)
    assert verdict.ok
    shas = checked_digests(ckpt, verdict.manifest, 1)
    victim = sorted(ckpt.glob("*.distcp"))[0]
    flip_bytes(victim)
    monkeypatch.setattr("tasks.export.checkpointing.verify_checkpoint", lambda d, **kw: verdict)
    monkeypatch.setattr("tasks.export.checked_digests", lambda *args: shas)
    return victim


def test_changed_file_is_refused_by_the_server(ckpt: Path, client, s3_settings, monkeypatch):
    victim = _verdict_before_change(ckpt, monkeypatch)
    with pytest.raises(ExportError, match=rf"server refused .*{victim.name}.*manifest's sha256"):
        export_checkpoint(
            client, ckpt, BUCKET, "changed", "run1", endpoint=s3_settings.endpoint_url
        )
    objs = remote_objects(client, "changed/run1/step_5/")
    assert victim.name not in objs  # BadDigest: the server stored nothing for it
    assert "manifest.json" not in objs


def test_reexport_withdraws_the_old_manifest_before_any_object(
    ckpt: Path, client, s3_settings, monkeypatch
):
    export_checkpoint(client, ckpt, BUCKET, "again", "run1", endpoint=s3_settings.endpoint_url)
    victim = _verdict_before_change(ckpt, monkeypatch)
    # The remote copy is stale too, so the re-export must upload the (now changed) shard.
    client.put_object(Bucket=BUCKET, Key=f"again/run1/step_5/{victim.name}", Body=b"old")
    spy = _FailAfter(client, 100)
    with pytest.raises(ExportError, match="server refused"):
        export_checkpoint(spy, ckpt, BUCKET, "again", "run1", endpoint=s3_settings.endpoint_url)
    # The manifest went first, before the (refused) upload of the changed shard.
    assert spy.calls == [("delete_object", "manifest.json"), ("put_object", victim.name)]
    objs = remote_objects(client, "again/run1/step_5/")
    assert "manifest.json" not in objs  # no manifest over objects that changed under it


def test_reexport_order_delete_manifest_objects_manifest_last(ckpt: Path, client, s3_settings):
    export_checkpoint(client, ckpt, BUCKET, "order", "run1", endpoint=s3_settings.endpoint_url)
    name = sorted(p.name for p in ckpt.glob("*.distcp"))[0]
    client.put_object(Bucket=BUCKET, Key=f"order/run1/step_5/{name}", Body=b"stale")
    spy = _FailAfter(client, 100)
    events: list[tuple[str, str]] = []
    report = export_checkpoint(
        spy,
        ckpt,
        BUCKET,
        "order",
        "run1",
        endpoint=s3_settings.endpoint_url,
        on_object=lambda n, a: events.append((n, a)),
    )
    assert spy.calls == [
        ("delete_object", "manifest.json"),
        ("put_object", name),
        ("put_object", "manifest.json"),
    ]
    assert events[-1] == ("manifest.json", "uploaded") and report.uploaded == 2
    # Dropped after the manifest was withdrawn: the prefix shows no manifest at all.
    spy = _FailAfter(client, 0)
    client.put_object(Bucket=BUCKET, Key=f"order/run1/step_5/{name}", Body=b"stale again")
    with pytest.raises(StorageError):
        export_checkpoint(spy, ckpt, BUCKET, "order", "run1", endpoint=s3_settings.endpoint_url)
    assert spy.calls == [("delete_object", "manifest.json")]
    assert "manifest.json" not in remote_objects(client, "order/run1/step_5/")


def test_multipart_is_verified_per_part_and_whole(client, tmp_path: Path):
    import os

    from tasks.storage.verified_upload import composite_sha256_b64, part_checksums, upload_multipart

    part = 5 << 20
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(2 * part + 12345))  # 3 parts
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ExportError, match="refusing to complete"):
        upload_multipart(client, BUCKET, "mp/bad", path, "0" * 64, part_size=part, extra={})
    with pytest.raises(Exception) as gone:
        client.head_object(Bucket=BUCKET, Key="mp/bad")
    assert "404" in str(gone.value) or "Not Found" in str(gone.value)  # aborted: invisible
    parts = upload_multipart(client, BUCKET, "mp/good", path, sha, part_size=part, extra={})
    head = client.head_object(Bucket=BUCKET, Key="mp/good", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == composite_sha256_b64(parts)
    assert part_checksums(path, part) == (sha, parts)
