"""Model runner: owns the weights and the paged KV cache, turns a scheduled batch into
tensors, runs the forward pass and samples.

Only the rows that sample (the last token of every request whose known and pending
tokens are all computed after this step) and the prompt rows of prompt-logprob requests
go through the LM head.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.backend import create_backend
from kernels.screened_greedy import ScreenedGreedyHead
from kernels.triton_attention import decode_splits
from kernels.util import cdiv

from . import tensor_parallel
from .config import EngineConfig
from .cpu_malloc import keep_freed_memory, zeros_on_huge_pages
from .device import cpu_has_bf16, synchronize
from .model_config import ModelConfig
from .model_source import resolve_model
from .models import build_model
from .pooling import Pooler, PoolingSpec, detect_pooling
from .resolve import Platform, resolve, resolve_platform
from .sampling_batch import BatchSampler, StepLogprobs
from .scheduler import ScheduledBatch
from .tensor_parallel import Command, TpGroup
from .transfer import DeviceToHost, Download, HostToDevice
from .weights import load_checkpoint

logger = logging.getLogger(__name__)


def warmup_batches(max_batch: int, num_kv_heads: int, num_sms: int) -> list[list[int]]:
    """Query lengths of one small batch per Triton kernel variant an eager step can launch.

    Triton compiles a kernel again for every new combination of constexprs and argument
    specialisations (an int equal to 1 or divisible by 16, a pointer's 16-byte alignment),
    and a compile takes far longer than a step. The per-step values are kept out of the specialisation
    (``do_not_specialize``, aligned metadata), which leaves the attention's configuration as
    the only thing that changes with the step: its decode split factor (one per distinct
    :func:`decode_splits` value up to ``max_batch``), short query chunks and long ones."""
    first_batch_of_split: dict[int, int] = {}
    for b in range(1, max_batch + 1):
        first_batch_of_split.setdefault(decode_splits(b, num_kv_heads, num_sms), b)
    return [[1] * b for b in sorted(first_batch_of_split.values())] + [[1, 2], [1, 64]]


class LaunchedStep:
    """A step whose sampled tokens may still be on their way from the device."""

    def __init__(
        self,
        batch: ScheduledBatch,
        download: Download | None,
        logprobs: StepLogprobs | None = None,
        launched_at: float = 0.0,
        pooled: list | None = None,
    ):
        self.batch = batch
        self.download = download
        self.logprobs = logprobs  # prompt and output logprob rows, recorded with the tokens
        self.launched_at = launched_at  # monotonic (the engine's throughput spans from it)
        self.pooled = pooled or []  # an embedding model's: (request, its vector) per prompt finished
        self._tokens: list[int] | None = None if download is not None else []

    @property
    def tokens_on_device(self) -> torch.Tensor:
        return self.download.device_tensor

    def result(self) -> list[int]:
        """The sampled tokens (waits for the device the first time)."""
        if self._tokens is None:
            self._tokens = self.download.wait()
        return self._tokens


@dataclass
class LoadedModel:
    path: str
    config: ModelConfig  # the whole model's
    model: torch.nn.Module
    shard: ModelConfig | None = None  # under tensor parallelism: this rank's share of it
    pooling: PoolingSpec | None = None  # an embedding model's (None: a generation model)


def load_model(config: EngineConfig, tp: TpGroup | None = None) -> LoadedModel:
    """Resolve, read and place the weights (each tensor cast to the target dtype as it is
    read or adopted, so the peak stays near one copy plus a tensor); with ``tp``, this
    rank's slices of them."""
    platform = resolve_platform(config, tp.rank if tp is not None else 0)
    device, dtype = platform.device, platform.dtype
    path = resolve_model(config.model)
    started = time.perf_counter()
    logger.info("loading %s onto %s (%s)", path, device, str(dtype).removeprefix("torch."))
    model_config, state_dict = load_checkpoint(path, dtype, (tp.rank, tp.size) if tp is not None else None)
    pooling = detect_pooling(path, model_config, config.is_embedding)
    if pooling is not None and model_config.head == "lm":  # (pooled hidden states need no LM head)
        model_config = dataclasses.replace(model_config, head="none")
    shard = tensor_parallel.shard_config(model_config, tp.size) if tp is not None else None
    model = build_model(shard or model_config, dtype=dtype, tp=tp)
    model.load_weights(state_dict)  # (consumes it)
    model = model.to(device=device).eval()
    logger.info(
        "loaded %s: %d layers, %.0fM parameters, in %.1f s",
        model_config.architecture,
        model_config.num_layers,
        sum(p.numel() for p in model.parameters()) / 1e6,
        time.perf_counter() - started,
    )
    return LoadedModel(path, model_config, model, shard, pooling)


def _configure_cpu(platform: Platform) -> None:
    torch.set_num_threads(platform.num_threads)
    torch.set_flush_denormal(True)  # denormal activations slow x86 math by orders of magnitude
    keep_freed_memory()  # no page faults on every step's activations (cpu_malloc.py)
    if platform.dtype == torch.bfloat16 and not cpu_has_bf16():
        logger.warning("this CPU has no bf16 instructions: torch emulates them, and bfloat16 runs slower than float32")


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, tp: TpGroup | None = None):
        """``loaded`` lets several runners (e.g. tests with different KV sizes) share weights.
        ``self.config`` is the resolved config (resolve.py), decided once the weights are in.
        With ``config.tp_size`` > 1 this runner is rank 0 and starts the other ranks; ``tp``:
        this runner is that rank of the group (tp_worker.py)."""
        # (a wrong name fails before the weights load)
        platform = resolve_platform(config, tp.rank if tp is not None else 0)
        if platform.device.type == "cpu":
            _configure_cpu(platform)
        torch.manual_seed(config.seed)
        self.workers = None
        if config.tp_size > 1 and tp is None:
            from .tp_worker import start_workers

            self.workers, tp = start_workers(config, platform.device)
            atexit.register(self.close)  # (the ranks wait for rank 0's word to end)
        self.tp = tp
        loaded = loaded or load_model(config, tp)
        self.model_path, self.model_config, self.model = loaded.path, loaded.config, loaded.model
        self.layer_config = loaded.shard or loaded.config  # the layers this rank runs (its KV heads)
        # (packed by an earlier runner sharing the model)
        packed = self.model.model.layers[0].self_attn.qkv_proj.packed_weight is not None
        self.config = rc = resolve(config, self.layer_config, self.weight_bytes, packed, platform, loaded.pooling)
        rc.log()
        if tp is not None and config.nnodes == 1:  # (a step's activations at most; one host's ranks)
            tp.use_shared_memory(rc.max_num_batched_tokens * self.model_config.hidden_size)
        self.device, self.dtype, self.block_size = rc.device, rc.dtype, rc.block_size
        self.max_model_len, self.num_cache_blocks = rc.max_model_len, rc.num_kv_blocks
        self.max_running_requests, self.max_num_batched_tokens = rc.max_running_requests, rc.max_num_batched_tokens
        self._allocate_kv_cache()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(rc.seed)
        self.upload, self.download = HostToDevice(self.device), DeviceToHost(self.device)
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        )
        self.backend = create_backend(
            rc.kernel_backend,
            self.device,
            self.block_size,
            packed_weights=rc.cpu_packed_weights,
            num_kv_heads=self.layer_config.num_kv_heads,
            num_sms=self.num_sms,
            small_batch_gemv=rc.small_batch_gemv,
            pdl=rc.pdl,
            upload=self.upload,
        )
        self.backend.prepare_model(self.model)
        self.sampler = self.pooler = None  # a generation model samples, an embedding model pools
        if rc.pooling is not None:
            spec = rc.pooling
            score = functools.partial(self.model.compute_scores, self.backend) if spec.classifies else None
            self.pooler = Pooler(spec, score)
        else:
            lm_head = functools.partial(self.model.compute_logits, self.backend) if tp is None else self._tp_logits
            head = self.model.lm_head
            greedy = None
            if rc.cpu_screened_greedy and head is not None:
                greedy = ScreenedGreedyHead.build(head.weight, head.bias)
            self.sampler = BatchSampler(
                lm_head,
                self.device,
                self.generator,
                self.model_config.vocab_size,
                self.upload,
                rc.fused_sampling,
                greedy_head=greedy,
            )
        self.graphs = None
        if rc.compile_kernels:
            self.compile_kernels()
        if rc.cuda_graph:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        from .cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_caches,
            self.max_running_requests,
            cdiv(self.max_model_len, self.block_size),
            self.device,
            self.upload,
            # (the NCCL watchdog's thread queries the device while a TP graph is captured)
            capture_error_mode="global" if self.tp is None else "thread_local",
        )
        self.graphs.capture()

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Launch every Triton kernel variant an eager step can need once, so that no request
        waits for a JIT compile (see :func:`warmup_batches`). Slots are -1 and every table
        points at the null block: nothing is written to the KV cache."""
        for query_lens in warmup_batches(self.max_running_requests, self.layer_config.num_kv_heads, self.num_sms):
            seq_lens = [q + 3 for q in query_lens]
            tables = [[0] * cdiv(s, self.block_size) for s in seq_lens]
            meta = self.backend.prepare_metadata(query_lens, seq_lens, tables)
            meta.slot_mapping.fill_(-1)
            ids = torch.zeros(sum(query_lens), dtype=torch.int64, device=self.device)
            hidden = self.model(self.backend, ids, self.kv_caches, meta)
        if self.sampler is not None:
            self.sampler.compile_kernels(hidden)
        synchronize(self.device)

    # -- KV cache --------------------------------------------------------------------
    def _allocate_kv_cache(self) -> None:
        mc = self.layer_config
        shape = (mc.num_layers, 2, self.num_cache_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":  # (decode reads it at scattered blocks: cpu_malloc.py)
            self.kv_cache = zeros_on_huge_pages(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB, %s)",
            self.num_cache_blocks - 1,
            self.block_size,
            self.kv_cache_bytes / 2**30,
            self.dtype,
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.dtype.itemsize

    @property
    def weight_bytes(self) -> int:
        """The weights' bytes (a tied LM head counted once; packed copies not counted)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Start one step on the device; its sampled tokens (one per request that reaches
        the end of its known and pending tokens, 1 + drafts for a speculating one, in batch
        order) arrive with
        :meth:`LaunchedStep.result`. A request's pending last token (overlap schedule) is
        read from ``prev``'s sampled tokens on the device, never from the host."""
        launched_at = time.monotonic()
        input_ids, query_lens, seq_lens, tables, sample_rows = [], [], [], [], []
        patch_pos, patch_rows = [], []
        offset = 0
        for e in batch:
            req, n = e.request, e.num_new_tokens
            start = req.num_computed_tokens
            if req.draft_ids:  # speculating: its last token and the drafts, one decode row each
                input_ids.extend(req.token_ids[start:] + req.draft_ids)
                query_lens.extend([1] * n)
                seq_lens.extend(range(start + 1, start + n + 1))
                tables.extend([req.block_ids] * n)
                sample_rows.extend(range(offset, offset + n))
                offset += n
                continue
            ids = req.token_ids[start : start + n]
            if len(ids) < n:  # the last input token is the previous step's sample, still on the device
                assert len(ids) == n - 1 and req.num_pending == 1 and prev is not None, req.request_id
                patch_pos.append(offset + n - 1)
                patch_rows.append(req.pending_row)
                ids.append(0)
            input_ids.extend(ids)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(req.block_ids)
            offset += n
            if e.samples:  # all its tokens computed after this step: its last row samples
                sample_rows.append(offset - 1)
        patch = self._patch(patch_pos, patch_rows, prev) if patch_pos else None
        if self.graphs is not None and offset == len(query_lens) and self.graphs.can_run(offset):
            if self.workers is not None:  # the other ranks replay theirs: its all-reduces pair them
                self.workers.send(Command("graph", (input_ids, seq_lens, tables)))
            hidden = self.graphs.run(input_ids, seq_lens, tables, patch)  # decode-only step
        else:
            if self.workers is not None:  # the other ranks run the same step on their shards
                self.workers.send(Command("forward", (input_ids, query_lens, seq_lens, tables)))
            hidden = self.forward(input_ids, query_lens, seq_lens, tables, patch)
        if self.pooler is not None:  # an embedding model: the finished prompts' vectors
            return LaunchedStep(batch, None, launched_at=launched_at, pooled=self.pooler.pool(batch, hidden))
        # LM head on the sampling rows (and prompt-logprob rows), sampling, logprobs.
        sampling = batch.sampling_rows
        tokens, logprobs = self.sampler.run(batch, hidden, sample_rows, sampling)
        return LaunchedStep(batch, self.download(tokens) if sampling else None, logprobs, launched_at)

    def forward(self, input_ids: list[int], query_lens, seq_lens, tables, patch=None) -> torch.Tensor:
        """The model over one flattened batch: hidden states ``[T, hidden]``."""
        ids = self.upload(np.asarray(input_ids, dtype=np.int64))
        if patch is not None:
            patch(ids)
        meta = self.backend.prepare_metadata(query_lens, seq_lens, tables)
        return self.model(self.backend, ids, self.kv_caches, meta)

    def _tp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0's LM head: every rank scores its share of the vocabulary for these rows."""
        self.workers.send(Command("logits", hidden))
        return self.tp.gather_vocab(self.model.compute_logits(self.backend, hidden), self.model_config.vocab_size)

    def check_ranks(self) -> None:
        """RuntimeError if another tensor-parallel rank is gone (the engine cannot go on)."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0's runner)."""
        if self.workers is not None:
            try:
                self.workers.send(Command("stop"))
            except OSError:  # a rank already gone
                pass
            self.workers.join()
            self.workers = None
            torch.distributed.destroy_process_group()

    def _patch(self, positions: list[int], rows: list[int], prev: LaunchedStep):
        """``ids[positions] = prev's sampled tokens[rows]``, on the device's stream."""
        index = self.upload(np.asarray(positions + rows, dtype=np.int64))
        n = len(positions)
        values = prev.tokens_on_device[index[n:]]

        def patch(ids: torch.Tensor) -> None:
            ids[index[:n]] = values

        return patch
