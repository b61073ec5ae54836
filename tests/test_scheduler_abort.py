"""Scheduler.abort in the middle of things (the stand-in token source of test_scheduler.py,
no model): mid chunked prefill, and of the request whose prompt blocks another request is
waiting for. Nothing may leak, and what stays cached must be what was computed."""

from test_scheduler import add, make_scheduler, next_token, run, step


def step_all(sched):
    """One scheduled step, completed at once; returns the batch."""
    batch = sched.schedule()
    step(
        sched,
        batch,
        [
            next_token(e.request)
            for e in batch
            if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens
        ],
    )
    return batch


def reference(prompt, max_new):
    """The output of `prompt` alone on a fresh scheduler."""
    sched, _ = make_scheduler(budget=16)
    req = add(sched, "ref", prompt, max_new=max_new)
    run(sched)
    return req.output_ids


def test_abort_mid_chunked_prefill_frees_its_blocks_and_keeps_only_computed_ones_cached():
    sched, pool = make_scheduler(budget=16)  # blocks of 4 tokens
    prompt = list(range(100, 150))  # 50 tokens: chunks of 16
    add(sched, "a", prompt, max_new=3)
    step_all(sched)  # 16 of 50 computed
    assert pool.num_used_blocks > 0
    assert sched.abort("a")
    assert pool.num_used_blocks == 0 and [r.finish_reason for r in sched.take_finished()] == ["abort"]
    again = add(sched, "again", prompt, max_new=3)
    run(sched)
    assert again.num_cached_tokens == 16, "the cache must hold the computed chunk, and nothing past it"
    assert again.output_ids == reference(prompt, 3)
    assert pool.num_free_blocks == pool.num_blocks


def test_aborting_the_request_computing_a_shared_prompt_lets_its_waiter_run():
    """b waits for the blocks a is computing (the same prompt); a is aborted after its first
    chunk: b must not wait for blocks that will never come, and takes the finished chunk
    from the cache."""
    sched, pool = make_scheduler(budget=16)
    prompt = list(range(10, 34))  # 24 tokens: a chunk of 16, then 8
    a, b = add(sched, "a", prompt), add(sched, "b", prompt)
    first = step_all(sched)
    assert [r.request_id for r in first.requests] == ["a"]  # b waits for a's blocks
    assert sched.abort("a")
    run(sched)
    assert a.finish_reason == "abort" and b.finish_reason == "length"
    assert b.num_cached_tokens == 16
    assert b.output_ids == reference(prompt, 8)
    assert pool.num_free_blocks == pool.num_blocks
