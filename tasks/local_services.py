"""Local services that outlive a run: a Prefect server (the UI and the artifacts a run's report
points to) and the embedded S3 server (the demo's data and exports), kept up for a state
directory by ``nvrx-pipeline up`` and stopped by ``down`` (issue 27). Without them ``run`` uses
a temporary Prefect server and the S3 server stops with the run, so the UI and the README's
recipes for the demo's export have nothing to open afterwards.

The Prefect server runs ``prefect server start`` on 127.0.0.1 with its home (SQLite database)
under ``<state_dir>/prefect``, in a session of its own, recorded in ``server.json`` there (pid,
start time, port) so that ``run`` finds it and ``down`` stops exactly it. The S3 server is the
state directory's own (``tasks.storage.local_s3``), held by a "kept" user entry.

The kept Prefect server requires Prefect's own API auth (issue 43): a password generated once
for the state directory, in ``<state_dir>/prefect/auth`` (0600; the directory, which holds the
database, 0700). The CLI's clients read it there; the UI asks for it once per browser (its login
page); only ``/api/health`` answers without it."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from tasks.errors import PipelineError
from tasks.ownership.lease import record_alive
from tasks.ownership.processes import stop_session
from trainer.run_files import read_json_object, write_json_atomic

PREFECT_DIR = "prefect"
RECORD = "server.json"
AUTH = "auth"
MAX_AUTH_BYTES = 1024
DEFAULT_PORT = 4200


class ServiceError(PipelineError):
    pass


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def auth_file(state_dir: Path) -> Path:
    return Path(state_dir).absolute() / PREFECT_DIR / AUTH


def kept_prefect_auth(state_dir: Path) -> str:
    """The kept server's password (Prefect's ``PREFECT_API_AUTH_STRING``)."""
    from tasks.errors import StorageError
    from tasks.storage.local_keys import read_private

    path = auth_file(state_dir)
    fix = (
        f"stop the server (nvrx-pipeline down --state-dir {state_dir}) and start it again "
        "(up): a new password is generated when none is there"
    )
    try:
        data = read_private(
            path, limit=MAX_AUTH_BYTES, what="the kept Prefect server's password", fix=fix
        )
        text = data.decode("ascii").strip()
    except (StorageError, UnicodeDecodeError) as e:
        raise ServiceError(str(e)) from None
    if not text:
        raise ServiceError(f"{path}: not a password written by `nvrx-pipeline up`; remove it")
    return text


def _ensure_auth(home: Path) -> str:
    """The password, generated the first time (exclusively: two `up`s at once get one)."""
    from tasks.storage.local_keys import create_private

    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o700)  # its SQLite database holds every run's parameters and logs
    with contextlib.suppress(FileExistsError):
        create_private(home / AUTH, (secrets.token_urlsafe(24) + "\n").encode())
    return kept_prefect_auth(home.parent)


def prefect_client_env(state_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """What a run's process adds to its environment to reach Prefect. A server the caller
    names (``PREFECT_API_URL``): nothing, theirs to configure. Else the state directory's kept
    server (``up``), with its password: the run, its report and artifacts stay in its UI. Else
    Prefect starts a temporary server, which inherits this environment: a password of this
    invocation's own then guards it for as long as the run lasts."""
    if environ.get("PREFECT_API_URL"):
        return {}
    if (kept := kept_prefect_api(state_dir)) is not None:
        return {"PREFECT_API_URL": kept, "PREFECT_API_AUTH_STRING": kept_prefect_auth(state_dir)}
    password = secrets.token_urlsafe(24)
    return {"PREFECT_SERVER_API_AUTH_STRING": password, "PREFECT_API_AUTH_STRING": password}


def kept_prefect_api(state_dir: Path) -> str | None:
    """The API URL of this state directory's kept Prefect server when it is up, else None."""
    rec = read_json_object(Path(state_dir) / PREFECT_DIR / RECORD)
    port = rec.get("port") if rec is not None and record_alive(rec) else None
    return f"http://127.0.0.1:{port}/api" if isinstance(port, int) and _health(port) else None


def start_prefect(
    state_dir: Path,
    port: int = DEFAULT_PORT,
    timeout: float = 180.0,
    *,
    meanwhile: Callable[[], object] | None = None,
) -> str:
    """Start the kept Prefect server (or find it up); its API URL. ``meanwhile`` runs while the
    server starts (its imports and database migrations take seconds: ``up`` starts the S3 server
    then, not after); when it raises, the server this call started is stopped."""
    home = Path(state_dir).absolute() / PREFECT_DIR
    api = kept_prefect_api(state_dir)
    if api is not None:
        if not auth_file(state_dir).exists():
            raise ServiceError(
                f"this state directory's Prefect server ({api}) was started without a "
                f"password, by an older version: stop it (nvrx-pipeline down --state-dir "
                f"{state_dir}) and run up again"
            )
        if meanwhile is not None:
            meanwhile()
        return api
    if _health(port):
        raise ServiceError(
            f"port {port}: another Prefect server already answers there (not this state "
            f"directory's): use it (PREFECT_API_URL=http://127.0.0.1:{port}/api), or --port N"
        )
    password = _ensure_auth(home)
    # Nothing of the caller's Prefect profile: this server has its own home and database.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_API_AUTH_STRING=password,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # The UI's pages call the API at this URL, 127.0.0.1:4200 unless told: on any other port
        # the UI would load and then fail every call ("Can't connect to Server API").
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",
    )
    prefect = Path(sys.executable).parent / "prefect"
    with open(home / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "port": port}
    write_json_atomic(home / RECORD, record)
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            stop_prefect(state_dir)
            raise
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(
                f"the Prefect server exited with {proc.returncode}; see {home / 'server.log'}"
            )
        if _health(port):
            return f"http://127.0.0.1:{port}/api"
        time.sleep(0.5)
    stop_prefect(state_dir)
    raise ServiceError(
        f"the Prefect server did not answer within {timeout:.0f} s; see {home / 'server.log'}"
    )


def stop_prefect(state_dir: Path) -> bool:
    """Stop the kept Prefect server; False when none was running."""
    path = Path(state_dir) / PREFECT_DIR / RECORD
    rec = read_json_object(path)
    path.unlink(missing_ok=True)
    if rec is None or not record_alive(rec):
        return False
    with contextlib.suppress(psutil.NoSuchProcess):
        stop_session(psutil.Process(int(str(rec["pid"]))), timeout_s=20)
    return True
