"""Files on the shared filesystem are untrusted (arch §6): a corrupted or forged checkpoint is
refused by validation, the load check and resume, which fall back to the newest intact one; a
forged DCP ``.metadata`` never runs its code, even with a manifest rewritten to match it; a
hostile dataset manifest never makes hydration write outside its destination.

Real checkpoints (a trainer run), real subprocesses, real files; the attacks are tables.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.errors import HydrationError
from tasks.hydrate import hydrate_dataset
from tasks.validation.checkpoint import Expectations, child_env, validate_latest
from tests.helpers import REPO, make_config, run_single, vouch_for, worker_env
from trainer import checkpointing
from trainer.untrusted import UnsafeCheckpointError, load_dcp_metadata, loads_dcp_metadata

NEWEST, OLDER = 10, 5


# -- a real run with two committed checkpoints ---------------------------------------------------
@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    cfg = make_config(tmp_path_factory.mktemp("untrusted") / "run", dataset, steps=NEWEST)
    out = run_single(cfg)
    assert out.returncode == 0, out.log[-2000:]
    assert checkpointing.committed_steps(cfg.run_root) == [OLDER, NEWEST]
    return cfg.run_root, cfg.fingerprint()


@pytest.fixture
def run_root(trained: tuple[Path, str], tmp_path: Path) -> Path:
    """A private copy of the trained run: each test attacks its own."""
    dst = tmp_path / "run"
    shutil.copytree(trained[0], dst)
    return dst


def newest(run_root: Path) -> Path:
    return checkpointing.committed_path(run_root, NEWEST)


# -- attacks on one checkpoint -----------------------------------------------------------------
def flip_one_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def flip_offset(path: Path) -> int:
    """The middle of a binary file; in manifest.json, the middle of the first digest: the
    manifest carries no digest of itself, so a flip in a field nothing checks (``created_at``)
    would change nothing worth detecting."""
    if path.name != checkpointing.MANIFEST:
        return path.stat().st_size // 2
    text = path.read_bytes()
    key = f'"{checkpointing.read_manifest(path.parent).digest}": "'.encode()
    return text.index(key) + len(key) + 16


def checkpoint_files(ckpt: Path) -> list[str]:
    names = sorted(e.name for e in checkpointing.read_manifest(ckpt).files)
    return [*names, checkpointing.MANIFEST]


def forge_metadata(ckpt: Path, payload: bytes) -> None:
    """What an attacker with write access does: replace ``.metadata`` and rewrite the (unsigned)
    manifest so that its size and digest match (xxh3 or sha256 alike: neither is a signature)."""
    vouch_for(ckpt, ".metadata", payload)
    # The digests vouch for the forgery; only the restricted reader stands in its way.
    verdict = checkpointing.verify_checkpoint(ckpt)
    assert not verdict.ok and "does not match" not in verdict.reason
    assert ".metadata" in verdict.reason


class _Reduce:
    """Pickles as ``fn(*args)``: what a hostile ``__reduce__`` runs on unpickling."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def _in_real_metadata(ckpt: Path, canary: Path) -> bytes:
    """The checkpoint's real metadata with the payload tucked inside (allowed outer classes)."""
    md = load_dcp_metadata(ckpt)
    md.planner_data = {"x": _Reduce(os.system, f"touch {canary}")}
    return pickle.dumps(md)


def _dotted(module: str, name: str, canary: Path) -> bytes:
    def short(text: str) -> bytes:
        raw = text.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    # PROTO 4, module, name, STACK_GLOBAL, the command, TUPLE1, REDUCE, STOP
    return (
        b"\x80\x04" + short(module) + short(name) + b"\x93" + short(f"touch {canary}") + b"\x85R."
    )


PAYLOADS: dict[str, Callable[[Path, Path], bytes]] = {
    "os.system": lambda ckpt, canary: pickle.dumps(_Reduce(os.system, f"touch {canary}")),
    "builtins.exec": lambda ckpt, canary: pickle.dumps(
        _Reduce(exec, f"open({str(canary)!r}, 'w').write('pwned')")
    ),
    # Protocol 4 resolves dotted names by getattr: an allowed module, a hostile path in it.
    "dotted name in torch": lambda ckpt, canary: _dotted(
        "torch", "serialization.os.system", canary
    ),
    "inside real metadata": _in_real_metadata,
}


# -- (a) one flipped bit in any file: the newest intact checkpoint is chosen -------------------
@pytest.mark.slow
def test_every_file_flipped_falls_back_to_the_older_checkpoint(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    fingerprint = trained[1]
    names = checkpoint_files(newest(trained[0]))
    assert {".metadata", checkpointing.MANIFEST} <= set(names) and any(
        n.endswith(".distcp") for n in names
    )
    for name in names:
        run_root = tmp_path / name.strip(".")
        shutil.copytree(trained[0], run_root)
        victim = newest(run_root) / name
        flip_one_bit(victim, flip_offset(victim))

        outcome = validate_latest(run_root, Expectations(), load=False)
        assert outcome.chosen.step == OLDER, name
        assert [r.step for r in outcome.rejected] == [NEWEST], name

        choice = checkpointing.choose_resume(run_root, fingerprint=fingerprint)
        assert choice.step == OLDER, name
        assert [s for s, _ in choice.rejected] == [NEWEST], name


def run_load_check(ckpt: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.validation.load_check", str(ckpt)],
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        timeout=120,
    )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp"])
def test_load_check_verifies_digests_before_unpickling(run_root: Path, victim: str) -> None:
    """The load check (also what export's consolidation runs) refuses files its manifest does
    not vouch for, whoever calls it."""
    path = newest(run_root) / victim
    flip_one_bit(path, flip_offset(path))
    result = run_load_check(newest(run_root))
    assert result["loaded"] is False
    assert f"{victim} missing or not matching the manifest" in result["error"], result


# -- (b) a forged .metadata with a matching manifest never runs ----------------------------------
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_restricted_unpickler_refuses_payloads(payload: str, run_root: Path, tmp_path: Path):
    canary = tmp_path / "canary"
    data = PAYLOADS[payload](newest(run_root), canary)
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        loads_dcp_metadata(data, source="forged")
    assert not canary.exists()
    # The attack is real: plain pickle (what torch's FileSystemReader uses) runs it.
    live = tmp_path / "forged.pickle"
    live.write_bytes(data)
    code = f"import pickle; pickle.loads(open({str(live)!r}, 'rb').read())"
    subprocess.run([sys.executable, "-c", code], env=worker_env(), cwd=REPO, timeout=60)
    assert canary.exists(), f"{payload}: the payload does not work, so the test proves nothing"


def test_restricted_unpickler_reads_real_metadata(run_root: Path) -> None:
    md = load_dcp_metadata(newest(run_root))
    assert "model.tok_emb.weight" in md.state_dict_metadata


def test_metadata_pointing_outside_the_checkpoint_is_refused(run_root: Path) -> None:
    md = load_dcp_metadata(newest(run_root))
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../elsewhere.distcp"
    with pytest.raises(UnsafeCheckpointError, match="not a plain file name"):
        loads_dcp_metadata(pickle.dumps(md), source="forged")


@pytest.mark.slow
def test_forged_metadata_validation_and_load_check_refuse(run_root: Path, tmp_path: Path):
    canary = tmp_path / "canary"
    forge_metadata(newest(run_root), PAYLOADS["os.system"](newest(run_root), canary))

    outcome = validate_latest(run_root, Expectations())  # with the fresh-process load
    assert outcome.chosen.step == OLDER and outcome.chosen.passed
    (bad,) = outcome.rejected
    detail = " ".join(c.detail for c in bad.failed_checks())
    assert re.search(r"refusing to unpickle (posix|os)\.system", detail), detail

    # The load check on its own (the export's consolidation runs it too).
    result = run_load_check(newest(run_root))
    assert result["loaded"] is False
    assert "UnsafeCheckpointError" in result["error"], result
    assert not canary.exists()


@pytest.mark.slow
def test_forged_metadata_never_runs_on_resume(
    run_root: Path, trained: tuple[Path, str], dataset: Path, tmp_path: Path
):
    """The resumed trainer reads ``.metadata`` only through the restricted reader: the payload
    never runs, step 10 is rejected with the reason, and the run goes on from step 5."""
    canary = tmp_path / "canary"
    forge_metadata(newest(run_root), PAYLOADS["os.system"](newest(run_root), canary))
    cfg = make_config(run_root, dataset, steps=NEWEST + 5)
    assert cfg.fingerprint() == trained[1]
    out = run_single(cfg, timeout=120)
    assert not canary.exists(), out.log[-2000:]
    assert out.returncode == 0, out.log[-3000:]
    loaded = [e for e in out.of_kind("resume") if e.get("action") == "loaded"]
    assert [e["step"] for e in loaded] == [OLDER], loaded
    skipped = [e for e in out.of_kind("resume") if e.get("action") == "skipped"]
    assert skipped and skipped[0]["step"] == NEWEST
    assert "refusing to unpickle" in skipped[0]["reason"]
    assert out.result is not None and out.result["final_step"] == NEWEST + 5


def test_resume_choice_rejects_forged_metadata(
    run_root: Path, trained: tuple[Path, str], tmp_path: Path
):
    canary = tmp_path / "canary"
    forge_metadata(newest(run_root), PAYLOADS["os.system"](newest(run_root), canary))
    choice = checkpointing.choose_resume(run_root, fingerprint=trained[1])
    assert not canary.exists()
    assert choice.step == OLDER
    assert "refusing to unpickle" in dict(choice.rejected)[NEWEST]


# -- the load check runs without credentials -------------------------------------------------
SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_SESSION_TOKEN": "token",
    "AWS_PROFILE": "prod",
    "AWS_ROLE_ARN": "arn:aws:iam::1:role/x",
    "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks/token",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1/credentials",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": "/v2/credentials/x",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": "/var/run/secrets/pods/token",
    "PREFECT_API_KEY": "pnu_x",
    "PREFECT_API_AUTH_STRING": "admin:pass",
    "HF_TOKEN": "hf_x",
    "RANK": "3",
}


def test_child_env_has_no_credentials() -> None:
    env = child_env({**SECRETS, "PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/x"})
    assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull
    assert env["AWS_CONFIG_FILE"] == os.devnull
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"
    assert env["PATH"] == "/usr/bin" and env["PYTHONPATH"].endswith("/x")


def test_child_process_sees_no_credentials() -> None:
    """A real child started with that environment: what the load-check process gets."""
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    parent = {**os.environ, **SECRETS}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(parent), capture_output=True, text=True
    )
    seen = json.loads(proc.stdout)
    assert not set(SECRETS) & set(seen)
    assert seen["AWS_EC2_METADATA_DISABLED"] == "true"


# -- (c) hostile dataset manifests -----------------------------------------------------------
class FakeS3:
    """The two s3fs calls hydration makes, over a dict (the attack is in the manifest; an
    object larger than its manifest says meets real SeaweedFS, tests/test_storage.py)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def cat_file(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.objects[key][start:end]

    def open(self, key: str, mode: str = "rb", **kw: Any) -> io.BytesIO:
        return io.BytesIO(self.objects[key])


def _dataset_objects(name: str, body: bytes = b"\x01\x00" * 8) -> dict[str, bytes]:
    entry = {
        "name": name,
        "tokens": len(body) // 2,
        "bytes": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    man = {"format": "nvrx-tokens-v1", "dtype": "uint16", "vocab_size": 512, "files": [entry]}
    return {f"b/ds/{name}": body, "b/ds/dataset.json": json.dumps(man).encode()}


HOSTILE_NAMES = {
    "absolute": "/SENTINEL/owned.bin",
    "dotdot": "../owned.bin",
    "dotdot deep": "x/../../owned.bin",
    "subdir": "a/b",
    "backslash": "..\\owned.bin",
    "nul": "shard\x00.bin",
    "trailing newline": "shard_00000.bin\n",
    "leading dot": ".bashrc",
    "dot": ".",
    "empty": "",
    "the manifest": "dataset.json",
}


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", sorted(HOSTILE_NAMES))
def test_hostile_dataset_names_are_refused(case: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("untouched")
    before = _tree(tmp_path)
    name = HOSTILE_NAMES[case].replace("/SENTINEL", str(sentinel))
    dest = tmp_path / "fsx" / "data"
    with pytest.raises(HydrationError) as err:
        hydrate_dataset(FakeS3(_dataset_objects(name)), "b", "ds", dest)
    msg = str(err.value)
    assert "s3://b/ds/dataset.json" in msg and "files[0].name" in msg and repr(name) in msg
    assert _tree(tmp_path) == before  # nothing written anywhere, sentinel unchanged
    assert not (tmp_path / "owned.bin").exists() and not (tmp_path / "fsx" / "owned.bin").exists()


LINKED_DESTS = {"is a link": ("data", "data"), "goes through a link": ("via/data", "via")}


@pytest.mark.parametrize("case", sorted(LINKED_DESTS))
def test_symlinked_destination_is_refused(case: str, tmp_path: Path) -> None:
    dest_rel, link_rel = LINKED_DESTS[case]
    sentinel = tmp_path / "SENTINEL"
    sentinel.mkdir()
    fsx = tmp_path / "fsx"
    fsx.mkdir()
    (fsx / link_rel).symlink_to(sentinel, target_is_directory=True)
    with pytest.raises(HydrationError, match=f"symbolic link {fsx / link_rel}"):
        hydrate_dataset(FakeS3(_dataset_objects("shard_00000.bin")), "b", "ds", fsx / dest_rel)
    assert list(sentinel.rglob("*")) == []


def test_planted_links_inside_the_destination_are_not_written_through(tmp_path: Path) -> None:
    """A link planted where a shard (or the old ``.part`` name) goes is replaced, never
    followed: the file it points at is unchanged."""
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    dest = tmp_path / "fsx"
    dest.mkdir()
    (dest / "shard_00000.bin").symlink_to(victim)
    (dest / ".shard_00000.bin.part").symlink_to(victim)
    report = hydrate_dataset(FakeS3(_dataset_objects("shard_00000.bin")), "b", "ds", dest)
    assert report.downloaded == 1
    assert victim.read_text() == "untouched"
    assert not (dest / "shard_00000.bin").is_symlink()
    # The planted .part link is left alone; the private staging directory is gone.
    assert sorted(p.name for p in dest.iterdir()) == [
        ".shard_00000.bin.part",
        "dataset.json",
        "shard_00000.bin",
    ]


def test_good_dataset_hydrates(tmp_path: Path) -> None:
    body = b"\x02\x00" * 16
    dest = tmp_path / "fsx"
    report = hydrate_dataset(FakeS3(_dataset_objects("shard_00000.bin", body)), "b", "ds", dest)
    assert report.downloaded == 1 and (dest / "shard_00000.bin").read_bytes() == body


@pytest.mark.parametrize(
    ("field", "value"),
    [("bytes", -1), ("bytes", "16"), ("bytes", True), ("bytes", None), ("sha256", "x" * 64),
     ("sha256", None), ("sha256", "AB" * 32)],
)  # fmt: skip
def test_a_manifests_sizes_and_digests_are_checked_before_any_read(
    tmp_path: Path, field: str, value: Any
) -> None:
    """The sizes bound every read and the digests judge it: a manifest whose entry has neither
    in a usable form is refused naming the field, before any object is fetched or written."""
    objects = _dataset_objects("shard_00000.bin")
    man = json.loads(objects["b/ds/dataset.json"])
    man["files"][0][field] = value
    objects["b/ds/dataset.json"] = json.dumps(man).encode()
    with pytest.raises(HydrationError, match=rf"files\[0\]\.{field} must be"):
        hydrate_dataset(FakeS3(objects), "b", "ds", tmp_path / "fsx")
    assert not (tmp_path / "fsx").exists()


HOSTILE_MANIFESTS: dict[str, tuple[Any, str]] = {
    "not JSON": (b"\xff{", r"is malformed \(UnicodeDecodeError"),
    "nested past the recursion limit": (b"[" * 100_000, r"is malformed \(RecursionError"),
    "a list": ([], "not a JSON object of format 'nvrx-tokens-v1'"),
    "another format": ({"format": "other"}, "not a JSON object of format"),
    "no files": ({"files": []}, "files must be a non-empty list"),
    "an entry not an object": ({"files": ["shard_00000.bin"]}, r"files\[0\] must be an object"),
    "an unknown dtype": ({"dtype": "int8"}, r"dtype: 'int8' is not a token dtype"),
    "a vocabulary the dtype cannot hold": ({"vocab_size": 70000}, "does not fit dtype uint16"),
    "tokens not a count": ({"tokens": "8"}, r"files\[0\]\.tokens must be a non-negative integer"),
    "sizes that disagree with the dtype": ({"tokens": 4}, r"16 bytes, but 4 tokens of uint16"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_a_bad_manifest_is_refused_whole_before_any_read(tmp_path: Path, case: str) -> None:
    """The S3 manifest is parsed as strictly as a local one (trainer.data.DatasetManifest), and
    before anything is fetched or written: a bad one never starts a download."""
    objects = _dataset_objects("shard_00000.bin")
    change, message = HOSTILE_MANIFESTS[case]
    if isinstance(change, dict):
        man = json.loads(objects["b/ds/dataset.json"])
        for key, value in change.items():
            (man["files"][0] if key == "tokens" else man)[key] = value
        change = json.dumps(man).encode()
    objects["b/ds/dataset.json"] = (
        change if isinstance(change, bytes) else json.dumps(change).encode()
    )
    with pytest.raises(HydrationError, match=f"dataset manifest s3://b/ds/dataset.json.*{message}"):
        hydrate_dataset(FakeS3(objects), "b", "ds", tmp_path / "fsx")
    assert not (tmp_path / "fsx").exists()
