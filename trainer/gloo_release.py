"""Release a raising rank's gloo connections at once, so that its peers' collectives fail now.

gloo collectives cannot be aborted: ``ProcessGroupGloo.abort()`` and ``shutdown()`` return at
once and leave a peer's pending collective blocked (measured; NVRx's ``AbortTorchDistributed``
aborts NCCL only). When one rank raises, its peers sit in their next collective until the
process-group timeout, and only then does the in-process restart begin: the exception's
recovery was that timeout plus the restart (3.4 s with ``pg_timeout_s`` 3).

A gloo group closes its TCP pairs when its last reference goes, and a peer blocked on a closed
pair fails at once ("Connection closed by peer"). So the raising rank, before the exception
leaves the function that the Wrapper restarts, drops every reference it holds to the dead
iteration's groups: the traceback's frames (the model, whose FSDP state holds its shard group),
the default group's registry (``destroy_process_group``), and the registries of the device
meshes that outlive the model in torch's caches (DTensor specs hold their mesh, and a mesh keeps
its groups in ``_pg_registry``). A ``gc.collect`` then frees the cycles modules form with their
hooks. Every group is destroyed by then, so nothing can use what is dropped.

Only for gloo: on NCCL the Wrapper's abort releases the peers, and a destroy on the main thread
could wait on the very collective it is meant to end.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from types import TracebackType

log = logging.getLogger(__name__)


def release_process_groups(tb: TracebackType | None) -> float:
    """Destroy this process's process groups and drop every reference the raised exception's
    frames and torch's device meshes keep to them; returns the seconds it took. Never raises:
    a failure here leaves the peers to their process-group timeout, as before."""
    t0 = time.perf_counter()
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        # Frames that are still executing (the caller's, the Wrapper's) are skipped.
        traceback.clear_frames(tb)
        if dist.is_initialized():
            dist.destroy_process_group()
        for obj in gc.get_objects():
            if isinstance(obj, DeviceMesh):
                registry = getattr(obj, "_pg_registry", None)
                if registry:
                    registry.clear()
        gc.collect()
    except Exception as e:  # best effort: the timeout still releases the peers
        log.warning("could not release the process groups at once: %s", e)
    return time.perf_counter() - t0
