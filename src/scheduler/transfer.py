"""Host <-> device copies that never make the host wait for earlier GPU work.

A copy from pageable host memory (``torch.tensor(list, device="cuda")``, or ``.to(device)``
of an ordinary CPU tensor) first waits for the whole stream to drain; so does ``.tolist()``
of a device tensor. Either one inside a step's launch path serialises the host with the
GPU, and the overlap schedule (the next step prepared while this one computes) is gone.
Here copies go through rings of pinned buffers instead, ordered on the stream like any
kernel; an event per slot tells when a slot may be written again.

On the CPU both directions are plain views: nothing is copied.
"""

from __future__ import annotations

import numpy as np
import torch

from .device import accelerator_module


class _PinnedRing:
    """``slots`` pinned byte buffers used round-robin, each with the event of its last copy."""

    def __init__(self, device: torch.device, slots: int):
        self.module = accelerator_module(device)
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list = [None] * slots
        self.next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()  # its copy ran long ago in all but pathological cases
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[i] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        return i, buf

    def mark(self, i: int) -> None:
        event = self.events[i] = self.events[i] or self.module.Event()
        event.record()


class HostToDevice:
    """``upload(array)``: a device tensor with the contents of a host numpy array, copied
    asynchronously; the array may be reused or dropped right after the call. On the CPU
    the "upload" is the array itself (no copy): pass a fresh array, as every caller does."""

    # A slot taken again within one step would wait for the step before it: a launch
    # makes ~3 uploads for the model and up to ~7 for sampling.
    def __init__(self, device: torch.device, slots: int = 32):
        self.device = device
        self.ring = _PinnedRing(device, slots) if device.type != "cpu" else None

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.ring is None:
            return host
        i, buf = self.ring.take(host.numel() * host.element_size())
        staged = buf[: host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self.ring.mark(i)
        return out


class Download:
    """A device tensor on its way to the host; :meth:`wait` blocks until it has arrived."""

    def __init__(self, device_tensor: torch.Tensor, host: torch.Tensor, event=None):
        self.device_tensor = device_tensor  # the source, for device-side consumers meanwhile
        self.host, self.event = host, event

    def wait(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class DeviceToHost:
    """``download(tensor)`` starts an asynchronous copy to pinned memory. A slot is reused
    ``slots`` downloads later, so at most that many may be outstanding (the engine keeps
    at most two steps in flight)."""

    def __init__(self, device: torch.device, slots: int = 4):
        self.ring = _PinnedRing(device, slots) if device.type != "cpu" else None

    def __call__(self, tensor: torch.Tensor) -> Download:
        if self.ring is None:
            return Download(tensor, tensor)
        i, buf = self.ring.take(tensor.numel() * tensor.element_size())
        host = buf[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        self.ring.mark(i)
        return Download(tensor, host, self.ring.events[i])
