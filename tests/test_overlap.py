"""The overlap schedule (each step launched before the previous step's tokens are taken),
forced on for the CPU: with the bundled model it must give exactly the tokens of the plain
schedule, under batching, chunked prefill, prefix hits, preemption, stop tokens, aborts
mid-flight and requests that need their tokens on the host, and hand every KV block back."""

import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.messages import AddRequest, SamplingParams
from scheduler.model_runner import ModelRunner, load_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(EngineConfig(device="cpu"))


def make_engine(loaded, overlap=True, **overrides):
    config = EngineConfig(device="cpu", overlap_schedule=overlap, **{"kv_cache_tokens": 4096, **overrides})
    return Engine(config, ModelRunner(config, loaded))


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(rng.randint(20, 70))] for _ in range(n)]


def assert_no_leak(engine):
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, f"{engine.pool.num_used_blocks} KV blocks held"
    assert not engine.has_work() and engine.inflight is None


@pytest.fixture(scope="module")
def reference(loaded):
    engine = make_engine(loaded, overlap=False, max_running_requests=6)
    return [c.output_ids for c in engine.generate(prompts(6), GREEDY)]


def test_default_is_off_on_cpu(loaded):
    assert make_engine(loaded, overlap=None).overlap is False


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_running_requests": 6},
        {"max_running_requests": 6, "max_num_batched_tokens": 16},  # chunked prefill
        {"max_running_requests": 6, "kv_cache_tokens": 160},  # preemption
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_same_tokens_as_the_plain_schedule(loaded, reference, overrides):
    engine = make_engine(loaded, **overrides)
    out = engine.generate(prompts(6), GREEDY)
    assert [c.output_ids for c in out] == reference
    assert all(c.finish_reason == "length" for c in out)
    if "kv_cache_tokens" in overrides:
        assert engine.scheduler.num_preemptions > 0
    assert_no_leak(engine)


def test_steps_really_overlap_and_outputs_lag_one_step(loaded):
    engine = make_engine(loaded)
    engine.add_request(AddRequest("a", prompts(1)[0], GREEDY))
    first = engine.step()  # the prefill is launched; its token is not taken yet
    assert engine.inflight is not None and first.outputs == []
    second = engine.step()  # decode 1 launched, then the prefill's token taken
    assert [len(o.new_token_ids) for o in second.outputs] == [1]
    req = engine.scheduler.requests["a"]
    assert req.num_pending == 1 and req.num_output_tokens == 1


def test_prefix_hits_under_overlap(loaded):
    engine = make_engine(loaded)
    prompt = prompts(1, seed=3)[0] + list(range(200, 240))
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens > 0 and second.output_ids == first.output_ids
    engine.add_request(AddRequest("never-run", prompts(1, seed=5)[0], GREEDY))
    engine.abort("never-run")  # aborted before admission: its prompt is no cache miss
    engine.step()
    assert engine.load.cache_hit_rate == second.num_cached_tokens / (2 * len(prompt))
    assert_no_leak(engine)


def test_stop_token_found_a_step_late_drops_the_extra_token(loaded, reference):
    # Stop each request at its 5th reference token: overlap has already launched the next
    # step for it, whose token must be dropped and whose KV must still come back.
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, stop_token_ids=[ref[4]])
        for ref in reference
    ]
    plain = make_engine(loaded, overlap=False, max_running_requests=6).generate(prompts(6), params)
    engine = make_engine(loaded, max_running_requests=6)
    out = engine.generate(prompts(6), params)
    assert [c.output_ids for c in out] == [c.output_ids for c in plain]
    assert [c.finish_reason for c in out] == [c.finish_reason for c in plain]
    assert all(c.finish_reason == "stop" and len(c.output_ids) <= 5 for c in out)
    assert engine.stats.num_generated_tokens == sum(len(c.output_ids) for c in out)  # not the dropped ones
    assert_no_leak(engine)


def test_abort_while_a_step_is_in_flight(loaded, reference):
    engine = make_engine(loaded, max_running_requests=6)
    for i, p in enumerate(prompts(6)):
        engine.add_request(AddRequest(f"r{i}", p, GREEDY))
    outputs = {}
    for _ in range(4):
        for o in engine.step().outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    victim = engine.scheduler.requests["r2"]
    assert victim in engine.inflight.batch.requests
    assert engine.abort("r2")
    finals = engine.finished_outputs()
    assert [o.finish_reason for o in finals] == ["abort"]
    while engine.has_work():
        for o in engine.step().outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, ref in enumerate(reference):
        got = outputs.get(f"r{i}", [])
        assert got == (ref[: len(got)] if i == 2 else ref)
    assert_no_leak(engine)


def test_requests_needing_host_tokens_fall_back_to_plain_steps(loaded, reference):
    # A logprobs request and a penalised one among plain ones: the steps they are in take
    # the previous tokens first; tokens and logprob rows stay aligned.
    engine = make_engine(loaded, max_running_requests=6)
    params = [GREEDY] * 6
    params[1] = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, return_logprob=True)
    params[3] = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    out = engine.generate(prompts(6), params)
    plain = make_engine(loaded, overlap=False, max_running_requests=6).generate(prompts(6), params)
    assert [c.output_ids for c in out] == [c.output_ids for c in plain]
    assert out[1].output_ids == reference[1]
    assert_no_leak(engine)


def test_length_limit_is_not_scheduled_past(loaded):
    # The last token's step is in flight: the request is not given another row.
    engine = make_engine(loaded)
    engine.add_request(
        AddRequest("a", prompts(1)[0], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    )
    steps = []
    while engine.has_work():
        engine.step()
        steps.append(engine.stats.steps)
    assert steps == [1, 2, 2]  # prefill (samples token 1), decode (token 2), then only the take
    assert engine.stats.batch_size_histogram == {1: 2}  # the take is no step
    assert_no_leak(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_only_request_samples_nothing_and_warms_the_cache(loaded, overlap):
    engine = make_engine(loaded, overlap=overlap)
    prompt = prompts(1, seed=4)[0] + list(range(300, 340))
    only = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=0))[0]
    assert only.output_ids == [] and only.finish_reason == "length"
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens >= len(prompt) // 16 * 16 - 16 and len(again.output_ids) == 20
    assert engine.stats.num_generated_tokens == 20
    assert_no_leak(engine)

    # With logprobs: the prompt's, no output row for the sample that is no output, but the
    # token_ids_logprob row at the next position (prefill-only scoring), sent once at the end
    from scheduler.messages import AddRequest

    sp = SamplingParams(
        temperature=0.0, max_new_tokens=0, return_logprob=True, logprob_start_len=0, token_ids_logprob=[5, 9]
    )
    req = engine.add_request(AddRequest("scored", prompt, sp))
    outputs = []
    while engine.has_work():
        outputs += engine.step().outputs
    assert req.output_logprobs.values == [] and len(req.input_logprobs.values) == len(prompt)
    (final,) = [o for o in outputs if o.request_id == "scored" and o.finish_reason]
    assert final.new_token_ids == [] and len(final.output_logprobs.ids_values) == 1
    assert len(final.output_logprobs.ids_values[0]) == 2 and all(v <= 0 for v in final.output_logprobs.ids_values[0])
    assert not [o for o in outputs if o.request_id == "scored" and o.output_logprobs and not o.finish_reason]
