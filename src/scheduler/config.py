"""Engine configuration: what the user asked for (:class:`EngineConfig`) and what "auto" or
an unset option means on each kind of device (:data:`DEVICE_DEFAULTS`, the one table of
per-device defaults; the CLI help reads it). ``resolve.py`` turns both into the frozen
config the engine runs with.

Adding a per-device default: a field of :class:`DeviceDefaults` and its value in each row.
Light on purpose: the servicer imports it without torch.
"""

from __future__ import annotations

import dataclasses
import math

import msgspec

PROFILE_MAX_TRACES = 20  # traces StartProfile keeps by default (one with stacks is large)


class DisaggregationConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill/decode disaggregation (``--disaggregation-*``; scheduler/disagg/)."""

    mode: str  # "prefill" | "decode"
    host: str  # this daemon's address as its PD peer reaches it (bootstrap server, transfers)
    bootstrap_port: int = 8998  # a prefill daemon's bootstrap server (SGLang's default)
    transfer_backend: str = "mooncake"  # "memcpy": both engines in one process (tests)
    bootstrap_timeout_s: float = 300.0  # a leg whose partner does not show up within this fails
    waiting_timeout_s: float = 300.0  # decode: registered KV that does not arrive within this fails


class EngineConfig(msgspec.Struct, kw_only=True):
    """What the user asked for (the CLI's flags; "auto" and None: the device's default, see
    ``DEVICE_DEFAULTS``). :func:`resolve` turns it into a :class:`ResolvedConfig`."""

    model: str = "smollm2"
    device: str = "auto"  # auto | cpu | cuda[:N] | npu[:N]
    dtype: str = "auto"  # auto (the device's default) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_cache_tokens: int | None = None  # KV capacity in tokens; None = from kv_cache_memory
    kv_cache_memory: str | None = None  # e.g. "2GiB"; None = the device's default budget
    max_running_requests: int | None = None  # None = per-device default
    max_queued_requests: int | None = None  # waiting beyond free running slots; None = 4 x max_running_requests
    max_num_batched_tokens: int | None = None  # step token budget; None = per-device default
    # prompts with more tokens left prefill in chunks of at most this many, one at a time, so
    # shorter ones start meanwhile; None = half the step budget, 0 = off (vLLM's default)
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None  # None = the model's context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None = all cores
    kernel_backend: str = "auto"  # auto (the device's default) | torch | cpu | triton (kernels/backend.py)
    cuda_graph: bool = True  # replay captured graphs for decode-only steps (CUDA + triton only)
    # steps of <= 16 tokens run the Triton projections with the norms and SiLU fused
    # (kernels/triton_gemv.py; triton backend only); off until measured faster than cuBLAS
    small_batch_gemv: bool = False
    # their kernels launch as programmatic dependents (CUDA sm_90+; needs small_batch_gemv):
    # each pulls its weights into L2 while the previous kernel finishes; off until measured
    pdl: bool = False
    # CPU: keep a packed copy of the projections for batches of a few dozen rows (faster,
    # the weights' memory again); None: when that copy is small against the free memory
    cpu_packed_weights: bool | None = None
    # launch each step before taking the previous step's tokens; None: the device's default
    overlap_schedule: bool | None = None
    # speculative decoding: "ngram" (prompt lookup, scheduler/ngram.py) or None; each step a
    # decoding request verifies up to speculative_num_draft_tokens drafts
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 3
    seed: int = 0
    max_logprobs: int = 20  # most logprobs per token a request may ask for (as vLLM's default)
    grammar_compile_timeout_s: float = 30.0  # a structured-output grammar compiling longer is refused
    constrained_json_any_whitespace: bool = False  # JSON constraints allow any whitespace (else compact JSON)
    served_model_name: str | None = None
    # serve embeddings (Embed) rather than generations; also chosen by the checkpoint itself
    # (a classifier, a sentence-transformers layout, a base model): scheduler/pooling.py
    is_embedding: bool = False
    # StartProfile writes traces only inside this directory; None: SGLANG_TORCH_PROFILER_DIR, else off
    profile_dir: str | None = None
    profile_max_traces: int = PROFILE_MAX_TRACES  # traces kept under profile_dir; older ones are deleted
    disaggregation: DisaggregationConfig | None = None  # None: --disaggregation-mode null
    tp_size: int = 1  # tensor-parallel ranks, one process each (tensor_parallel.py)
    nnodes: int = 1  # hosts the TP ranks span (--tp-size / --nnodes ranks on each)
    node_rank: int = 0  # this host's place among them; 0 runs the scheduler and the gRPC server
    dist_init_addr: str | None = None  # HOST:PORT where the ranks meet (and PORT+1: rank 0's commands)
    dp_size: int = 1  # engine replicas behind the one port, a scheduler process each (servicer/replicas.py)
    dp_rank: int = 0  # which replica this scheduler is (set by the servicer per process)


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
    """What "auto" and an unset option mean on one kind of device."""

    dtype: str
    kernel_backend: str
    kv_cache_memory: str  # a size ("2GiB"), or a share of the memory free after the weights ("85%")
    # Step token budget: on a CPU a step's time grows with its tokens, so a smaller budget keeps
    # running decodes moving while long prompts prefill; accelerators want bigger steps.
    max_num_batched_tokens: int
    # Requests decoded together: a CPU step grows with every row, an accelerator's barely does
    # until far more rows (vLLM's default is 256 too).
    max_running_requests: int
    # A CPU computes on the cores that would do the bookkeeping: nothing to overlap.
    overlap_schedule: bool
    cuda_graph: bool
    # Speculation's cost model (ngram.py NgramDrafter.pays): decode rows whose per-row cost
    # equals the step's fixed cost, per dtype; absent: drafts are not gated.
    speculative_doubling_rows: dict[str, int]


_ACCELERATOR = DeviceDefaults(
    dtype="bfloat16",
    kernel_backend="triton",
    kv_cache_memory="85%",
    max_num_batched_tokens=8192,
    max_running_requests=256,
    overlap_schedule=True,
    cuda_graph=True,
    speculative_doubling_rows={},
)

DEVICE_DEFAULTS: dict[str, DeviceDefaults] = {
    "cpu": DeviceDefaults(
        dtype="float32",
        kernel_backend="cpu",
        kv_cache_memory="2GiB",
        max_num_batched_tokens=512,
        max_running_requests=64,
        overlap_schedule=False,
        cuda_graph=False,
        speculative_doubling_rows={"float32": 128, "bfloat16": 32, "float16": 32},  # A/B-chosen: docs/performance.md
    ),
    "cuda": _ACCELERATOR,
    # (no Triton or CUDA graphs there: the torch paths through torch_npu)
    "npu": dataclasses.replace(_ACCELERATOR, kernel_backend="torch", cuda_graph=False),
}


def describe_default(field: str, shown=str) -> str:
    """One field of every row of ``DEVICE_DEFAULTS`` for help texts: '512 on cpu, 8192 on cuda and npu'."""
    by_value: dict[str, list[str]] = {}
    for device, row in DEVICE_DEFAULTS.items():
        by_value.setdefault(shown(getattr(row, field)), []).append(device)
    return ", ".join(f"{value} on {' and '.join(devices)}" for value, devices in by_value.items())


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
