"""CUDA graphs for decode-only steps.

A decode step of a small model is a few hundred short kernels; launched one by one from
Python they cost more than they compute. We capture the model's forward once per padded
batch size (1, 2, 4, 8, then every 16 up to the max running requests) into graphs that
share one memory pool, and replay the smallest graph that holds the batch.

Every graph reads its inputs from the same static buffers. A step copies its tokens,
slots, positions and KV lengths there (padded rows: token 0, slot -1 so nothing is stored,
KV length 0 so attention reads no key and writes zeros) and its block tables into the
first rows of a static table; then replays. Only the real rows of the output are used.
Under the overlap schedule some token ids are still on the device (the previous step's
samples): they are gathered into the static ids after the copy, on the stream, before
the replay. Steps with any prefill chunk run eagerly.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from kernels.attention import varlen_arrays
from kernels.triton_attention import VarlenMetadata, decode_splits
from kernels.util import cdiv

from .transfer import HostToDevice

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` rounded up to a multiple of 16."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch or b == 1]
    top = cdiv(max_batch, 16) * 16 if max_batch > 8 else 0
    return sorted(set(small + list(range(16, top + 1, 16)) + ([max_batch] if max_batch <= 8 else [])))


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size that holds ``n`` rows (None: too many, run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def decode_inputs(
    input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int, padded: int
) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays for a padded decode batch: ``[4, padded]`` int64 rows (token ids, slots,
    positions, KV lengths; padded rows 0, -1, 0, 0) and the ``[n, W]`` block tables."""
    n = len(input_ids)
    slots, pos, _, seq, table = varlen_arrays([1] * n, seq_lens, block_tables, block_size)
    vecs = np.zeros((4, padded), dtype=np.int64)
    vecs[1, n:] = -1
    vecs[0, :n], vecs[1, :n], vecs[2, :n], vecs[3, :n] = input_ids, slots, pos, seq
    return vecs, table


class DecodeGraphs:
    def __init__(
        self,
        model,
        backend,
        kv_caches,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        upload=None,
        capture_error_mode: str = "global",
    ):
        """``backend``: the runner's Triton backend (the graphs replay its kernels). Under
        tensor parallelism every rank captures the same sizes at the same time (the
        all-reduces inside are captured too) and replays the same one each step."""
        self.capture_error_mode = capture_error_mode
        self.model, self.backend, self.kv_caches, self.block_size = model, backend, kv_caches, backend.block_size
        self.upload = upload or HostToDevice(device)  # host arrays -> device, never waiting for the GPU
        self.sizes = capture_sizes(max_batch)
        top = self.sizes[-1]
        self.vecs = torch.zeros((4, top), dtype=torch.int64, device=device)  # ids, slots, positions, seq lens
        self.vecs[1].fill_(-1)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int64, device=device)  # one query per row
        self.block_tables = torch.zeros((top, max_blocks + 1), dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, bs: int) -> torch.Tensor:
        meta = VarlenMetadata(
            slot_mapping=self.vecs[1, :bs],
            positions=self.vecs[2, :bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.vecs[3, :bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            num_splits=decode_splits(bs, self.backend.num_kv_heads, self.backend.num_sms),
        )
        return self.model(self.backend, self.vecs[0, :bs], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the pool then fits the smaller ones)."""
        pool = torch.cuda.graph_pool_handle()
        free_before = torch.cuda.mem_get_info()[0]
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: compiles kernels, picks GEMM algorithms outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (batch %s) using %.0f MiB",
            len(self.sizes),
            self.sizes,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**20,
        )

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def load_inputs(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]]) -> int:
        """Copy a decode batch into the static buffers; returns the padded size to replay."""
        n = len(input_ids)
        bs = padded_size(self.sizes, n)
        vecs, table = decode_inputs(input_ids, seq_lens, block_tables, self.block_size, bs)
        self.vecs[:, :bs].copy_(self.upload(vecs))
        self.block_tables[:n, : table.shape[1]].copy_(self.upload(table))
        return bs

    def run(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], patch=None) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch (one query token per request).
        ``patch(ids)``: writes the token ids still on the device into the ids tensor."""
        bs = self.load_inputs(input_ids, seq_lens, block_tables)
        if patch is not None:
            patch(self.vecs[0])
        self.graphs[bs].replay()
        return self.outputs[bs][: len(input_ids)]
