"""Engine configuration shared by the CLI, the scheduler process and the offline engine."""

from __future__ import annotations

import math

import msgspec


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = "smollm2"
    device: str = "auto"  # auto | cpu | cuda[:N] | npu[:N]
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPUs) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_cache_tokens: int | None = None  # KV capacity in tokens; None = from kv_cache_memory
    kv_cache_memory: str | None = None  # e.g. "2GiB"; None = default budget for the device
    max_running_requests: int | None = None  # None = per-device default (64 on CPU, 256 on accelerators)
    max_queued_requests: int | None = None  # waiting beyond free running slots; None = no limit
    max_num_batched_tokens: int | None = None  # step token budget; None = per-device default
    # prompts with more tokens left prefill in chunks of at most this many, one at a time, so
    # shorter ones start meanwhile; None = half the step budget, 0 = off (vLLM's default)
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None  # None = the model's context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None = all cores
    kernel_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere) | torch | triton
    cuda_graph: bool = True  # replay captured graphs for decode-only steps (CUDA + triton only)
    # steps of <= 16 tokens run the Triton projections with the norms and SiLU fused
    # (kernels/triton_gemv.py; triton backend only); off until measured faster than cuBLAS
    small_batch_gemv: bool = False
    # their kernels launch as programmatic dependents (CUDA sm_90+; needs small_batch_gemv):
    # each pulls its weights into L2 while the previous kernel finishes; off until measured
    pdl: bool = False
    # CPU: keep a packed copy of the projections for batches of a few dozen rows (faster,
    # the weights' memory again); None: when that copy fits in a quarter of the free memory
    cpu_packed_weights: bool | None = None
    # launch each step before taking the previous step's tokens; None: on accelerators only
    overlap_schedule: bool | None = None
    # speculative decoding: "ngram" (prompt lookup, scheduler/ngram.py) or None; each step a
    # decoding request verifies up to speculative_num_draft_tokens drafts
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 3
    seed: int = 0
    max_logprobs: int = 20  # most logprobs per token a request may ask for (as vLLM's default)
    grammar_compile_timeout_s: float = 30.0  # a structured-output grammar compiling longer is refused
    served_model_name: str | None = None


def parse_memory_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {
        "": 1,
        "b": 1,
        "k": 1e3,
        "kb": 1e3,
        "kib": 2**10,
        "m": 1e6,
        "mb": 1e6,
        "mib": 2**20,
        "g": 1e9,
        "gb": 1e9,
        "gib": 2**30,
        "t": 1e12,
        "tb": 1e12,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if not num or unit not in units:
        raise ValueError(f"cannot read memory size {text!r} (try e.g. 2GiB or 512MiB)")
    size = float(num) * units[unit]
    if not (math.isfinite(size) and size >= 1):
        raise ValueError(f"memory size {text!r} must be a positive number of bytes (e.g. 2GiB)")
    return int(size)
