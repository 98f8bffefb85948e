"""TCPStores that listen where they are told, not on every interface (docs/architecture.md §4,
"Doors").

torch's ``TCPStore`` server binds ``*:PORT`` whatever host it is given, and its clients trust
what it holds (torch elastic's rendezvous state is a pickle). Given a socket already bound to the
host's own address (``master_listen_fd``) it listens there alone. Used for the trainer's store
(one per incarnation, at ``MASTER_PORT``, which :class:`BoundNvrxStore` joins for NVRx) and a
local elastic job's rendezvous store.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
from typing import Any

import torch.distributed as dist


def listening_socket(host: str, port: int) -> int:
    """A listening TCP socket bound to ``host``'s (first) address and ``port``; its file
    descriptor, which the store's server then owns."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock.detach()  # the fd outlives the Python object: the server closes it


def _bound_fd(host: str, port: int) -> int | None:
    """:func:`listening_socket`, or None when ``host`` names no address of this machine: the
    server then binds every interface, as torch would, and says so, rather than not start."""
    try:
        return listening_socket(host, port)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        logging.getLogger(__name__).warning(
            "store on %s:%d: %s is not an address of this machine (%s); listening on every "
            "interface",
            host,
            port,
            host,
            e,
        )
        return None


def _listen_kwargs(fd: int | None) -> dict[str, Any]:
    return {} if fd is None else {"master_listen_fd": fd}


def tcp_store(host: str, port: int, *, is_master: bool, **kwargs: Any) -> dist.TCPStore:
    """A ``TCPStore``; its server (``is_master``) listening on ``host``'s address alone."""
    if is_master:
        fd = _bound_fd(host, port)
        return dist.TCPStore(host, port, is_master=True, **_listen_kwargs(fd), **kwargs)
    return dist.TCPStore(host, port, is_master=False, **kwargs)


def _nvrx_store_base() -> type:
    from nvidia_resiliency_ext.inprocess import store

    return store.TCPStore


class BoundNvrxStore(_nvrx_store_base()):  # type: ignore[misc]
    """NVRx in-process restart's ``TCPStore`` (the Wrapper's ``store_factory``), bound as
    :func:`tcp_store` binds one. As NVRx's: rank 0 hosts, or joins as a client if it cannot.
    With ``join`` every rank is a client of a store hosted already (the trainer's)."""

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        use_libuv: bool = True,
        join: bool = False,
    ) -> None:
        host = host_name if host_name is not None else os.environ["MASTER_ADDR"]
        port = port if port is not None else int(os.environ["MASTER_PORT"])
        world = world_size if world_size is not None else int(os.environ["WORLD_SIZE"])
        kwargs: dict[str, Any] = {
            "host_name": host,
            "port": port,
            "world_size": world,
            "timeout": timeout,
            "wait_for_workers": wait_for_workers,
            "multi_tenant": multi_tenant,
            "use_libuv": use_libuv,
        }
        if not join and int(os.environ["RANK"]) == self.TCP_STORE_HOST_RANK:
            try:
                fd = _bound_fd(host, port)
                dist.TCPStore.__init__(self, is_master=True, **_listen_kwargs(fd), **kwargs)
                return
            except Exception as e:  # as NVRx does: another hosts it, be a client
                logging.getLogger(__name__).debug("not hosting the NVRx store: %s", e)
        dist.TCPStore.__init__(self, is_master=False, **kwargs)
