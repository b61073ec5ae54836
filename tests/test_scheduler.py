"""Scheduler policy with a stand-in token source (no model): batching, chunking,
preemption and aborts, checked through the block pool's counts."""

import pytest

from scheduler.block_pool import BlockPool
from scheduler.kv_manager import KVCacheManager
from scheduler.messages import AddRequest, SamplingParams
from scheduler.ngram import NgramDrafter
from scheduler.scheduler import AdmissionError, Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, max_running=8, budget=32, max_len=256, prefix=True, long_prefill=0):
    pool = BlockPool(num_blocks, block_size, prefix)
    config = SchedulerConfig(max_running, budget, max_len, long_prefill_token_threshold=long_prefill)
    return Scheduler(config, KVCacheManager(pool), frozenset({2})), pool


def next_token(req):
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 100 + (sum(req.token_ids) * 31 + len(req.token_ids)) % 1000


def step(sched, batch, sampled):
    """Launch and complete a step at once (no overlap): ``sampled`` has one token per
    request that samples in it, in batch order."""
    sched.advance(batch)
    sched.complete(batch, sampled)


def run(sched, max_steps=10_000):
    steps = []
    while sched.has_work() and len(steps) < max_steps:
        batch = sched.schedule()
        sampled = [
            next_token(e.request)
            for e in batch
            if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens
        ]
        steps.append((len(batch), batch.num_tokens))
        step(sched, batch, sampled)
    return steps


def add(sched, rid, prompt, max_new=8, **kw):
    return sched.add_request(AddRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)))


def test_requests_share_steps_and_finish():
    sched, pool = make_scheduler()
    reqs = [add(sched, f"r{i}", list(range(10 + i, 20 + i))) for i in range(4)]
    steps = run(sched)
    assert max(b for b, _ in steps) == 4
    assert all(r.finish_reason == "length" and r.num_output_tokens == 8 for r in reqs)
    assert pool.num_free_blocks == pool.num_blocks


def test_decodes_come_first_in_a_mixed_step():
    sched, _ = make_scheduler()
    add(sched, "a", list(range(10, 20)))
    step(sched, sched.schedule(), [5])  # a: prefill done, now decoding
    add(sched, "b", list(range(30, 40)))
    batch = sched.schedule()
    assert [(e.request.request_id, e.num_new_tokens) for e in batch] == [("a", 1), ("b", 10)]


def test_long_prompt_is_chunked_under_the_budget():
    sched, pool = make_scheduler(budget=16)
    req = add(sched, "long", list(range(100, 150)), max_new=3)
    batch = sched.schedule()
    assert [e.num_new_tokens for e in batch] == [16]
    run(sched)
    assert req.num_output_tokens == 3
    assert pool.num_free_blocks == pool.num_blocks


def chunks(batch):
    return {e.request.request_id: e.num_new_tokens for e in batch}


def finish_step(sched, batch):
    step(
        sched,
        batch,
        [
            next_token(e.request)
            for e in batch
            if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens
        ],
    )


def test_a_short_prompt_starts_while_a_long_one_prefills():
    sched, pool = make_scheduler(budget=16, long_prefill=8)
    long = add(sched, "long", list(range(100, 160)))
    first = sched.schedule()
    assert chunks(first) == {"long": 16}  # alone: the budget left after its cut goes back to it
    finish_step(sched, first)
    short = add(sched, "short", list(range(200, 206)))
    second = sched.schedule()
    assert chunks(second) == {"long": 10, "short": 6}  # without the threshold: {"long": 16}
    finish_step(sched, second)
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0
    run(sched)
    assert long.num_output_tokens == short.num_output_tokens == 8
    assert pool.num_free_blocks == pool.num_blocks


def test_one_long_prompt_prefills_at_a_time_and_short_ones_pass_it():
    sched, _ = make_scheduler(budget=16, long_prefill=8)
    add(sched, "long-a", list(range(100, 140)))
    add(sched, "long-b", list(range(300, 340)))
    add(sched, "short", list(range(200, 205)))
    first = sched.schedule()
    assert chunks(first) == {"long-a": 11, "short": 5}  # long-b waits for long-a's prompt
    finish_step(sched, first)
    steps = []
    while sched.waiting:
        batch = sched.schedule()
        steps.append(chunks(batch))
        finish_step(sched, batch)
    # long-a's last chunk leaves budget over: long-b starts with it, as without a threshold
    assert steps == [{"short": 1, "long-a": 15}, {"short": 1, "long-a": 14, "long-b": 1}]


@pytest.mark.parametrize("lengths", [[40, 40, 40], [60, 25, 33, 9, 70], [20] * 6])
def test_the_threshold_keeps_steps_full(lengths):
    """Whatever the prompts, a step holds as many tokens as without the threshold, and the
    same tokens come out."""
    prompts = [list(range(100 + 97 * i, 100 + 97 * i + n)) for i, n in enumerate(lengths)]
    runs = []
    for threshold in (0, 8):
        sched, pool = make_scheduler(budget=16, long_prefill=threshold)
        reqs = [add(sched, f"r{i}", p) for i, p in enumerate(prompts)]
        runs.append(([n for _, n in run(sched)], [r.output_ids for r in reqs]))
        assert pool.num_free_blocks == pool.num_blocks
    (plain_steps, plain_out), (capped_steps, capped_out) = runs
    assert capped_out == plain_out and capped_steps == plain_steps


def test_a_cut_chunk_grows_only_into_blocks_that_hold_all_of_it():
    sched, pool = make_scheduler(num_blocks=5, block_size=4, budget=16, long_prefill=8)  # 4 usable blocks
    add(sched, "d", [10, 11, 12], max_new=2)
    finish_step(sched, sched.schedule())  # d's last token next, in its one block
    add(sched, "a", list(range(100, 115)), max_new=1)
    batch = sched.schedule()
    # the rest of a's prompt (7) would need 2 more blocks, 1 is free: a keeps its cut chunk
    assert chunks(batch) == {"d": 1, "a": 8} and pool.num_free_blocks == 1
    finish_step(sched, batch)  # d is done and frees its block: now the rest fits
    assert chunks(sched.schedule()) == {"a": 7}
    run(sched)
    assert sched.num_preemptions == 0 and pool.num_free_blocks == pool.num_blocks


def periodic_step(sched, batch):
    """Launch and complete a step of a 'model' that repeats every third token: each row
    samples what came three tokens before (drafts from the repeats then always hold)."""
    rows = [(r.token_ids + r.draft_ids[:i])[-3] for r in batch.sampling_requests for i in range(1 + len(r.draft_ids))]
    step(sched, batch, rows)


def test_drafts_take_only_the_budget_prefill_leaves():
    sched, _ = make_scheduler(budget=8)
    sched.drafter = NgramDrafter(max_draft_tokens=3)
    for rid in ("a", "b"):
        add(sched, rid, [5, 6, 7, 5, 6, 7, 5, 6], max_new=30)  # (2 is the stop id here)
    while len(sched.running) < 2 or any(r.num_output_tokens == 0 for r in sched.running):  # both prompts
        periodic_step(sched, sched.schedule())
    for _ in range(2):  # then each decodes 1 + 3 drafts a step: the whole budget
        batch = sched.schedule()
        assert chunks(batch) == {"a": 4, "b": 4} and all(len(r.draft_ids) == 3 for r in batch.requests)
        periodic_step(sched, batch)
    add(sched, "short", [50, 51, 52, 53, 54, 55])
    batch = sched.schedule()  # the newcomer's prefill first, drafts from what it leaves
    assert chunks(batch) == {"a": 1, "b": 1, "short": 6}  # (drafts first would leave it no room)
    periodic_step(sched, batch)
    assert sched.num_accepted_drafts == sched.num_draft_tokens > 12  # (the 'model' repeats: all kept)


def outputs(prompts, **kw):
    sched, pool = make_scheduler(**kw)
    reqs = [add(sched, f"r{i}", p, max_new=12) for i, p in enumerate(prompts)]
    run(sched)
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
    return [r.output_ids for r in reqs], sched


def test_preemption_under_tiny_kv_gives_same_tokens_and_leaks_nothing():
    prompts = [list(range(10 * i + 3, 10 * i + 15)) for i in range(6)]
    roomy, _ = outputs(prompts)
    tight, sched = outputs(prompts, num_blocks=12)  # 11 usable blocks of 4 tokens
    assert sched.num_preemptions > 0
    assert tight == roomy


def test_a_token_in_flight_is_awaited_before_preempting():
    # Under the overlap schedule the next step is planned while the last one's tokens are
    # in flight. A request short of a block then may have its EOS in flight, which frees its
    # blocks: preempting another request for it would throw away that one's work.
    sched, pool = make_scheduler(num_blocks=3, block_size=4)  # 2 usable blocks
    a = add(sched, "a", [10, 11, 12, 13], max_new=4)
    b = add(sched, "b", [20, 21, 22], max_new=2)
    first = sched.schedule()
    sched.advance(first)  # both prefills launched, their tokens in flight
    second = sched.schedule()
    assert second.requests == [b]  # a's next token needs a third block: a waits, nobody is preempted
    sched.advance(second)
    sched.complete(first, [2, 50])  # a's token is the stop id
    sched.complete(second, [51])
    assert a.finish_reason == "stop" and b.output_ids == [50, 51] and b.finish_reason == "length"
    assert sched.num_preemptions == 0 and not sched.has_work()
    assert pool.num_free_blocks == pool.num_blocks


def test_prefix_hit_reports_cached_tokens():
    sched, _ = make_scheduler()
    prompt = list(range(40, 53))
    first = add(sched, "a", prompt)
    run(sched)
    second = add(sched, "b", prompt)
    run(sched)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 12
    assert second.output_ids == first.output_ids


def test_abort_frees_blocks_at_once():
    sched, pool = make_scheduler()
    add(sched, "a", list(range(10, 30)), max_new=100)
    step(sched, sched.schedule(), [7])
    assert pool.num_used_blocks > 0
    assert sched.abort("a")
    assert pool.num_used_blocks == 0
    assert [r.finish_reason for r in sched.take_finished()] == ["abort"]
    assert not sched.abort("a")


def test_stop_token_and_eos():
    sched, _ = make_scheduler()
    req = add(sched, "a", [5, 6, 7], max_new=50)
    batch = sched.schedule()
    step(sched, batch, [2])  # EOS
    assert req.finish_reason == "stop" and req.matched_token_id == 2
    req = add(sched, "b", [5, 6, 7], max_new=50, ignore_eos=True, stop_token_ids=[9])
    step(sched, sched.schedule(), [2])
    assert not req.is_finished
    step(sched, sched.schedule(), [9])
    assert req.finish_reason == "stop" and req.matched_token_id == 9


@pytest.mark.parametrize(
    "prompt_len,max_new,code",
    [
        (0, 4, "INVALID_ARGUMENT"),
        (256, 4, "INVALID_ARGUMENT"),
        (200, 100, "INVALID_ARGUMENT"),
        (100, 100, "INVALID_ARGUMENT"),
    ],
)
def test_requests_that_can_never_run_are_refused(prompt_len, max_new, code):
    sched, _ = make_scheduler(num_blocks=40, max_len=256)  # 156 KV tokens
    with pytest.raises(AdmissionError) as e:
        add(sched, "x", list(range(prompt_len)), max_new=max_new)
    assert e.value.code == code
    assert not sched.has_work()


def test_queue_limit_counts_only_requests_beyond_the_free_running_slots():
    pool = BlockPool(64, 4, True)
    sched = Scheduler(SchedulerConfig(2, 2048, 8192, max_queued_requests=1), KVCacheManager(pool), frozenset({2}))
    for i in range(2):  # both start at the next step
        add(sched, f"r{i}", [5, 6, 7], max_new=4)
    msg = AddRequest("r2", [5, 6, 7], SamplingParams(max_new_tokens=4))
    held = sched.add_request(msg, holds=frozenset({"grammar"}))  # counts
    with pytest.raises(AdmissionError) as e:
        add(sched, "over", [5, 6, 7])
    assert e.value.code == "RESOURCE_EXHAUSTED" and "queue is full" in str(e.value) and "retry" in str(e.value)
    assert "over" not in sched.requests
    step(sched, sched.schedule(), [9, 9])  # r0, r1 run; r2 still held: still full
    with pytest.raises(AdmissionError):
        add(sched, "over", [5, 6, 7])
    sched.release_held(held, "grammar")
    run(sched)
    add(sched, "later", [5, 6, 7])  # room again once the queue drains
    run(sched)
    assert pool.num_free_blocks == pool.num_blocks


def test_duplicate_request_id_is_refused():
    sched, _ = make_scheduler()
    add(sched, "a", [1, 2, 3])
    with pytest.raises(AdmissionError) as e:
        add(sched, "a", [1, 2, 3])
    assert e.value.code == "ALREADY_EXISTS"


def test_cache_salt_separates_prefix_cache():
    sched, _ = make_scheduler()
    prompt = list(range(40, 53))
    sched.add_request(AddRequest("a", prompt, SamplingParams(temperature=0.0, max_new_tokens=2), cache_salt="tenant-1"))
    run(sched)
    other = sched.add_request(
        AddRequest("b", prompt, SamplingParams(temperature=0.0, max_new_tokens=2), cache_salt="tenant-2")
    )
    same = sched.add_request(
        AddRequest("c", prompt, SamplingParams(temperature=0.0, max_new_tokens=2), cache_salt="tenant-1")
    )
    run(sched)
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 12


def test_requests_sharing_a_prompt_compute_it_once():
    # n > 1 siblings (or one system prompt in a burst) arrive together: the first computes
    # the shared blocks, the others wait a step and take them from the cache.
    sched, pool = make_scheduler(budget=64)
    prompt = list(range(10, 30))  # 5 blocks of 4
    siblings = [add(sched, f"r-n{i}", prompt) for i in range(3)]
    add(sched, "other", list(range(50, 60)))
    first = sched.schedule()
    assert [r.request_id for r in first.requests] == ["r-n0", "other"]  # the rest is passed over
    step(sched, first, [next_token(r) for r in first.requests])
    second = sched.schedule()
    assert chunks(second) == {
        "r-n0": 1,
        "other": 1,
        "r-n1": 4,
        "r-n2": 4,
    }  # the last block holds the last token: recomputed
    assert [r.num_cached_tokens for r in siblings] == [0, 16, 16]
    step(sched, second, [next_token(r) for r in second.requests])
    run(sched)
    assert all(r.output_ids == siblings[0].output_ids for r in siblings[1:])
    assert pool.num_free_blocks == pool.num_blocks


def test_a_chunked_shared_prompt_is_waited_for_chunk_by_chunk():
    sched, pool = make_scheduler(budget=16)
    prompt = list(range(10, 34))  # 6 blocks: a chunk of 16, then 8 (and room for 8 more)
    a, b = add(sched, "a", prompt), add(sched, "b", prompt)
    admitted = []
    while b.num_computed_tokens == 0:
        batch = sched.schedule()
        admitted.append([r.request_id for r in batch.requests])
        step(
            sched,
            batch,
            [
                next_token(e.request)
                for e in batch
                if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens
            ],
        )
    assert admitted[:2] == [["a"], ["a"]] and b.num_cached_tokens == 20  # not 16 and 2 blocks again
    run(sched)
    assert b.output_ids == a.output_ids and pool.num_free_blocks == pool.num_blocks
