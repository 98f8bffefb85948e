"""The NVRx surface this project uses, resolved once by feature detection (0.4.1 ... 0.7.x).

0.4.1 is the newest wheel for Python 3.11 / glibc 2.36; 0.7.0 needs Python 3.12 + glibc 2.39,
deprecates in-process restart and adds NVML health checks that fail without a GPU. Everything
version-dependent is decided here so the rest of the trainer reads the same on both.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import logging
import os
import queue
from typing import Any

from nvidia_resiliency_ext.checkpointing.async_ckpt import core as _core
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as _fs_async
from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver as _saver

log = logging.getLogger(__name__)

FileSystemWriterAsync = _fs_async.FileSystemWriterAsync
AsyncCallsQueue, AsyncRequest = _core.AsyncCallsQueue, _core.AsyncRequest
_PLAN_PARAMS = set(inspect.signature(_saver.save_state_dict_async_plan).parameters)


def version() -> str:
    try:
        return importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def save_state_dict_async_plan(state_dict: Any, writer: Any, **kwargs: Any) -> Any:
    """``state_dict_saver.save_state_dict_async_plan`` with only the keywords this NVRx knows."""
    return _saver.save_state_dict_async_plan(
        state_dict, writer, **{k: v for k, v in kwargs.items() if k in _PLAN_PARAMS}
    )


def new_metadata_cache() -> Any:
    """A per-checkpointer plan cache (the save plan is identical from one save to the next)."""
    cls = getattr(_saver, "CheckpointMetadataCache", None)
    if cls is None or "metadata_cache" not in _PLAN_PARAMS:
        return None
    return cls()


def warm_write_results_queue() -> None:
    """Create NVRx's lazily made results-queue Manager (a spawn, ~1 s) now, not in the first
    save. Not thread-safe against a save planning meanwhile (two Managers): the caller waits."""
    getter = getattr(_fs_async, "_get_write_results_queue", None)
    if getter is not None:
        getter()


def fork_write_results_queue() -> bool:
    """Create NVRx's results-queue Manager by forking this process, if none exists: its server
    unpickles torch types, so a spawned one imports torch on the first save's results (the
    first finalize waited 2.8 s for it). False where this NVRx keeps no such queue."""
    if not hasattr(_fs_async, "_results_queue") or not hasattr(
        _fs_async, "_get_write_results_queue"
    ):
        return False
    if _fs_async._results_queue is None:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("fork"))
        manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
        _fs_async._results_queue = manager.Queue()
    return True


def write_results_queue_ready() -> bool:
    """Whether NVRx's results-queue Manager exists (a save can plan without starting it)."""
    return getattr(_fs_async, "_results_queue", True) is not None


def stop_write_results_queue() -> None:
    """At the worker's end: kill NVRx's results-queue Manager now, and forget it. Left to its
    exit finalizer (a join of up to 1 s; having imported torch it takes 0.8-1.0 s to wind down),
    every worker's exit waited ~1 s. Nothing is lost once every save is finalized or abandoned;
    a later save in this process starts a new one."""
    results = getattr(_fs_async, "_results_queue", None)
    process = getattr(getattr(results, "_manager", None), "_process", None)
    if process is None:
        return
    if process.is_alive():
        process.kill()
        process.join(5)
    _fs_async._results_queue = None


def discard_write_results() -> int:
    """Empty NVRx's process-wide write-results queue; how many results were dropped. The writer
    puts one item per save and a finalize takes the oldest: an abandoned save's item would give
    the next finalize that save's DCP ``.metadata`` (a checkpoint that does not load, or that
    hides its own write error)."""
    results = getattr(_fs_async, "_results_queue", None)
    dropped = 0
    while results is not None:
        try:
            results.get_nowait()
        except queue.Empty:
            break
        dropped += 1
    return dropped


def start_persistent_writer(queue: Any, request: Any, *, rank: int, fork: bool = False) -> str:
    """Schedule ``request`` on a persistent ``AsyncCallsQueue``, starting its writer, before any
    process group exists (the caller's rank is set so NVRx does not ask ``get_rank()``); returns
    how the writer started. NVRx spawns it: an interpreter that imports torch first (4.5 s for a
    lone worker, 7-16 s with 2-3 workers on 2 cores). With ``fork`` (the caller's word that no
    other thread runs and CUDA is untouched) this process is forked to run NVRx's own loop on
    its own queues: ready at once. An NVRx whose caller looks unexpected spawns as usual."""
    caller = queue._get_async_caller()
    if getattr(caller, "rank", None) is None:
        caller.rank = rank
    how = "spawn"
    if fork and _can_fork_writer(caller):
        import multiprocessing as mp

        level = logging.getLogger(_core.__name__).getEffectiveLevel()
        process = mp.get_context("fork").Process(
            target=_with_parent(type(caller).async_loop),
            args=(rank, caller.queue, caller.preload_q, caller.comp_q, level),
        )
        process.start()
        caller.process = process  # NVRx's schedule_async_call starts none when one is set
        how = "fork"
    queue.schedule_async_request(request)
    return how


def _die_with_parent(parent: int) -> None:
    """In a forked helper: die with the worker (PR_SET_PDEATHSIG), or a killed worker leaves its
    forked writer and Manager blocked for good on queues nobody feeds."""
    _pdeathsig(parent)
    # The same for what it forks: NVRx's writer forks a process per write, and the death signal
    # is not inherited, so a killed writer would orphan it, holding the staged shared memory.
    forking: list[int] = []
    os.register_at_fork(
        before=lambda: forking.append(os.getpid()),
        after_in_parent=forking.clear,
        after_in_child=lambda: _pdeathsig(forking.pop() if forking else os.getppid()),
    )


def _pdeathsig(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the one that forked it) dies; exit now if it has."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def _with_parent(loop: Any) -> Any:
    parent = os.getpid()

    def run(*args: Any) -> None:
        _die_with_parent(parent)
        loop(*args)

    return run


_WRITER_LOOP_ARGS = ["rank", "queue", "preload_q", "comp_q", "log_level"]


def _can_fork_writer(caller: Any) -> bool:
    """NVRx's persistent caller as 0.4.1 has it: no process yet, its queues, its loop's args."""
    loop = getattr(type(caller), "async_loop", None)
    if loop is None or getattr(caller, "process", False) is not None:
        return False
    if not all(hasattr(caller, name) for name in ("queue", "preload_q", "comp_q")):
        return False
    try:
        params = list(inspect.signature(loop).parameters)
    except (TypeError, ValueError):
        return False
    return params == _WRITER_LOOP_ARGS


# -- in-process restart -----------------------------------------------------------------------
def inprocess_available() -> tuple[bool, str]:
    """Whether ``nvidia_resiliency_ext.inprocess.Wrapper`` can be used, and why not."""
    try:
        from nvidia_resiliency_ext import inprocess
    except Exception as e:  # pragma: no cover - depends on the installed wheel
        return False, f"nvidia_resiliency_ext.inprocess cannot be imported: {e}"
    if not hasattr(inprocess, "Wrapper"):  # pragma: no cover
        return False, f"NVRx {version()} has no inprocess.Wrapper (removed after its deprecation)"
    return True, ""


def disable_device_health_checks(wrapper: Any) -> None:
    """0.7+ chains NVML GPU/NVLink/NIC checks into the restart health check: on CPU they fail
    on every restart. Keep only ours."""
    if hasattr(wrapper, "restart_health_check"):
        wrapper.restart_health_check = getattr(wrapper, "health_check", None)


# -- in-job (ft_launcher) --------------------------------------------------------------------
def no_restart_request_supported() -> bool:
    """Whether this NVRx's launcher takes ``WorkloadAction.ShutdownWorkload`` (0.4.1 does: it
    closes the rendezvous at its next round instead of respawning, and exits 1)."""
    try:
        from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction
    except Exception:  # pragma: no cover - depends on the installed wheel
        return False
    return hasattr(WorkloadAction, "ShutdownWorkload")


def request_no_restart(rank: int, reason: str) -> bool:
    """Ask the ft_launcher that started this worker not to restart the workload. Works before
    (and without) ``RankMonitorClient.init_workload_monitoring``: a worker whose configuration
    is bad may never get that far. False when not under ft_launcher or not supported."""
    from nvidia_resiliency_ext.fault_tolerance.data import FT_LAUNCHER_IPC_SOCKET_ENV_VAR

    path = os.environ.get(FT_LAUNCHER_IPC_SOCKET_ENV_VAR)
    if not path or not no_restart_request_supported():
        return False
    from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest
    from nvidia_resiliency_ext.fault_tolerance.ipc_connector import IpcConnector

    try:
        # The message the launcher's RankMonitorClient would send: (global rank, request).
        IpcConnector(path).send(
            (rank, WorkloadControlRequest(WorkloadAction.ShutdownWorkload, reason[:500]))
        )
    except Exception as e:  # best effort: the no-restart marker still says it
        log.warning("could not ask ft_launcher not to restart: %s", e)
        return False
    return True


def step_section_timeout(client: Any) -> float | None:
    """The ``step`` section's timeout the rank monitor held at connection (maybe an earlier
    incarnation's); None where this NVRx keeps it elsewhere."""
    timeouts = getattr(client, "section_timeouts", None)
    section = getattr(timeouts, "section", None)
    value = section.get("step") if isinstance(section, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def set_timeouts(client: Any, timeouts: Any) -> bool:
    """Tell this rank's monitor to time with ``timeouts`` (``trainer.timeouts.Timeouts``) from
    now on; whether it was told. Through the call NVRx's own ``calculate_and_set_section_timeouts``
    uses (``_set_calculated_timeouts``, applied at once), ours bounded and without its collective;
    an NVRx without it keeps the launch timeouts."""
    send = getattr(client, "_set_calculated_timeouts", None)
    current = getattr(client, "section_timeouts", None)
    if send is None or current is None or not isinstance(getattr(current, "section", None), dict):
        log.warning("this NVRx cannot take learned timeouts: the launch ones stay")
        return False
    try:
        from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionTimeouts

        send(
            new_hb_timeouts=HeartbeatTimeouts(
                initial=float(timeouts.initial.seconds),
                subsequent=float(timeouts.heartbeat.seconds),
                were_calculated=True,
            ),
            new_section_timeouts=SectionTimeouts(
                section={**current.section, **timeouts.sections()},
                out_of_section=float(timeouts.out_of_section.seconds),
                calculated_sections=set(current.section),
                is_out_of_section_calculated=True,
            ),
        )
    except Exception as e:  # the monitor's connection gone: hang detection as launched
        log.warning("the rank monitor did not take the learned timeouts: %s", e)
        return False
    return True
