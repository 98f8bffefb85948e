"""The one mapping from failure to retry decision (pure; the Prefect hook is a thin adapter)."""

from __future__ import annotations

from typing import Any

from tasks.errors import CapacityNotRestored, FenceBusy, NodeLost


def stage_retry_allowed(error: BaseException | None) -> bool:
    """A whole train stage is retried only when the in-job layers were exhausted by node loss,
    or when its epoch could not be published past a frozen holder of the fence lock. Every
    other failure repeats on a retry (a bug, bad data, a fault that keeps coming) and must fail
    fast with its cause."""
    return isinstance(error, NodeLost | FenceBusy)


def awaits_capacity(error: BaseException | None) -> bool:
    """The run ended for want of nodes, not for a fault of its own: lost nodes used up its
    stage attempts, or too few came back. The same run, resumed once capacity is back, goes on
    from its newest valid checkpoint (the capacity-restored automation does that)."""
    return isinstance(error, NodeLost | CapacityNotRestored)


def prefect_retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` for the task that runs the train stage."""
    try:
        state.result()
    except BaseException as e:  # the stage's exception comes back out of the failed state
        return stage_retry_allowed(e)
    return False
