"""Which Prefect server a `run` reaches, with which password (tasks.local_services.
prefect_client_env): a table over the three cases, with a live health endpoint standing in for
the kept server (the real one, its 401s and its UI login: tests/test_local_services.py)."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tasks.local_services import (
    PREFECT_DIR,
    RECORD,
    ServiceError,
    auth_file,
    prefect_client_env,
)
from trainer.run_files import write_json_atomic


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[Path]:
    """A state directory whose kept server is recorded (this process) and answers health."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    me = psutil.Process()
    home = tmp_path / PREFECT_DIR
    home.mkdir(mode=0o700)
    port = server.server_address[1]
    write_json_atomic(home / RECORD, {"pid": me.pid, "create_time": me.create_time(), "port": port})
    try:
        yield tmp_path
    finally:
        server.shutdown()


def _password(path: Path, text: str = "s3cret-password", mode: int = 0o600) -> None:
    path.write_text(text + "\n")
    path.chmod(mode)


def test_a_server_the_caller_names_is_theirs_to_configure(kept: Path):
    _password(auth_file(kept))
    assert prefect_client_env(kept, {"PREFECT_API_URL": "http://elsewhere/api"}) == {}


def test_the_kept_server_is_reached_with_its_password(kept: Path):
    _password(auth_file(kept))
    env = prefect_client_env(kept, {})
    port = (kept / PREFECT_DIR / RECORD).read_text().split('"port": ')[1].rstrip("}\n ")
    assert env == {
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_API_AUTH_STRING": "s3cret-password",
    }


@pytest.mark.parametrize(
    "spoil,expect",
    [
        (lambda p: None, "missing"),
        (lambda p: _password(p, mode=0o644), "mode 0600"),
        (lambda p: _password(p, text=""), "not a password"),
    ],
    ids=["no password file", "readable by others", "empty"],
)
def test_a_kept_server_without_a_private_password_is_refused_naming_the_fix(
    kept: Path, spoil, expect: str
):
    spoil(auth_file(kept))
    with pytest.raises(ServiceError, match=expect) as refused:
        prefect_client_env(kept, {})
    assert "nvrx-pipeline down" in str(refused.value) or "remove it" in str(refused.value)


def test_a_temporary_server_gets_a_password_of_this_invocation(tmp_path: Path):
    first, second = prefect_client_env(tmp_path, {}), prefect_client_env(tmp_path, {})
    assert set(first) == {"PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"}
    assert first["PREFECT_SERVER_API_AUTH_STRING"] == first["PREFECT_API_AUTH_STRING"]
    assert len(first["PREFECT_API_AUTH_STRING"]) >= 32
    assert first != second  # never a fixed or stored one
    assert not os.listdir(tmp_path)  # and written nowhere
