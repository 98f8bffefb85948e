"""The stores the pipeline hosts listen on their host's address alone (issue 28, item 7):
torch's TCPStore server binds every interface whatever host it is given, and its clients trust
what it holds. A client that tries the machine's other address is refused; through the given
address the store works. (trainer.stores; the run's own use: every local drill.)"""

from __future__ import annotations

import datetime
import socket
import subprocess

import pytest

from tests.helpers import free_port
from trainer.stores import BoundNvrxStore, tcp_store


def _other_address() -> str | None:
    """This machine's first address that is not loopback, if it has one."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return next((a for a in out if not a.startswith("127.") and ":" not in a), None)


def _listening(port: int) -> list[str]:
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.split()[3].endswith(f":{port}")]


def _refused_from_outside(port: int) -> None:
    other = _other_address()
    if other is None:
        pytest.skip("no address but loopback to try from")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((other, port), timeout=5)


def test_the_pipelines_stores_listen_on_their_host_alone(monkeypatch):
    timeout = datetime.timedelta(seconds=10)
    port = free_port()
    server = tcp_store("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout)
    assert _listening(port) == [f"127.0.0.1:{port}"]  # not *:port
    client = tcp_store("127.0.0.1", port, is_master=False, timeout=timeout)
    client.set("k", "v")
    assert server.get("k") == b"v"
    _refused_from_outside(port)

    # NVRx in-process restart's store, as the Wrapper makes it (its store_factory)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    host = BoundNvrxStore(port=port, timeout=timeout, wait_for_workers=False)
    assert _listening(port) == [f"127.0.0.1:{port}"]
    monkeypatch.setenv("RANK", "1")
    joined = BoundNvrxStore(port=port, timeout=timeout, wait_for_workers=False)
    joined.set(BoundNvrxStore.ANY_RANK_COMPLETED, "1")
    assert host.get(BoundNvrxStore.ANY_RANK_COMPLETED) == b"1"
    _refused_from_outside(port)


def test_a_host_that_is_not_this_machines_still_gets_a_store(caplog, monkeypatch):
    """MASTER_ADDR resolved here to an address no interface has (a NAT or virtual address that
    still routes to this host): the server binds as torch would, every interface, and says
    so, rather than not start."""
    import errno

    from trainer import stores

    def unavailable(host: str, port: int) -> int:
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    monkeypatch.setattr(stores, "listening_socket", unavailable)
    port = free_port()
    with caplog.at_level("WARNING"):
        store = tcp_store("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))  # fmt: skip
    assert "not an address of this machine" in caplog.text
    assert _listening(port) == [f"*:{port}"]
    store.set("k", "v")
