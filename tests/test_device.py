"""The device layer's memory accounting."""

import torch

from scheduler import device as device_module


def test_accelerator_memory_left_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """A freed engine's KV cache stays reserved by torch's allocator (mem_get_info no longer
    shows it free) but is handed out again: it counts as memory left; gaps inside segments
    that still hold live tensors do not."""

    class FakeAccelerator:
        mem_get_info = staticmethod(lambda device: (10 * 2**30, 80 * 2**30))
        memory_reserved = staticmethod(lambda device: 42 * 2**30)
        memory_allocated = staticmethod(lambda device: 2 * 2**30)
        memory_stats = staticmethod(lambda device: {"inactive_split_bytes.all.current": 2**30})

    monkeypatch.setattr(device_module, "accelerator_module", lambda device: FakeAccelerator)
    assert device_module.free_memory_bytes(torch.device("cuda")) == 49 * 2**30
