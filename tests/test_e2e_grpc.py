"""End-to-end tests of the real daemon over gRPC (smg-grpc-proto stubs), on the real model.

One daemon serves the whole session (see conftest.py). Requests are built the way the smg
router builds them (router contract §2): greedy is temperature 0 (proto3 unset),
top_p 1, top_k -1, repetition_penalty 1, skip_special_tokens true, logprob_start_len -1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import SCHEDULER_SERVICE, Daemon, _group_members, child_pids, wait_kv_free, wait_until

VOCAB_SIZE = 49152
CONTEXT_LENGTH = 8192
EOS = 2
RPC_TIMEOUT = 180
KV_FREE = (0, 0, 0)  # wait_kv_free: (requests in flight, KV tokens held, KV tokens in the last load)


# ------------------------------------------------------------------ request helpers


def sampling(max_new_tokens=None, **kw) -> pb.SamplingParams:
    base = dict(
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        repetition_penalty=1.0,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
    )
    base.update(kw)
    sp = pb.SamplingParams(**base)
    if max_new_tokens is not None:
        sp.max_new_tokens = max_new_tokens
    return sp


def make_request(
    input_ids, *, max_new_tokens=16, stream=False, rid=None, params=None, cache_salt=None, **kw
) -> pb.GenerateRequest:
    """`cache_salt` (custom_params, as the router forwards it) keeps the prompt's blocks apart
    from every other request's: pass a fresh one where a test needs a cold prefix cache."""
    req = pb.GenerateRequest(
        request_id=rid or f"e2e-{uuid.uuid4().hex[:16]}",
        tokenized=pb.TokenizedInput(original_text="", input_ids=list(input_ids)),
        sampling_params=params if params is not None else sampling(max_new_tokens, **kw),
        stream=stream,
        logprob_start_len=-1,
    )
    if cache_salt is not None:
        req.sampling_params.custom_params.update({"cache_salt": cache_salt})
    return req


def fresh_salt() -> str:
    return f"salt-{uuid.uuid4().hex}"


def generate(stub, req, timeout=RPC_TIMEOUT):
    """All messages of one Generate call, as (kind, message) pairs."""
    return [(m.WhichOneof("response"), m) for m in stub.Generate(req, timeout=timeout)]


def completes_of(msgs):
    return [m.complete for kind, m in msgs if kind == "complete"]


def chunks_of(msgs):
    return [m.chunk for kind, m in msgs if kind == "chunk"]


def one_complete(stub, req, timeout=RPC_TIMEOUT):
    """A non-streaming call must answer exactly one Complete and nothing else."""
    msgs = generate(stub, req, timeout)
    kinds = [k for k, _ in msgs]
    assert kinds == ["complete"], f"non-stream Generate should answer one Complete, got {kinds}"
    assert msgs[0][1].request_id == req.request_id
    return msgs[0][1].complete


def greedy_ids(stub, input_ids, max_new_tokens=16, **kw):
    c = one_complete(stub, make_request(input_ids, max_new_tokens=max_new_tokens, **kw))
    return list(c.output_ids), c


def chat_ids(tokenizer, content):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:3] == [1, 9690, 198], ids[:8]
    return ids


def check_usage(c, prompt_len):
    assert c.prompt_tokens == prompt_len
    assert c.completion_tokens == len(c.output_ids)
    assert 0 <= c.cached_tokens <= c.prompt_tokens


def server_info(stub):
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def sched_stat(stub, key):
    info = server_info(stub)
    fields = info.scheduler_info.fields
    assert key in fields, f"scheduler_info has no {key!r}: {sorted(fields)}"
    return fields[key].number_value


def num_busy(stub) -> int:
    """Requests the servicer has in flight plus those the scheduler still runs or queues
    (a cancelled request leaves the servicer at once and the scheduler a step later).
    Scheduler stats that did not answer in time (scheduler_info is then {"error": ...})
    count as one busy request: unknown is not idle."""
    info = server_info(stub)
    fields = info.scheduler_info.fields
    if "num_running_reqs" not in fields or "num_waiting_reqs" not in fields:
        return info.active_requests + 1
    queued = sum(int(fields[k].number_value) for k in ("num_running_reqs", "num_waiting_reqs"))
    return info.active_requests + queued


def num_running(stub) -> int | None:
    """Requests the scheduler runs now; None when its stats did not answer in time."""
    fields = server_info(stub).scheduler_info.fields
    return int(fields["num_running_reqs"].number_value) if "num_running_reqs" in fields else None


def wait_idle(stub, timeout=60.0):
    """Wait until neither the servicer nor the scheduler holds a request; returns the last count."""
    deadline = time.monotonic() + timeout
    n = None
    while time.monotonic() < deadline:
        n = num_busy(stub)
        if n == 0:
            return 0
        time.sleep(0.2)
    return n


@pytest.fixture(scope="module")
def france(tokenizer):
    return chat_ids(tokenizer, "What is the capital of France?")


@pytest.fixture(scope="module")
def hi(tokenizer):
    return chat_ids(tokenizer, "Hi")


@pytest.fixture(scope="module")
def story(tokenizer):
    return tokenizer.encode("Once upon a time", add_special_tokens=False)


# ------------------------------------------------------------------ Generate


def test_generate_nonstream_greedy(grpc_stub, tokenizer, france):
    req = make_request(france, max_new_tokens=24)
    c = one_complete(grpc_stub, req)
    out = list(c.output_ids)
    assert out, "empty output_ids"
    assert all(0 <= t < VOCAB_SIZE for t in out)
    assert c.finish_reason in ("length", "stop"), c.finish_reason
    if c.finish_reason == "length":
        assert len(out) == 24
    else:
        assert c.WhichOneof("matched_stop") == "matched_token_id" and c.matched_token_id == EOS
        assert len(out) <= 24
    check_usage(c, len(france))
    assert c.index == 0
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text, f"greedy answer without 'Paris': {text!r}"


def test_greedy_is_deterministic_and_prefix_cached(grpc_stub, story):
    prompt = story * 12  # 48 tokens: at least a few full KV blocks to reuse
    a, ca = greedy_ids(grpc_stub, prompt, max_new_tokens=8)
    b, cb = greedy_ids(grpc_stub, prompt, max_new_tokens=8)
    assert a == b
    assert ca.prompt_tokens == cb.prompt_tokens == len(prompt)
    assert cb.cached_tokens > 0, "the second identical prompt should hit the prefix cache"
    assert cb.cached_tokens < len(prompt)


def test_proto3_defaults_are_greedy(grpc_stub, france):
    """temperature/top_p/top_k/repetition_penalty all left at proto3 zero = greedy, unrestricted."""
    ref, _ = greedy_ids(grpc_stub, france, max_new_tokens=12)
    bare = pb.SamplingParams(max_new_tokens=12)
    c = one_complete(grpc_stub, make_request(france, params=bare))
    assert list(c.output_ids) == ref


def test_generate_stream_deltas_match_nonstream(grpc_stub, france):
    ref, ref_c = greedy_ids(grpc_stub, france, max_new_tokens=16)
    req = make_request(france, max_new_tokens=16, stream=True)
    msgs = generate(grpc_stub, req)
    kinds = [k for k, _ in msgs]
    assert kinds[-1] == "complete" and kinds.count("complete") == 1, kinds
    assert all(m.request_id == req.request_id for _, m in msgs)
    chunks = chunks_of(msgs)
    assert len(chunks) >= 2, f"streaming should send a chunk per step, got {kinds}"
    total = []
    for ch in chunks:
        assert len(ch.token_ids) >= 1, "a chunk without new tokens"
        total.extend(ch.token_ids)
        assert ch.completion_tokens == len(total), "chunk completion_tokens must be cumulative"
        assert ch.prompt_tokens == len(france)
        assert 0 <= ch.cached_tokens <= len(france)
        assert ch.index == 0
    assert total == ref, "concatenated stream deltas differ from the non-stream output"
    c = completes_of(msgs)[0]
    assert c.finish_reason == ref_c.finish_reason
    assert c.completion_tokens == len(total)
    assert c.prompt_tokens == len(france)
    if c.output_ids:  # the reference sends the last delta; the full list is also accepted
        assert list(c.output_ids) == total[-len(c.output_ids) :]


def test_concurrent_generate_batches(grpc_stub, tokenizer):
    prompts = [
        tokenizer.encode(f"Story {i}: once upon a time, a {w}", add_special_tokens=False)
        for i, w in enumerate(
            [
                "cat",
                "dog",
                "king",
                "robot",
                "tree",
                "ship",
                "bird",
                "girl",
                "wizard",
                "fox",
                "city",
                "river",
                "baker",
                "knight",
                "whale",
                "cloud",
            ]
        )
    ]
    n_new = 12
    assert wait_idle(grpc_stub) == 0
    steps_before = sched_stat(grpc_stub, "steps")
    refs = [greedy_ids(grpc_stub, p, max_new_tokens=n_new, ignore_eos=True)[0] for p in prompts]
    seq_steps = sched_stat(grpc_stub, "steps") - steps_before  # >= 16 x 12: one token per step

    start = threading.Barrier(len(prompts))

    def one(p):
        start.wait(timeout=30)
        return one_complete(grpc_stub, make_request(p, max_new_tokens=n_new, ignore_eos=True))

    steps_before = sched_stat(grpc_stub, "steps")
    with ThreadPoolExecutor(len(prompts)) as ex:
        results = list(ex.map(one, prompts))
    conc_steps = sched_stat(grpc_stub, "steps") - steps_before

    for p, ref, c in zip(prompts, refs, results):
        assert c.finish_reason == "length"
        assert len(c.output_ids) == n_new
        check_usage(c, len(p))
        # Batching must not mix requests up: same greedy tokens as alone (the first few at
        # least; later ones could flip on float near-ties between batch shapes).
        assert list(c.output_ids)[:8] == ref[:8]
    assert sched_stat(grpc_stub, "max_batch_size") > 1
    print(f"16 x {n_new} tokens: {seq_steps} engine steps one by one, {conc_steps} concurrently")
    # Counted in engine steps, not seconds (a shared CPU makes wall time noisy): batched,
    # the 16 requests share their steps (~12 when they all arrive at once).
    assert seq_steps >= len(prompts) * n_new, seq_steps
    assert 0 < conc_steps <= seq_steps // 2, f"16 concurrent requests took {conc_steps} steps, one by one {seq_steps}"


def test_64_concurrent_requests_finish_and_free_their_kv(grpc_stub):
    """64 requests in flight at once (more than max_running_requests=32): all finish with
    their own lengths, and afterwards the pool holds no block (GetLoads)."""
    import random

    rng = random.Random(7)
    work = [([rng.randint(100, 49000) for _ in range(rng.randint(8, 40))], rng.randint(4, 12)) for _ in range(64)]

    def run(item):
        ids, n = item
        return one_complete(grpc_stub, make_request(ids, max_new_tokens=n, ignore_eos=True))

    with ThreadPoolExecutor(len(work)) as ex:
        completes = list(ex.map(run, work))
    assert [c.completion_tokens for c in completes] == [n for _, n in work]
    assert all(c.finish_reason == "length" for c in completes)
    # (GetLoads trails the last step by a heartbeat: wait_kv_free polls it too)
    assert wait_kv_free(grpc_stub) == KV_FREE, "a request still runs or KV is held after all requests ended"


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("stream", [False, True])
def test_max_new_tokens_gives_length(grpc_stub, story, n, stream):
    req = make_request(story, max_new_tokens=n, stream=stream, ignore_eos=True)
    msgs = generate(grpc_stub, req)
    c = completes_of(msgs)[-1]
    assert c.finish_reason == "length"
    assert c.completion_tokens == n
    if stream:
        assert sum(len(ch.token_ids) for ch in chunks_of(msgs)) == n
    else:
        assert len(c.output_ids) == n


def test_the_stop_string_tokenizer_is_loaded_before_the_scheduler_reports_ready(daemon):
    """Loaded after ready, on a thread beside the first requests, its import slowed them; the
    daemon is ready only once it is loaded (the scheduler logs both, in order)."""
    log = daemon.log_path.read_text(errors="replace")
    loaded, ready = log.find("loading the tokenizer for stop strings"), log.find("scheduler ready")
    assert 0 <= loaded < ready, daemon.log_tail(60)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids(grpc_stub, france, stream):
    """A stop token id ends the output with that token included (as EOS is, and as the
    reference servicer sends it: the router decodes with skip_special_tokens)."""
    base, _ = greedy_ids(grpc_stub, france, max_new_tokens=16)
    assert len(base) >= 3, base
    stop_id = base[2]
    idx = base.index(stop_id)  # the first occurrence is where it must stop
    msgs = generate(grpc_stub, make_request(france, max_new_tokens=16, stream=stream, stop_token_ids=[stop_id]))
    c = completes_of(msgs)[-1]
    out = [t for ch in chunks_of(msgs) for t in ch.token_ids] if stream else list(c.output_ids)
    assert c.finish_reason == "stop"
    assert c.WhichOneof("matched_stop") == "matched_token_id"
    assert c.matched_token_id == stop_id
    assert out == base[: idx + 1], (out, base, stop_id)
    assert c.completion_tokens == len(out)


def test_eos_stop_and_ignore_eos(grpc_stub, hi):
    base, c = greedy_ids(grpc_stub, hi, max_new_tokens=48)
    assert c.finish_reason == "stop", f"greedy reply to 'Hi' did not end with EOS in 48 tokens: {base}"
    assert c.WhichOneof("matched_stop") == "matched_token_id" and c.matched_token_id == EOS
    n = len(base) + 4
    out, c2 = greedy_ids(grpc_stub, hi, max_new_tokens=n, ignore_eos=True)
    assert c2.finish_reason == "length"
    assert len(out) == n
    assert out[: len(base)] == base
    assert EOS in out[: len(base) + 1], "ignore_eos run should pass through the EOS the plain run stopped on"


def test_n2_fanout(grpc_stub, france):
    ref, _ = greedy_ids(grpc_stub, france, max_new_tokens=6)
    msgs = generate(grpc_stub, make_request(france, max_new_tokens=6, n=2))
    cs = completes_of(msgs)
    assert len(cs) == 2
    assert sorted(c.index for c in cs) == [0, 1]
    for c in cs:
        assert list(c.output_ids) == ref  # greedy: both choices are the same
    msgs = generate(grpc_stub, make_request(france, max_new_tokens=6, n=2, stream=True))
    cs = completes_of(msgs)
    assert sorted(c.index for c in cs) == [0, 1]
    assert msgs[-1][0] == "complete"
    for i in (0, 1):
        toks = [t for ch in chunks_of(msgs) if ch.index == i for t in ch.token_ids]
        assert toks == ref


def test_sampling_with_temperature(grpc_stub, story):
    c = one_complete(
        grpc_stub, make_request(story, max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True)
    )
    assert c.finish_reason == "length" and len(c.output_ids) == 8
    assert all(0 <= t < VOCAB_SIZE for t in c.output_ids)


# ------------------------------------------------------------------ bad input


BAD_INPUTS = {
    "empty": ([], 4),
    "out_of_vocab": ([1, 9690, VOCAB_SIZE], 4),
    "uint32_max": ([1, 2**32 - 1], 4),
    "prompt_plus_max_new_over_context": ([17] * 100, CONTEXT_LENGTH),
    "prompt_over_context": ([17] * (CONTEXT_LENGTH + 1), 1),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_invalid_argument(grpc_stub, case, stream):
    ids, max_new = BAD_INPUTS[case]
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, make_request(ids, max_new_tokens=max_new, stream=stream), timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    if "context" in case:
        assert "context limit" in ei.value.details() and str(CONTEXT_LENGTH) in ei.value.details(), ei.value.details()


def test_an_oversized_message_is_refused_before_it_is_parsed(grpc_stub):
    # 17 MiB of prompt (6M three-byte ids): over the 16 MiB receive limit, refused by gRPC
    # itself rather than parsed on the event loop (which would stall every other call)
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, make_request([40000] * 6_000_000, max_new_tokens=1), timeout=60)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (ei.value.code(), ei.value.details())
    assert grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy


def test_a_burst_of_calls_is_served_whole(daemon):
    """3000 calls at once: gRPC must not cancel the ones the event loop has not taken yet
    (past its default 1000 pending calls it cancelled a random share: 448 of 3000 here)."""
    import asyncio
    from collections import Counter

    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    async def burst(n: int) -> Counter:
        channels = [
            grpc.aio.insecure_channel(daemon.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)
        ]
        stubs = [pb_grpc.SglangSchedulerStub(ch) for ch in channels]
        outcome = Counter()

        async def one(i: int) -> None:
            try:
                await stubs[i % 4].GetLoads(pb.GetLoadsRequest(), timeout=60)
                outcome["OK"] += 1
            except grpc.aio.AioRpcError as e:
                outcome[e.code().name] += 1

        try:
            await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            for ch in channels:
                await ch.close()
        return outcome

    assert asyncio.run(burst(3000)) == Counter(OK=3000)


def test_daemon_healthy_after_bad_inputs(grpc_stub, story):
    for ids, max_new in BAD_INPUTS.values():
        with pytest.raises(grpc.RpcError):
            generate(grpc_stub, make_request(ids, max_new_tokens=max_new), timeout=30)
    h = grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert h.healthy, h.message
    out, c = greedy_ids(grpc_stub, story, max_new_tokens=4, ignore_eos=True)
    assert len(out) == 4 and c.finish_reason == "length"
    assert wait_kv_free(grpc_stub) == KV_FREE, "the daemon still runs a request or holds KV"


def _with(field, value):
    """A request tweak: set one GenerateRequest (or sampling_params.X) field."""

    def tweak(req):
        obj, name = (req.sampling_params, field[3:]) if field.startswith("sp.") else (req, field)
        if name == "seed":
            obj.custom_params.update({"seed": value})
        else:
            setattr(obj, name, value)

    return tweak


UNSERVABLE = {  # fields the daemon cannot honour, or asks too much of: (tweak, status)
    "lora_adapter": (_with("lora_id", "my-adapter"), grpc.StatusCode.NOT_FOUND),
    "data_parallel_rank_1": (_with("data_parallel_rank", 1), grpc.StatusCode.INVALID_ARGUMENT),
    "hidden_states": (_with("return_hidden_states", True), grpc.StatusCode.INVALID_ARGUMENT),
    "n_over_limit": (_with("sp.n", 1025), grpc.StatusCode.INVALID_ARGUMENT),
    "top_logprobs_over_limit": (
        lambda r: (_with("return_logprob", True)(r), _with("top_logprobs_num", 21)(r)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "nan_repetition_penalty": (_with("sp.repetition_penalty", float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
    "seed_over_64_bits": (_with("sp.seed", 1e20), grpc.StatusCode.INVALID_ARGUMENT),
    "fractional_seed": (_with("sp.seed", 1.5), grpc.StatusCode.INVALID_ARGUMENT),
    # stop strings are checked on every token inside the step loop: their work is bounded
    "too_many_stop_strings": (
        lambda r: r.sampling_params.stop.extend(f"s{i}" for i in range(65)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "stop_string_too_long": (lambda r: r.sampling_params.stop.append("q" * 513), grpc.StatusCode.INVALID_ARGUMENT),
    "stop_token_id_over_vocab": (
        lambda r: r.sampling_params.stop_token_ids.append(VOCAB_SIZE),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
}


@pytest.mark.parametrize("case", sorted(UNSERVABLE))
def test_unservable_request_gets_a_precise_status(grpc_stub, story, case):
    tweak, code = UNSERVABLE[case]
    req = make_request(story, max_new_tokens=2)
    tweak(req)
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, req, timeout=30)
    assert ei.value.code() == code, (ei.value.code(), ei.value.details())


@pytest.mark.parametrize("first_n,second", [(2, "{rid}-n0"), (1, None)])
def test_an_id_clashing_with_a_sequence_id_in_flight_is_refused(grpc_stub, story, first_n, second):
    """n > 1 runs its sequences as "<id>-n<i>": a caller's id equal to one of them (or an
    n > 1 call whose sequence ids equal a caller's id) must not cross their outputs."""
    rid = f"clash-{uuid.uuid4().hex[:8]}"
    # long enough that a stalled test thread still finds it in flight (~20 ms a token)
    first = make_request(
        story, max_new_tokens=96, rid=rid if first_n == 2 else f"{rid}-n0", stream=True, ignore_eos=True, n=first_n
    )
    call = grpc_stub.Generate(first, timeout=RPC_TIMEOUT)
    next(call)  # in flight now
    clash = make_request(story, max_new_tokens=2, rid=second.format(rid=rid) if second else rid, n=3 - first_n)
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, clash, timeout=30)
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS, (ei.value.code(), ei.value.details())
    completes = [m.complete for m in call if m.WhichOneof("response") == "complete"]
    assert len(completes) == first_n and all(c.finish_reason == "length" for c in completes)
    assert wait_idle(grpc_stub) == 0


# ------------------------------------------------------------------ abort / cancel


def test_abort_unknown_request_is_noop(grpc_stub):
    """Abort of an id nobody runs changes nothing and says so (success false, not found)."""
    for _ in range(2):  # twice is fine too
        r = grpc_stub.Abort(pb.AbortRequest(request_id="no-such-request", reason="test"), timeout=5)
        assert r.success is False and "not found" in r.message, r


def test_an_abort_that_overtakes_its_generate_still_ends_it(grpc_stub, story):
    """The router aborts once, when its client drops; that Abort can reach us before the
    Generate it cancels. The Generate then ends at once (CANCELLED), not at its length limit:
    "at once" is checked as state, not time: no token streamed, none generated."""
    rid = f"overtaken-{uuid.uuid4().hex[:8]}"
    assert wait_idle(grpc_stub) == 0
    generated_before = sched_stat(grpc_stub, "num_generated_tokens")
    r = grpc_stub.Abort(pb.AbortRequest(request_id=rid, reason="Stream dropped"), timeout=5)
    assert r.success is False  # (nothing to abort yet)
    call = grpc_stub.Generate(
        make_request(story, max_new_tokens=300, ignore_eos=True, stream=True, rid=rid), timeout=RPC_TIMEOUT
    )
    streamed = []
    with pytest.raises(grpc.RpcError) as ei:
        for m in call:
            streamed.append(m)
    assert ei.value.code() == grpc.StatusCode.CANCELLED and "aborted before it arrived" in ei.value.details()
    assert not streamed, f"{len(streamed)} message(s) streamed before the CANCELLED status"
    assert sched_stat(grpc_stub, "num_generated_tokens") == generated_before, "the scheduler ran the aborted request"
    # remembered once: the id runs normally afterwards
    assert one_complete(grpc_stub, make_request(story, max_new_tokens=2, rid=rid)).completion_tokens == 2


def test_abort_stops_a_running_stream(grpc_stub, story):
    """The router sends Abort{rid, "Stream dropped"} when a streaming client leaves and keeps
    reading; the daemon must stop generating and end the stream, and free its KV."""
    limit = 4000
    req = make_request(story, max_new_tokens=limit, stream=True, ignore_eos=True)
    call = grpc_stub.Generate(req, timeout=RPC_TIMEOUT)
    got = 0
    reply = ended = None
    try:
        for m in call:
            if m.WhichOneof("response") == "chunk":
                got += len(m.chunk.token_ids)
                if reply is None and got >= 2:
                    reply = grpc_stub.Abort(
                        pb.AbortRequest(request_id=req.request_id, reason="Stream dropped"), timeout=10
                    )
            else:
                ended = m.complete
                break
    except grpc.RpcError as e:  # ending the stream with a status is acceptable too
        assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED), (e.code(), e.details())
        ended = e
    assert reply is not None and reply.success, reply
    assert ended is not None, "the stream ended with neither a Complete nor a status"
    if not isinstance(ended, grpc.RpcError):
        assert ended.finish_reason == "abort" and ended.completion_tokens < limit, ended
    assert got < limit, "the stream ran to its length limit after the Abort"
    assert wait_kv_free(grpc_stub) == KV_FREE, "the aborted request still runs or holds KV"


def test_client_cancel_frees_the_request(grpc_stub, story):
    """A non-streaming client that disconnects cancels the RPC (no Abort is sent): the
    request that was running stops and frees its KV."""
    assert wait_kv_free(grpc_stub) == KV_FREE, "KV held before the test started"
    req = make_request(story, max_new_tokens=4000, ignore_eos=True)
    call = grpc_stub.Generate(req, timeout=RPC_TIMEOUT)
    wait_until(lambda: num_running(grpc_stub) == 1, 120, "the request running in the scheduler")
    assert server_info(grpc_stub).active_requests == 1, "the request never started running"
    call.cancel()
    assert wait_kv_free(grpc_stub) == KV_FREE, "the cancelled request still runs or holds KV"


def test_n_sequences_refused_together_free_their_id(grpc_stub, story):
    """Every sequence of an n=3 call refused at once (prompt + max_new_tokens over the
    context): one INVALID_ARGUMENT, and no sequence id stays taken afterwards."""
    rid = f"refused-{uuid.uuid4().hex[:8]}"
    too_long = make_request(story, max_new_tokens=CONTEXT_LENGTH, rid=rid, n=3)
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, too_long, timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    assert wait_idle(grpc_stub) == 0, "a refused sequence id is still counted in flight"
    (done,) = completes_of(generate(grpc_stub, make_request(story, max_new_tokens=2, rid=f"{rid}-n1"), timeout=60))
    assert done.finish_reason in ("length", "stop")


def test_an_id_reused_right_after_a_cancel_gets_its_own_tokens(grpc_stub, story):
    """A stream cancelled mid-way, then its id sent again at once: the new call is refused
    (ALREADY_EXISTS) while the scheduler still holds the old request, and once admitted it
    gets its own complete answer, never the old one's last token and abort notice; nothing
    is left running afterwards."""
    rid = f"reuse-{uuid.uuid4().hex[:8]}"
    call = grpc_stub.Generate(
        make_request(story, max_new_tokens=200, rid=rid, stream=True, ignore_eos=True), timeout=RPC_TIMEOUT
    )
    for i, _ in enumerate(call):
        if i == 4:
            break
    call.cancel()
    again = make_request(story, max_new_tokens=8, rid=rid, ignore_eos=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            (done,) = completes_of(generate(grpc_stub, again, timeout=60))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.ALREADY_EXISTS, (e.code(), e.details())
            assert time.monotonic() < deadline, "the cancelled request's id never came free"
            time.sleep(0.02)
    assert done.finish_reason == "length" and len(done.output_ids) == 8, done
    assert wait_kv_free(grpc_stub) == KV_FREE, "a request is left running (or holding KV) with nobody to receive it"


# ------------------------------------------------------------------ info, loads, health


def test_get_model_info(grpc_stub):
    mi = grpc_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert mi.model_path
    assert mi.tokenizer_path
    assert mi.is_generation
    assert mi.served_model_name == "smollm2"
    assert mi.max_context_length == CONTEXT_LENGTH
    assert mi.vocab_size == VOCAB_SIZE
    assert list(mi.eos_token_ids) == [EOS]
    si = server_info(grpc_stub)
    ctx = si.server_args.fields["context_length"].number_value
    assert ctx == mi.max_context_length


def test_tokenizer_path_is_loadable(model_info, tokenizer):
    import os

    assert os.path.isfile(os.path.join(model_info.tokenizer_path, "tokenizer.json"))
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == EOS
    assert tokenizer.chat_template, "the router needs a chat template in the tokenizer dir"


def test_get_tokenizer_streams_the_tokenizer_files_as_a_checked_zip(grpc_stub, model_info):
    """GetTokenizer (what a router that cannot read tokenizer_path fetches, contract §3):
    chunks that join into a ZIP of the tokenizer files, flat names, tokenizer.json identical
    to the daemon's, and the whole archive's sha256 on the last chunk only."""
    import hashlib
    import io
    import zipfile

    from smg_grpc_proto.generated import common_pb2

    chunks = list(grpc_stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=120))
    assert len(chunks) > 1, "tokenizer.json alone is megabytes: expected several chunks"
    assert all(c.data for c in chunks) and not any(c.sha256 for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.testzip() is None
        names = zf.namelist()
        assert "tokenizer.json" in names and "tokenizer_config.json" in names, names
        assert all("/" not in n for n in names), names
        with open(os.path.join(model_info.tokenizer_path, "tokenizer.json"), "rb") as f:
            assert zf.read("tokenizer.json") == f.read()


def test_get_server_info(grpc_stub):
    si = server_info(grpc_stub)
    args = si.server_args.fields
    for key in ("model_path", "tokenizer_path", "context_length", "max_running_requests"):
        assert key in args, f"server_args lacks {key}: {sorted(args)}"
    assert args["max_running_requests"].number_value == 32
    assert args["model_path"].string_value
    sched = si.scheduler_info.fields
    assert "max_batch_size" in sched and "steps" in sched, sorted(sched)
    assert sched["steps"].number_value >= 1  # warm-up went through the engine
    assert sched["max_batch_size"].number_value >= 1
    assert si.server_type == "grpc"
    assert si.active_requests >= 0
    assert si.uptime_seconds > 0


def test_lora_adapters_none_loaded_and_loading_unsupported(grpc_stub):
    assert not grpc_stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=10).loaded_adapters
    with pytest.raises(grpc.RpcError) as ei:
        grpc_stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="x", lora_path="/nowhere"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED and "does not support LoRA" in ei.value.details()


def test_get_loads(grpc_stub):
    r = grpc_stub.GetLoads(pb.GetLoadsRequest(include=["core", "disagg", "queues", "memory"]), timeout=10)
    assert len(r.loads) >= 1
    load = r.loads[0]
    assert 0.0 <= load.token_usage <= 1.0
    assert load.num_running_reqs >= 0 and load.num_waiting_reqs >= 0
    assert load.max_running_requests == 32


def test_gen_throughput_falls_to_zero_when_idle(grpc_stub, story):
    greedy_ids(grpc_stub, story, max_new_tokens=8, ignore_eos=True)
    assert wait_idle(grpc_stub) == 0
    deadline = time.monotonic() + 60  # the throughput window is 5 s
    while (tput := grpc_stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].gen_throughput) > 0:
        assert time.monotonic() < deadline, f"an idle daemon still reports {tput} tok/s"
        time.sleep(0.5)


def test_health_check_rpc_is_fast(grpc_stub):
    """HealthCheck answers from the servicer's own view: it runs no generation (SGLang's
    does), so the engine takes no step for it. (Fast is checked as that state, not as a
    time: a hang would still fail, at the call's deadline.)"""
    assert wait_idle(grpc_stub) == 0
    before = sched_stat(grpc_stub, "steps"), sched_stat(grpc_stub, "num_generated_tokens")
    for _ in range(3):
        h = grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert h.healthy, h.message
    assert (sched_stat(grpc_stub, "steps"), sched_stat(grpc_stub, "num_generated_tokens")) == before


def test_health_check_rpc_fast_under_load(grpc_stub, story):
    """The router's first probe gives up after about 2 s; HealthCheck must not queue behind
    generation: it answers healthy while four long streams run. Checked as that state (every
    answer came while all four streams still ran, each far from its 2000 tokens), not as a
    time a loaded machine could exceed; the times are printed."""
    # Four streams that generate until cancelled, so every probe meets a busy scheduler.
    load = [
        grpc_stub.Generate(
            make_request(story * 4, max_new_tokens=2000, stream=True, ignore_eos=True), timeout=RPC_TIMEOUT
        )
        for _ in range(4)
    ]
    try:
        for call in load:
            next(call)  # generating now
        worst = 0.0
        for _ in range(5):
            t0 = time.monotonic()
            h = grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
            worst = max(worst, time.monotonic() - t0)
            assert h.healthy, h.message
            assert not any(call.done() for call in load), "a stream ended: the probe was not answered under load"
            time.sleep(0.2)  # (pacing)
    finally:
        for call in load:
            call.cancel()
    assert wait_kv_free(grpc_stub) == KV_FREE, "the cancelled streams still run or hold KV"
    print(f"slowest HealthCheck while generating: {worst:.3f} s")


def prefill_in_background(stub, prompt):
    """Start a one-token request for `prompt` on a thread, every prompt token computed (a
    fresh salt: no prefix-cache hit). Returns (thread, done event, result: "c" its
    GenerateComplete or "e" its exception)."""
    done, result = threading.Event(), {}

    def run():
        try:
            result["c"] = one_complete(stub, make_request(prompt, max_new_tokens=1, cache_salt=fresh_salt()))
        except Exception as e:  # noqa: BLE001 - reported by the caller
            result["e"] = e
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    return t, done, result


def test_health_stays_up_during_long_prefill(grpc_stub, health_stub):
    """A busy scheduler is not a dead one (contract §4: readiness may drop only after 30 s
    without output while requests are pending; liveness '' never for mere load; GetLoads
    must keep answering while generation runs, §10)."""
    prompt = [1000 + (i * 7919) % 40000 for i in range(3000)]
    t, done, result = prefill_in_background(grpc_stub, prompt)
    problems = []
    probes = 0  # rounds finished while the request was in flight
    try:
        while not done.wait(0.05):
            live = health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            ready = health_stub.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=5).status
            h = grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
            try:
                grpc_stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=5)
                loads_ok = True
            except grpc.RpcError as e:
                loads_ok = f"{e.code().name}: {e.details()}"
            if live != health_pb2.HealthCheckResponse.SERVING:
                problems.append("liveness '' NOT_SERVING")
            if ready != health_pb2.HealthCheckResponse.SERVING:
                problems.append("readiness NOT_SERVING")
            if not h.healthy:
                problems.append(f"HealthCheck healthy=false ({h.message})")
            if loads_ok is not True:
                problems.append(f"GetLoads {loads_ok}")
            probes += not done.is_set()
    finally:
        t.join(timeout=RPC_TIMEOUT)
    assert "e" not in result, result.get("e")
    assert result["c"].cached_tokens == 0 and result["c"].prompt_tokens == len(prompt), result["c"]
    assert not problems, sorted(set(problems))
    assert probes >= 2, f"only {probes} probe round(s) during the prefill: nothing was checked"


def test_a_short_request_is_answered_while_a_long_prompt_prefills(grpc_stub):
    """A long prompt prefills at most half the step budget at a time (the default
    --long-prefill-token-threshold), so a short request sent meanwhile starts in the next
    step and is answered before the long prompt's first token, not after its whole prefill."""
    assert server_info(grpc_stub).server_args.fields["long_prefill_token_threshold"].number_value == 256
    long_prompt = [1000 + (i * 7919) % 40000 for i in range(4000)]  # ~8 steps of 512 tokens
    t, done, result = prefill_in_background(grpc_stub, long_prompt)
    try:
        deadline = time.monotonic() + RPC_TIMEOUT
        while not num_running(grpc_stub) and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        short = one_complete(
            grpc_stub, make_request([1, 2, 3, 4, 5, 6], max_new_tokens=2, ignore_eos=True, cache_salt=fresh_salt())
        )
        long_done_first = done.is_set()
    finally:
        t.join(timeout=RPC_TIMEOUT)
    assert "e" not in result, result.get("e")
    assert result["c"].prompt_tokens == len(long_prompt) and result["c"].cached_tokens == 0
    assert short.completion_tokens == 2
    assert not long_done_first, "the short request waited for the long prompt's whole prefill"


def test_flush_cache_drops_the_prefix_cache(grpc_stub, story):
    from smg_grpc_proto.generated import common_pb2

    prompt = story * 12
    greedy_ids(grpc_stub, prompt, max_new_tokens=2)
    assert wait_idle(grpc_stub) == 0
    r = grpc_stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=60)
    assert r.success, r.message
    _, c = greedy_ids(grpc_stub, prompt, max_new_tokens=2)
    assert c.cached_tokens == 0
    with pytest.raises(grpc.RpcError) as ei:  # NaN would compare as "wait forever"
        grpc_stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=float("nan")), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()


def test_bf16_daemon_answers_and_frees_its_kv(tmp_path, tokenizer, france, story):
    """``--dtype bfloat16`` on the CPU (the fast dtype where the CPU has bf16 instructions):
    the same answer, prompts that hit the prefix cache and run batched, and no KV left held."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    with Daemon(
        max_running_requests=8, kv_cache_tokens=4096, extra_args=["--dtype", "bfloat16"], log_dir=tmp_path
    ) as d:
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            assert (
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args.fields["dtype"].string_value
                == "bfloat16"
            )
            out, _ = greedy_ids(stub, france, max_new_tokens=24)
            assert "Paris" in tokenizer.decode(out, skip_special_tokens=True)
            prompts = [story * 8 + [100 + i] for i in range(8)]  # a shared 32-token prefix
            alone, _ = greedy_ids(stub, prompts[0], max_new_tokens=12, ignore_eos=True)
            with ThreadPoolExecutor(len(prompts)) as ex:
                batched = list(ex.map(lambda p: greedy_ids(stub, p, max_new_tokens=12, ignore_eos=True)[1], prompts))
            assert all(c.completion_tokens == 12 for c in batched)
            assert sum(c.cached_tokens for c in batched) >= 7 * 32
            assert list(batched[0].output_ids)[:4] == alone[:4]
            assert wait_kv_free(stub) == KV_FREE, "a request still runs or KV is held after all requests ended"


@pytest.mark.parametrize("target", ["leader", "group"])
def test_sigterm_drains_in_flight_requests(tmp_path, target):
    """SIGTERM lets an in-flight stream finish; while it drains, health says NOT_SERVING and
    a new call gets UNAVAILABLE; then the daemon exits 0, with no "leaked" lines from its
    scheduler process's teardown, and leaves no process behind. (The grace period is far
    longer than the stream needs: this checks order, not speed.)"""
    from grpc_health.v1 import health_pb2_grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    n = 32  # the stream outlasts the few calls made while it drains many times over
    with Daemon(
        max_running_requests=4, kv_cache_tokens=2048, log_dir=tmp_path, extra_args=["--shutdown-grace-period", "600"]
    ) as d:
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            req = make_request([6403, 1980, 253, 655], max_new_tokens=n, ignore_eos=True, stream=True)
            call = stub.Generate(req, timeout=600)
            first = next(call)
            assert first.WhichOneof("response") == "chunk"
            if target == "leader":
                os.kill(d.proc.pid, signal.SIGTERM)
            else:
                os.killpg(d.proc.pid, signal.SIGTERM)
            # An answer (rather than a refused call) means the server is still up: draining.
            deadline = time.monotonic() + 60
            while (
                status := health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            ) == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "still SERVING 60 s after SIGTERM"
                time.sleep(0.02)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            ready = health.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=10).status
            assert ready == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as ei:
                generate(stub, make_request([6403, 1980], max_new_tokens=1), timeout=60)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in ei.value.details(), (
                ei.value.code(),
                ei.value.details(),
            )
            msgs = [first] + list(call)
            assert msgs[-1].WhichOneof("response") == "complete"
            assert msgs[-1].complete.finish_reason == "length"
            assert sum(len(m.chunk.token_ids) for m in msgs if m.WhichOneof("response") == "chunk") == n
        assert d.proc.wait(timeout=60) == 0, d.log_tail()
        # (the scheduler process ends without interpreter teardown, where Triton's nanobind
        # bindings would report leaked objects)
        assert "leaked" not in d.log_path.read_text(errors="replace"), d.log_tail(60)
        wait_until(lambda: not _group_members(d.proc.pid), 60, "no daemon process left after the SIGTERM")


@pytest.mark.parametrize("cut_by", ["grace_period", "second_sigterm"])
def test_requests_cut_off_by_shutdown_end_unavailable(tmp_path, cut_by):
    """Past the grace period, or at a second SIGTERM while draining (an operator who will not
    wait), an in-flight call ends with UNAVAILABLE (the router retries it on another worker),
    not with a truncated answer that looks complete; the daemon still exits 0."""
    from grpc_health.v1 import health_pb2_grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    grace = "0.5" if cut_by == "grace_period" else "600"
    with Daemon(
        max_running_requests=4, kv_cache_tokens=4096, log_dir=tmp_path, extra_args=["--shutdown-grace-period", grace]
    ) as d:
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            req = make_request([6403, 1980, 253, 655], max_new_tokens=3000, ignore_eos=True, stream=True)
            call = stub.Generate(req, timeout=RPC_TIMEOUT)
            assert next(call).WhichOneof("response") == "chunk"
            os.kill(d.proc.pid, signal.SIGTERM)
            if cut_by == "second_sigterm":
                # the first one handled (draining: NOT_SERVING; two signals pending at once
                # would merge into one), the stream still going: now the second
                health = health_pb2_grpc.HealthStub(ch)
                deadline = time.monotonic() + 60
                while (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    assert time.monotonic() < deadline, "still SERVING 60 s after SIGTERM"
                    time.sleep(0.02)
                assert next(call).WhichOneof("response") == "chunk"
                os.kill(d.proc.pid, signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as ei:
                for _ in call:
                    pass
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
            assert "shutting down" in ei.value.details()
        assert d.proc.wait(timeout=60) == 0, d.log_tail()
        if cut_by == "second_sigterm":
            assert "second stop signal" in d.log_tail(200), d.log_tail()


def test_a_scheduler_dying_while_draining_still_exits_1(tmp_path):
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    with Daemon(max_running_requests=4, kv_cache_tokens=4096, log_dir=tmp_path) as d:
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            req = make_request([6403, 1980, 253, 655], max_new_tokens=3000, ignore_eos=True, stream=True)
            call = stub.Generate(req, timeout=RPC_TIMEOUT)
            assert next(call).WhichOneof("response") == "chunk"
            os.kill(d.proc.pid, signal.SIGTERM)  # draining: the stream goes on
            assert next(call).WhichOneof("response") == "chunk"
            for pid in child_pids(d.proc.pid):
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as ei:
                for _ in call:
                    pass
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert d.proc.wait(timeout=60) == 1, d.log_tail()


@pytest.mark.parametrize("service", ["", SCHEDULER_SERVICE])
def test_grpc_health_serving(health_stub, service):
    r = health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_health_unknown_service(health_stub):
    with pytest.raises(grpc.RpcError) as ei:
        health_stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_health_watch_reports_current_status(health_stub):
    stream = health_stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    try:
        first = next(stream)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stream.cancel()
