"""The KV block pool: fixed-size blocks, reference counts, prefix-cache index, events.

Block 0 is the reserved null block: never handed out, used as padding in block tables.

Free blocks wait in ``free_queue`` in eviction order (front evicted first). A freed
block keeps its hash, so a later request with the same prefix can take it back
(a prefix hit) until the block is reused for something else; only then does its hash
leave the index and a ``removed`` event go out.

Two requests that compute the same block at once (neither found it cached when it was
scheduled) hold equal copies. The first one indexed is the published holder; later ones
are kept as ``copies``, so when the holder is reused a copy takes its place: the hash stays
cached and the router hears no ``removed`` for content that is still here (it would drop
the parent of every later block of the copy's request from its tree).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .messages import KvCleared, KvEvent, KvRemoved, KvStored

NULL_BLOCK = 0


def hash_block(parent: bytes | None, token_ids, extra: bytes = b"") -> bytes:
    """Chained block hash: sha256(parent digest | tokens as u32 LE | extra keys)."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def public_hash(digest: bytes) -> int:
    """The int64 identity published in KV events: first 8 digest bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


class Block:
    __slots__ = ("block_id", "ref_cnt", "digest")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None


class BlockPool:
    def __init__(self, num_cache_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        """``num_cache_blocks``: the KV cache's blocks, the null block included."""
        if num_cache_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (1 is the null block), got {num_cache_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_cache_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_cache_blocks))
        self.cached: dict[bytes, int] = {}  # digest -> the block published for it
        self.copies: dict[bytes, list[int]] = {}  # digest -> other blocks with the same content
        self.events: list[KvEvent] = []  # prefix-cache changes since the last take_events

    # -- capacity --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- allocation ------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; pass a request's blocks tail-first so
        its last blocks are evicted first (its first blocks are the likeliest to be shared)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    # -- prefix cache ----------------------------------------------------------------
    def lookup(self, digests: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``digests`` (not yet referenced)."""
        hits = []
        if self.enable_prefix_caching:
            for digest in digests:
                block_id = self.cached.get(digest)
                if block_id is None:
                    break
                hits.append(block_id)
        return hits

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on prefix-hit blocks (pulling free ones out of the queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def cache_block(self, block_id: int, digest: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        """Index a block that just became full so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        block.digest = digest
        if digest in self.cached:  # computed twice at once: already published
            self.copies.setdefault(digest, []).append(block_id)
            return
        self.cached[digest] = block_id
        self.events.append(
            KvStored(public_hash(digest), public_hash(parent) if parent else None, list(token_ids), self.block_size)
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.digest = None
        self.cached.clear()
        self.copies.clear()
        self.events.append(KvCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    def _forget(self, block: Block) -> None:
        """Drop a block about to be reused from the index (a copy takes over if one is left)."""
        digest = block.digest
        if digest is None:
            return
        block.digest = None
        copies = self.copies.get(digest)
        if self.cached[digest] != block.block_id:
            copies.remove(block.block_id)
        elif copies:
            self.cached[digest] = copies.pop()
        else:
            del self.cached[digest]
            removed = public_hash(digest)
            if self.events and isinstance(self.events[-1], KvRemoved):  # consecutive removals merge
                self.events[-1].block_hashes.append(removed)
            else:
                self.events.append(KvRemoved([removed]))
            return
        if not copies:
            del self.copies[digest]
