"""One writer per run, no orphans (arch §6), against real processes: the lease, takeover
decisions, the embedded S3 server's identity and reference count, two invocations of one run id,
and an orchestrator SIGKILLed mid-train."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import pytest

from flows.cli import main
from flows.context import RunContext
from flows.models import PipelineResult
from tasks.backends.local_nodes import kill_tree
from tasks.errors import StorageError
from tasks.ownership import processes, takeover
from tasks.ownership.lease import LeaseRecord, Owner, RunBusy, RunLease
from tasks.storage.local_s3 import EMBEDDED_ENDPOINT, ensure_local_s3, recorded_server
from tasks.storage.s3 import S3Settings
from tests.helpers import free_s3_port, read_events
from tests.pipeline_helpers import make_params, nvrx_events
from trainer.event_types import Event, Step
from trainer.run_files import write_text_atomic
from trainer.rundir import Layout

REPO = Path(__file__).resolve().parents[2]


# -- the lease ------------------------------------------------------------------------------------
def test_second_lease_is_refused_naming_the_owner(tmp_path: Path):
    first = RunLease(tmp_path, "r1")
    first.acquire()
    try:
        with pytest.raises(RunBusy, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            RunLease(tmp_path, "r1").acquire()
        assert json.loads((tmp_path / "owner.lease").read_text())["owner"]["pid"] == os.getpid()
    finally:
        first.release()
    assert not (tmp_path / "owner.lease").exists()
    again = RunLease(tmp_path, "r1")
    again.acquire()
    assert again.takeover is None  # a clean release leaves nothing to take over
    again.release()


def test_without_flock_the_lease_file_alone_decides(tmp_path: Path, monkeypatch):
    """Lustre mounted without ``-o flock`` answers ENOSYS: the O_EXCL lease file and its owner's
    liveness still make one writer."""
    import errno
    import fcntl

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    first = RunLease(tmp_path, "r1")
    first.acquire()
    try:
        with pytest.raises(RunBusy, match=f"pid {os.getpid()}"):
            RunLease(tmp_path, "r1").acquire()
    finally:
        first.release()
    assert not (tmp_path / "owner.lease").exists()


def _dead_owner(host: str | None = None, heartbeat_at: float | None = None) -> LeaseRecord:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(proc.pid).create_time()
    proc.wait()
    owner = Owner("deadbeef", proc.pid, host or socket.gethostname(), created, time.time() - 100)
    return LeaseRecord("r1", owner, heartbeat_at or time.time(), ({"kind": "node", "pid": 1},))


@dataclass(frozen=True)
class Stale:
    name: str
    record: LeaseRecord
    beating: bool  # its owner rewrites it (a live owner on another host)
    taken_over: bool


# Another host's lease is judged by its record changing on this process's own clock: its
# heartbeat_at, by the owner's clock, may be an hour off either way and decides nothing.
STALE = [
    Stale("dead-pid-same-host", _dead_owner(), False, True),
    Stale("other-host-beating", _dead_owner("elsewhere", time.time() + 3600), True, False),
    Stale("other-host-beating-clock-behind", _dead_owner("elsewhere", time.time() - 3600),
          True, False),
    Stale("other-host-silent-clock-ahead", _dead_owner("elsewhere", time.time() + 3600),
          False, True),
    Stale("other-host-silent", _dead_owner("elsewhere", time.time() - 3600), False, True),
]  # fmt: skip


@contextlib.contextmanager
def beating(path: Path, rec: LeaseRecord, on: bool) -> Iterator[None]:
    """The record's owner rewrites it (heartbeat_at moving by its own clock) while the block
    runs."""
    stop = threading.Event()

    def beat() -> None:
        i = 0
        while not stop.wait(0.2):
            i += 1
            path.write_text(replace(rec, heartbeat_at=rec.heartbeat_at + i).to_json())

    thread = threading.Thread(target=beat, daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


@pytest.mark.parametrize("sc", STALE, ids=[s.name for s in STALE])
def test_stale_lease_is_taken_over_and_live_one_is_not(sc: Stale, tmp_path: Path):
    path = tmp_path / "owner.lease"
    path.write_text(sc.record.to_json())
    mine = RunLease(tmp_path, "r1")
    with beating(path, sc.record, sc.beating):
        if not sc.taken_over:
            with pytest.raises(RunBusy, match="elsewhere"):
                mine.acquire(stale_after_s=2.0)
            return
        mine.acquire(stale_after_s=2.0)
    try:
        assert mine.takeover == sc.record  # the dead owner's records, to adopt or end
        now = LeaseRecord.parse(path.read_text())
        assert now is not None and now.owner.invocation == mine.owner.invocation
    finally:
        mine.release()


def test_another_hosts_owner_is_judged_on_the_readers_clock():
    from tasks.ownership.lease import HeartbeatWatch

    rec = _dead_owner("elsewhere", 5.0)
    clock = [100.0]
    watch = HeartbeatWatch(60.0, clock=lambda: clock[0])
    assert watch.alive(rec) is None  # one look proves nothing
    clock[0] = 159.0
    assert watch.alive(rec) is None
    clock[0] = 160.0
    assert watch.alive(rec) is False  # the same record for 60 s of our clock: gone
    watch = HeartbeatWatch(60.0, clock=lambda: clock[0])
    watch.alive(rec)
    clock[0] = 165.0
    assert watch.alive(replace(rec, heartbeat_at=4.0)) is True  # changed (even backwards)
    other = replace(rec, owner=replace(rec.owner, invocation="someone-else"))
    assert watch.alive(other) is None  # a new owner is judged afresh


def test_records_and_heartbeat_reach_the_file(tmp_path: Path):
    mine = RunLease(tmp_path, "r1", heartbeat_s=0.1)
    mine.acquire()
    try:
        first = json.loads((tmp_path / "owner.lease").read_text())["heartbeat_at"]
        mine.record({"kind": "node", "attempt": 1, "node": 0, "pid": 123})
        time.sleep(0.4)
        rec = LeaseRecord.parse((tmp_path / "owner.lease").read_text())
        assert rec is not None and rec.heartbeat_at > first
        assert rec.resources == ({"kind": "node", "attempt": 1, "node": 0, "pid": 123},)
        mine.forget({"kind": "node", "attempt": 1})
        rec = LeaseRecord.parse((tmp_path / "owner.lease").read_text())
        assert rec is not None and rec.resources == ()
    finally:
        mine.release()


def test_a_lease_taken_over_is_known_lost_and_never_rewritten(tmp_path: Path):
    """Two orchestrators that both believe they hold the lease (a takeover across hosts, the
    lock lost): the old one's heartbeat finds the new owner in the file and stops writing it,
    and every destructive action it tries raises LeaseLost."""
    from tasks.ownership.lease import LeaseLost

    old = RunLease(tmp_path, "r1", heartbeat_s=0.05)
    old.acquire()
    try:
        old.check("watch")  # still its own
        new = Owner("newowner", os.getpid(), "other-host", time.time(), time.time())
        (tmp_path / "owner.lease").write_text(LeaseRecord("r1", new, time.time()).to_json())
        deadline = time.monotonic() + 5
        while old.lost is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # several heartbeats: none rewrites the file
        rec = LeaseRecord.parse((tmp_path / "owner.lease").read_text())
        assert rec is not None and rec.owner.invocation == "newowner"
        with pytest.raises(LeaseLost, match="taken over by pid .* on other-host.*export"):
            old.check("export the checkpoint")
        old.record({"kind": "node", "attempt": 1, "node": 0, "pid": 1})  # no write either
        rec = LeaseRecord.parse((tmp_path / "owner.lease").read_text())
        assert rec is not None and rec.owner.invocation == "newowner" and rec.resources == ()
    finally:
        old.release()
    assert (tmp_path / "owner.lease").exists()  # the new owner's file stays


OLD_OWNER = """
import sys, time
from pathlib import Path
from tasks.ownership.lease import RunLease
lease = RunLease(Path(sys.argv[1]), "r1", heartbeat_s=0.0)  # swaps without pause
lease.acquire()
print("held", flush=True)
while lease.lost is None:
    time.sleep(0.01)
lease.release()
print("lost", flush=True)
"""


@pytest.mark.parametrize("pause_s", [0.0, 0.003, 0.011, 0.02, 0.037])
def test_a_paused_old_owner_resuming_after_a_takeover_never_overwrites_it(
    tmp_path: Path, pause_s: float
):
    """The old owner (a real process rewriting its lease as fast as it can) is paused
    (SIGSTOP) wherever it is, maybe between reading the file and writing it; a new owner on
    another host takes the lease over (the same compare-and-swap, under the swap lock); the old
    one resumes: it finds the new owner, writes nothing more, and its release leaves the file."""
    from tasks.ownership.lease import swapping

    old = subprocess.Popen(
        [sys.executable, "-c", OLD_OWNER, str(tmp_path)], stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        assert old.stdout is not None and old.stdout.readline() == b"held\n"
        time.sleep(pause_s)
        old.send_signal(signal.SIGSTOP)
        new = Owner("newowner", os.getpid(), "other-host", time.time(), time.time())

        def take_over() -> None:  # waits while the paused owner is mid-swap
            with swapping(tmp_path):
                (tmp_path / "owner.lease").write_text(LeaseRecord("r1", new, time.time()).to_json())

        taker = threading.Thread(target=take_over)
        taker.start()
        taker.join(0.3)
        old.send_signal(signal.SIGCONT)
        taker.join(10)
        assert not taker.is_alive()
        out, _ = old.communicate(timeout=10)  # an owner that overwrote would beat on
        assert out == b"lost\n" and old.returncode == 0
        rec = LeaseRecord.parse((tmp_path / "owner.lease").read_text())
        assert rec is not None and rec.owner.invocation == "newowner"
    finally:
        old.kill()
        old.wait()


def test_an_owner_frozen_mid_swap_makes_the_run_busy_not_a_hang(tmp_path: Path, monkeypatch):
    """A real process holds the lease's swap lock and is frozen (SIGSTOP): a takeover of the
    lease, due by its record (its owner is dead), waits no longer than wait_s, then RunBusy."""
    from tasks.ownership import lease

    (tmp_path / Layout.LEASE).write_text(_dead_owner().to_json())
    holds = "import sys; from trainer import fence\n"
    holds += "with fence.locked(sys.argv[1]):\n"
    holds += " print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", holds, str(tmp_path / Layout.LEASE_LOCK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        holder.send_signal(signal.SIGSTOP)
        monkeypatch.setattr(lease, "SWAP_TIMEOUT_S", 0.3)
        started = time.monotonic()
        with pytest.raises(RunBusy):
            RunLease(tmp_path, "r1").acquire(wait_s=1.0)
        assert time.monotonic() - started < 10
        holder.send_signal(signal.SIGCONT)
        holder.communicate(timeout=30)  # thawed, it lets go: the takeover goes through
        again = RunLease(tmp_path, "r1")
        again.acquire()
        assert again.takeover is not None
        again.release()
    finally:
        holder.kill()
        holder.wait()


# -- takeover decisions (pure) --------------------------------------------------------------------
def _snap(**kw: object) -> takeover.Snapshot:
    nodes = tuple(
        takeover.NodeRecord(kind="node", attempt=2, node=n, pid=10 + n, create_time=1.0)
        for n in range(2)
    )
    base: dict[str, object] = {
        "previous": _dead_owner(),
        "nodes": nodes,
        "alive": frozenset({0, 1}),
        "strays": 4,
        "last_event_t": 1000.0,
        "attempt_ended": False,
        "last_step": 13,
        "last_commit": 10,
        "now": 1005.0,
    }
    return takeover.Snapshot(**{**base, **kw})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Decision:
    name: str
    snap: dict[str, object]
    action: takeover.Action
    steps_lost: int


DECISIONS = [
    Decision("healthy", {}, takeover.Action.ADOPT, 0),
    Decision("node-gone", {"alive": frozenset({0})}, takeover.Action.END, 3),
    Decision("quiet-too-long", {"now": 1000.0 + 500}, takeover.Action.END, 3),
    Decision("no-progress-ever", {"last_event_t": None}, takeover.Action.END, 3),
    Decision("already-ended", {"attempt_ended": True}, takeover.Action.END, 3),
    Decision("strays-only", {"alive": frozenset(), "strays": 2}, takeover.Action.END, 3),
    Decision("all-gone", {"alive": frozenset(), "strays": 0}, takeover.Action.NOTHING, 0),
]


@pytest.mark.parametrize("d", DECISIONS, ids=[d.name for d in DECISIONS])
def test_takeover_decision(d: Decision):
    plan = takeover.decide(_snap(**d.snap))
    assert plan.action == d.action, plan.reason
    assert plan.steps_lost == d.steps_lost
    assert plan.attempt == 2
    assert (plan.nodes != ()) == (d.action == takeover.Action.ADOPT)


def test_a_forged_lease_names_no_process_of_ours(tmp_path: Path):
    """A lease naming an untagged process (its real pid and start time, readable by anyone from
    /proc) and an exit file elsewhere: takeover sees nothing of the dead owner alive, ends
    nothing, and an adopted node's exit file is the run's own."""
    from tasks.backends.local_nodes import NodeProcess

    victim = subprocess.Popen(["sleep", "60"])
    try:
        created = psutil.Process(victim.pid).create_time()
        elsewhere = tmp_path / "elsewhere.exit"
        elsewhere.write_text("0\n")
        dead = _dead_owner()
        node = {"kind": "node", "attempt": 1, "node": 0, "pid": victim.pid,
                "create_time": created, "exit_file": str(elsewhere)}  # fmt: skip
        forged = LeaseRecord("r1", dead.owner, time.time(), (node, {"kind": "node", "pid": "x"}))
        snap = takeover.gather(forged, tmp_path / "run")
        assert snap.alive == frozenset() and snap.strays == 0
        plan = takeover.decide(snap)
        assert plan.action == takeover.Action.NOTHING, plan.reason
        assert takeover.carry_out(plan, forged, tmp_path / "run") == []
        # Tagged as the dead owner's, the same process would count as its node.
        assert not processes.carries(victim.pid, created, tmp_path / "run", "deadbeef")
        adopted = NodeProcess.from_record(
            takeover.NodeRecord.model_validate(node), tmp_path / "run"
        )
        assert adopted.exit_file == tmp_path / "run" / "logs" / "attempt1-node0.exit"
        assert victim.poll() is None  # never signalled
    finally:
        victim.kill()
        victim.wait()


def test_a_tagged_process_of_the_dead_owner_is_its_node(tmp_path: Path):
    run_root = tmp_path / "run"
    env = {**os.environ, **processes.tags(run_root, "deadbeef")}
    node_proc = subprocess.Popen(["sleep", "60"], env=env)
    try:
        created = psutil.Process(node_proc.pid).create_time()
        deadline = time.monotonic() + 5  # the environment is readable once exec is done
        while not processes.carries(node_proc.pid, created, run_root, "deadbeef"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        dead = _dead_owner()
        node = {"kind": "node", "attempt": 1, "node": 0, "pid": node_proc.pid,
                "create_time": created}  # fmt: skip
        snap = takeover.gather(LeaseRecord("r1", dead.owner, time.time(), (node,)), run_root)
        assert snap.alive == frozenset({0})
        assert not processes.carries(node_proc.pid, created, run_root, "another")
    finally:
        node_proc.kill()
        node_proc.wait()


# -- the embedded S3 server -----------------------------------------------------------------------
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_squatter_on_the_embedded_port_is_refused(tmp_path: Path):
    port = int(EMBEDDED_ENDPOINT.rsplit(":", 1)[1])
    if not _port_free(port):
        pytest.skip(f"port {port} is in use on this machine")
    squatter = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 20
        while _port_free(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(StorageError, match=f"pid {squatter.pid}.*not this state directory"):
            ensure_local_s3(S3Settings(endpoint_url=EMBEDDED_ENDPOINT), tmp_path, user="u")
        assert not (tmp_path / "s3" / "users").exists() or not any(
            (tmp_path / "s3" / "users").iterdir()
        )
    finally:
        squatter.kill()
        squatter.wait()


_USER_SCRIPT = """
import sys, time
from pathlib import Path
from tasks.storage.local_s3 import ensure_local_s3
from tasks.storage.s3 import S3Settings
ensure_local_s3(S3Settings(endpoint_url=sys.argv[1]), Path(sys.argv[2]), user="child")
print("registered", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_server_is_shared_by_reference_and_a_dead_user_does_not_hold_it(tmp_path: Path):
    port = free_s3_port()
    endpoint = f"http://127.0.0.1:{port}"
    settings = S3Settings(endpoint_url=endpoint)
    first = ensure_local_s3(settings, tmp_path, user="first")
    assert first is not None and first.started_here
    server = recorded_server(tmp_path / "s3", port)
    assert server is not None
    # A second user (a killed orchestrator, in the end) registers, then dies without a word.
    child = subprocess.Popen(
        [sys.executable, "-c", _USER_SCRIPT, endpoint, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"registered"
    second = ensure_local_s3(settings, tmp_path, user="second")
    assert second is not None and not second.started_here  # identified as ours, shared
    first.release()
    assert server.is_running()  # "second" still uses it
    child.kill()
    child.wait()
    second.release()  # the last live user out stops it; the dead child does not hold it
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert recorded_server(tmp_path / "s3", port) is None


# -- whole invocations ----------------------------------------------------------------------------
def _cli(params: dict[str, object], prefect_api: str, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "flows.cli", "run", "--json"]
    for k, v in params.items():
        argv += ["--set", f"{k}={v}"]
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.Popen(
        [*argv, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )


def _result(stdout: str) -> PipelineResult:
    return PipelineResult.model_validate_json(stdout.strip().splitlines()[-1])


def _cli_params(state: Path, s3: S3Settings, run_id: str, **kw: object) -> dict[str, object]:
    params = make_params(state, s3, run_id=run_id, **kw)
    return {
        "state_dir": params.state_dir,
        "s3_endpoint": params.s3_endpoint,
        "steps": params.steps,
        "nodes": params.nodes,
        "nproc_per_node": params.nproc_per_node,
        "run_id": run_id,
        **kw,
    }


@pytest.mark.slow
# Started together (the race the lock decides). One started while the other trains meets the
# same lease and the same refusal; the CI budget keeps only the race.
@pytest.mark.parametrize("apart_s", [0.0], ids=["0s-apart"])
def test_two_invocations_of_one_run_id_exactly_one_trains(
    apart_s: float, baseline: PipelineResult, prefect_server, s3_settings, tmp_path: Path
):
    run_id = f"twice-{int(apart_s)}"
    params = _cli_params(tmp_path, s3_settings, run_id)
    first = _cli(params, prefect_server)
    time.sleep(apart_s)
    second = _cli(params, prefect_server)
    outs = [p.communicate(timeout=600) for p in (first, second)]
    codes = [first.returncode, second.returncode]
    assert sorted(codes) == [0, 1], (codes, [o[1][-2000:] for o in outs])
    winner, loser = (outs[0], outs[1]) if codes[0] == 0 else (outs[1], outs[0])
    assert "is being run by pid" in loser[1] and "exactly one writer" in loser[1], loser[1][-2000:]
    result = _result(winner[0])
    assert result.status == "completed" and result.final_step == 20 and result.takeover is None
    assert result.params_sha256 == baseline.params_sha256
    run_root = tmp_path / "fsx" / "runs" / run_id
    events = read_events(run_root)
    assert sum(1 for e in events if e["kind"] == "stage_attempt") == 1  # only one ever trained
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(1, 21))
    assert _result(loser[0]).run_id == run_id and _result(loser[0]).status == "failed"
    assert not (run_root / "owner.lease").exists()
    assert processes.tagged(run_root) == []


@dataclass(frozen=True)
class Crash:
    name: str
    also_kill_node: bool  # the dead orchestrator's job is not healthy any more
    action: str


CRASHES = [Crash("healthy-job-adopted", False, "adopt"), Crash("broken-job-ended", True, "end")]


@pytest.mark.slow
@pytest.mark.parametrize("sc", CRASHES, ids=[c.name for c in CRASHES])
def test_orchestrator_sigkilled_mid_train_then_rerun(
    sc: Crash, baseline: PipelineResult, prefect_server, tmp_path: Path, capsys
):
    port = free_s3_port()
    s3 = S3Settings(endpoint_url=f"http://127.0.0.1:{port}")  # this run's own server
    run_id = f"crash-{sc.name}"
    # Slowed (0.5 s a step) until the re-run's takeover, so that the kill comes mid-train; the
    # re-run's own steps need no pace (a relaunch from step 5 spent 7 s sleeping).
    slowed = "tests.adversarial.workloads:PACED_UNTIL_TAKEOVER_GPT"
    params = _cli_params(tmp_path, s3, run_id, workload=slowed, ckpt_interval=5)
    run_root = RunContext.create(make_params(tmp_path, s3, run_id=run_id)).run_root
    first = _cli(params, prefect_server)
    deadline = time.monotonic() + 300
    # Mid-train, with a commit behind it (the step-5 save commits a few steps later).
    while not any(e["kind"] == "checkpoint" for e in read_events(run_root)):
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)  # the orchestrator alone: its nodes and S3 server live on
    first.wait()
    capsys.readouterr()
    assert main(["status", run_id, "--state-dir", str(tmp_path), "--json"]) == 0
    owner = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["owner"]
    assert owner["pid"] == first.pid and owner["alive"] is False  # status says it is gone
    left = processes.tagged(run_root)
    assert left, "the simulated nodes outlive their orchestrator"
    old_invocation = {t.invocation for t in left}
    server = recorded_server(tmp_path / "s3", port)
    assert server is not None and server.is_running()
    if sc.also_kill_node:
        rec = LeaseRecord.parse((run_root / "owner.lease").read_text())
        assert rec is not None
        [node1] = [r for r in rec.resources if r.get("kind") == "node" and r["node"] == 1]
        kill_tree(int(node1["pid"]))

    again = _cli(params, prefect_server)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-4000:]
    result = _result(out)
    assert result.status == "completed" and result.final_step == 20
    assert result.params_sha256 == baseline.params_sha256  # nothing lost, bitwise
    events = read_events(run_root)
    [took] = [e for e in events if e["kind"] == "takeover"]
    if sc.action == "adopt":
        assert took["action"] == "adopt", took
    # The result says what the crash cost.
    assert result.takeover is not None and result.takeover.action == took["action"]
    assert result.takeover.steps_lost == took["steps_lost"]
    assert f"pid {first.pid} " in result.takeover.previous_owner
    after = [e for e in events if e["t"] >= took["t"]]
    attempts = [e for e in after if e["kind"] == "stage_attempt"]
    if sc.action == "adopt":
        assert took["steps_lost"] == 0
        assert [bool(a.get("adopted")) for a in attempts] == [True]  # watched, not relaunched
        steps = [e["step"] for e in events if e["kind"] == "step"]
        assert steps == list(range(1, 21))  # no step replayed: the crash cost no training
    else:
        # Ended before anything new started (or, had the survivor given up by itself before the
        # takeover looked, nothing was left to end): never two trainings side by side.
        assert attempts and not attempts[0].get("adopted") and took["t"] < attempts[0]["t"]
        survivors = {t.pid for t in left if psutil.pid_exists(t.pid)}
        assert took["action"] in ("end", "nothing")
        assert survivors <= set(took["ended_pids"]) | {p for p in survivors if not _alive(p)}
        loaded = [e for e in after if e["kind"] == "resume" and e.get("action") == "loaded"]
        assert loaded and loaded[0]["step"] >= 5  # resumed from a commit, not step 0
        # A fresh attempt of a new invocation, not an in-job respawn of the dead one's.
        assert not [e for e in after if e["kind"] == "restart"], after
    assert result.faults == []
    # Nothing of the first invocation survives the re-run, nor of the re-run itself.
    assert [t for t in processes.tagged(run_root) if t.invocation in old_invocation] == []
    assert processes.tagged(run_root) == []
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert not (run_root / "owner.lease").exists()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_orchestrator_sigterm_ends_everything_it_started(prefect_server, tmp_path: Path):
    """A stop request (a scheduler, `kill`, Prefect cancelling the process) unwinds the run: its
    nodes, its S3 server and its lease go with it."""
    port = free_s3_port()
    s3 = S3Settings(endpoint_url=f"http://127.0.0.1:{port}")
    run_id = "sigterm"
    params = _cli_params(tmp_path, s3, run_id, workload="tests.adversarial.workloads:SLOW_GPT")
    run_root = RunContext.create(make_params(tmp_path, s3, run_id=run_id)).run_root
    proc = _cli(params, prefect_server)
    deadline = time.monotonic() + 300
    while not any(e["kind"] == "step" for e in read_events(run_root)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    server = recorded_server(tmp_path / "s3", port)
    assert server is not None and processes.tagged(run_root)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert processes.tagged(run_root) == [], err[-3000:]
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert not (run_root / "owner.lease").exists()
    # A stop asked for is reported as such, not as a failure.
    saved = PipelineResult.model_validate_json((run_root / "pipeline_result.json").read_text())
    assert saved.status == "cancelled"
    events = nvrx_events(run_id, expect="nvrx.run.cancelled")
    assert "nvrx.run.cancelled" in [e.event for e in events]
    assert "nvrx.run.failed" not in [e.event for e in events]


@pytest.mark.slow
def test_a_lease_taken_over_mid_train_leaves_the_nodes_to_the_new_owner(
    dataset: Path, tmp_path: Path
):
    """Two orchestrators that both believe they hold the lease, with real processes: the old
    one watches its attempt (ft_launcher, 2 simulated nodes) when another host's invocation
    takes the lease over (the lock lost). Its watch stops at the next poll with LeaseLost; the
    nodes, now the new owner's, are not signalled: they train on and complete by themselves."""
    from tasks.backends.base import LaunchRequest
    from tasks.backends.local import LocalBackend
    from tasks.backends.local_nodes import exit_file
    from tasks.ownership.lease import LeaseLost
    from tasks.train_stage import run_attempt
    from tests.helpers import make_config

    # Slowed (the same maths), so that the nodes still train when the watch stops.
    cfg = make_config(
        tmp_path / "run", dataset, steps=12, workload="tests.adversarial.workloads:SLOW_GPT"
    )
    cfg.run_root.mkdir(parents=True)
    old = RunLease(cfg.run_root, "r-lost", heartbeat_s=0.2)
    old.acquire()

    def on_event(e: Event) -> None:
        # Mid-train another host takes over, and beats as a real owner does (atomically, every
        # step): the old owner's compare-and-swap holds no lock here (the lock was lost), so a
        # single write could be overwritten by its heartbeat between its read and its write.
        if isinstance(e, Step) and e.step >= 2:
            new = Owner("newowner", os.getpid(), "other-host", time.time(), time.time())
            rec = LeaseRecord("r-lost", new, time.time())
            write_text_atomic(cfg.run_root / "owner.lease", rec.to_json())

    request = LaunchRequest(
        run_id="r-lost", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1, deadline_s=300,
        invocation=old.owner.invocation,
    )  # fmt: skip
    try:
        with pytest.raises(LeaseLost, match="taken over by pid .* on other-host"):
            run_attempt(LocalBackend(), request, on_event=on_event, check_owner=old.check)
        nodes = [t.process for t in processes.tagged(cfg.run_root)]
        assert nodes, "the attempt's processes were ended"
        deadline = time.monotonic() + 240
        exits = [exit_file(cfg.run_root, 1, n) for n in range(2)]
        while not all(f.exists() for f in exits):
            assert time.monotonic() < deadline, "the nodes never finished"
            time.sleep(0.5)
        assert [f.read_text().strip() for f in exits] == ["0", "0"]
        result = json.loads((cfg.run_root / "result.json").read_text())
        assert result["status"] == "completed" and result["final_step"] == 12
        events = read_events(cfg.run_root)
        assert not [e for e in events if e["kind"] in ("stage_attempt_end", "fenced")]
    finally:
        old.release()
        processes.end([t.process for t in processes.tagged(cfg.run_root)])
