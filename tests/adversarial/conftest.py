"""Run the trainer (one process, world size 1, no launcher) under strace fault injection: kill
it or fail a syscall at an exact point of the checkpoint commit."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.helpers import REPO, RunOutcome, _outcome, _run, ckpt, make_config, write_config
from tests.helpers import worker_env as helper_env
from trainer.config import TrainConfig
from trainer.launch import trainer_args, worker_env

# Commits at steps 2, 4, 6, 8, 10; with keep_last=2 the commit of 6 is the first that prunes
# (step 2). No in-process layer: a SIGKILL ends the process anyway, and fewer processes to trace.
STEPS, INTERVAL, KEEP = 10, 2, 2


def tiny_config(run_root: Path, dataset: Path) -> TrainConfig:
    cfg = make_config(run_root, dataset, steps=STEPS, checkpoint=ckpt(INTERVAL, keep_last=KEEP))
    return replace(cfg, inprocess=replace(cfg.inprocess, enabled=False))


# strace options every tampering gets, chosen by the ``strace_ok`` probe: ``--seccomp-bpf`` where
# the kernel lets strace use it (only the traced syscalls stop the tracee, not every one: the
# trainer's start-up runs at nearly full speed under it), nothing where it does not. Without it
# every syscall of every traced process stops: the trainer's checkpoint writer (a spawned
# interpreter importing torch) took 22.7 s to start instead of 4.5 (measured here).
STRACE_OPTIONS: list[str] = []

KILL = "signal=KILL"
# How a kill is injected: strace holds the thread on entering the syscall (``delay_enter``) and
# the harness SIGKILLs its process there, so the syscall never runs, as with strace's own
# ``signal=KILL``. That one is not used: under ``--seccomp-bpf`` strace 6.1 delivers no signal
# here (the syscall completes; measured), and without seccomp-bpf the run is 3-5x slower.
HOLD = "delay_enter=600s"
# strace -f writes the pid left-justified in 5 columns and a space ("%-5d "): "12345 rename(" but
# "7544  rename(". With one space required, every drill timed out whenever the traced pid had
# fewer than 5 digits (a fresh machine's first processes: the "intermittent" probe timeouts).
SYSCALL_ENTRY = re.compile(r"^(\d+)\s+([a-z0-9_]+)\(")


@dataclass(frozen=True)
class Inject:
    """One strace tampering: ``action`` (``signal=KILL``, ``error=ENOSPC``) at the ``when``-th
    call of ``syscalls`` that touches ``path`` (strace counts only calls matching ``-P``)."""

    syscalls: str
    path: Path
    action: str
    when: int = 1

    def argv(self, log: Path) -> list[str]:
        strace = shutil.which("strace")
        assert strace is not None
        action = HOLD if self.action == KILL else self.action
        # Under --seccomp-bpf, strace 6.1 keeps a thread in syscall-stop mode after a traced
        # call until its next one: with only rare calls traced (a rename), every syscall after
        # one stops the tracee (404 k stops in one life against 55 k, the writer's start-up
        # 16 s against 5; measured). Tracing ``write`` too brings the threads back often; only
        # calls touching ``path`` are logged, and only ``syscalls`` are tampered with.
        traced = self.syscalls if "write" in self.syscalls.split(",") else f"{self.syscalls},write"
        return [
            strace,
            "-f",
            *STRACE_OPTIONS,
            "-qq",
            f"-o{log}",
            f"-P{self.path}",
            f"-etrace={traced}",
            f"-einject={self.syscalls}:{action}:when={self.when}",
        ]

    def held_thread(self, trace: str) -> int | None:
        """The thread strace holds at the ``when``-th matching call (for a kill), once it is
        there: only matching calls are logged, each entry as it is entered."""
        names = set(self.syscalls.split(","))
        entries = [
            int(m.group(1))
            for m in map(SYSCALL_ENTRY.match, trace.splitlines())
            if m and m.group(2) in names
        ]
        return entries[self.when - 1] if len(entries) >= self.when else None


def run_under(cfg: TrainConfig, inject: Inject | None, *, timeout: float = 120) -> RunOutcome:
    """Run the trainer, under ``inject`` if given; returncode -9 when the injection killed it."""
    config = write_config(cfg)
    log = cfg.run_root.parent / f"{cfg.run_root.name}.log"
    argv = [sys.executable, *trainer_args(cfg, config)]
    if inject is None:
        rc = _run(argv, log, timeout, worker_env(config))
    else:
        trace = log.with_suffix(".strace")
        rc = _run_traced(inject, trace, argv, log, timeout, worker_env(config))
    return _outcome(cfg, rc, log.read_text())


def _run_traced(
    inject: Inject,
    trace: Path,
    argv: list[str],
    log_path: Path,
    timeout: float,
    env: dict[str, str],
) -> int:
    """Like ``tests.helpers._run``, under ``inject``. A kill ends the run at once (-9): the held
    thread's process is SIGKILLed, then the whole session (the dead trainer's checkpoint writer
    and its multiprocessing manager would outlive it)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*inject.argv(trace), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**helper_env(), **env},
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if inject.action == KILL and trace.exists():
                    held = inject.held_thread(trace.read_text(errors="replace"))
                    if held is not None:
                        os.kill(held, signal.SIGKILL)  # a thread id: its whole process dies
                        return -9
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout)
                time.sleep(0.05)
            return proc.returncode
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def strace_ok(tmp_path_factory: pytest.TempPathFactory) -> None:
    """strace present and allowed to trace here (ptrace may be forbidden in a container), with
    both tamperings the drills use: a kill on entering a syscall (it never runs) and an error."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    tmp = tmp_path_factory.mktemp("strace")
    probe = tmp / "probe"
    src, dst = str(probe), str(probe.with_suffix(".renamed"))
    code = f"import os; open({src!r}, 'w').close(); os.rename({src!r}, {dst!r})"
    argv = [sys.executable, "-c", code]
    seen = []
    for options in (["--seccomp-bpf"], []):
        STRACE_OPTIONS[:] = options
        try:
            killed = _run_traced(
                Inject("rename", probe, KILL), tmp / "k.strace", argv, tmp / "k.out", 30, {}
            )
        except subprocess.TimeoutExpired:
            seen.append((options, "no held call within 30 s"))
            probe.unlink(missing_ok=True)
            continue
        kept = probe.exists() and not probe.with_suffix(".renamed").exists()
        probe.unlink(missing_ok=True)
        failed = _run_traced(
            Inject("rename", probe, "error=EXDEV"), tmp / "e.strace", argv, tmp / "e.out", 30, {}
        )
        refused = "Invalid cross-device link" in (tmp / "e.out").read_text()
        probe.unlink(missing_ok=True)
        if killed == -9 and kept and failed == 1 and refused:
            return
        seen.append((options, killed, kept, failed))
    pytest.skip(f"strace fault injection does not work here: {seen}")


@pytest.fixture(scope="session")
def fault_free(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    """The same config without faults: what every drill's final parameters must equal."""
    out = run_under(tiny_config(tmp_path_factory.mktemp("adv") / "baseline", dataset), None)
    assert out.returncode == 0, out.log[-3000:]
    return out
