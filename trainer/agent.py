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
"""

from __future__ import annotations

import inspect
import sys
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
    freeze_drill = options.get("--freeze-drill") == "yes"
    beat = _beat(options["--beat"], freeze_drill=freeze_drill) if "--beat" in options else None
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
