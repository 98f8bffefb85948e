"""Before a train attempt that follows a node loss: wait, bounded, until the cluster again has
enough healthy GPU/EFA nodes. The decision is the preflight's own pure node check, re-run on a
fresh node list each poll, so "healthy" means the same thing before the first attempt and
after a loss."""

from __future__ import annotations

import time
from collections.abc import Callable

from tasks.backends.eks.kube import Kube
from tasks.checks import CheckResult, Status
from tasks.errors import CapacityNotRestored as CapacityNotRestored  # raised here
from tasks.preflight.checks import Snapshot
from tasks.preflight.eks import EksRequirements, check_nodes


def wait_for_nodes(
    kube: Kube,
    req: EksRequirements,
    *,
    timeout_s: float,
    poll_s: float,
    log: Callable[[str], None] = lambda msg: None,
) -> CheckResult:
    started = time.monotonic()
    while True:
        snap = Snapshot()
        try:
            snap.facts["nodes"] = kube.nodes()
        except Exception as e:
            snap.errors["nodes"] = f"cannot list nodes: {e}"
        result = check_nodes(snap, req)
        if result.status == Status.PASSED:
            return result
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise CapacityNotRestored(
                f"after {waited:.0f} s (eks.node_wait_s={timeout_s:.0f}) still too few healthy "
                f"nodes: {result.detail}; {result.fix or 'check the node group'}, then re-run "
                "with the same run_id to resume from the newest valid checkpoint"
            )
        log(f"waiting for healthy nodes ({waited:.0f} s): {result.detail}")
        time.sleep(poll_s)
