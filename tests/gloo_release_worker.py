"""Two gloo ranks: rank 1 raises while it holds an FSDP2 model; rank 0 waits in an all-reduce.

``python gloo_release_worker.py RANK PORT MODE`` with MODE ``release`` (rank 1 calls
``release_process_groups`` on the exception's traceback) or ``keep`` (it only holds on). Rank 0
prints how its collective ended: ``PEER-ERROR <message>``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer.gloo_release import release_process_groups

PG_TIMEOUT_S = 4


def train_then_raise() -> None:
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    optim.step()
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("injected")
    # Rank 0: the next collective, which rank 1 never joins.
    dist.all_reduce(torch.ones(1))


def main() -> int:
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        train_then_raise()
    except RuntimeError as e:
        if rank == 0:
            print("PEER-ERROR", str(e).splitlines()[0], flush=True)
            # Out now, past the interpreter's teardown: destroying a gloo group that timed out
            # while its peer still holds the connections can abort in C++ ("terminate called
            # without an active exception", SIGABRT), which is not what this drill measures.
            os._exit(0)
        if mode == "release":
            release_process_groups(e.__traceback__)
        # The process lives on (an in-process restart would follow): only a closed connection,
        # not an exit, can release rank 0 before its timeout.
        time.sleep(PG_TIMEOUT_S + 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
