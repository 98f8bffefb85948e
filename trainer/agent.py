"""Every node's launcher: NVRx's ``ft_launcher`` run in this process, with the node's beat
(:mod:`trainer.node_beat`: it lives through every respawn of the node's workers) and, for an
elastic job, the rendezvous keep-alive it needs:
``python -m trainer.agent [--keep-alive SECONDS:MISSES] [--beat RUN_ROOT:INTERVAL_S]
[--freeze-drill yes] -- ARGS...`` (``--freeze-drill``: the run has a node-freeze drill, whose
marker the beat thread looks for).

NVRx 0.4.1 drops a dead node from the world only after 3 missed renewals 5 s apart, hard-coded
in ``FtRendezvousHandler.from_backend`` (``--rdzv-conf`` does not reach it): a spare's takeover
or an elastic shrink waited 15 s on a node known to be dead. This runs NVRx's own launcher
``main`` with those two settings replaced (feature-detected: otherwise a warning, and NVRx's).

It also ends a node the job turned away (a waiting hot spare, a late replacement, when the
world finishes and closes the rendezvous) with exit 0, not NVRx's 1 (``RendezvousClosedError``):
on EKS that exit 1 could fail the Indexed Job (``backoffLimit: 0``). Only an agent that never
joined a world of this rendezvous is turned away.

A leaving store host looks every 0.1 s, not NVRx's 1 s, whether the other nodes left
(:func:`patch_exit_poll`): up to 1 s off every attempt's end.

An eviction's SIGTERM (a drain, a spot reclaim: docs/architecture.md §4, "Evictions with
notice") is first the node's: its beat says ``leaving`` and its workers are told
(:mod:`trainer.notice`, SIGUSR1) and given the launcher's ``--term-timeout`` to save their step
and leave; only then does NVRx's launcher end what is left, as it always did.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from typing import Any


def patch_keep_alive(interval_s: float, misses: int) -> bool:
    """Every rendezvous this process creates renews every ``interval_s`` and drops a node after
    ``misses`` missed renewals. False: this NVRx has no such setting."""
    try:
        from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rdzv
    except ImportError:
        return False
    original = getattr(rdzv, "RendezvousSettings", None)
    if original is None or getattr(original, "_nvrx_keep_alive", False):
        return original is not None
    params = inspect.signature(original).parameters
    if "keep_alive_interval" not in params or "keep_alive_max_attempt" not in params:
        return False

    def settings(*args: Any, **kwargs: Any) -> Any:
        kwargs["keep_alive_interval"] = timedelta(seconds=interval_s)
        kwargs["keep_alive_max_attempt"] = misses
        return original(*args, **kwargs)

    settings._nvrx_keep_alive = True  # type: ignore[attr-defined]
    # from_backend looks the name up in its module at call time.
    rdzv.RendezvousSettings = settings
    return True


# How often a leaving store host looks whether the other nodes left (NVRx: 1 s, hard-coded).
LEAVE_POLL_S = 0.1


def patch_exit_poll(interval_s: float = LEAVE_POLL_S) -> bool:
    """NVRx 0.4.1's store host, leaving, looks once a second whether every other node has left
    the rendezvous (``clean_rdzv_shutdown``'s hard-coded poll), so every attempt's end waited up
    to 1 s more than its nodes took. This looks every ``interval_s`` instead, otherwise the same
    (the same calls, the same exit-barrier timeout); a non-host, or an agent without the
    attributes it uses, runs NVRx's own. False: an unexpected NVRx (its own stands)."""
    try:
        from nvidia_resiliency_ext.fault_tolerance import launcher
    except ImportError:
        return False
    cls: Any = getattr(launcher, "LocalElasticAgent", None)
    original = getattr(cls, "clean_rdzv_shutdown", None)
    if original is None or list(inspect.signature(original).parameters) != ["self", "close"]:
        return False
    if getattr(original, "_nvrx_exit_poll", False):
        return True
    log = launcher.logger

    def clean_rdzv_shutdown(self: Any, close: bool) -> None:
        handler: Any = getattr(self, "_rdzv_handler", None)
        needed = ("_stop_heartbeats", "remove_this_node", "set_closed", "num_nodes")
        if not getattr(self, "_is_store_host", False) or not all(
            hasattr(handler, n) for n in needed
        ):
            return original(self, close)
        try:
            handler._stop_heartbeats()
            handler.remove_this_node()
            if close:
                handler.set_closed()
            until = time.monotonic() + float(self._exit_barrier_timeout)
            while handler.num_nodes() > 0 and time.monotonic() < until:
                time.sleep(interval_s)
            if handler.num_nodes() > 0:
                log.warning("Some nodes did not leave the rendezvous on time: exiting anyway")
        except Exception as e:  # as NVRx's: the agent is exiting either way
            log.warning("Error while trying to gracefully exit the rendezvous: %s", e)

    clean_rdzv_shutdown._nvrx_exit_poll = True  # type: ignore[attr-defined]
    cls.clean_rdzv_shutdown = clean_rdzv_shutdown
    return True


class Admission:
    """Whether this agent ever joined a world, and whether the rendezvous closed on it first."""

    joined: bool = False
    turned_away: bool = False


def patch_admission(admission: type[Admission] = Admission) -> bool:
    """Record on ``admission`` how this process's rendezvous rounds end. False: an unexpected
    handler (the launcher's exit code then stands)."""
    try:
        from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rdzv
    except ImportError:
        return False
    handler = getattr(rdzv, "FtRendezvousHandler", None)
    original = getattr(handler, "next_rendezvous", None)
    # NVRx raises its own copy of torch elastic's error (_torch_elastic_compat), by this name.
    closed = getattr(rdzv, "RendezvousClosedError", None)
    if handler is None or original is None or closed is None:
        return False
    if getattr(original, "_nvrx_admission", False):
        return True

    def next_rendezvous(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            out = original(self, *args, **kwargs)
        except closed:
            admission.turned_away = not admission.joined
            raise
        admission.joined = True
        return out

    next_rendezvous._nvrx_admission = True  # type: ignore[attr-defined]
    handler.next_rendezvous = next_rendezvous
    return True


class Notice:
    """An eviction's notice, passed on to this node's workers (see the module's docstring)."""

    def __init__(self, beat: Any, wait_s: float) -> None:
        self.beat, self.wait_s = beat, wait_s
        self.told = False
        self.workers: Any = None  # the launcher's newest process context

    def pids(self) -> list[int]:
        return list(self.workers.pids().values()) if self.workers is not None else []

    def on_sigterm(self, original: Any, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and not self.told:
            self.told = True
            if self.beat is not None:
                self.beat.leave()  # first: the watcher names the eviction, and waits for it
            pids = self.pids()
            from trainer.notice import SIGNAL

            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, SIGNAL)
            print(
                f"trainer.agent: SIGTERM (an eviction's notice): workers {pids} told to save "
                f"their step and leave, within {self.wait_s:g} s",
                file=sys.stderr,
                flush=True,
            )
            until = time.monotonic() + self.wait_s
            while time.monotonic() < until and any(_running(p) for p in pids):
                time.sleep(0.1)
        original(signum, frame)  # NVRx's: its launcher ends whatever is left


def _running(pid: int) -> bool:
    """Not ended (a child that exited stays a zombie until the launcher reaps it: it must keep
    its exit code for the launcher, so it is looked at, never waited on here)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def patch_notice(notice: Notice) -> bool:
    """Every handler NVRx's launcher installs for SIGTERM goes through ``notice`` first, and it
    learns each process context the launcher starts. False: an unexpected NVRx (an eviction
    then ends the workers at once, as before: a node loss with nothing saved)."""
    try:
        from nvidia_resiliency_ext.fault_tolerance import launcher
        from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.multiprocessing import (
            api,
        )
    except ImportError:
        return False
    start = getattr(launcher, "start_processes", None)
    original = getattr(api, "_terminate_process_handler", None)
    if start is None or original is None:
        return False

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        notice.workers = start(*args, **kwargs)
        return notice.workers

    def handler(signum: int, frame: Any) -> None:
        notice.on_sigterm(original, signum, frame)

    # Both are looked up in their modules at call time (PContext.start installs the handler).
    launcher.start_processes = start_processes
    api._terminate_process_handler = handler
    signal.signal(signal.SIGTERM, handler)  # before the first workers start, too
    return True


def term_timeout(launcher_args: list[str]) -> float:
    """The launcher's ``--term-timeout`` (trainer.launch always passes it; NVRx's default else)."""
    for i, arg in enumerate(launcher_args):
        name, sep, value = arg.partition("=")
        if name in ("--term-timeout", "--term_timeout"):
            raw = value if sep else (launcher_args[i + 1] if i + 1 < len(launcher_args) else "")
            with contextlib.suppress(ValueError):
                return float(raw)
    return 1800.0


def parse_keep_alive(value: str) -> tuple[float, int]:
    interval, sep, misses = value.partition(":")
    try:
        out = (float(interval), int(misses))
    except ValueError:
        out = (0.0, 0)
    if not sep or out[0] <= 0 or out[1] < 1:
        raise SystemExit(f"--keep-alive: expected SECONDS:MISSES (e.g. 1:3), got {value!r}")
    return out


USAGE = (
    "usage: python -m trainer.agent [--keep-alive SECONDS:MISSES] "
    "[--beat RUN_ROOT:INTERVAL_S] [--freeze-drill yes] -- FT_LAUNCHER_ARGS..."
)


def _options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """This module's options (before ``--``) and ft_launcher's arguments (after it)."""
    if "--" not in args:
        raise SystemExit(USAGE)
    ours, theirs = args[: args.index("--")], args[args.index("--") + 1 :]
    if len(ours) % 2 or not theirs:
        raise SystemExit(USAGE)
    options = dict(zip(ours[::2], ours[1::2], strict=True))
    if (
        set(options) - {"--keep-alive", "--beat", "--freeze-drill"}
        or len(options) != len(ours) // 2
    ):
        raise SystemExit(USAGE)
    return options, theirs


def _beat(value: str, *, freeze_drill: bool) -> Any:
    """The node's beat (trainer.node_beat), from this agent for as long as it lives: its
    workers come and go with every respawn. None where no backend said which node this is."""
    from pathlib import Path

    from trainer.elastic import node_id
    from trainer.node_beat import NodeBeat
    from trainer.rundir import RunDir

    root, sep, interval = value.rpartition(":")
    try:
        interval_s = float(interval)
    except ValueError:
        interval_s = 0.0
    if not sep or not root or not interval_s > 0:
        raise SystemExit(f"--beat: expected RUN_ROOT:INTERVAL_S (e.g. /fsx/run:1), got {value!r}")
    node = node_id()
    if node < 0:
        print(
            "trainer.agent: no node id (NVRX_NODE, JOB_COMPLETION_INDEX): no beat", file=sys.stderr
        )
        return None
    run_dir = RunDir.from_env(Path(root))
    freeze = run_dir.freeze_file(node) if freeze_drill else None
    return NodeBeat(run_dir.beat_file(node), interval_s=interval_s, freeze=freeze)


def main(argv: list[str] | None = None) -> int:
    options, launcher_args = _options(list(sys.argv[1:] if argv is None else argv))
    elastic = "--keep-alive" in options
    if elastic:
        interval, misses = parse_keep_alive(options["--keep-alive"])
        if not patch_keep_alive(interval, misses):
            warnings.warn(
                "this NVRx rendezvous has no keep-alive settings to replace: a lost node is "
                "dropped from the world after NVRx's own keep-alive",
                stacklevel=1,
            )
        patch_admission()
    if not patch_exit_poll():
        warnings.warn(
            "this NVRx's launcher has no clean_rdzv_shutdown to replace: its store host waits "
            "up to 1 s more at every attempt's end",
            stacklevel=1,
        )
    freeze_drill = options.get("--freeze-drill") == "yes"
    beat = _beat(options["--beat"], freeze_drill=freeze_drill) if "--beat" in options else None
    if not patch_notice(Notice(beat, term_timeout(launcher_args))):
        warnings.warn(
            "this NVRx's launcher has no SIGTERM handler to extend: an eviction's notice ends "
            "the workers at once, with nothing saved",
            stacklevel=1,
        )
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_main

    sys.argv = ["ft_launcher", *launcher_args]
    try:
        ft_main()
    except SystemExit as e:
        if e.code not in (0, None) and elastic and Admission.turned_away:
            print(
                "trainer.agent: the job ended while this node waited to join (a hot spare or a "
                "late replacement): turned away, exit 0",
                file=sys.stderr,
                flush=True,
            )
            return 0
        raise
    finally:
        if beat is not None:
            beat.close(done=True)  # whatever the exit code: ended, not frozen
    return 0


if __name__ == "__main__":
    import gc

    try:
        sys.exit(main())
    finally:
        gc.freeze()  # as trainer/__main__.py: skip the exit's walk over torch's objects
