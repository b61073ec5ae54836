"""N-gram speculative decoding on the bundled model: the same tokens as decoding one at a
time (greedy), fewer steps where the text repeats, every KV block back, and the requests
that may not speculate (penalties, seeds, logprobs) untouched beside those that do."""

import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.messages import AddRequest, SamplingParams
from scheduler.model_runner import ModelRunner, load_model
from scheduler.stop_strings import load_tokenizer


@pytest.fixture(scope="module")
def loaded():
    return load_model(EngineConfig(device="cpu"))


def make_engine(loaded, spec: bool, **overrides):
    config = EngineConfig(
        device="cpu", speculative_algorithm="ngram" if spec else None, **{"kv_cache_tokens": 8192, **overrides}
    )
    return Engine(config, ModelRunner(config, loaded))


def repeated(seed: int, length: int = 24, times: int = 3) -> list[int]:
    """A random run of tokens said `times` times: the model goes on repeating it (as text
    quoting its context does), which n-gram drafts predict."""
    rng = random.Random(seed)
    run = [rng.randint(1000, 30000) for _ in range(length)]
    return run * times


def greedy(max_new=48, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, **kw)


def assert_no_leak(engine):
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.has_work()


def test_greedy_tokens_are_unchanged_in_fewer_steps(loaded):
    prompts = [repeated(0), repeated(1, length=40, times=2), [random.Random(2).randint(100, 40000) for _ in range(60)]]
    plain = make_engine(loaded, spec=False)
    expected = [c.output_ids for c in plain.generate(prompts, greedy())]
    spec = make_engine(loaded, spec=True)
    got = [c.output_ids for c in spec.generate(prompts, greedy())]
    assert got == expected
    sched = spec.scheduler
    assert sched.num_accepted_drafts > 0.5 * sched.num_draft_tokens > 0, (
        sched.num_accepted_drafts,
        sched.num_draft_tokens,
    )
    # (the third prompt repeats nothing: it keeps the batch going for most of its 48 steps)
    assert spec.stats.steps < plain.stats.steps, (spec.stats.steps, plain.stats.steps)
    assert_no_leak(spec)


@pytest.mark.parametrize("drafts", [1, 3, 5])  # 5: six rows, past the few-row projections
def test_draft_counts_and_one_request_alone(loaded, drafts):
    prompt = repeated(0)
    plain = make_engine(loaded, spec=False)
    expected = plain.generate([prompt], greedy(40))[0].output_ids
    spec = make_engine(loaded, spec=True, speculative_num_draft_tokens=drafts)
    assert spec.generate([prompt], greedy(40))[0].output_ids == expected
    kept = spec.scheduler.num_accepted_drafts
    assert kept > 0
    assert spec.stats.steps == plain.stats.steps - kept  # each kept draft is a step saved
    assert_no_leak(spec)


def test_ends_inside_a_run_of_accepted_drafts(loaded):
    """max_new_tokens, a stop id and a stop string met in the middle of a step's kept
    drafts end the request exactly where decoding one token at a time ends it."""
    prompt = repeated(4)
    free = make_engine(loaded, spec=False).generate([prompt], greedy(40))[0].output_ids
    text = load_tokenizer(loaded.path).decode(free[12:20])
    cases = [greedy(11), greedy(40, stop_token_ids=[free[9]]), greedy(40, stop=[text[len(text) // 2 :]])]
    plain = make_engine(loaded, spec=False).generate([prompt] * 3, cases)
    spec = make_engine(loaded, spec=True)
    got = spec.generate([prompt] * 3, cases)
    assert [(c.output_ids, c.finish_reason) for c in got] == [(c.output_ids, c.finish_reason) for c in plain]
    assert [c.finish_reason for c in got] == ["length", "stop", "stop"]
    assert_no_leak(spec)


def test_requests_that_may_not_speculate_decode_as_before(loaded):
    """Penalties, a seed, logprobs: their rows would depend on each other; they decode one
    token a step beside speculating requests, with the tokens they get without speculation."""
    prompt = repeated(5)
    params = [
        greedy(),  # speculates
        greedy(repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, seed=7, max_new_tokens=48, ignore_eos=True),
        greedy(return_logprob=True, top_logprobs_num=2),
    ]
    engine = make_engine(loaded, spec=True)
    reqs = [engine.add_request(AddRequest(f"r{i}", list(prompt), p)) for i, p in enumerate(params)]
    drafted = set()
    while engine.has_work():
        engine.step()
        drafted |= {r.request_id for r in reqs if r.num_draft_tokens}
    assert drafted == {"r0"}
    plain = make_engine(loaded, spec=False).generate([prompt] * 4, params)
    assert [r.output_ids for r in reqs] == [c.output_ids for c in plain]
    assert len(reqs[3].output_logprobs.values) == 48
    assert_no_leak(engine)


def test_sampled_requests_speculate_and_end_whole(loaded):
    """Sampled rows are each the model's own sample: the kept tokens need no correction.
    (Their values differ from a run without speculation, which draws other numbers.)"""
    engine = make_engine(loaded, spec=True)
    out = engine.generate(
        [repeated(6)] * 4, SamplingParams(temperature=0.3, top_p=0.95, max_new_tokens=40, ignore_eos=True)
    )
    assert all(len(c.output_ids) == 40 and c.finish_reason == "length" for c in out)
    assert engine.scheduler.num_accepted_drafts > 0
    assert_no_leak(engine)


def test_preemption_and_chunked_prefill_with_speculation(loaded):
    prompts = [repeated(10 + i, length=20 + 7 * i) for i in range(6)]
    expected = [c.output_ids for c in make_engine(loaded, spec=False).generate(prompts, greedy(32))]
    spec = make_engine(loaded, spec=True, kv_cache_tokens=400, max_num_batched_tokens=64)
    got = [c.output_ids for c in spec.generate(prompts, greedy(32))]
    assert got == expected
    assert spec.scheduler.num_preemptions > 0 and spec.scheduler.num_accepted_drafts > 0
    assert_no_leak(spec)


def test_speculation_refuses_a_forced_overlap_schedule(loaded):
    """Once a step overlaps, every request has a token in flight and none could draft again."""
    with pytest.raises(ValueError, match="cannot run with the overlap schedule"):
        make_engine(loaded, spec=True, overlap_schedule=True)
    config = EngineConfig(device="cpu", kv_cache_tokens=1024, speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="'eagle' is not supported"):
        Engine(config, ModelRunner(config, loaded))


def test_drafts_only_where_the_cost_model_says_they_pay(loaded, monkeypatch):
    from scheduler.config import DEVICE_DEFAULTS

    prompts = [repeated(0), repeated(1)]
    expected = [c.output_ids for c in make_engine(loaded, spec=False).generate(prompts, greedy(16))]
    spec = make_engine(loaded, spec=True)
    expected_rows = DEVICE_DEFAULTS["cpu"].speculative_doubling_rows[str(spec.runner.dtype).removeprefix("torch.")]
    assert spec.scheduler.drafter.doubling_rows == spec.config.speculative_doubling_rows == expected_rows
    asked = []  # the decode rows of each step a request would have drafted in
    monkeypatch.setattr(spec.scheduler.drafter, "pays", lambda req, rows: asked.append(rows) and False)
    assert [c.output_ids for c in spec.generate(prompts, greedy(16))] == expected
    assert spec.scheduler.num_draft_tokens == 0 and asked and set(asked) <= {1, 2}
    assert_no_leak(spec)
