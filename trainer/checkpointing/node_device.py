"""How a memory save's bytes leave the device (issue 40, item 3).

On CPU the copy *is* the save: synchronous, on the training thread (``staging.SyncCopy``), into
the generation's mapped buffer, and complete when it returns.

On CUDA the training thread only launches it:

- each generation's buffer (a mapping of node memory, kept across saves by ``NodeMemory``) is
  page-locked once when it is made (``cudaHostRegister``, as ``staging`` pins the durable save's
  shared buffers and torch's own ``_create_cpu_state_dict(pin_memory=True, share_memory=True)``
  does), and unregistered before it is unmapped, so the device-to-host copy runs at the pinned
  floor and truly asynchronously (into pageable memory the host would wait for the stream);
- the copy runs on a side stream that first waits for the training stream (so it sees the
  finished optimizer step), with an event recorded behind it (``staging.CudaSideStreamCopy``);
- the sealing thread waits on that event before it digests the bytes (:meth:`DeviceCopy.wait`);
- until the event has completed, every optimizer step first makes its stream wait on it (a
  global optimizer-step pre-hook, installed while this object lives): the copy must see this
  step's parameters and moments, not the next step's. The host is never blocked by it.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from typing import Any

import torch

from trainer.checkpointing.staging import SyncCopy, make_copier


class DeviceCopy:
    """The copy of one rank's memory saves from ``device`` (see the module's doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copier: SyncCopy = make_copier(device)
        self._pinned: dict[int, int] = {}  # id(mapping) -> the registered address
        self._hook: Any = None
        if self.copier.non_blocking:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            copier = self.copier

            def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                copier.order_current_stream()

            self._hook = register_optimizer_step_pre_hook(before_step)

    @property
    def non_blocking(self) -> bool:
        return self.copier.non_blocking

    def pin(self, mm: mmap.mmap) -> None:
        """Page-lock a generation's new buffer (CUDA only; once per mapping)."""
        if not self.non_blocking or id(mm) in self._pinned or len(mm) == 0:
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

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Around the copy's launch: on CUDA, on the side stream, with the event recorded."""
        with self.copier.copying():
            yield

    def wait(self) -> None:
        """Block the calling thread (the sealing one) until the launched copy has completed."""
        self.copier.synchronize()

    def close(self) -> None:
        self.wait()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
