"""Device abstraction: CPU, CUDA and (through torch_npu's same API) Ascend NPUs."""

from __future__ import annotations

import importlib.util

import torch

from .config import DEVICE_DEFAULTS

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    if name.startswith("npu") and not _npu_available():
        raise ValueError(f"--device {name}: no NPU is visible (torch_npu is missing or finds no device)")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (auto, cpu, cuda, cuda:N, npu, npu:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return device


def rank_device(device: torch.device, ordinal: int) -> torch.device:
    """The device of the ``ordinal``-th rank (DP replica x TP rank) of a daemon whose first
    rank runs on ``device``: the accelerators after it, one each; every rank on a CPU."""
    if device.type == "cpu" or ordinal == 0:
        return device
    index = (device.index or 0) + ordinal
    count = accelerator_module(device).device_count()
    if index >= count:
        raise ValueError(f"rank {ordinal} would run on {device.type}:{index}, but only {count} are visible")
    return torch.device(device.type, index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["npu"]).dtype
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def accelerator_module(device: torch.device):
    """torch.cuda / torch.npu for accelerators, None on CPU."""
    return None if device.type == "cpu" else getattr(torch, device.type)


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory the device can still give (on the CPU: Linux's MemAvailable); None if unknown.
    On accelerators that includes the whole segments torch's caching allocator holds unused
    (freed tensors stay reserved until ``empty_cache``, and the allocator hands them out
    again), not the gaps inside segments that still hold live tensors (a large allocation
    such as the KV cache cannot use those)."""
    mod = accelerator_module(device)
    if mod is not None:
        free, _total = mod.mem_get_info(device)
        gaps = mod.memory_stats(device).get("inactive_split_bytes.all.current", 0)
        return free + mod.memory_reserved(device) - mod.memory_allocated(device) - gaps
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def synchronize(device: torch.device) -> None:
    mod = accelerator_module(device)
    if mod is not None:
        mod.synchronize(device)


def cpu_has_bf16() -> bool:
    """Does this CPU compute bf16 natively (AVX512-BF16 or AMX on x86, BF16 on Arm)? Without
    it torch emulates bf16 math and ``--dtype bfloat16`` runs slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith(("flags", "Features")) for w in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
