"""Per-request KV bookkeeping on top of the block pool: prefix lookup, slot
allocation as a request grows, hashing blocks as they fill, and freeing."""

from __future__ import annotations

from kernels.util import cdiv

from .block_pool import BlockPool, hash_block
from .request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def _update_digests(self, req: Request, num_tokens: int) -> None:
        """Extend the request's hash chain over every full block within ``num_tokens``."""
        bs = self.block_size
        for i in range(len(req.block_digests), num_tokens // bs):
            parent = req.block_digests[-1] if req.block_digests else None
            req.block_digests.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], req.hash_extra))

    def _num_reusable_blocks(self, req: Request) -> int:
        """How many of the request's leading blocks it may take from the cache (their digests
        made): at least the last token is always left to compute, so it still produces logits."""
        self._update_digests(req, req.num_tokens - 1)
        limit = req.num_tokens - 1
        if req.prefix_cache_limit is not None:  # prompt logprobs need those positions' logits
            limit = min(limit, req.prefix_cache_limit)
        return limit // self.block_size

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks for the request's longest known prefix."""
        if not self.pool.enable_prefix_caching:
            return []
        return self.pool.lookup(req.block_digests[: self._num_reusable_blocks(req)])

    def next_block_in_progress(self, req: Request, cached: list[int], in_progress: set[bytes]) -> bool:
        """Whether the block after ``req``'s cached prefix (``find_cached_prefix``) is one that
        another request is computing (``in_progress``: see :meth:`uncached_digests`): it is
        cached a step later."""
        i = len(cached)
        return i < self._num_reusable_blocks(req) and req.block_digests[i] in in_progress

    @staticmethod
    def uncached_digests(req: Request) -> list[bytes]:
        """Digests of the known blocks (its prompt's, or after a preemption also its
        output's) that an admitted request has yet to compute and index."""
        return req.block_digests[req.num_committed_blocks :]

    def can_admit(self, req: Request, cached: list[int], num_new_tokens: int) -> bool:
        needed = cdiv(len(cached) * self.block_size + num_new_tokens, self.block_size) - len(cached)
        reusable = sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)
        return needed + reusable <= self.pool.num_free_blocks

    def admit(self, req: Request, cached: list[int]) -> None:
        """Give a waiting request its prefix-hit blocks."""
        self.pool.touch(cached)
        req.block_ids = list(cached)
        req.num_computed_tokens = len(cached) * self.block_size
        req.num_committed_blocks = len(cached)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False if the pool is short."""
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_ids)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        req.block_ids.extend(self.pool.allocate(needed))
        return True

    def commit(self, req: Request) -> None:
        """After a step: index the request's newly full blocks for prefix sharing."""
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        # (never past the known tokens: a block's digest needs all of its tokens)
        known = min(req.num_computed_tokens, req.num_tokens)
        num_full = known // bs
        if num_full <= req.num_committed_blocks:
            return
        self._update_digests(req, known)
        for i in range(req.num_committed_blocks, num_full):
            parent = req.block_digests[i - 1] if i else None
            self.pool.cache_block(req.block_ids[i], req.block_digests[i], parent, req.token_ids[i * bs : (i + 1) * bs])
        req.num_committed_blocks = num_full

    def free(self, req: Request) -> None:
        self.pool.free(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_committed_blocks = 0
