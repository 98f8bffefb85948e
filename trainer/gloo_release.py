"""Release a raising rank's gloo connections at once, so that its peers' collectives fail now.

gloo collectives cannot be aborted: ``ProcessGroupGloo.abort()``/``shutdown()`` leave a peer's
pending collective blocked (NVRx's ``AbortTorchDistributed`` aborts NCCL only), so peers of a
raising rank waited out the process-group timeout before the in-process restart began.

A gloo group closes its TCP pairs when its last reference goes, and a peer blocked on a closed
pair fails at once. So the raising rank, before the exception leaves the Wrapper's function,
drops every reference to the dead iteration's groups: the traceback's frames (the model's FSDP
state), the default group (``destroy_process_group``), and the device meshes' ``_pg_registry``
(DTensor specs keep meshes alive in torch's caches); ``gc.collect`` frees the cycles.

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
    """Destroy this process's process groups and drop every reference the exception's frames and
    torch's device meshes keep to them; the seconds it took. Never raises (on failure the peers
    wait out their process-group timeout)."""
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
