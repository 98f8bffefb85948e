"""Run the trainer (one process, world size 1, no launcher) under strace fault injection: kill
it or fail a syscall at an exact point of the checkpoint commit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.helpers import REPO, RunOutcome, _outcome, _run, make_config, write_config
from tests.helpers import worker_env as helper_env
from trainer.config import TrainConfig
from trainer.launch import trainer_args, worker_env

# Commits at steps 2, 4, 6, 8, 10; with keep_last=2 the commit of 6 is the first that prunes
# (step 2). No in-process layer: a SIGKILL ends the process anyway, and fewer processes to trace.
STEPS, INTERVAL, KEEP = 10, 2, 2


def tiny_config(run_root: Path, dataset: Path) -> TrainConfig:
    cfg = make_config(run_root, dataset, steps=STEPS, ckpt_interval=INTERVAL, keep_last=KEEP)
    return replace(cfg, inprocess=replace(cfg.inprocess, enabled=False))


# strace options every tampering gets, chosen by the ``strace_ok`` probe: ``--seccomp-bpf`` where
# the kernel lets strace use it (only the traced syscalls stop the tracee, not every one: the
# trainer's start-up runs at nearly full speed under it), nothing where it does not.
STRACE_OPTIONS: list[str] = []


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
        return [
            strace,
            "-f",
            *STRACE_OPTIONS,
            "-qq",
            f"-o{log}",
            f"-P{self.path}",
            f"-etrace={self.syscalls}",
            f"-einject={self.syscalls}:{self.action}:when={self.when}",
        ]


def run_under(cfg: TrainConfig, inject: Inject | None, *, timeout: float = 120) -> RunOutcome:
    """Run the trainer, under ``inject`` if given; returncode -9 when strace killed it."""
    config = write_config(cfg)
    log = cfg.run_root.parent / f"{cfg.run_root.name}.log"
    argv = [sys.executable, *trainer_args(cfg, config)]
    if inject is None:
        rc = _run(argv, log, timeout, worker_env(config))
    else:
        trace = log.with_suffix(".strace")
        watch = trace if inject.action == "signal=KILL" else None
        rc = _run_traced([*inject.argv(trace), *argv], log, watch, timeout, worker_env(config))
    return _outcome(cfg, rc, log.read_text())


KILLED = "+++ killed by SIGKILL +++"


def _run_traced(
    argv: list[str], log_path: Path, trace: Path | None, timeout: float, env: dict[str, str]
) -> int:
    """Like ``tests.helpers._run``; with ``trace``, a kill in it ends the run at once (-9):
    strace would wait for every tracee, and the dead trainer's checkpoint writer (and its
    multiprocessing manager) outlive it until the session is killed."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**helper_env(), **env},
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if trace and trace.exists() and KILLED in trace.read_text(errors="replace"):
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
    """strace present and allowed to trace here (ptrace may be forbidden in a container)."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    probe = tmp_path_factory.mktemp("strace") / "probe"
    src, dst = str(probe), str(probe.with_suffix(".renamed"))
    code = f"import os; open({src!r}, 'w').close(); os.rename({src!r}, {dst!r})"
    rcs = []
    for options in (["--seccomp-bpf"], []):
        STRACE_OPTIONS[:] = options
        target = Inject("rename", probe, "signal=KILL")
        rc = _run(
            [*target.argv(probe.with_suffix(".log")), sys.executable, "-c", code],
            probe.with_suffix(".out"),
            30,
        )
        if rc == -9:
            return
        rcs.append(rc)
        probe.unlink(missing_ok=True)
    pytest.skip(f"strace fault injection does not work here (exits {rcs})")


@pytest.fixture(scope="session")
def fault_free(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    """The same config without faults: what every drill's final parameters must equal."""
    out = run_under(tiny_config(tmp_path_factory.mktemp("adv") / "baseline", dataset), None)
    assert out.returncode == 0, out.log[-3000:]
    return out
