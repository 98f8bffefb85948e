"""``nvrx-pipeline pull`` against real exports in the SeaweedFS fixture, and the recipes of
docs/exports.md (moved there from the README) for loading an export with plain torch DCP (run
as written there)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flows.cli import main
from flows.cli.common import EXIT_FAILED, EXIT_USAGE
from tasks.errors import PullError
from tasks.export import ExportOptions, export_checkpoint
from tasks.pull import files_to_pull, mismatch, pull_export, step_in_prefix
from tasks.storage.s3 import S3Settings, boto3_client
from tests.helpers import REPO, SmallCheckpoint
from trainer import checkpointing
from trainer.digest import tensor_dict_sha256

BUCKET = "pull-test"
SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def client(s3_settings: S3Settings) -> Any:
    c = boto3_client(s3_settings)
    c.create_bucket(Bucket=BUCKET)
    return c


def export(client: Any, s3: S3Settings, ckpt: SmallCheckpoint, prefix: str, **opts: Any) -> str:
    report = export_checkpoint(
        client,
        ckpt.path,
        BUCKET,
        prefix,
        "run1",
        endpoint=s3.endpoint_url,
        options=ExportOptions(**opts),
    )
    return report.uri


@pytest.fixture(scope="module")
def consolidated_uri(client, s3_settings, small_checkpoint) -> str:
    """One consolidated export (DCP files + model.safetensors; its manifest records the model's
    params_sha256), shared: consolidating loads the model in a fresh process (seconds)."""
    return export(client, s3_settings, small_checkpoint, "good", consolidated=True)


def pull(
    uri: str, dest: Path, s3: S3Settings, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any] | None, str]:
    """``nvrx-pipeline pull URI DEST --json``: (exit code, the JSON summary, stderr)."""
    assert s3.endpoint_url
    rc = main(["pull", uri, str(dest), "--s3-endpoint", s3.endpoint_url, "--json"])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return rc, (json.loads(lines[-1]) if rc == 0 else None), err


def leftovers(dest: Path) -> list[str]:
    """Anything a pull may have left beside DIR (its hidden staging directory)."""
    return [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.pull-")]


def test_good_pull_verifies_and_matches(
    consolidated_uri, s3_settings, small_checkpoint, tmp_path, capsys
):
    uri = consolidated_uri
    dest = tmp_path / "out" / "step_5"  # the parent is created too
    rc, summary, err = pull(uri, dest, s3_settings, capsys)
    assert rc == 0, err
    local = checkpointing.read_manifest(small_checkpoint.path)
    names = {e.name for e in local.files} | {"model.safetensors", "manifest.json"}
    assert {p.name for p in dest.iterdir()} == names
    for e in local.files:  # byte for byte the committed checkpoint
        assert (dest / e.name).read_bytes() == (small_checkpoint.path / e.name).read_bytes()
    assert summary == {
        "uri": uri,
        "dir": str(dest),
        "files": len(names),
        "bytes": sum(p.stat().st_size for p in dest.iterdir()),
        "verified": True,
        "step": 5,
        "downloaded": len(names),
        "params_sha256": small_checkpoint.params_sha256,  # the run's, from the manifest
    }
    assert "pull: 100%" in err and leftovers(dest) == []
    ref = tmp_path / "ref"
    ref.mkdir()  # DIR gets the mode of any new directory (the umask's), not a temp dir's 0700
    assert dest.stat().st_mode & 0o777 == ref.stat().st_mode & 0o777
    # The same export again: verified in place, nothing downloaded, DIR untouched.
    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    rc, again, err = pull(uri, dest, s3_settings, capsys)
    assert rc == 0, err
    assert again is not None and again["downloaded"] == 0 and again["verified"]
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before


def test_tampered_object_fails_and_leaves_no_dir(
    client, s3_settings, small_checkpoint, tmp_path, capsys
):
    uri = export(client, s3_settings, small_checkpoint, "tampered")
    key = f"tampered/run1/step_5/{SHARD}"
    body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF  # same size, one byte changed
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    dest = tmp_path / "step_5"
    rc, _, err = pull(uri, dest, s3_settings, capsys)
    assert rc == EXIT_FAILED
    assert f"{uri}{SHARD} does not match its sha256 in the manifest" in err
    assert not dest.exists() and leftovers(dest) == []


@pytest.mark.parametrize(
    "hostile",
    [
        {"files": [{"name": "../x", "bytes": 1, "sha256": "0" * 64}]},
        {"consolidated": {"../x": {"bytes": 1, "sha256": "0" * 64}}},
        {"consolidated": {"hf": {"files": [{"name": "../../x", "bytes": 1, "sha256": "0" * 64}]}}},
        {"files": [{"name": "manifest.json", "bytes": 1, "sha256": "0" * 64}]},
    ],
    ids=["file", "consolidated-file", "consolidated-dir-file", "the-manifest"],
)
def test_hostile_name_in_the_manifest_is_refused(
    hostile, request, client, s3_settings, small_checkpoint, tmp_path, capsys
):
    prefix = f"hostile-{request.node.callspec.id}"
    uri = export(client, s3_settings, small_checkpoint, prefix)
    key = f"{prefix}/run1/step_5/manifest.json"
    man = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    if "files" in hostile:
        man["files"] += hostile["files"]
    else:
        man.update(hostile)
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(man).encode())
    dest = tmp_path / "d" / "step_5"
    rc, _, err = pull(uri, dest, s3_settings, capsys)
    assert rc == EXIT_FAILED
    assert f"{uri}manifest.json" in err and ("safe path component" in err or "twice" in err)
    assert not dest.exists() and leftovers(dest) == []
    assert not (tmp_path / "x").exists() and not (tmp_path / "d" / "x").exists()


def test_non_empty_dir_is_refused(client, s3_settings, small_checkpoint, tmp_path, capsys):
    uri = export(client, s3_settings, small_checkpoint, "busy")
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    rc, _, err = pull(uri, dest, s3_settings, capsys)
    assert rc == EXIT_USAGE
    assert f"DIR {dest} is not empty" in err and "give a new or empty directory" in err
    assert [p.name for p in dest.iterdir()] == ["notes.txt"] and leftovers(dest) == []
    # A different export in DIR is refused too, and left as it is.
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "someone else"}')
    rc, _, err = pull(uri, other, s3_settings, capsys)
    assert rc == EXIT_USAGE and f"DIR {other} holds a different export" in err
    # An empty DIR is fine: the verified download replaces it.
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, summary, err = pull(uri, empty, s3_settings, capsys)
    assert rc == 0 and summary is not None and summary["verified"], err
    assert (empty / SHARD).is_file()


def test_usage_errors(client, s3_settings, small_checkpoint, tmp_path, capsys):
    rc, _, err = pull("https://example.com/x", tmp_path / "d", s3_settings, capsys)
    assert rc == EXIT_USAGE and "S3_URI" in err
    rc, _, err = pull(f"s3://{BUCKET}", tmp_path / "d", s3_settings, capsys)
    assert rc == EXIT_USAGE and "S3_URI" in err and "step_<N>" in err
    # A prefix with no export under it: a failure (exit 1), naming what is missing.
    rc, _, err = pull(f"s3://{BUCKET}/nothing/here/", tmp_path / "d", s3_settings, capsys)
    assert rc == EXIT_FAILED and "manifest.json does not exist" in err
    assert not (tmp_path / "d").exists()
    # A run's prefix instead of one of its steps: the message lists the steps there are.
    uri = export(client, s3_settings, small_checkpoint, "runprefix")
    rc, _, err = pull(f"s3://{BUCKET}/runprefix/run1", tmp_path / "d", s3_settings, capsys)
    assert rc == EXIT_FAILED and f"(under it: {uri})" in err
    with pytest.raises(SystemExit) as e:
        main(["pull", "--help"])
    assert e.value.code == 0 and "exit codes:" in capsys.readouterr().out


class _InterruptedClient:
    """A real client whose shard download is interrupted (Ctrl-C) half-way through."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def get_object(self, **kw: Any) -> Any:
        r = self.real.get_object(**kw)
        if kw["Key"].endswith(SHARD):
            body = r["Body"]

            class Body:
                calls = 0

                def read(self, n: int = -1) -> bytes:
                    Body.calls += 1
                    if Body.calls > 1:
                        raise KeyboardInterrupt
                    return bytes(body.read(min(n, 4096)))

            r["Body"] = Body()
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_interrupted_pull_leaves_no_dir(client, s3_settings, small_checkpoint, tmp_path):
    uri = export(client, s3_settings, small_checkpoint, "interrupted")
    dest = tmp_path / "step_5"
    with pytest.raises(KeyboardInterrupt):
        pull_export(
            _InterruptedClient(client),
            BUCKET,
            uri.removeprefix(f"s3://{BUCKET}/").rstrip("/"),
            dest,
            endpoint=s3_settings.endpoint_url,
        )
    assert not dest.exists() and leftovers(dest) == []


# -- the decisions, as tables --------------------------------------------------------------------
GOOD = {"bytes": 3, "sha256": "a" * 64}


@pytest.mark.parametrize(
    "manifest_extra, refused",
    [
        ({}, None),
        ({"consolidated": {"model.safetensors": GOOD}}, None),
        ({"consolidated": {"hf": {"files": [{"name": "config.json", **GOOD}]}}}, None),
        ({"consolidated": {"shard": GOOD}}, "twice"),  # collides with a DCP file
        ({"consolidated": {"shard": {"files": [{"name": "a", **GOOD}]}}}, "file and a directory"),
        ({"consolidated": {"x": {"bytes": 3}}}, "neither a file nor a directory"),
        ({"consolidated": {"x": {"bytes": -1, "sha256": "a" * 64}}}, "size"),
        ({"consolidated": {"hf": {"files": [{"name": "a/b", **GOOD}]}}}, "safe path component"),
        ({"consolidated": {"..": {"files": [{"name": "a", **GOOD}]}}}, "safe path component"),
        ({"consolidated": []}, "not an object"),
        # A checkpoint's own manifest (xxh3) copied up by hand: exports carry sha256.
        ({"format": "nvrx-ckpt-v2", "digest": "xxh3_128"}, "field 'digest' is 'xxh3_128'"),
    ],
)
def test_files_to_pull(manifest_extra, refused):
    shard = {"name": "shard", **GOOD, "xxh3_128": "b" * 32}
    doc = {"format": "nvrx-ckpt-v1", "step": 5, "world_size": 1, "files": [shard]}
    man = checkpointing.parse_manifest("M", {**doc, **manifest_extra})
    if refused is None:
        names = [f.name for f in files_to_pull(man, where="M")]
        assert names[0] == "shard" and len(names) == 1 + len(manifest_extra.get("consolidated", {}))
    else:
        with pytest.raises((PullError, checkpointing.CheckpointError), match=refused):
            files_to_pull(man, where="M")


def test_mismatch_and_step():
    f = checkpointing.FileEntry("a", 3, "a" * 64)
    assert mismatch(f, 3, "a" * 64) is None
    assert mismatch(f, 2, "a" * 64) == "is 2 bytes, the manifest says 3"
    assert mismatch(f, 3, "b" * 64) == "does not match its sha256 in the manifest"
    assert step_in_prefix("exports/run1/step_30") == 30
    assert step_in_prefix("exports/run1") is None


# -- the docs/exports.md recipes (moved from the README) ----------------------------------------
def recipe_code() -> str:
    """The first ``python`` block under docs/exports.md's 'Load an export with torch DCP'
    heading."""
    doc = (REPO / "docs" / "exports.md").read_text()
    section = doc.split("\n## Load an export with torch DCP, straight from S3\n", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "the recipe's code block is missing from docs/exports.md"
    return m.group(1)


# Runs the recipe in a fresh interpreter on each (source, storage options, output file), then
# proves it imported nothing from this repository.
DRIVER = """
import json, sys
for source, options, out in json.loads(sys.argv[1]):
    torch.save(load_model_state(source, **options), out)
ours = sorted({m.split(".")[0] for m in sys.modules} & {"trainer", "tasks", "flows", "tests"})
assert not ours, f"the recipe imported {ours}"
"""


def run_recipe(tmp_path: Path, jobs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The loaded state dicts, one per (source, storage options) of ``jobs``."""
    script = tmp_path / "recipe.py"
    script.write_text(recipe_code() + DRIVER)
    outs = [str(tmp_path / f"weights-{i}.pt") for i in range(len(jobs))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AWS_")}
    args = json.dumps([[src, opts, out] for (src, opts), out in zip(jobs, outs, strict=True)])
    proc = subprocess.run(
        [sys.executable, str(script), args],
        cwd=tmp_path,  # not the repository: nothing of it on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(torch.load(out, weights_only=True)) for out in outs]


def test_readme_recipes_load_the_runs_parameters(
    consolidated_uri, s3_settings, small_checkpoint, tmp_path, capsys
):
    """Straight from S3 (FsspecReader over s3fs), and from a pulled directory."""
    dest = tmp_path / "step_5"
    rc, _, err = pull(consolidated_uri, dest, s3_settings, capsys)
    assert rc == 0, err
    creds = s3_settings.credentials()
    s3_options = {
        "endpoint_url": s3_settings.endpoint_url,
        "key": creds.get("aws_access_key_id"),
        "secret": creds.get("aws_secret_access_key"),
    }
    from_s3, from_dir = run_recipe(tmp_path, [(consolidated_uri, s3_options), (str(dest), {})])
    for weights in (from_s3, from_dir):
        assert tensor_dict_sha256(weights) == small_checkpoint.params_sha256
        assert not any(k.startswith(("model.", "optim")) for k in weights)  # the model's names
