"""How the daemon's DP replicas share requests (servicer/replicas.py): pinned, by cached
prefix (the ranks' KV events, as the service's hubs keep them), by load; no scheduler process
(the clients are never started)."""

from __future__ import annotations

import asyncio
import time

from helpers import sample_model_info
from scheduler.block_pool import hash_block, public_hash
from scheduler.config import EngineConfig
from scheduler.messages import KvCleared, KvEvents, KvRemoved, KvStored, LoadSnapshot
from servicer.cached_blocks import CachedBlocks
from servicer.replicas import AFFINITY_SLACK, Replicas, sum_loads
from servicer.scheduler_client import _Route

BS = 16


def replicas(size: int = 2) -> Replicas:
    reps = Replicas(EngineConfig(model="unused", dp_size=size))
    for client in reps.ranks:
        client.model_info = sample_model_info(block_size=BS)
    # As the service wires them (its hubs, which need the protos, follow a CachedBlocks each):
    reps.cached = [CachedBlocks() for _ in range(size)]
    reps.kv_event_listener = lambda msg, rank: reps.cached[rank].apply(msg.events)
    return reps


def close(reps: Replicas) -> None:
    for client in reps.ranks:
        client.to_scheduler.close(0)
        client.from_scheduler.close(0)
        client.ctx.term()


def stored_events(prompt: list[int]) -> KvEvents:
    events, parent = [], None
    for i in range(len(prompt) // BS):
        digest = hash_block(parent, prompt[i * BS : (i + 1) * BS])
        tokens = prompt[i * BS : (i + 1) * BS]
        events.append(KvStored(public_hash(digest), public_hash(parent) if parent else None, tokens, BS))
        parent = digest
    return KvEvents(events, time.time())


def test_ranks_share_requests_by_pin_prefix_and_load():
    async def main():
        reps = replicas()
        try:
            prompt = list(range(100, 200))
            assert reps.pick_rank(1, prompt) == 1 and reps.pick_rank(0, prompt) == 0
            assert {reps.pick_rank(None, prompt) for _ in range(4)} == {0, 1}  # idle ranks take turns
            reps._on_kv_events(1, stored_events(prompt))
            assert all(reps.pick_rank(None, prompt + [i]) == 1 for i in range(4))  # its prefix is cached there
            assert reps._cached_blocks(prompt[:40] + list(range(500, 600)), "") == [0, 2]
            assert reps._cached_blocks(prompt, "salted") == [0, 0]  # another salt, another cache
            for i in range(AFFINITY_SLACK + 1):  # too busy for the hit to be worth it
                reps.ranks[1]._routes[f"busy-{i}"] = _Route(asyncio.Queue())
            assert reps.pick_rank(None, prompt) == 0
            reps.ranks[1]._routes.clear()
            reps._on_kv_events(1, KvEvents([KvRemoved([e.block_hash for e in stored_events(prompt).events[:1]])], 0.0))
            assert reps._cached_blocks(prompt, "") == [0, 0]
            reps._on_kv_events(0, stored_events(prompt))
            reps._on_kv_events(0, KvEvents([KvCleared()], 0.0))
            assert reps._cached_blocks(prompt, "") == [0, 0]
        finally:
            close(reps)

    asyncio.run(main())


def test_loads_sum_across_ranks():
    a = LoadSnapshot(version=2, num_running=3, num_waiting=1, num_used_tokens=64, max_total_num_tokens=1024)
    b = LoadSnapshot(version=5, num_running=1, num_used_tokens=32, max_total_num_tokens=1024, cache_hit_rate=0.5)
    total = sum_loads([a, b])
    assert (total.num_running, total.num_waiting, total.num_used_tokens, total.max_total_num_tokens) == (4, 1, 96, 2048)
    assert total.cache_hit_rate == 0.25


def test_a_rank_that_died_fails_the_set_before_the_watcher_runs():
    """The daemon's exit code after a drain reads ``failed``: a rank's own event counts at once,
    not only when the watcher task has set the set's ``died`` (a race the drain could win)."""
    reps = replicas(2)
    try:
        reps.ready.set()
        assert reps.alive and not reps.failed
        reps.ranks[1].dead_reason = "the scheduler process exited with code -9"
        reps.ranks[1].died.set()
        assert not reps.died.is_set()  # (the watcher has not run)
        assert reps.failed and not reps.alive
        assert reps.failure_reason == "DP rank 1: the scheduler process exited with code -9"
    finally:
        close(reps)
