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


@pytest.mark.slow
def test_ports_next_to_master_port_taken_do_not_stop_the_workers(dataset, tmp_path):
    """Issue 29, item 7: the in-process layer's stores used to sit on MASTER_PORT+1 and +2,
    ports nobody reserved. Here another process holds both (as an outgoing connection's port
    may): a world of two workers with in-process restart, started as the launcher starts them,
    still trains to the end, on the one store rank 0 hosts at MASTER_PORT."""
    import dataclasses
    import os
    import sys

    from tests.helpers import FAST_INJOB, REPO, make_config, worker_env, write_config
    from trainer.launch import trainer_args
    from trainer.launch import worker_env as launch_env

    cfg = make_config(
        tmp_path / "run", dataset, steps=3, injob=dataclasses.replace(FAST_INJOB, enabled=False)
    )
    assert cfg.inprocess.enabled
    config = write_config(cfg)
    squatters = []
    for _ in range(50):  # a free port whose two neighbours can be taken
        port = free_port()
        try:
            for p in (port + 1, port + 2):
                s = socket.socket()
                squatters.append(s)
                s.bind(("127.0.0.1", p))
                s.listen()
            break
        except OSError:
            for s in squatters:
                s.close()
            squatters.clear()
    assert squatters, "no free port with two free neighbours"
    env = {**worker_env(), **launch_env(config), "MASTER_ADDR": "127.0.0.1"}
    env.update(MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    argv = [sys.executable, *trainer_args(cfg, config)]
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = []
    try:
        for r in (0, 1):
            with open(logs[r], "w") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        cwd=REPO,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for s in squatters:
            s.close()
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    assert (cfg.run_root / "result.json").exists()
