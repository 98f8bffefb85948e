"""The embedded S3 server's generated secrets (tasks.storage.local_keys): made once, whole, this
user's alone; anything else in their place is refused, naming the path and the fix. (The server
refusing a client without them: tests/test_storage.py::test_local_server_started_on_demand_and_
stopped; the kept server through the CLI: tests/test_local_services.py.)"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.errors import StorageError
from tasks.storage.local_keys import (
    CREDENTIALS,
    FILES,
    SECURITY,
    ensure_keys,
    keys_of,
    read_credentials,
)


def test_generated_once_whole_and_private(tmp_path: Path):
    data = tmp_path / "s3"
    keys = ensure_keys(data)
    first = read_credentials(keys.credentials)
    assert (
        first["aws_access_key_id"].startswith("NVRX") and len(first["aws_secret_access_key"]) >= 40
    )
    assert stat.S_IMODE(os.stat(keys.root).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(keys.root / f).st_mode) for f in FILES} == {0o600}
    assert sorted(p.name for p in data.iterdir()) == ["secrets"]  # no temporary directory left
    assert read_credentials(ensure_keys(data).credentials) == first  # kept, not regenerated
    # security.toml names the certificates where they are, not where they were generated
    toml = (keys.root / SECURITY).read_text()
    assert f'ca = "{keys.root}/ca.crt"' in toml and ".secrets-" not in toml
    assert toml.count('key = "') >= 4 and 'key = ""' not in toml


def _chmod(mode: int, name: str | None = None) -> Callable[[Path], None]:
    return lambda root: os.chmod(root if name is None else root / name, mode)


def _relink(root: Path) -> None:
    target = root.parent / "elsewhere"
    (root / CREDENTIALS).rename(target)
    (root / CREDENTIALS).symlink_to(target)


def _chown(root: Path) -> None:
    os.chown(root / CREDENTIALS, 4242, 4242)


def _remove(root: Path) -> None:
    (root / SECURITY).unlink()


TAMPERED: list[tuple[str, Callable[[Path], None], str]] = [
    ("credentials readable by others", _chmod(0o644, CREDENTIALS), "mode 0600"),
    ("credentials writable by the group", _chmod(0o620, CREDENTIALS), "mode 0600"),
    ("directory open to others", _chmod(0o755), "mode 0700"),
    ("credentials a link", _relink, "mode 0600"),
    ("credentials another user's", _chown, "uid 4242"),
    ("a file missing", _remove, "missing"),
]


@pytest.mark.parametrize("tamper,expect", [t[1:] for t in TAMPERED], ids=[t[0] for t in TAMPERED])
def test_tampered_secrets_are_refused_naming_the_path_and_the_fix(
    tmp_path: Path, tamper: Callable[[Path], None], expect: str
):
    if tamper is _chown and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (CI runs as root)")
    keys = ensure_keys(tmp_path / "s3")
    tamper(keys.root)
    with pytest.raises(StorageError, match=expect) as refused:
        ensure_keys(tmp_path / "s3")
    assert str(keys.root) in str(refused.value) and "remove" in str(refused.value)


@pytest.mark.parametrize(
    "text",
    ["", "[default]\naws_access_key_id = a\naws_secret_access_key = b\n", "[nvrx-local]\nx = 1\n"],
    ids=["empty", "another profile", "no keys"],
)
def test_a_credentials_file_without_the_profile_is_refused(tmp_path: Path, text: str):
    path = tmp_path / "credentials"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(StorageError, match=r"no \[nvrx-local\] profile"):
        read_credentials(path)


def test_an_oversized_credentials_file_is_not_read_whole(tmp_path: Path):
    path = tmp_path / "credentials"
    path.write_bytes(b"#" * (1 << 20))
    path.chmod(0o600)
    with pytest.raises(StorageError, match="over 16384 bytes"):
        read_credentials(path)


def test_keys_of_names_the_directory_without_reading_it(tmp_path: Path):
    assert keys_of(tmp_path / "s3").credentials == (tmp_path / "s3" / "secrets" / CREDENTIALS)
    assert not (tmp_path / "s3").exists()
