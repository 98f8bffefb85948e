"""A network of its own for one local attempt (issue 28, item 7; arch §4, "Doors").

Every store of a local attempt (the rendezvous store an agent or ``tasks.backends.rdzv_store``
hosts, the workers' ``MASTER_PORT`` store, NVRx in-process restart's) is a ``TCPStore`` whose
clients trust what it holds, and torch elastic's own listen on every interface. Bound to
127.0.0.1 they are still open to every process of the machine. So the attempt's processes run in
a private network namespace: a loopback of their own, nothing else, and nothing outside can
connect to them.

- A *holder* (``python -m tasks.backends.netns``, started by ``unshare --user --map-root-user
  --net``) makes the namespace, brings its loopback up and keeps it while the attempt runs. No
  privilege is needed where the kernel allows user namespaces (it does on Debian and most
  distributions; root always may).
- Each simulated node (and an elastic job's store) enters it with ``nsenter``, which ``exec`` s
  the command: the node's pid is the one the backend records.
- Rank 0's metrics are published: the holder accepts on a socket bound *outside* (a socket keeps
  the namespace it was made in) on ``127.0.0.1:<rank 0's port>`` and forwards each connection to
  the same port inside, where rank 0 serves. Nothing else is published.

Where user namespaces are not allowed, root still makes the namespace without one
(:class:`Mode`); for anyone else :func:`support` says why and the attempt shares the host's
network as before (the preflight's "private network" check says so too).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import fcntl
import functools
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


class Mode(enum.StrEnum):
    """How the namespace is made: in a user namespace of its own (any user, where the kernel
    allows them), or by root alone (a container that grants root ``CAP_SYS_ADMIN`` but forbids
    user namespaces)."""

    USER = "user"
    ROOT = "root"


UNSHARE = {
    Mode.USER: ("unshare", "--user", "--map-root-user", "--net"),
    Mode.ROOT: ("unshare", "--net"),
}
READY = b"ready\n"
READY_TIMEOUT_S = 30.0
# A local flood of scrapes must not grow threads without bound: past this many open forwarded
# connections, new ones are closed at once.
MAX_FORWARDED = 32
FORWARD_IDLE_S = 30.0


def _tries(mode: Mode) -> str | None:
    """Why ``mode`` cannot make a namespace here, or None."""
    try:
        done = subprocess.run(
            [*UNSHARE[mode], "--", "true"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@functools.cache
def _probe() -> tuple[Mode | None, str | None]:
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return None, f"{tool} (util-linux) is not installed"
    why = _tries(Mode.USER)
    if why is None:
        return Mode.USER, None
    if os.geteuid() == 0 and _tries(Mode.ROOT) is None:
        return Mode.ROOT, None
    return None, (
        f"user namespaces are not allowed here ({why}): enable them (sysctl "
        "kernel.unprivileged_userns_clone=1, or on Ubuntu "
        "kernel.apparmor_restrict_unprivileged_userns=0)"
    )


def mode() -> Mode | None:
    """How namespaces are made here (once per process), or None when they cannot be."""
    return _probe()[0]


def support() -> str | None:
    """None when a private network namespace can be made here; otherwise why not."""
    return _probe()[1]


@dataclass
class PrivateNetwork:
    """One attempt's namespace, held by ``holder``; :meth:`enter` prefixes a command to run it
    inside."""

    holder: subprocess.Popen[bytes]
    published: int | None = None  # the port forwarded from the host's 127.0.0.1, if any
    mode: Mode = Mode.USER

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside (``nsenter`` then ``exec`` s it)."""
        if self.holder.poll() is not None:
            raise RuntimeError(
                f"the attempt's network namespace is gone (its holder, pid {self.holder.pid}, "
                f"exited {self.holder.returncode}): no node can join the attempt any more"
            )
        ns = f"/proc/{self.holder.pid}/ns"
        if self.mode == Mode.ROOT:
            return ["nsenter", f"--net={ns}/net", "--"]
        return ["nsenter", f"--user={ns}/user", f"--net={ns}/net", "--preserve-credentials", "--"]

    def close(self) -> None:
        """Idempotent: the namespace goes with its last process."""
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()


def open_network(
    *,
    env: dict[str, str],
    cwd: Path,
    log: Path,
    publish: int | None = None,
    how: Mode | None = None,
) -> PrivateNetwork:
    """A new namespace with its loopback up, and ``publish`` (a port) forwarded to it from the
    host's 127.0.0.1 when given and free there (a port in use is said in the log and not
    published: metrics never stop training). Returns once the holder is ready; raises with its
    log when it is not within ``READY_TIMEOUT_S``. ``how``: this machine's :func:`mode` unless
    given."""
    how = how or mode()
    if how is None:
        raise RuntimeError(f"no private network can be made here: {support()}")
    listener: socket.socket | None = None
    if publish is not None:
        try:
            listener = socket.create_server(("127.0.0.1", publish), backlog=64)
        except OSError as e:
            with open(log, "a") as out:
                print(f"rank 0's metrics port 127.0.0.1:{publish} not published: {e}", file=out)
    argv = [*UNSHARE[how], "--", sys.executable, "-m", "tasks.backends.netns"]
    fds: tuple[int, ...] = ()
    if listener is not None:
        argv += ["--publish-fd", str(listener.fileno()), "--port", str(publish)]
        fds = (listener.fileno(),)
    failed = "the attempt's network namespace did not start"
    try:
        holder = start_ready(argv, failed, log=log, env=env, cwd=cwd, pass_fds=fds)
    finally:
        if listener is not None:
            listener.close()  # the holder has its own copy
    return PrivateNetwork(holder, published=publish if listener is not None else None, mode=how)


def start_ready(
    argv: list[str],
    failed: str,
    *,
    log: Path,
    env: dict[str, str],
    cwd: Path,
    pass_fds: tuple[int, ...] = (),
    timeout_s: float = READY_TIMEOUT_S,
) -> subprocess.Popen[bytes]:
    """Start ``argv --ready-fd FD`` in a session of its own (not in the caller's signals), its
    output appended to ``log``; return it once it says :data:`READY` on that pipe (a connection
    from here could not reach what listens inside an attempt's network). Otherwise it is killed
    and this raises ``failed`` with its exit code and the log's tail."""
    r, w = os.pipe()
    try:
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [*argv, "--ready-fd", str(w)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                pass_fds=(w, *pass_fds),
                start_new_session=True,
            )
    finally:
        os.close(w)
    try:
        ready = await_ready(r, timeout_s=timeout_s)
    finally:
        os.close(r)
    if ready:
        return popen
    if popen.poll() is None:
        popen.kill()
    popen.wait()
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"{failed} (exit code {popen.returncode}); {log}:\n{tail}")


def await_ready(fd: int, *, timeout_s: float = READY_TIMEOUT_S) -> bool:
    """Did the process holding the pipe's other end say :data:`READY` within ``timeout_s``?
    False when it closed the pipe first (it exited) or stayed silent."""
    deadline = time.monotonic() + timeout_s
    got = b""
    while len(got) < len(READY):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, len(READY) - len(got))
        if not chunk:
            return False
        got += chunk
    return got == READY


# -- the holder, inside the namespace -----------------------------------------------------------
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then ifr_flags, padded to its 40 bytes


def loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (not on every machine): the ioctl it makes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        flags = struct.unpack(_IFREQ, got)[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def _copy(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _forward(client: socket.socket, port: int, slots: threading.BoundedSemaphore) -> None:
    try:
        with client, socket.create_connection(("127.0.0.1", port), timeout=5) as inner:
            client.settimeout(FORWARD_IDLE_S)
            inner.settimeout(FORWARD_IDLE_S)
            back = threading.Thread(target=_copy, args=(inner, client), daemon=True)
            back.start()
            _copy(client, inner)
            back.join(FORWARD_IDLE_S)
    except OSError:
        pass  # nothing serves inside (rank 0 not up yet, or gone): the scrape fails, as it would
    finally:
        slots.release()


def publish(listener: socket.socket, port: int) -> None:
    """Forward every connection to ``listener`` (outside) to 127.0.0.1:``port`` (inside)."""
    slots = threading.BoundedSemaphore(MAX_FORWARDED)
    while True:
        try:
            client, _ = listener.accept()  # EINTR is retried by Python itself (PEP 475)
        except ConnectionAbortedError:  # the client left before it was accepted
            continue
        if not slots.acquire(blocking=False):
            client.close()
            continue
        threading.Thread(target=_forward, args=(client, port, slots), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.backends.netns")
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--publish-fd", type=int)
    p.add_argument("--port", type=int)
    args = p.parse_args(argv)
    loopback_up()
    if args.publish_fd is not None:
        listener = socket.socket(fileno=args.publish_fd)
        threading.Thread(
            target=publish, args=(listener, args.port), name="publish", daemon=True
        ).start()
    os.write(args.ready_fd, READY)
    os.close(args.ready_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:  # the namespace lives while this does (and while any node is in it)
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
