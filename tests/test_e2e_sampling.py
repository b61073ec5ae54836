"""End-to-end sampling features through the real daemon (session daemon, SmolLM2 on CPU):
seeds, top-k 1, logit bias, min_new_tokens, penalties and logprobs checked against HF
transformers' logits on the same tokens, stop strings, stream_interval."""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from helpers import wait_kv_free
from test_e2e_grpc import (
    KV_FREE,
    chunks_of,
    completes_of,
    fresh_salt,
    generate,
    greedy_ids,
    make_request,
    one_complete,
    sampling,
)

EOS = 2


@pytest.fixture(scope="module")
def story(tokenizer):
    return tokenizer.encode("Once upon a time, in a small village by the sea,", add_special_tokens=False)


@pytest.fixture(scope="module")
def hi(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_model():
    """The bundled GGUF through HF transformers (dequantised to float32), loaded once."""
    from transformers import AutoModelForCausalLM

    from scheduler.model_source import resolve_model

    path = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def seeded(seed, **kw):
    sp = sampling(**kw)
    sp.custom_params.update({"seed": seed})
    return sp


def sample_ids(stub, prompt, params):
    return list(one_complete(stub, make_request(prompt, params=params)).output_ids)


# ------------------------------------------------------------------ seeds, greedy, bias


def test_seeded_sampling_is_reproducible(grpc_stub, story):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, ignore_eos=True)
    a = sample_ids(grpc_stub, story, seeded(1234, **kw))
    b = sample_ids(grpc_stub, story, seeded(1234, **kw))
    c = sample_ids(grpc_stub, story, seeded(999, **kw))
    assert a == b, "same seed, different tokens"
    assert a != c, "different seeds gave identical samples"


def test_seeded_sampling_does_not_depend_on_the_batch(grpc_stub, story, tokenizer):
    kw = dict(max_new_tokens=12, temperature=1.2, top_k=40, min_p=0.02, ignore_eos=True)
    alone = sample_ids(grpc_stub, story, seeded(77, **kw))
    others = [tokenizer.encode(f"Tale {i}: the {w} said", add_special_tokens=False) for i, w in enumerate("abcdef")]
    barrier = threading.Barrier(len(others) + 1)

    def run(prompt, params):
        barrier.wait(timeout=30)
        return sample_ids(grpc_stub, prompt, params)

    with ThreadPoolExecutor(len(others) + 1) as ex:
        futs = [
            ex.submit(run, p, sampling(max_new_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)) for p in others
        ]
        mine = ex.submit(run, story, seeded(77, **kw))
        [f.result() for f in futs]
        assert mine.result() == alone


def test_n_seeded_choices_differ(grpc_stub, story):
    msgs = generate(
        grpc_stub, make_request(story, params=seeded(5, max_new_tokens=12, temperature=1.0, n=2, ignore_eos=True))
    )
    cs = sorted(completes_of(msgs), key=lambda c: c.index)
    assert len(cs) == 2 and list(cs[0].output_ids) != list(cs[1].output_ids)
    again = generate(
        grpc_stub, make_request(story, params=seeded(5, max_new_tokens=12, temperature=1.0, n=2, ignore_eos=True))
    )
    assert [list(c.output_ids) for c in sorted(completes_of(again), key=lambda c: c.index)] == [
        list(c.output_ids) for c in cs
    ]


def test_n_sequences_compute_their_prompt_once(grpc_stub):
    """n > 1 arrives as n sequences at once: the first computes the prompt, the others wait a
    step and take its blocks from the prefix cache (all but the block holding the last token)."""
    prompt = random.Random(7).choices(range(1000, 40000), k=100)
    # a fresh cache salt: cached nowhere yet, even when this test runs again on the same daemon
    msgs = generate(
        grpc_stub,
        make_request(prompt, params=seeded(3, max_new_tokens=4, temperature=1.0, n=4), cache_salt=fresh_salt()),
    )
    cached = sorted(c.cached_tokens for c in completes_of(msgs))
    assert cached == [0, 96, 96, 96], cached


def test_top_k_1_equals_greedy(grpc_stub, story):
    ref, _ = greedy_ids(grpc_stub, story, max_new_tokens=12, ignore_eos=True)
    out = sample_ids(grpc_stub, story, sampling(max_new_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))
    assert out == ref


def test_logit_bias_forces_a_token(grpc_stub, story):
    forced = 1234
    sp = sampling(max_new_tokens=6, temperature=0.7, ignore_eos=True)
    sp.logit_bias[str(forced)] = 100.0
    assert sample_ids(grpc_stub, story, sp) == [forced] * 6
    sp = sampling(max_new_tokens=6, ignore_eos=True)
    sp.logit_bias["1234"] = 100.0
    assert sample_ids(grpc_stub, story, sp) == [forced] * 6  # greedy too
    sp = sampling(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    sp.logit_bias["1234"] = float("inf")  # clamped to 100, as vLLM does (not inf - inf = NaN)
    assert sample_ids(grpc_stub, story, sp) == [forced] * 6


# "1_0", " 5" and Arabic 3 would pass int(); 4400 digits make int() raise past Python's digit limit
@pytest.mark.parametrize("key", ["hello", "1_0", " 5", "\u0663", "9" * 4400])
def test_bad_logit_bias_is_invalid_argument(grpc_stub, story, key):
    sp = sampling(max_new_tokens=2)
    sp.logit_bias[key] = 1.0
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, make_request(story, params=sp), timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must be token ids" in ei.value.details(), ei.value.details()


def test_min_new_tokens_prevents_eos(grpc_stub, hi):
    base, c = greedy_ids(grpc_stub, hi, max_new_tokens=48)
    assert c.finish_reason == "stop" and base[-1] == EOS, base
    m = len(base) + 3
    out = sample_ids(grpc_stub, hi, sampling(max_new_tokens=m + 20, min_new_tokens=m))
    assert len(out) > m and EOS not in out[:m]
    assert out[: len(base) - 1] == base[:-1]  # until the masked EOS, the greedy path is unchanged


# ------------------------------------------------------------------ against HF logits


def penalised(logits, prompt, outputs, rep, freq, pres):
    x = logits.clone()
    seen = torch.tensor(sorted(set(prompt) | set(outputs)))
    v = x[seen]
    x[seen] = torch.where(v > 0, v / rep, v * rep)
    for t in set(outputs):
        x[t] -= freq * outputs.count(t) + pres
    return x


@pytest.mark.parametrize("rep,freq,pres", [(1.8, 0.0, 0.0), (1.1, 0.6, 0.4)])
def test_penalties_follow_the_formulas(grpc_stub, hf_model, story, rep, freq, pres):
    n = 24
    plain, _ = greedy_ids(grpc_stub, story, max_new_tokens=n, ignore_eos=True)
    out = sample_ids(
        grpc_stub,
        story,
        sampling(
            max_new_tokens=n, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, ignore_eos=True
        ),
    )
    assert out != plain
    logits = hf_logits(hf_model, story + out)
    for i, tok in enumerate(out):
        x = penalised(logits[len(story) - 1 + i], story, out[:i], rep, freq, pres)
        assert float(x.max() - x[tok]) < 1e-3, f"token {i}: {tok} is not the argmax of the penalised logits"


def test_logprobs_match_hf(grpc_stub, hf_model, story):
    wanted = [11, 284, 4830]
    req = make_request(story, params=sampling(max_new_tokens=6, ignore_eos=True))
    req.return_logprob = True
    req.top_logprobs_num = 5
    req.token_ids_logprob.extend(wanted)
    req.logprob_start_len = 0
    c = one_complete(grpc_stub, req)
    out = list(c.output_ids)
    ids = story + out
    ref = hf_logits(hf_model, ids).log_softmax(-1)

    ol = c.output_logprobs
    assert list(ol.token_ids) == out and len(ol.token_logprobs) == len(out) == len(ol.top_logprobs)
    for i, tok in enumerate(out):
        row = ref[len(story) - 1 + i]
        assert ol.token_logprobs[i] == pytest.approx(float(row[tok]), abs=2e-3)
        top = ol.top_logprobs[i]
        assert list(top.token_ids)[:1] == [int(row.argmax())] and len(top.values) == 5
        assert list(top.values) == pytest.approx(row.topk(5).values.tolist(), abs=2e-3)
        assert list(ol.token_ids_logprobs[i].token_ids) == wanted
        assert list(ol.token_ids_logprobs[i].values) == pytest.approx(row[wanted].tolist(), abs=2e-3)

    il = c.input_logprobs
    assert list(il.token_ids) == story and len(il.token_logprobs) == len(story)
    assert not il.token_logprobs[0].HasField("value")  # the first prompt token has none
    for t in range(1, len(story)):
        assert il.token_logprobs[t].value == pytest.approx(float(ref[t - 1, story[t]]), abs=2e-3)
    assert len(il.top_logprobs) == len(story) and len(il.top_logprobs[0].values) == 0
    assert list(il.top_logprobs[3].token_ids) == ref[2].topk(5).indices.tolist()


def test_logprobs_stream_incremental_and_start_len(grpc_stub, story):
    prompt = story * 3  # long enough for cached blocks: logprob_start_len must still compute its positions
    greedy_ids(grpc_stub, prompt, max_new_tokens=2)  # warm the prefix cache
    req = make_request(prompt, params=sampling(max_new_tokens=8, ignore_eos=True), stream=True)
    req.return_logprob = True
    req.top_logprobs_num = 2
    req.logprob_start_len = 5
    msgs = generate(grpc_stub, req)
    chunks, c = chunks_of(msgs), completes_of(msgs)[0]
    assert c.cached_tokens == 0, "positions that need logprobs must not come from the prefix cache"
    assert [ch.HasField("input_logprobs") for ch in chunks].count(True) == 1 and chunks[0].HasField("input_logprobs")
    il = chunks[0].input_logprobs
    assert list(il.token_ids) == prompt[5:] and all(x.HasField("value") for x in il.token_logprobs)
    streamed = [v for ch in chunks for v in ch.output_logprobs.token_logprobs]
    assert [t for ch in chunks for t in ch.output_logprobs.token_ids] == [t for ch in chunks for t in ch.token_ids]
    assert streamed == pytest.approx(list(c.output_logprobs.token_logprobs))  # Complete: cumulative
    assert len(streamed) == 8 and all(v <= 0 for v in streamed)
    assert all(len(ch.output_logprobs.top_logprobs) == len(ch.token_ids) for ch in chunks)
    # the same positions' values without the cache
    cold = make_request(prompt, params=sampling(max_new_tokens=1), rid=None)
    cold.return_logprob = True
    cold.logprob_start_len = 0
    full = one_complete(grpc_stub, cold).input_logprobs
    assert [x.value for x in full.token_logprobs[5:]] == pytest.approx([x.value for x in il.token_logprobs], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_max_new_tokens_0_scores_the_prompt(grpc_stub, hf_model, story, stream):
    # SGLang's prompt scoring: the prompt is prefilled for its logprobs, nothing is sampled
    req = make_request(story, params=sampling(max_new_tokens=0), stream=stream)
    req.return_logprob = True
    req.logprob_start_len = 0
    req.token_ids_logprob.extend([story[1], 13])
    msgs = generate(grpc_stub, req)
    c = completes_of(msgs)[0]
    assert list(c.output_ids) == [] and c.finish_reason == "length" and c.completion_tokens == 0
    il = c.input_logprobs if not stream else next(ch.input_logprobs for ch in chunks_of(msgs))
    ref = hf_logits(hf_model, story).log_softmax(-1)
    assert list(il.token_ids) == story
    for t in range(1, len(story)):
        assert il.token_logprobs[t].value == pytest.approx(float(ref[t - 1, story[t]]), abs=2e-3)
    # the proto's prefill-only scoring: one token_ids_logprob row at the next position, no token
    (row,) = c.output_logprobs.token_ids_logprobs
    assert list(row.token_ids) == [story[1], 13] and not c.output_logprobs.token_logprobs
    assert list(row.values) == pytest.approx([float(ref[-1, story[1]]), float(ref[-1, 13])], abs=2e-3)
    assert all(not ch.token_ids for ch in chunks_of(msgs))


# ------------------------------------------------------------------ stop strings, stream_interval


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_trimmed_or_kept(grpc_stub, tokenizer, story, stream):
    base, _ = greedy_ids(grpc_stub, story, max_new_tokens=24, ignore_eos=True)
    text = tokenizer.decode(base, skip_special_tokens=True)
    words = text.split()
    stop = " " + words[4]  # a word in the middle (its leading space included)
    cut = text.index(stop)

    def run(**kw):
        sp = sampling(max_new_tokens=24, ignore_eos=True, **kw)
        sp.stop.extend([stop, "never-there"])
        msgs = generate(grpc_stub, make_request(story, params=sp, stream=stream))
        c = completes_of(msgs)[0]
        out = [t for ch in chunks_of(msgs) for t in ch.token_ids] if stream else list(c.output_ids)
        assert c.finish_reason == "stop" and c.WhichOneof("matched_stop") == "matched_stop_str"
        assert c.matched_stop_str == stop
        return out, tokenizer.decode(out, skip_special_tokens=True), c.completion_tokens

    trimmed, trimmed_text, trimmed_count = run()
    assert stop not in trimmed_text and text.startswith(trimmed_text)
    assert len(trimmed_text) <= cut and trimmed == base[: len(trimmed)]
    kept, kept_text, kept_count = run(no_stop_trim=True)
    assert kept_text.startswith(text[: cut + len(stop)]) and kept == base[: len(kept)]
    assert len(kept) > len(trimmed)
    # usage counts every generated token, the trimmed stop string's too (as vLLM and SGLang)
    assert trimmed_count == kept_count == len(kept)


def test_stream_interval(grpc_stub, story):
    sp = sampling(max_new_tokens=10, ignore_eos=True, stream_interval=4)
    msgs = generate(grpc_stub, make_request(story, params=sp, stream=True))
    sizes = [len(ch.token_ids) for ch in chunks_of(msgs)]
    assert sum(sizes) == 10 and sizes[0] >= 1
    assert sizes[0] == 1, f"the first chunk goes out at once: {sizes}"
    assert all(s == 4 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 4, sizes
    ref, _ = greedy_ids(grpc_stub, story, max_new_tokens=10, ignore_eos=True)
    assert [t for ch in chunks_of(msgs) for t in ch.token_ids] == ref
    assert chunks_of(msgs)[-1].completion_tokens == 10


# ------------------------------------------------------------------ structured output (xgrammar)


def test_json_schema_output_parses(grpc_stub, tokenizer):
    import json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    prompt = tokenizer.encode("Describe a person as JSON:", add_special_tokens=False)
    sp = sampling(max_new_tokens=64, temperature=0.7)
    sp.custom_params.update({"seed": 3})
    sp.json_schema = json.dumps(schema)
    c = one_complete(grpc_stub, make_request(prompt, params=sp))
    assert c.finish_reason == "stop", (c.finish_reason, tokenizer.decode(list(c.output_ids)))
    value = json.loads(tokenizer.decode(list(c.output_ids), skip_special_tokens=True))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and isinstance(value["name"], str)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_ebnf_constraints(grpc_stub, tokenizer, story, stream):
    import re

    sp = sampling(max_new_tokens=16)
    sp.regex = r"(yes|no), [0-9]{3}!"
    msgs = generate(grpc_stub, make_request(story, params=sp, stream=stream))
    c = completes_of(msgs)[0]
    out = [t for ch in chunks_of(msgs) for t in ch.token_ids] if stream else list(c.output_ids)
    assert c.finish_reason == "stop"
    assert re.fullmatch(r"(yes|no), [0-9]{3}!", tokenizer.decode(out, skip_special_tokens=True))
    sp = sampling(max_new_tokens=8, temperature=1.0)
    sp.ebnf_grammar = 'root ::= "cat" | "dog"'
    c = one_complete(grpc_stub, make_request(story, params=sp))
    assert tokenizer.decode(list(c.output_ids), skip_special_tokens=True) in ("cat", "dog")


@pytest.mark.parametrize(
    "kind,spec", [("json_schema", "{not json"), ("regex", "(unclosed"), ("ebnf_grammar", "root ::= ")]
)
def test_bad_constraint_is_a_failed_constraint(grpc_stub, story, kind, spec):
    """As SGLang's servicer answers it: FAILED_PRECONDITION with the trailer the router
    turns into HTTP 422 (router contract, errors)."""
    sp = sampling(max_new_tokens=4)
    setattr(sp, kind, spec)
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, make_request(story, params=sp), timeout=60)
    assert_constraint_failed(ei.value)
    assert f"invalid {kind}" in ei.value.details(), ei.value.details()


def assert_constraint_failed(error: grpc.RpcError) -> None:
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, (error.code(), error.details())
    assert ("smg-constraint-failed", "engine") in tuple(error.trailing_metadata() or ()), error.trailing_metadata()


@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= "a" x\nx ::= x'])
def test_a_grammar_with_no_way_to_finish_is_a_failed_constraint(grpc_stub, story, grammar):
    """A grammar that compiles but admits no complete output leaves the sampler no token
    (at once, or after "a"): the request ends as a failed constraint instead of emitting
    tokens outside it up to the length limit, and frees its KV."""
    sp = sampling(max_new_tokens=32, temperature=0.7)
    sp.ebnf_grammar = grammar
    with pytest.raises(grpc.RpcError) as ei:
        generate(grpc_stub, make_request(story, params=sp), timeout=60)
    assert_constraint_failed(ei.value)
    assert "allows no token" in ei.value.details(), ei.value.details()
    assert wait_kv_free(grpc_stub) == KV_FREE, "the refused request still runs or holds KV"
