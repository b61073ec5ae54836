"""The blocks a scheduler's prefix cache holds now, followed from its KV events: what a new
KV event subscriber is sent first (kv_events.py), and where a DP replica finds a request's
prefix (replicas.py). Proto-free, so both can use it."""

from __future__ import annotations

from scheduler.messages import KvCleared, KvRemoved, KvStored


def well_formed(ev: KvStored) -> bool:
    """A full block with its own hash (partial or malformed blocks are never published)."""
    return ev.block_size > 0 and len(ev.token_ids) == ev.block_size and ev.block_hash != ev.parent_hash


class CachedBlocks:
    def __init__(self):
        self._blocks: dict[int, KvStored] = {}  # by hash, each after its parent

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> list[KvStored]:
        """Every cached block, parents first."""
        return list(self._blocks.values())

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, KvStored):
                if well_formed(ev):
                    self._blocks.pop(ev.block_hash, None)  # (re-stored: after its parent again)
                    self._blocks[ev.block_hash] = ev
            elif isinstance(ev, KvRemoved):
                for h in ev.block_hashes:
                    self._blocks.pop(h, None)
            elif isinstance(ev, KvCleared):
                self._blocks.clear()
