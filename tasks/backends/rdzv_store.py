"""The rendezvous store of a local elastic job, in a process of its own:
``python -m tasks.backends.rdzv_store --port P``.

ft_launcher's c10d rendezvous keeps its state in a TCPStore that, by default, the agent at the
endpoint hosts: losing that node loses the store, and no survivor can re-form the job (NVRx says
as much of the rendezvous host). A simulated node is any agent, so the local backend hosts the
store apart from all of them (the agents are told ``is_host=false``) and any node may be lost.
It says ``ready`` once it listens (on ``--ready-fd``, a pipe: the store may listen in the
attempt's own network, tasks.backends.netns, where the launcher cannot connect to see), and ends
with its session (the job's ``stop``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.backends.rdzv_store")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ready-fd", type=int, help="a pipe to write 'ready' to once listening")
    args = p.parse_args(argv)
    from datetime import timedelta

    from trainer.stores import tcp_store

    # Listening on --host alone (torch's own server binds every interface: trainer.stores).
    store = tcp_store(
        args.host,
        args.port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    print("ready", flush=True)
    if args.ready_fd is not None:
        import os

        from tasks.backends.netns import READY

        os.write(args.ready_fd, READY)
        os.close(args.ready_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:  # serves from its own threads; nothing to do here but stay up
        time.sleep(3600)
    del store


if __name__ == "__main__":
    sys.exit(main())
