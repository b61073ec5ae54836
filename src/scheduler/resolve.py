"""From the user's :class:`~.config.EngineConfig` to the :class:`ResolvedConfig` the engine runs
with: every "auto" and None decided once, for this device, dtype and model, from
``config.DEVICE_DEFAULTS``, and logged at start-up. The scheduler, the runner and the engine
each read their part of it; none derives policy from another's internals.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from kernels import envs
from kernels.backend import BACKENDS
from kernels.linear import can_pack
from kernels.triton_attention import triton_available
from kernels.util import cdiv

from .config import DEVICE_DEFAULTS, DeviceDefaults, DisaggregationConfig, EngineConfig, parse_memory_size
from .cuda_graphs import capture_sizes
from .device import cpu_has_bf16, free_memory_bytes, rank_device, resolve_device, resolve_dtype
from .model_config import ModelConfig
from .pooling import PoolingSpec

logger = logging.getLogger(__name__)

# CPU: a packed copy of the weights is kept when it takes at most this share of the memory
# still available after the KV cache.
PACKED_WEIGHTS_MAX_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class Platform:
    """What is decided before the weights load: where, in what dtype, with which kernels."""

    device: torch.device
    dtype: torch.dtype
    kernel_backend: str  # a name of kernels.backend.BACKENDS
    num_threads: int  # torch intra-op threads (CPU)


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """Every engine option decided for this device, dtype and model."""

    device: torch.device
    dtype: torch.dtype
    kernel_backend: str  # a name of kernels.backend.BACKENDS
    fused_sampling: bool  # the Triton samplers (the Triton backend on CUDA)
    compile_kernels: bool  # every Triton kernel variant launched once at start-up (CUDA)
    small_batch_gemv: bool
    pdl: bool
    cuda_graph: bool
    cpu_packed_weights: bool
    num_threads: int
    block_size: int
    num_kv_blocks: int  # the null block included
    max_model_len: int
    max_running_requests: int
    max_queued_requests: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # 0: off
    enable_prefix_caching: bool
    overlap_schedule: bool
    speculative_algorithm: str  # "none" | "ngram"
    speculative_num_draft_tokens: int  # 0 without speculation
    speculative_doubling_rows: int  # 0: drafts not gated
    max_speculative_rows: int  # 0: no limit (eager steps); else the largest CUDA graph
    seed: int
    max_logprobs: int
    grammar_compile_timeout_s: float
    constrained_json_any_whitespace: bool
    served_model_name: str
    disaggregation: DisaggregationConfig | None = None  # None: mode null
    tp_size: int = 1
    pooling: PoolingSpec | None = None  # an embedding model's (pooling.py); None: it generates
    # greedy rows of an fp32 CPU model take their argmax from a bf16 copy of the LM head and
    # exact fp32 logits of the few tokens that can win (kernels/screened_greedy.py)
    cpu_screened_greedy: bool = False

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size

    def log(self) -> None:
        fields = dataclasses.asdict(self)
        fields["device"], fields["dtype"] = str(self.device), str(self.dtype).removeprefix("torch.")
        logger.info("engine config: %s", ", ".join(f"{k}={v}" for k, v in fields.items()))


def resolve_platform(config: EngineConfig, tp_rank: int = 0) -> Platform:
    """The device, dtype and kernel backend, checked before any weight is read (a wrong name
    fails start-up at once); raises ValueError. On accelerators each rank (of each replica)
    takes the next device after the one named."""
    local_rank = tp_rank % (config.tp_size // config.nnodes)  # (its place on its host)
    device = rank_device(resolve_device(config.device), config.dp_rank * config.tp_size + local_rank)
    dtype = resolve_dtype(config.dtype, device)
    backend = _kernel_backend(config, device, _defaults(device))
    _speculative_algorithm(config)
    # (every rank of every replica on this host shares its cores)
    ranks_here = config.tp_size // config.nnodes * config.dp_size
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // ranks_here)
    return Platform(device, dtype, backend, threads)


# Waiting requests per running slot when --max-queued-requests is unset: the queue holds a
# few batches' worth (beyond that a request waits several whole generations, and the router
# does better to retry RESOURCE_EXHAUSTED elsewhere), and running + queued still takes one
# call of n = 1024 (the most request conversion allows) at the accelerators' 256 slots.
QUEUED_PER_RUNNING_SLOT = 4


def _max_queued_requests(asked: int | None, running: int) -> int:
    return QUEUED_PER_RUNNING_SLOT * running if asked is None else asked


def resolve(
    config: EngineConfig,
    model: ModelConfig,
    weight_bytes: int,
    packed: bool = False,
    platform: Platform | None = None,
    pooling: PoolingSpec | None = None,
) -> ResolvedConfig:
    """Decide every option (after the weights are loaded: the KV cache takes what memory they
    leave); raises ValueError for a combination that cannot run here. ``packed``: the model
    already carries packed CPU weights (shared with an earlier runner), kept unless refused.
    ``pooling``: the model embeds (it was detected from the checkpoint, pooling.py)."""
    platform = platform or resolve_platform(config)
    if pooling is not None:
        _check_embedding(config)
    device, dtype, backend = platform.device, platform.dtype, platform.kernel_backend
    defaults = _defaults(device)
    max_model_len = _context_limit(config.max_model_len, model)
    num_kv_blocks = _num_kv_blocks(config, device, dtype, model, defaults)
    running = config.max_running_requests or defaults.max_running_requests
    budget = config.max_num_batched_tokens or defaults.max_num_batched_tokens
    threshold = config.long_prefill_token_threshold
    speculative = _speculative_algorithm(config)
    # (an embedding model's steps are prefills, which graphs do not replay)
    cuda_graph = config.cuda_graph and defaults.cuda_graph and backend == "triton" and pooling is None
    kv_bytes = (num_kv_blocks * config.block_size) * _bytes_per_token(model, dtype)
    resolved = ResolvedConfig(
        device=device,
        dtype=dtype,
        kernel_backend=backend,
        fused_sampling=backend == "triton" and device.type == "cuda",
        compile_kernels=backend == "triton" and device.type == "cuda",
        small_batch_gemv=_small_batch_gemv(config, backend),
        pdl=_pdl(config, device, backend),
        cuda_graph=cuda_graph,
        cpu_packed_weights=backend == "cpu" and _cpu_packed_weights(config, dtype, weight_bytes, kv_bytes, packed),
        num_threads=platform.num_threads,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        max_running_requests=running,
        max_queued_requests=_max_queued_requests(config.max_queued_requests, running),
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=budget // 2 if threshold is None else threshold,
        enable_prefix_caching=config.enable_prefix_caching,
        overlap_schedule=_overlap_schedule(config, defaults, speculative) and pooling is None,
        speculative_algorithm=speculative,
        speculative_num_draft_tokens=config.speculative_num_draft_tokens if speculative != "none" else 0,
        speculative_doubling_rows=defaults.speculative_doubling_rows.get(str(dtype).removeprefix("torch."), 0),
        max_speculative_rows=capture_sizes(running)[-1] if cuda_graph else 0,
        seed=config.seed,
        max_logprobs=config.max_logprobs,
        grammar_compile_timeout_s=config.grammar_compile_timeout_s,
        constrained_json_any_whitespace=config.constrained_json_any_whitespace,
        served_model_name=config.served_model_name or config.model,
        disaggregation=config.disaggregation,
        tp_size=config.tp_size,
        pooling=pooling,
        cpu_screened_greedy=backend == "cpu" and dtype == torch.float32 and config.tp_size == 1 and pooling is None,
    )
    if pooling is not None:
        logger.info("serving embeddings: %s", pooling.describe())
    if resolved.kv_capacity_tokens < max_model_len:
        flag = "--kv-cache-tokens" if config.kv_cache_tokens is not None else "--kv-cache-memory"
        logger.warning(
            "the KV cache holds %d tokens, less than the %d-token context: longer requests "
            "will be refused (raise %s or lower --max-model-len)",
            resolved.kv_capacity_tokens,
            max_model_len,
            flag,
        )
    return resolved


def _defaults(device: torch.device) -> DeviceDefaults:
    return DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["npu"])  # (other accelerators: as NPUs)


def _check_embedding(config: EngineConfig) -> None:
    """What an embedding model cannot run with: its requests end with their prefill, so there
    is nothing to speculate, overlap or hand to a decode daemon."""
    if config.speculative_algorithm:
        raise ValueError("speculative decoding does not apply to an embedding model (it generates no tokens)")
    if config.overlap_schedule:
        raise ValueError("--overlap-schedule on does not apply to an embedding model (it generates no tokens)")
    if config.disaggregation is not None:
        raise ValueError("prefill/decode disaggregation does not apply to an embedding model (it has no decode)")


def _kernel_backend(config: EngineConfig, device: torch.device, defaults: DeviceDefaults) -> str:
    name = config.kernel_backend
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose auto or one of {sorted(BACKENDS)}")
    if name == "auto":
        name = defaults.kernel_backend
        if name == "triton" and not triton_available():
            logger.warning("triton is not installed: using the torch kernels on %s", device)
            return "torch"
        return name
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"--kernel-backend cpu runs on the CPU only, not on {device}")
    if name == "triton":
        if device.type == "cpu" and not envs.triton_interpreter():
            raise ValueError("--kernel-backend triton on the CPU runs only under TRITON_INTERPRET=1 (for tests)")
        if not triton_available():
            raise ValueError("--kernel-backend triton needs the triton package")
    return name


def _small_batch_gemv(config: EngineConfig, backend: str) -> bool:
    if config.small_batch_gemv and backend != "triton":
        logger.warning("small_batch_gemv needs the Triton kernels (CUDA, or kernel_backend=triton): ignored")
        return False
    return config.small_batch_gemv


def _pdl(config: EngineConfig, device: torch.device, backend: str) -> bool:
    """Programmatic dependent launch needs the small-batch kernels on a CUDA sm_90+ GPU."""
    if not config.pdl:
        return False
    usable = (
        backend == "triton"
        and config.small_batch_gemv
        and device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] >= 9
    )
    if not usable:
        logger.warning("pdl needs --small-batch-gemv on an NVIDIA GPU of compute capability 9.0 or newer: ignored")
    return usable


def _speculative_algorithm(config: EngineConfig) -> str:
    algorithm = config.speculative_algorithm
    if algorithm not in (None, "ngram"):
        raise ValueError(f"speculative algorithm {algorithm!r} is not supported (have: ngram)")
    if algorithm and config.overlap_schedule:
        raise ValueError(
            "speculative decoding needs each step's tokens before the next is scheduled: "
            "it cannot run with the overlap schedule (leave --overlap-schedule at auto or off)"
        )
    return algorithm or "none"


def _overlap_schedule(config: EngineConfig, defaults: DeviceDefaults, speculative: str) -> bool:
    """Speculation drafts from the last token, which must be on the host: no overlap. Nor
    under tensor parallelism: the other ranks get a step's token ids from rank 0's host
    before its previous step's tokens are known there."""
    if config.overlap_schedule and config.tp_size > 1:
        raise ValueError("--overlap-schedule on cannot run with --tp-size > 1")
    if config.overlap_schedule is not None:
        return config.overlap_schedule
    return defaults.overlap_schedule and speculative == "none" and config.tp_size == 1


def _context_limit(requested: int | None, model: ModelConfig) -> int:
    """The model's context limit, or less if asked; a sliding-window model's is its window
    (attention here is full, exact only that far)."""
    limit = model.max_position_embeddings
    if requested and requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's context ({limit} tokens)")
    if model.sliding_window and model.sliding_window < limit:
        if requested and requested > model.sliding_window:
            raise ValueError(
                f"--max-model-len {requested} exceeds the model's sliding window "
                f"({model.sliding_window}): attention here is full, exact only that far"
            )
        logger.warning("context limited to the model's sliding window: %d tokens", model.sliding_window)
        limit = model.sliding_window
    return requested or limit  # (a larger one was refused above)


def _bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype.itemsize


def _num_kv_blocks(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, model: ModelConfig, defaults: DeviceDefaults
) -> int:
    """KV cache blocks, the null block included."""
    block_size = config.block_size
    per_block = _bytes_per_token(model, dtype) * block_size
    if config.kv_cache_tokens is not None:
        return cdiv(config.kv_cache_tokens, block_size) + 1  # + the null block
    if config.kv_cache_memory is not None:
        budget = parse_memory_size(config.kv_cache_memory)
        free = free_memory_bytes(device)
        if free is not None and budget > free:
            raise ValueError(
                f"--kv-cache-memory {config.kv_cache_memory} is more than the "
                f"{free / 2**30:.1f} GiB {device.type} memory still available"
            )
    elif defaults.kv_cache_memory.endswith("%"):
        budget = int(free_memory_bytes(device) * float(defaults.kv_cache_memory[:-1]) / 100)
    else:
        budget = parse_memory_size(defaults.kv_cache_memory)
    num_blocks = budget // per_block
    if num_blocks < 2:  # the null block and one for requests: a floor would overrun the budget
        raise ValueError(
            f"a KV cache of {budget / 2**20:.1f} MiB holds fewer than 2 blocks of {block_size} "
            f"tokens ({per_block / 2**20:.1f} MiB each, one of them the null block): "
            "give more memory (--kv-cache-memory) or a smaller --block-size"
        )
    return num_blocks


def _cpu_packed_weights(
    config: EngineConfig, dtype: torch.dtype, weight_bytes: int, kv_bytes: int, packed: bool
) -> bool:
    """A packed copy of the projections speeds up CPU decode batches past a few rows and
    fp32 prefill chunks (kernels/linear.py) at the cost of the weights' memory again."""
    if not can_pack(dtype) or (dtype == torch.bfloat16 and not cpu_has_bf16()):
        return False  # (oneDNN would emulate bf16)
    if config.cpu_packed_weights is not None:
        return config.cpu_packed_weights
    if packed:  # (the memory rule was applied when they were made)
        return True
    free = free_memory_bytes(torch.device("cpu"))
    available = None if free is None else free - kv_bytes
    if available is not None and weight_bytes <= PACKED_WEIGHTS_MAX_SHARE * available:
        return True
    logger.info(
        "projections not packed: a copy of the %.2f GiB of weights would take more than %d%% of the memory available",
        weight_bytes / 2**30,
        100 * PACKED_WEIGHTS_MAX_SHARE,
    )
    return False
