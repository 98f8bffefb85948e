"""A local attempt's network is its own (issue 28, item 7; tasks.backends.netns): during a run, a
client elsewhere on the machine cannot connect to any store of the run (the rendezvous store an
agent hosts, the workers' MASTER_PORT store, NVRx in-process restart's), while rank 0's metrics
port, the one published, still answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.backends import netns
from tasks.ownership import processes
from tests.helpers import REPO, free_port, make_config, read_events


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            return True
    except ConnectionRefusedError:
        return False


def _listening(pids: list[int]) -> set[int]:
    """The TCP ports the processes listen on, as their own network sees them: each one's
    ``/proc/PID/net/tcp{,6}`` (psutil reads the caller's network's tables), matched to the
    sockets it holds."""
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
            lines = [
                line.split()
                for table in ("tcp", "tcp6")
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            ]
        except OSError:  # gone meanwhile
            continue
        for f in lines:
            if f[3] == "0A" and f"socket:[{f[9]}]" in held:  # TCP_LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_this_machine_allows_a_private_network():
    """The claim below needs it; CI's machines allow user namespaces (so does Debian's kernel
    by default). Where one does not, the backend says so and shares the host's network."""
    assert netns.support() is None, netns.support()


# Listens on every interface (as torch's stores do) and greets whoever connects with its port.
_GREETER = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("up", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hello " + sys.argv[1].encode())
    c.close()
"""


@pytest.mark.parametrize("how", list(netns.Mode))
def test_only_the_published_port_is_reachable(tmp_path: Path, how: netns.Mode):
    """Either way of making the namespace (root without a user namespace: a container that
    forbids them; CI's machines, like this one, run as root)."""
    if how == netns.Mode.ROOT and os.geteuid() != 0:
        pytest.skip("only root makes a network namespace without a user namespace")
    port = free_port()
    net = netns.open_network(
        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, log=tmp_path / "net.log",
        publish=port, how=how,
    )  # fmt: skip
    assert net.mode == how
    other = free_port()
    servers = [
        subprocess.Popen(
            [*net.enter(), sys.executable, "-c", _GREETER, str(p)], stdout=subprocess.PIPE
        )
        for p in (port, other)
    ]
    try:
        for s in servers:
            assert s.stdout is not None and s.stdout.readline() == b"up\n"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            assert c.recv(100) == f"hello {port}".encode()  # forwarded inside
        assert not _connects(other)  # bound to every interface inside: still unreachable
        assert other in _listening([servers[1].pid])  # ... though it listens there
    finally:
        for s in servers:
            s.kill()
            s.wait()
        net.close()
    assert not _connects(port)  # the namespace's port is closed with it


def test_a_port_taken_outside_is_not_published(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "net.log"
        net = netns.open_network(env=dict(os.environ), cwd=REPO, log=log, publish=port)
        try:
            assert net.published is None
            assert f"127.0.0.1:{port} not published" in log.read_text()
        finally:
            net.close()


@pytest.mark.slow
def test_a_client_outside_the_run_cannot_reach_its_stores(dataset: Path, tmp_path: Path):
    """Two simulated nodes with in-process restart, rank 0's metrics on: once training steps,
    every port any process of the run listens on is tried from here. Only the metrics port
    answers, with rank 0's series; nothing of the run is left after it stops."""
    from tasks.backends.base import LaunchRequest
    from tasks.backends.local import LocalBackend

    metrics = free_port()
    cfg = make_config(tmp_path / "run", dataset, steps=400, metrics_port=metrics)
    assert cfg.inprocess.enabled
    request = LaunchRequest(
        run_id="doors", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1, deadline_s=300
    )
    job = LocalBackend(tmp_path / "state").launch(request)
    try:
        assert job.network is not None and job.network.published == metrics
        deadline = time.monotonic() + 120
        while not any(e["kind"] == "step" for e in read_events(cfg.run_root)):
            assert job.running(), "the attempt ended before its first step"
            assert time.monotonic() < deadline, "no step within 120 s"
            time.sleep(0.2)
        run = [t.pid for t in processes.tagged(cfg.run_root)]
        ports = _listening(run)
        rdzv = _rdzv_port(cfg.run_root)
        # the agent-hosted rendezvous store, the incarnation's store (the workers' process
        # groups and NVRx's keys: trainer.inprocess_layer), rank 0's metrics
        assert rdzv in ports and metrics in ports and len(ports) >= 3, ports
        reachable = sorted(p for p in ports if _connects(p))
        assert reachable == [metrics], f"reachable from outside the run: {reachable}"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'nvrx_train_rank{run_id="run"} 0.0' in body
    finally:
        job.stop()
    assert not processes.tagged(cfg.run_root), "a process of the run outlived it"
    assert job.network.holder.poll() is not None


def _rdzv_port(run_root: Path) -> int:
    """The rendezvous endpoint's port, from node 0's agent command line."""
    for t in processes.tagged(run_root):
        for arg in t.process.cmdline():
            if arg.startswith("--rdzv-endpoint="):
                return int(arg.rsplit(":", 1)[1])
    raise AssertionError("no agent names its rendezvous endpoint")


@pytest.mark.parametrize(
    ("user_ns", "root_ns", "euid", "expected"),
    [
        (None, None, 1000, netns.Mode.USER),  # user namespaces allowed: any user
        ("Operation not permitted", None, 0, netns.Mode.ROOT),  # forbidden, but root
        ("Operation not permitted", None, 1000, None),  # forbidden, not root: shared network
        ("Operation not permitted", "Operation not permitted", 0, None),  # no CAP_SYS_ADMIN
    ],
)
def test_how_a_namespace_is_made_here(monkeypatch, user_ns, root_ns, euid, expected):
    answers = {netns.Mode.USER: user_ns, netns.Mode.ROOT: root_ns}
    monkeypatch.setattr(netns, "_tries", lambda mode: answers[mode])
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    netns._probe.cache_clear()
    try:
        assert netns.mode() == expected
        why = netns.support()
        assert (why is None) == (expected is not None)
        if why is not None:
            assert "user namespaces are not allowed here (Operation not permitted)" in why
    finally:
        monkeypatch.undo()
        netns._probe.cache_clear()
