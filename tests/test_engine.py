"""The offline engine on the bundled model: prefix caching, chunked prefill and
preemption must not change greedy tokens, and every KV block comes back."""

import random

import pytest
import torch

from helpers import wait_until
from scheduler.config import EngineConfig
from scheduler.engine import AdmissionError, Engine
from scheduler.messages import SamplingParams
from scheduler.metrics import ThroughputWindow
from scheduler.model_runner import ModelRunner, load_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(EngineConfig(device="cpu"))


def make_engine(loaded, **overrides):
    config = EngineConfig(device="cpu", **{"kv_cache_tokens": 4096, **overrides})
    return Engine(config, ModelRunner(config, loaded))


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(rng.randint(20, 70))] for _ in range(n)]


def assert_no_leak(engine):
    pool = engine.pool
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} KV blocks still held"
    assert not engine.has_work()


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy outputs with a roomy KV and one request at a time (no batching effects)."""
    engine = make_engine(loaded, max_running_requests=1, enable_prefix_caching=False)
    return [engine.generate([p], GREEDY)[0].output_ids for p in prompts(6)]


def test_batched_matches_one_at_a_time(loaded, reference):
    engine = make_engine(loaded, max_running_requests=6)
    out = engine.generate(prompts(6), GREEDY)
    assert [c.output_ids for c in out] == reference
    assert engine.stats.max_batch_size > 1
    assert_no_leak(engine)


def test_packed_cpu_weights_give_the_same_tokens(loaded):
    """40 requests decode together: the projections take the packed weights (kernels/linear.py)."""
    from kernels.linear import can_pack

    if not can_pack(torch.float32):
        pytest.skip("no packed sgemm in this torch build")
    batch = prompts(40, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    unpacked = make_engine(loaded, cpu_packed_weights=False, max_running_requests=40)
    assert loaded.model.lm_head.packed_weight is None
    expected = [c.output_ids for c in unpacked.generate(batch, params)]
    packed = make_engine(loaded, cpu_packed_weights=True, max_running_requests=40)
    assert loaded.model.lm_head.packed_weight is not None
    assert loaded.model.model.layers[0].mlp.down_proj.packed_weight is not None
    assert [c.output_ids for c in packed.generate(batch, params)] == expected
    assert packed.stats.max_batch_size == 40
    make_engine(loaded, cpu_packed_weights=False)  # drops them from the shared model
    assert loaded.model.lm_head.packed_weight is None


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(loaded):
    engine = make_engine(loaded)
    prompt = prompts(1, seed=3)[0] + list(range(200, 240))
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert second.output_ids == first.output_ids
    assert_no_leak(engine)


def test_requests_sharing_a_cached_prefix_decode_as_without_the_cache(loaded):
    """Requests behind one cached system prompt decode together with their tables starting at
    the same blocks, which the CPU decode attention attends for all of them at once
    (csrc/paged_decode_attention.c, shared prefixes): the same tokens as each on its own blocks."""
    system = prompts(1, seed=5)[0] * 2  # 40-140 tokens: whole 16-token blocks to share
    batch = [system + question for question in prompts(6, seed=6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    expected = [c.output_ids for c in make_engine(loaded, enable_prefix_caching=False).generate(batch, params)]
    engine = make_engine(loaded)
    engine.generate([system + [7]], GREEDY)  # caches the system prompt's blocks
    out = engine.generate(batch, params)
    assert all(c.num_cached_tokens >= len(system) // 16 * 16 > 0 for c in out)
    assert engine.stats.max_batch_size == len(batch)
    assert [c.output_ids for c in out] == expected
    assert_no_leak(engine)


def test_chunked_prefill_gives_same_tokens(loaded, reference):
    engine = make_engine(loaded, max_num_batched_tokens=16, enable_prefix_caching=False)
    out = engine.generate(prompts(6), GREEDY)
    assert engine.stats.max_step_tokens <= 16
    assert [c.output_ids for c in out] == reference
    assert_no_leak(engine)


def test_preemption_under_tiny_kv_gives_same_tokens(loaded, reference):
    # 6 requests of up to ~94 tokens each cannot all fit in 160 KV tokens at once.
    engine = make_engine(loaded, kv_cache_tokens=160, max_running_requests=6)
    out = engine.generate(prompts(6), GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [c.output_ids for c in out] == reference
    assert_no_leak(engine)


def test_generate_refusing_one_prompt_queues_none(loaded, reference):
    """All or none: the prompts queued before a refused one are dropped with it, so the
    engine is left empty and the next call runs (its ids do not clash with leftovers)."""
    engine = make_engine(loaded)
    with pytest.raises(AdmissionError):
        engine.generate([prompts(1)[0], []], GREEDY)
    assert_no_leak(engine)
    assert engine.generate([prompts(1)[0]], GREEDY)[0].output_ids == reference[0]
    assert_no_leak(engine)


def test_generation_throughput_over_a_sliding_window():
    window = ThroughputWindow(window_s=5.0)

    def steps(*entries, now=None):  # (launched, done, tokens)
        for launched, done, n in entries:
            window.add(launched, done, n)
        return window.rate(now if now is not None else entries[-1][1])

    # the 5 s window drops the step done at t=1; the rate runs from the first kept launch
    assert steps((0, 1, 10), (1, 2, 20), (2, 3, 30), (6, 6.5, 40)) == pytest.approx((20 + 30 + 40) / 5.5)
    assert window.num_tokens == 90
    assert window.rate(12.0) == 0.0 and window.num_tokens == 0  # idle since: the window is empty
    # steps longer than the window (a busy CPU) still give a rate, not 0
    assert steps((20, 26, 12)) == pytest.approx(12 / 6) and steps((26, 32, 24)) == pytest.approx(24 / 6)
    # after a short idle gap the old steps age out by their end: the gap is not averaged in
    steps(*[(t, t + 1, 100) for t in range(40, 45)])
    assert steps((49, 50, 100), (50, 51, 100)) == pytest.approx(100.0)


def test_the_load_reports_the_engines_throughput(loaded):
    engine = make_engine(loaded)
    engine.generate(prompts(2), GREEDY)
    assert engine.load.gen_throughput > 0 and 0 < engine.throughput.num_tokens <= 2 * GREEDY.max_new_tokens


def _stopped_workers(engine):
    """The engine's compile workers, ready and then paused (SIGSTOP): a compile handed to
    one stays unfinished until the returned ``resume`` (SIGCONT) runs. Warms the engine's
    grammar side first (the vocabulary tables, both workers started)."""
    import os
    import signal

    warm = SamplingParams(temperature=0.0, max_new_tokens=4, constraint_kind="regex", constraint="(warm)")
    engine.generate([prompts(1, seed=3)[0]], warm)
    workers = engine.grammars.workers
    wait_until(lambda: engine.grammars.poll() and all(w.ready for w in workers), 300, "the workers ready")
    pids = [w.process.pid for w in workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def resume():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # killed meanwhile
                pass

    return pids, resume


def _alive(pid) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_waiting_uncached_tokens_leave_out_prefix_hits_and_count_held_requests(loaded):
    """The load's queued prefill work (the router's least-load input): a queued request's
    tokens minus its prefix-cache hit, plus every token of one held for its grammar."""
    from scheduler.messages import AddRequest

    engine = make_engine(loaded, max_running_requests=1)
    _, resume = _stopped_workers(engine)
    shared, other, fresh = prompts(3, seed=11)
    shared = (shared * 3)[:64]  # four full 16-token blocks
    engine.generate([shared], GREEDY)  # caches them
    try:
        engine.add_request(AddRequest("runs", other, GREEDY))  # the one running slot
        engine.step()
        engine.add_request(AddRequest("hit", shared + [7, 8, 9], GREEDY))
        engine.add_request(AddRequest("miss", (fresh * 2)[:30], GREEDY))
        regex = SamplingParams(temperature=0.0, max_new_tokens=8, constraint_kind="regex", constraint="(a|b)")
        engine.add_request(AddRequest("held", other[:20], regex))
        engine.refresh_load()
        assert engine.load.num_waiting == 3
        assert engine.load.num_waiting_uncached_tokens == (67 - 64) + 30 + 20
    finally:
        resume()
        for rid in ("runs", "hit", "miss", "held"):
            engine.abort(rid)
        engine.step()
        engine.grammars.close()
    assert_no_leak(engine)


GOOD = SamplingParams(temperature=0.0, max_new_tokens=8, constraint_kind="regex", constraint="(yes|no)!")


def test_a_grammar_compiling_past_its_time_limit_is_refused_and_delays_no_other(loaded):
    """Two compiles that never end fill both workers: each request is refused with
    CONSTRAINT_FAILED once it has compiled for grammar_compile_timeout_s, its worker is
    killed, and the grammar queued behind them compiles on a fresh worker and is served."""
    import time

    from scheduler.messages import AddRequest

    engine = make_engine(loaded, grammar_compile_timeout_s=5.0)
    stuck_pids, resume = _stopped_workers(engine)
    try:
        stuck = [
            SamplingParams(temperature=0.0, max_new_tokens=8, constraint_kind="regex", constraint=f"(s{i})!")
            for i in (1, 2)
        ]
        for rid, sp in (("stuck-1", stuck[0]), ("stuck-2", stuck[1]), ("queued", GOOD)):
            engine.add_request(AddRequest(rid, prompts(1, seed=6)[0], sp))
        tokens, errors, finish = {}, {}, {}
        deadline = time.monotonic() + 300
        while engine.has_work():
            assert time.monotonic() < deadline, "held requests never left the engine"
            for o in engine.step().outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                finish[o.request_id] = o.finish_reason
                if o.error:
                    errors[o.request_id] = (o.error_code, o.error)
        assert sorted(errors) == ["stuck-1", "stuck-2"], errors
        assert all(code == "CONSTRAINT_FAILED" and "did not compile within 5 s" in msg for code, msg in errors.values())
        from scheduler.stop_strings import load_tokenizer

        *text, end = tokens["queued"]
        assert finish["queued"] == "stop" and end in engine.scheduler.eos_token_ids, (finish, tokens)
        assert load_tokenizer(engine.runner.model_path).decode(text) in ("yes!", "no!")
        assert_no_leak(engine)
        # The overrunning compiles are stopped, not left running: new constraints are served
        assert not any(_alive(pid) for pid in stuck_pids)
        assert engine.generate([prompts(1, seed=7)[0]], GOOD)[0].finish_reason == "stop"
    finally:
        resume()
        engine.grammars.close()


def test_a_cancelled_request_compiling_its_grammar_holds_no_worker(loaded):
    """Aborting a request while its grammar compiles stops that compile (its worker is
    killed and replaced); a compile that already finished keeps its worker; later grammars
    wait behind nothing."""
    from scheduler.messages import AddRequest

    engine = make_engine(loaded, grammar_compile_timeout_s=30.0)
    stuck_pids, resume = _stopped_workers(engine)
    try:
        stuck = SamplingParams(temperature=0.0, max_new_tokens=8, constraint_kind="regex", constraint="(stuck)!")
        for rid in ("stuck-1", "stuck-2"):
            engine.add_request(AddRequest(rid, prompts(1, seed=6)[0], stuck))
        assert all(job.worker is not None for job in engine.grammars.jobs.values())
        assert engine.abort("stuck-1") and engine.abort("stuck-2")
        assert [o.finish_reason for o in engine.finished_outputs()] == ["abort", "abort"]
        wait_until(lambda: not any(_alive(pid) for pid in stuck_pids), 60, "the stuck workers killed")
        # A compile that already finished (not yet taken by a step) keeps its worker
        workers = engine.grammars.workers
        wait_until(lambda: engine.grammars.poll() and all(w.ready for w in workers), 300, "new workers ready")
        engine.add_request(AddRequest("compiled", prompts(1, seed=8)[0], GOOD))
        job = engine.grammars.jobs["compiled"]
        wait_until(lambda: job.worker.conn.poll(), 300, "the grammar compiled")
        worker = job.worker
        assert engine.abort("compiled") and worker in engine.grammars.workers and _alive(worker.process.pid)
        engine.finished_outputs()
        done = engine.generate([prompts(1, seed=7)[0]], GOOD)[0]
        assert done.finish_reason == "stop"
        assert_no_leak(engine)
    finally:
        resume()
        engine.grammars.close()


def test_compile_workers_that_died_idle_are_replaced(loaded):
    """A worker killed while idle (the OOM killer, an operator) is noticed when the next
    grammar is handed to it: a fresh one compiles that grammar and the engine keeps serving."""
    engine = make_engine(loaded, grammar_compile_timeout_s=300.0)
    _, resume = _stopped_workers(engine)
    try:
        resume()
        for w in engine.grammars.workers:
            w.process.kill()
            w.process.wait()
        done = engine.generate([prompts(1, seed=7)[0]], GOOD)[0]
        assert done.finish_reason == "stop"
        assert_no_leak(engine)
    finally:
        engine.grammars.close()


def test_a_compiling_grammar_holds_only_its_own_request(loaded, reference):
    """Grammar compilation runs beside the step loop: other requests keep stepping while it
    is stuck, the held request starts once it is done, and an abort or a failure while it
    compiles leaves nothing behind."""
    from scheduler.messages import AddRequest

    # (No compile time limit in reach: the held compiles wait for the plain request, however
    # long a loaded machine takes over it; the limit has its own tests above.)
    engine = make_engine(loaded, grammar_compile_timeout_s=3600.0)
    _, resume = _stopped_workers(engine)
    try:
        regex = SamplingParams(temperature=0.0, max_new_tokens=8, constraint_kind="regex", constraint="(yes|no)!")
        bad = SamplingParams(temperature=0.0, max_new_tokens=8, constraint_kind="regex", constraint="(")
        engine.add_request(AddRequest("plain", prompts(1)[0], GREEDY))
        engine.add_request(AddRequest("constrained", prompts(2)[1], regex))
        engine.add_request(AddRequest("aborted", prompts(3)[2], regex))
        engine.add_request(AddRequest("invalid", prompts(4)[3], bad))
        assert engine.abort("aborted")
        tokens, finish, errors = {}, {}, {}

        def step():
            for o in engine.step().outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                finish[o.request_id] = o.finish_reason
                if o.error:
                    errors[o.request_id] = (o.error_code, o.error)

        while finish.get("plain") is None:  # the plain request runs to its end meanwhile
            step()
        assert tokens["plain"] == reference[0] and "constrained" not in tokens and engine.has_work()
        resume()
        while engine.has_work():
            step()
        assert finish["aborted"] == "abort" and not tokens["aborted"]
        assert list(errors) == ["invalid"] and errors["invalid"] == ("CONSTRAINT_FAILED", "invalid regex"), errors
        from scheduler.stop_strings import load_tokenizer

        *text, end = tokens["constrained"]
        assert finish["constrained"] == "stop" and end in engine.scheduler.eos_token_ids
        assert load_tokenizer(engine.runner.model_path).decode(text) in ("yes!", "no!")
        assert_no_leak(engine)
    finally:
        resume()
        engine.grammars.close()


def test_a_grammar_error_says_whether_the_spec_or_the_grammar_engine_is_at_fault(loaded):
    """In short words of ours: xgrammar's own text (C++ checks, source files) stays in the log."""
    pytest.importorskip("xgrammar")
    from scheduler.grammar import GrammarBackend, GrammarError

    backend = GrammarBackend.get(loaded.path, loaded.config.vocab_size, [2])
    cases = {
        '{"type": "object", "properties": 3': "invalid json_schema: not JSON",  # xgrammar: "Check failed"
        '{"type": "strin"}': "invalid json_schema",
        # A valid schema beyond xgrammar's limits (large repetition counts in a pattern):
        '{"type": "string", "pattern": "([a-z][0-9]){200,2000}"}': (
            "json_schema not supported by the grammar engine (xgrammar)"
        ),
    }
    for spec, message in cases.items():
        with pytest.raises(GrammarError) as e:
            backend.compile("json_schema", spec)
        assert str(e.value) == message
    with pytest.raises(GrammarError) as e:  # (a KeyError inside before)
        backend.compile("structural_tag", '{"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a"]}')
    assert str(e.value) == "invalid structural_tag: a structure lacks the string 'end'"


def test_a_kv_cache_larger_than_the_memory_left_is_refused(loaded):
    with pytest.raises(ValueError, match="kv-cache-memory 100TiB is more than"):
        ModelRunner(EngineConfig(device="cpu", kv_cache_memory="100TiB"), loaded)


@pytest.mark.parametrize("overrides", [{"kv_cache_memory": "1"}, {"block_size": 100_000}])
def test_a_kv_budget_below_two_blocks_is_refused(loaded, overrides):
    # (no floor of 2 blocks that would overrun the budget: 100k-token blocks need 8.6 GiB)
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        ModelRunner(EngineConfig(device="cpu", **overrides), loaded)


def test_the_compiled_grammar_cache_is_bounded(loaded):
    """Every tool-calling request may bring its own schema: the compiled-grammar cache keeps
    within its byte limit instead of growing for the life of the process."""
    import json

    from scheduler.grammar import GrammarBackend

    limit = 256 * 1024
    backend = GrammarBackend(
        loaded.path, loaded.config.vocab_size, list(loaded.config.eos_token_ids), cache_limit_bytes=limit
    )
    for i in range(16):  # ~100 KB each here: unbounded, 1.6 MB
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(8)}}
        backend.compile("json_schema", json.dumps(schema))
    assert 0 < backend.compiler.get_cache_size_bytes() < 1.2 * limit  # (xgrammar's own overhead on top)


def test_per_device_defaults_on_the_cpu(loaded):
    """Unset, the step budget, running slots and long-prefill threshold take the CPU's
    defaults (accelerators: 8192 tokens, 256 requests)."""
    config = make_engine(loaded).scheduler.config
    assert (config.max_num_batched_tokens, config.max_running_requests) == (512, 64)
    assert config.long_prefill_token_threshold == 256


def test_a_token_outside_the_vocabulary_is_refused_not_run(loaded):
    from scheduler.messages import AddRequest

    engine = make_engine(loaded)
    vocab = loaded.config.vocab_size
    for bad in ([5, vocab], [-1, 5]):
        with pytest.raises(AdmissionError, match="outside the vocabulary") as e:
            engine.add_request(AddRequest("x", bad, GREEDY))
        assert e.value.code == "INVALID_ARGUMENT"
    assert not engine.has_work()
