"""``ft_launcher`` with the rendezvous keep-alive an elastic job needs:
``python -m trainer.agent --keep-alive SECONDS:MISSES -- FT_LAUNCHER_ARGS...``.

NVRx 0.4.1's rendezvous drops a dead node from the world only after it has missed 3 renewals
5 s apart, a setting hard-coded in ``FtRendezvousHandler.from_backend`` (``--rdzv-conf`` does
not reach it). The survivors of a node loss (trainer.elastic) re-form only after that, so a
spare's takeover or an elastic shrink costs 15 s of waiting on a node known to be dead. This
entry point runs NVRx's own launcher ``main`` unchanged, with those two settings replaced.

Feature-detected: where the rendezvous module has no such settings (another NVRx version), the
launcher runs as it is and a warning says so.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from datetime import timedelta
from typing import Any


def patch_keep_alive(interval_s: float, misses: int) -> bool:
    """Make every rendezvous this process creates renew its membership every ``interval_s``
    and drop a node after ``misses`` missed renewals. False: this NVRx has no such setting."""
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


def parse_keep_alive(value: str) -> tuple[float, int]:
    interval, sep, misses = value.partition(":")
    try:
        out = (float(interval), int(misses))
    except ValueError:
        out = (0.0, 0)
    if not sep or out[0] <= 0 or out[1] < 1:
        raise SystemExit(f"--keep-alive: expected SECONDS:MISSES (e.g. 1:3), got {value!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "--keep-alive" or args[2] != "--":
        print(
            "usage: python -m trainer.agent --keep-alive SECONDS:MISSES -- FT_LAUNCHER_ARGS...",
            file=sys.stderr,
        )
        return 2
    interval, misses = parse_keep_alive(args[1])
    if not patch_keep_alive(interval, misses):
        warnings.warn(
            "this NVRx rendezvous has no keep-alive settings to replace: a lost node is dropped "
            "from the world after NVRx's own keep-alive",
            stacklevel=1,
        )
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_main

    sys.argv = ["ft_launcher", *args[3:]]
    ft_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
