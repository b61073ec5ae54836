"""Block pool and per-request KV bookkeeping: allocation, ref counts, prefix cache, events."""

import random

import pytest

from scheduler.block_pool import NULL_BLOCK, BlockPool, hash_block, public_hash
from scheduler.kv_manager import KVCacheManager
from scheduler.messages import KvCleared, KvRemoved, KvStored, SamplingParams
from scheduler.request import Request


def make_request(rid, tokens, max_new=4):
    return Request(rid, tokens, SamplingParams(temperature=0.0), max_new, frozenset({2}))


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_cache_blocks=5, block_size=4)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4
    ids = pool.allocate(4)
    assert NULL_BLOCK not in ids and sorted(ids) == [1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_free_returns_blocks_and_keeps_eviction_order():
    pool = BlockPool(num_cache_blocks=5, block_size=4)
    a = pool.allocate(2)
    pool.free(list(reversed(a)))  # tail first: a[1] is evicted before a[0]
    assert pool.num_free_blocks == 4
    order = list(pool.free_queue)
    assert order.index(a[1]) < order.index(a[0])


def test_shared_block_needs_every_reference_dropped():
    pool = BlockPool(num_cache_blocks=3, block_size=4)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2


def test_hash_chain_depends_on_parent():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"salt") != h1


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    pool = BlockPool(num_cache_blocks=16, block_size=4)
    kv = KVCacheManager(pool)
    prompt = list(range(10, 22))  # 12 tokens = 3 full blocks
    first = make_request("a", prompt)
    assert kv.find_cached_prefix(first) == []
    kv.admit(first, [])
    assert kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.commit(first)
    stored = [e for e in pool.take_events() if isinstance(e, KvStored)]
    assert len(stored) == 3 and stored[1].parent_hash == stored[0].block_hash
    assert all(len(e.token_ids) == 4 for e in stored)

    second = make_request("b", prompt)
    hits = kv.find_cached_prefix(second)
    assert hits == first.block_ids[:2]  # the third block holds the last token: recomputed
    kv.admit(second, hits)
    assert second.num_computed_tokens == 8
    assert all(pool.blocks[b].ref_cnt == 2 for b in hits)

    kv.free(first)
    kv.free(second)
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    # Freed blocks stay cached until reused.
    assert kv.find_cached_prefix(make_request("c", prompt)) == hits


def test_reusing_a_cached_block_emits_removed():
    pool = BlockPool(num_cache_blocks=3, block_size=2)
    kv = KVCacheManager(pool)
    r = make_request("a", [5, 6, 7, 8])
    kv.admit(r, [])
    kv.allocate(r, 4)
    r.num_computed_tokens = 4
    kv.commit(r)
    kv.free(r)
    pool.take_events()
    pool.allocate(2)  # the pool is full of cached blocks: both get evicted
    events = pool.take_events()
    assert [type(e) for e in events] == [KvRemoved] and len(events[0].block_hashes) == 2  # merged
    assert not pool.cached
    # a store between two removals keeps them apart (the order of events is the cache's history)
    pool = BlockPool(num_cache_blocks=4, block_size=2)
    for block_id, digest in ((1, b"a"), (2, b"b"), (3, b"c")):
        pool.cache_block(block_id, digest * 32, None, [block_id, block_id])
    pool.take_events()
    pool.allocate(1)  # evicts block 1 (the free queue's front)
    pool.cache_block(1, b"d" * 32, None, [7, 7])
    pool.allocate(1)  # evicts block 2
    assert [type(e) for e in pool.take_events()] == [KvRemoved, KvStored, KvRemoved]


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(num_cache_blocks=4, block_size=2)
    ids = pool.allocate(1)
    assert not pool.reset_prefix_cache()
    pool.free(ids)
    assert pool.reset_prefix_cache()
    assert isinstance(pool.take_events()[-1], KvCleared)


def test_prefix_caching_disabled_never_hits():
    pool = BlockPool(num_cache_blocks=8, block_size=2, enable_prefix_caching=False)
    kv = KVCacheManager(pool)
    r = make_request("a", [1, 2, 3, 4, 5])
    kv.admit(r, [])
    kv.allocate(r, 5)
    r.num_computed_tokens = 5
    kv.commit(r)
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []
    assert pool.take_events() == []


def test_a_block_computed_twice_stays_cached_while_a_copy_lives():
    """Two requests prefill the same prompt at once: both compute its blocks, the first
    indexes them. Reusing the first's blocks must not announce the content as removed while
    the second still holds it, or the router would orphan the second's later blocks."""
    pool = BlockPool(num_cache_blocks=8, block_size=2)
    kv = KVCacheManager(pool)
    first, second = make_request("a", [5, 6, 7, 8]), make_request("b", [5, 6, 7, 8, 9, 1])
    for r in (first, second):
        kv.admit(r, kv.find_cached_prefix(r))  # both miss: neither has run yet
    for r in (first, second):
        kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.commit(r)
    stored = pool.take_events()
    assert len(stored) == 3  # the shared blocks once, then the second's own block
    assert stored[2].parent_hash == stored[1].block_hash
    kv.free(first)
    pool.allocate(pool.num_free_blocks)  # reuses the first's blocks (and the free ones)
    assert pool.take_events() == []
    hits = kv.find_cached_prefix(make_request("c", [5, 6, 7, 8, 9, 1, 4]))
    assert hits == second.block_ids  # the whole chain is still found, through the copies
    kv.free(second)
    pool.allocate(3)
    (removed,) = pool.take_events()
    assert sorted(removed.block_hashes) == sorted(e.block_hash for e in stored)
    assert not pool.cached and not pool.copies


@pytest.mark.parametrize("seed", range(4))
def test_events_replay_to_the_pool_index_under_random_traffic(seed):
    """What a router rebuilds from the events matches what the pool can serve: every store's
    parent is live when it arrives, every removal names a live hash, and at each point the
    replayed set is exactly the pool's index (requests overlap, share prefixes, get freed)."""
    rng = random.Random(seed)
    pool = BlockPool(num_cache_blocks=16, block_size=2)
    kv = KVCacheManager(pool)
    prefixes = [[rng.randint(1, 9) for _ in range(24)] for _ in range(3)]
    live, replayed = [], set()
    for step in range(1000):
        if live and (rng.random() < 0.2 or pool.num_free_blocks < 6):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes)[: rng.randint(2, 24)] + [rng.randint(1, 3) for _ in range(rng.randint(0, 4))]
            r = make_request(f"r{step}", tokens)
            kv.admit(r, kv.find_cached_prefix(r))
            live.append(r)
        for r in live:  # every live request computes a little more (concurrent prefills)
            todo = min(r.num_tokens - r.num_computed_tokens, rng.randint(0, 1))
            if todo and kv.allocate(r, todo):
                r.num_computed_tokens += todo
                kv.commit(r)
        for event in pool.take_events():
            if isinstance(event, KvStored):
                assert event.parent_hash is None or event.parent_hash in replayed
                assert event.block_hash not in replayed
                replayed.add(event.block_hash)
            else:
                assert set(event.block_hashes) <= replayed
                replayed -= set(event.block_hashes)
        assert replayed == {public_hash(d) for d in pool.cached}
        for digest, block_id in pool.cached.items():
            assert pool.blocks[block_id].digest == digest
