"""The snapshot of a rank's state that a save writes: CPU buffers the size of the state,
allocated once and refilled on every save while the state layout is unchanged, in shared memory
(the writer process receives a handle, not the bytes; page-locked too when the source is on
CUDA). A ``DTensor`` is staged as ``DTensor(cpu_buffer, source._spec)``: same global shape,
placements and mesh (the DCP planner makes the same plan, the cached plan stays valid), its
local tensor on the CPU.

The copy (:class:`Copier`) is required on CPU too ("moving to CPU" is a no-op for CPU tensors:
the writer would read the live parameters while ``optimizer.step()`` mutates them, measured
corrupt checkpoints). A memory save's bytes leave the device the same way (:class:`DeviceCopy`).
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import (
    _copy_state_dict,
    _identity_func,
    _iterate_state_dict,
)
from torch.distributed.tensor import DTensor


class Copier:
    """The staging copy. On CPU it runs on the calling thread and is complete when ``copy_``
    returns: nothing is ever in flight. On CUDA, device-to-host copies on a side stream that
    first waits on the current stream (so it sees the finished optimizer step); an event
    recorded behind them tells when they are done. Nothing here synchronizes the device."""

    def __init__(self, device: torch.device) -> None:
        self.non_blocking = device.type == "cuda"
        self.event: torch.cuda.Event | None = None
        if self.non_blocking:
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            # Created on the training thread after its current stream is set up (as DCP's
            # DefaultStager does), never the default stream.
            self.stream = torch.cuda.Stream(device=device)
        self.device = device

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        if not self.non_blocking:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # even after a failed copy: whatever was enqueued must be waited for
            event = torch.cuda.Event()
            event.record(self.stream)
            self.event = event

    @property
    def in_flight(self) -> bool:
        return self.event is not None

    def query(self) -> bool:
        """Whether the last copy has completed (and forget it if so)."""
        if self.event is None:
            return True
        if self.event.query():
            self.event = None
            return True
        return False

    # The event is read once into a local: a memory save's sealing thread may clear it
    # (synchronize) while the training thread's optimizer hook orders its stream on it.
    def order_current_stream(self) -> None:
        """Make work queued after this call on the current stream run after the copy."""
        event = self.event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Block the host until the copy has completed."""
        event = self.event
        if event is not None:
            event.synchronize()
            self.event = None


def local_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor of a state dict, a DTensor as its local shard, in traversal order."""
    if isinstance(obj, DTensor):
        return [obj._local_tensor]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in local_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in local_tensors(v)]
    return []


def _signature(obj: Any) -> Any:
    """The state layout that the staging buffers (and the cached DCP plan) depend on: structure,
    and per tensor its local shape, dtype, device type and, for a DTensor, its global shape and
    placements. Values of non-tensor entries (a learning rate) are not part of it."""
    if isinstance(obj, ShardedTensor):
        raise TypeError("ShardedTensor (FSDP1) state is not supported: use FSDP2 (DTensor)")
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        return (
            "D",
            tuple(local.shape),
            local.dtype,
            local.device.type,
            tuple(obj.shape),
            tuple(obj.placements),
        )
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return ("{", tuple((k, _signature(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("[" if isinstance(obj, list) else "(", tuple(_signature(v) for v in obj))
    return type(obj).__name__


class Staging:
    """The buffers, built and filled with torch's ``_iterate_state_dict`` and
    ``_copy_state_dict``. Not ``_create_cpu_state_dict``: it gives 0-dim tensors a buffer that
    is neither shared nor pinned (on CUDA a copy into pageable memory makes the host wait for
    the stream) and returns a 0-dim DTensor itself, i.e. the live device tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.key: Any = None
        self.buffers: list[torch.Tensor] = []  # local CPU tensors, in traversal order
        self.reallocated = False
        self._copier: Copier | None = None

    @property
    def copier(self) -> Copier:
        if self._copier is None:
            self._copier = Copier(self.device)
        return self._copier

    @staticmethod
    def _alloc(src: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(tuple(src.shape), dtype=src.dtype, device="cpu")
        # Shared memory: the writer process receives a handle, not a copy of the bytes.
        buf.share_memory_()
        nbytes = buf.numel() * buf.element_size()
        if src.device.type == "cuda" and nbytes > 0:
            # Page-lock the shared buffer once (cudaHostRegister, as torch's own
            # _create_cpu_state_dict(pin_memory=True, share_memory=True) does) so the
            # device-to-host copy is truly asynchronous and runs at full speed.
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.pin_memory(buf.data_ptr(), nbytes)
            weakref.finalize(buf, _pin_memory_utils.unpin_memory, buf.data_ptr())
        return buf

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the buffers; returns the staged state (CPU tensors only).

        On CUDA the copy may still be in flight when this returns (see ``copier``)."""
        key = _signature(state_dict)
        self.reallocated = key != self.key
        if self.reallocated:
            self.key = None
            self.buffers = []
        reuse = iter(self.buffers)
        fresh: list[torch.Tensor] = []

        def buffer_for(local: torch.Tensor) -> torch.Tensor:
            if self.reallocated:
                buf = self._alloc(local)
                fresh.append(buf)
                return buf
            return next(reuse)

        def tensor_func(obj: torch.Tensor, _pg: Any, _device: Any, _c: Any) -> torch.Tensor:
            return buffer_for(obj)

        def dtensor_func(obj: DTensor, _pg: Any, _device: Any, _c: Any) -> DTensor:
            # Same spec (mesh, placements, global shape and stride), CPU local tensor. Never
            # DTensor.from_local(buf, mesh): that moves the buffer to the mesh's device.
            return DTensor(buffer_for(obj._local_tensor), obj._spec, requires_grad=False)

        with torch.no_grad():
            target = _iterate_state_dict(
                state_dict, _identity_func, dtensor_func, tensor_func, type_check=False
            )
            if self.reallocated:
                self.buffers = fresh
                self.key = key
            with self.copier.copying():
                staged = _copy_state_dict(
                    state_dict, target, non_blocking=self.copier.non_blocking, type_check=False
                )
        return staged


class DeviceCopy:
    """How a memory save's bytes (node_copy) leave ``device``. On CPU the copy *is* the save:
    synchronous, on the training thread, complete when it returns. On CUDA the training thread
    only launches it, as :class:`Copier` does:

    - each generation's buffer (a mapping of node memory, kept across saves) is page-locked once
      when it is made (:meth:`pin`, as :meth:`Staging._alloc` pins the durable save's buffers) and
      unregistered before it is unmapped, so the copy runs at the pinned floor and truly
      asynchronously (into pageable memory the host would wait for the stream);
    - the sealing thread waits on the copy's event before it digests the bytes;
    - until then every optimizer step first makes its stream wait on it (a global optimizer-step
      pre-hook, installed while this object lives): the copy must see this step's parameters and
      moments, not the next step's. The host is never blocked by it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copier = Copier(device)
        self._pinned: dict[int, int] = {}  # id(mapping) -> the registered address
        self._hook: Any = None
        if self.copier.non_blocking:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            copier = self.copier
            self._hook = register_optimizer_step_pre_hook(lambda *_: copier.order_current_stream())

    def pin(self, mm: mmap.mmap) -> None:
        """Page-lock a generation's new buffer (CUDA only; once per mapping)."""
        if not self.copier.non_blocking or id(mm) in self._pinned or len(mm) == 0:
            return
        from torch.cuda import _pin_memory_utils

        view = torch.frombuffer(mm, dtype=torch.uint8)
        ptr = view.data_ptr()
        del view  # an exported buffer would keep the mapping from closing
        _pin_memory_utils.pin_memory(ptr, len(mm))
        self._pinned[id(mm)] = ptr

    def unpin(self, mm: mmap.mmap) -> None:
        """Before a pinned buffer is unmapped (no copy is in flight: the caller waited)."""
        ptr = self._pinned.pop(id(mm), None)
        if ptr is not None:
            from torch.cuda import _pin_memory_utils

            with contextlib.suppress(AssertionError):  # already gone with its context
                _pin_memory_utils.unpin_memory(ptr)

    def close(self) -> None:
        self.copier.synchronize()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
