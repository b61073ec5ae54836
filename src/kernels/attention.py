"""Paged attention over a block-structured KV cache: the torch reference.

KV layout per layer: K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

One step's batch is flattened: ``T`` query tokens from ``B`` requests, decodes
(one query token each) first, then prefill chunks. The causal mask is
bottom-right aligned: query ``j`` of a request whose chunk has ``q_len`` tokens
and whose KV (after this step) has ``seq_len`` tokens sees keys
``0 .. seq_len - q_len + j``; this is what makes chunked prefill and prefix
hits correct.

Everything that depends only on the batch (gather indices, masks) is built once
per step in :class:`AttentionMetadata` and reused by every layer. The fast paths (native
CPU, Triton) are in ``kernels/backend.py``; these functions are what they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .norm import rms_norm
from .rotary import apply_rotary


@dataclass
class PrefillSegment:
    """One request's prefill chunk: query rows ``[q_start, q_end)`` of the batch."""

    q_start: int
    q_end: int
    kv_slots: torch.Tensor  # [seq_len] flat slot of every key position
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plain causal (no prefix)


@dataclass
class AttentionMetadata:
    """The torch paths' view of a step: decodes first (gathered per request), then each
    prefill chunk with its key slots and mask."""

    slot_mapping: torch.Tensor  # [T] flat slot per query token (-1 = padding, not stored)
    positions: torch.Tensor  # [T] position of every query token (for rope)
    block_size: int = 16
    num_decodes: int = 0  # decode requests come first, one token each
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64
    decode_max_seq_len: int = 0  # max(decode_seq_lens), known on the host when built
    prefills: list[PrefillSegment] = field(default_factory=list)
    # the prefill chunks as the native kernel reads them: [P, 3] (first query row, query rows,
    # keys) and their block tables [P, max_blocks], int64
    prefill_segments: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    _decode_gather: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat KV slot of every key position [n, max_seq_len], key mask [n, 1, 1, max_seq_len])
        for the torch decode path; built on first use, once per step."""
        if self._decode_gather is None:
            tables, seq = self.decode_block_tables, self.decode_seq_lens
            kpos = torch.arange(int(seq.max()), device=seq.device)
            block_idx = (kpos // self.block_size).clamp(max=tables.shape[1] - 1).expand(len(seq), -1)
            slots = tables.gather(1, block_idx) * self.block_size + kpos % self.block_size
            valid = kpos[None, :] < seq[:, None]
            self._decode_gather = (torch.where(valid, slots, 0), valid[:, None, None, :])
        return self._decode_gather

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for a batch whose first requests are decodes (query_len 1)."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        slots, pos, _, seq, table = varlen_arrays(query_lens, seq_lens, block_tables, block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            positions=torch.from_numpy(pos).to(device),
            block_size=block_size,
            num_decodes=num_decodes,
        )
        if num_decodes:
            meta.decode_block_tables = torch.from_numpy(table[:num_decodes]).to(device)
            meta.decode_seq_lens = torch.from_numpy(seq[:num_decodes]).to(device)
            meta.decode_max_seq_len = int(seq[:num_decodes].max())
        q_start = num_decodes
        for i in range(num_decodes, len(query_lens)):
            q_len, s_len = query_lens[i], seq_lens[i]
            kpos = np.arange(s_len)
            kv_slots = torch.from_numpy(table[i, kpos // block_size] * block_size + kpos % block_size)
            mask = None
            if q_len != s_len:  # a prefix is already cached: bottom-right aligned causal mask
                k = torch.arange(s_len)
                mask = (k[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]).to(device)
            meta.prefills.append(PrefillSegment(q_start, q_start + q_len, kv_slots.to(device), mask))
            q_start += q_len
        if meta.prefills:
            segments = [
                (seg.q_start, seg.q_end - seg.q_start, int(s)) for seg, s in zip(meta.prefills, seq[num_decodes:])
            ]
            meta.prefill_segments = torch.tensor(segments, dtype=torch.int64, device=device)
            meta.prefill_block_tables = torch.from_numpy(table[num_decodes:]).to(device)
        return meta


def varlen_arrays(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[np.ndarray, ...]:
    """Host int64 arrays ``(slot_mapping [T], positions [T], query_start_loc [B+1],
    seq_lens [B], block_tables [B, W])`` of a batch (numpy: a few µs per request)."""
    qlen = np.asarray(query_lens, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    width = max(1, max((len(t) for t in block_tables), default=0))
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, row in enumerate(block_tables):
        table[i, : len(row)] = row
    qsl = np.zeros(len(qlen) + 1, dtype=np.int64)
    np.cumsum(qlen, out=qsl[1:])
    req = np.repeat(np.arange(len(qlen)), qlen)
    pos = (seq - qlen)[req] + np.arange(int(qsl[-1])) - qsl[:-1][req]
    slots = table[req, pos // block_size] * block_size + pos % block_size
    return slots, pos, qsl, seq, table


def qkv_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a fused ``[T, (H + 2 Hkv) D]`` q|k|v projection (any strides): ``q [T, H, D]`` and
    ``k, v [T, Hkv, D]``, with the per-head RMSNorm (``q_norm``/``k_norm`` weights, Qwen3) and
    rotary applied to q and k, and k, v stored in their cache slots (slot -1: not stored).
    Any device, dtype and layout; ``cpu_kernels.qkv_rope_store`` and
    ``triton_ops.qkv_rope_store`` take the same arguments."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:  # Qwen3 normalises each head before rope
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rotary(q, k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k, v


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write this step's keys/values ``[T, kv_heads, head_dim]`` into their slots; slot -1 is skipped."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


def decode_attention(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The decode rows ``q [num_decodes, heads, D]`` over flat caches ``[slots, kv_heads, D]``:
    gather each request's keys, then SDPA with a length mask."""
    slots, mask = meta.decode_gather()
    keys = k_flat.index_select(0, slots.flatten()).view(*slots.shape, *k_flat.shape[1:]).transpose(1, 2)
    values = v_flat.index_select(0, slots.flatten()).view(*slots.shape, *v_flat.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k_flat.shape[1]
    )
    return o.squeeze(2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [T, heads, head_dim]`` over the paged cache; returns ``[T, heads, head_dim]``.

    Assumes this step's K/V were already stored. ``k_new``/``v_new`` (this step's keys
    and values, ``[T, kv_heads, head_dim]``) let a prefill with no cached prefix skip
    reading its keys back from the cache. GQA: ``heads`` is a multiple of ``kv_heads``.
    """
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        out[:n] = decode_attention(q[:n], flat_cache(k_cache), flat_cache(v_cache), meta, scale)
    prefill_attention(q, k_cache, v_cache, meta, scale, out, k_new, v_new)
    return out


def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, kv_heads, D]`` -> ``[slots, kv_heads, D]`` (a view)."""
    return cache.view(-1, *cache.shape[2:])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> None:
    """The prefill chunks of :func:`paged_attention`, written into their rows of ``out``."""
    k_flat, v_flat = flat_cache(k_cache), flat_cache(v_cache)
    gqa = q.shape[1] != k_flat.shape[1]
    for seg in meta.prefills:
        query = q[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
        if seg.mask is None and k_new is not None:  # keys are exactly this chunk's
            keys, values = k_new[seg.q_start : seg.q_end], v_new[seg.q_start : seg.q_end]
        else:
            keys, values = k_flat.index_select(0, seg.kv_slots), v_flat.index_select(0, seg.kv_slots)
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=seg.mask,
            is_causal=seg.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[seg.q_start : seg.q_end] = o.squeeze(0).transpose(0, 1)
