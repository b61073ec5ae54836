"""End-to-end: the OpenAI sampling parameters the real `smg` router (PyPI smg 1.13) forwards
to the session daemon (router contract §2, §5): stop strings, n, chat logprobs,
response_format json_schema, max_tokens, temperature + seed, and a streaming client that
leaves mid-answer (the daemon must abort and free every KV block).

Greedy (temperature 0) wherever the assertion depends on the exact text."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import kv_state, wait_kv_free
from test_e2e_grpc import make_request, one_complete, sampling
from test_e2e_router import QUESTION, ok_json

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
TIMEOUT = 180.0  # generous: the 2 CPU cores are shared with other work


def chat(router, model, messages=QUESTION, **kw):
    body = {"model": model, "messages": messages, "temperature": 0, **kw}
    return ok_json(router.post("/v1/chat/completions", body, timeout=TIMEOUT))


def chat_stream(router, model, messages=QUESTION, **kw):
    """Parsed SSE events of one streamed chat request (the final [DONE] checked and dropped)."""
    body = {"model": model, "messages": messages, "temperature": 0, "stream": True, **kw}
    raw = list(router.sse("/v1/chat/completions", body, timeout=TIMEOUT))
    assert raw and raw[-1] == "[DONE]", raw[-3:]
    events = [json.loads(p) for p in raw[:-1]]
    errors = [e for e in events if "error" in e]
    assert not errors, errors
    return events


def streamed_choices(events):
    """{index: [content, [finish_reason...], [logprob rows...]]} of a streamed response."""
    out = {}
    for e in events:
        for c in e.get("choices") or []:
            text, finishes, rows = out.setdefault(c["index"], ["", [], []])
            out[c["index"]][0] = text + ((c.get("delta") or {}).get("content") or "")
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
            rows.extend((c.get("logprobs") or {}).get("content") or [])
    return out


@pytest.fixture(scope="module")
def reference(router, model):
    """The greedy answer to QUESTION (n=1, no stop): the baseline the other tests cut."""
    data = chat(router, model, max_tokens=32)
    c = data["choices"][0]
    assert c["finish_reason"] == "stop", data  # ends on EOS well before 32 tokens
    return c["message"]["content"], data["usage"]["completion_tokens"]


# ------------------------------------------------------------------ stop


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "stops,ntok",
    [
        ([" of France"], 2),  # several tokens: the router matches it on the text and drains the stream
        ([" Paris"], 1),  # one token: the router sends it as stop_token_ids, the daemon stops on it
        (["never-in-the-answer", " is"], 1),  # a list: the first one that occurs wins
    ],
    ids=["multi-token", "single-token", "list"],
)
def test_stop_strings(router, model, tokenizer, reference, stops, ntok, stream):
    ref, _ = reference
    hit = [s for s in stops if s in ref]
    assert len(hit) == 1, (ref, stops)
    stop = hit[0]
    assert len(tokenizer.encode(stop, add_special_tokens=False)) == ntok, stop  # the case the test means
    want = ref[: ref.index(stop)]
    assert want and want != ref
    if stream:
        got = streamed_choices(chat_stream(router, model, max_tokens=32, stop=stops))
        assert list(got) == [0]
        text, finishes, _ = got[0]
        assert finishes[-1:] == ["stop"], finishes
    else:
        data = chat(router, model, max_tokens=32, stop=stops)
        c = data["choices"][0]
        text = c["message"]["content"]
        assert c["finish_reason"] == "stop", data
        assert c.get("matched_stop") == stop, data
    assert text == want, f"stop {stop!r}: got {text!r}, expected the greedy answer cut before it: {want!r}"


# ------------------------------------------------------------------ n


def test_n_2_gives_two_choices(router, model, reference):
    ref, ref_tokens = reference
    data = chat(router, model, max_tokens=32, n=2)
    cs = data["choices"]
    assert [c["index"] for c in cs] == [0, 1], data
    for c in cs:  # greedy: both choices are the n=1 answer
        assert c["message"]["content"] == ref, data
        assert c["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == 2 * ref_tokens, data["usage"]


def test_n_2_stream(router, model, reference):
    ref, ref_tokens = reference
    events = chat_stream(router, model, max_tokens=32, n=2, stream_options={"include_usage": True})
    got = streamed_choices(events)
    assert sorted(got) == [0, 1], got
    for i in (0, 1):
        text, finishes, _ = got[i]
        assert text == ref, (i, text)
        assert finishes == ["stop"], (i, finishes)
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 2 * ref_tokens, usage


def test_n_2_sampled_choices(router, model):
    """temperature > 0: two independent samples, each a well-formed choice."""
    data = chat(router, model, messages=STORY, temperature=1.0, max_tokens=12, n=2)
    cs = data["choices"]
    assert [c["index"] for c in cs] == [0, 1], data
    assert all(c["message"]["content"] and c["finish_reason"] in ("stop", "length") for c in cs), data


# ------------------------------------------------------------------ sampling knobs: router == direct gRPC


@pytest.fixture(scope="module")
def story_ids(tokenizer):
    """STORY through the chat template, as the router sends it (contract §2)."""
    text = tokenizer.apply_chat_template(STORY, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


KNOB_TOKENS = 24


@pytest.fixture(scope="module")
def story_greedy(router, model):
    return chat(router, model, messages=STORY, max_tokens=KNOB_TOKENS)["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "knobs,changes_greedy",
    [
        ({"presence_penalty": 2.0}, True),
        ({"frequency_penalty": 2.0}, True),
        ({"repetition_penalty": 1.5}, True),
        ({"temperature": 1.5, "top_k": 1}, False),  # top_k 1 is greedy whatever the temperature
        ({"temperature": 1.0, "min_p": 0.99}, False),  # only the argmax survives min_p 0.99
    ],
    ids=["presence", "frequency", "repetition", "top_k_1", "min_p"],
)
def test_sampling_knobs_are_forwarded(
    router, model, grpc_stub, tokenizer, story_ids, story_greedy, knobs, changes_greedy
):
    """Each knob goes through the router unchanged: the router's answer is the daemon's
    answer to the same GenerateRequest sent directly (deterministic settings only)."""
    data = chat(router, model, messages=STORY, max_tokens=KNOB_TOKENS, **knobs)
    assert data["usage"]["prompt_tokens"] == len(story_ids)
    via_router = data["choices"][0]["message"]["content"]
    kw = {"temperature": 0.0, **knobs}
    c = one_complete(
        grpc_stub, make_request(story_ids, params=sampling(max_new_tokens=KNOB_TOKENS, **kw)), timeout=TIMEOUT
    )
    direct = tokenizer.decode(list(c.output_ids), skip_special_tokens=True)
    assert via_router == direct, f"{knobs}: router {via_router!r} != direct gRPC {direct!r}"
    if changes_greedy:
        assert via_router != story_greedy, f"{knobs} did not change the greedy text: was it dropped?"
    else:
        assert via_router == story_greedy


# ------------------------------------------------------------------ logprobs


def check_logprob_rows(rows, n_tokens, k=3):
    assert len(rows) == n_tokens, (len(rows), n_tokens)
    for i, row in enumerate(rows):
        top = row["top_logprobs"]
        assert len(top) == k, (i, row)
        values = [t["logprob"] for t in top]
        assert all(v <= 0 for v in values) and row["logprob"] <= 0, (i, row)
        assert values == sorted(values, reverse=True), (i, values)
        # greedy: the chosen token is the most likely one
        assert row["logprob"] == pytest.approx(max(values), abs=1e-5), (i, row)
        assert top[0]["token"] == row["token"], (i, row)
        assert len({t["token"] for t in top}) == k, (i, top)


def test_chat_logprobs_top_3(router, model):
    n = 6
    data = chat(router, model, max_tokens=n, logprobs=True, top_logprobs=3)
    c = data["choices"][0]
    assert c["finish_reason"] == "length" and data["usage"]["completion_tokens"] == n, data
    rows = (c.get("logprobs") or {}).get("content")
    assert rows, f"no logprobs in the choice: {c}"
    check_logprob_rows(rows, n)
    assert "".join(r["token"] for r in rows) == c["message"]["content"]
    # the same values when streamed
    got = streamed_choices(chat_stream(router, model, max_tokens=n, logprobs=True, top_logprobs=3))
    text, _, srows = got[0]
    assert text == c["message"]["content"]
    check_logprob_rows(srows, n)
    assert [r["logprob"] for r in srows] == pytest.approx([r["logprob"] for r in rows], abs=1e-4)


# ------------------------------------------------------------------ response_format


@pytest.mark.parametrize("stream,n", [(False, 1), (True, 2)], ids=["plain", "stream-n2"])
def test_response_format_json_schema(router, model, stream, n):
    """The constraint reaches the daemon (contract §2: json_schema oneof); every choice's
    grammar state is its own (n=2)."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "country", "is_capital"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    if stream:
        got = streamed_choices(chat_stream(router, model, max_tokens=96, n=n, response_format=fmt))
        answers = [(got[i][0], got[i][1][-1:]) for i in sorted(got)]
    else:
        data = chat(router, model, max_tokens=96, n=n, response_format=fmt)
        answers = [(c["message"]["content"], [c["finish_reason"]]) for c in data["choices"]]
    assert len(answers) == n, answers
    for content, finish in answers:
        assert finish == ["stop"], (finish, content)
        value = json.loads(content)
        assert isinstance(value, dict) and set(value) == set(schema["required"]), value
        assert isinstance(value["city"], str) and len(value["city"]) <= 20
        assert isinstance(value["country"], str) and len(value["country"]) <= 20
        assert isinstance(value["is_capital"], bool)


# ------------------------------------------------------------------ max_tokens


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_gives_length(router, model, field):
    n = 7
    data = chat(router, model, messages=STORY, **{field: n})
    c = data["choices"][0]
    assert c["finish_reason"] == "length", data
    assert data["usage"]["completion_tokens"] == n, data["usage"]
    assert c["message"]["content"]


def test_max_tokens_stream_usage(router, model):
    n = 7
    events = chat_stream(router, model, messages=STORY, max_tokens=n, stream_options={"include_usage": True})
    got = streamed_choices(events)
    assert got[0][1] == ["length"] and got[0][0], got
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == n, usage


# ------------------------------------------------------------------ temperature + seed


def test_temperature_with_seed(router, model):
    """Router contract §2: smg 1.13 does NOT forward `seed` (it is in the "not forwarded"
    row; the daemon honours a seed only from custom_params, which the router never sets,
    see tests/test_e2e_sampling.py for the daemon side). So through the router two requests
    with the same seed are independent samples: we assert what actually happens, i.e. that
    identical seeded requests do not all give the same text. If a later router forwards the
    seed, this test fails and should be flipped to assert equality."""
    body = dict(messages=STORY, temperature=1.0, top_p=1.0, seed=1234, max_tokens=12)
    with ThreadPoolExecutor(3) as ex:
        datas = list(ex.map(lambda _: chat(router, model, **body), range(3)))
    texts = [d["choices"][0]["message"]["content"] for d in datas]
    assert all(texts), texts
    assert len(set(texts)) > 1, f"3 seeded samples were identical: is `seed` forwarded now? {texts}"
    # temperature 0 stays deterministic whatever the seed
    g = [chat(router, model, messages=STORY, max_tokens=12, seed=s)["choices"][0]["message"]["content"] for s in (1, 2)]
    assert g[0] == g[1], g


# ------------------------------------------------------------------ client disconnect


def test_non_stream_disconnect_frees_kv(router, model, grpc_stub, reference):
    """A non-streaming client that times out: the router cancels the Generate RPC (contract
    §5, no Abort); the daemon must stop and free its KV all the same."""
    assert wait_kv_free(grpc_stub) == (0, 0, 0), "KV held before the test started"
    body = {"model": model, "messages": STORY, "temperature": 0, "max_tokens": 2000, "ignore_eos": True}
    outcome = []

    def client():
        try:
            outcome.append(router.post("/v1/chat/completions", body, timeout=4))
        except OSError as e:  # the client gives up (socket timeout)
            outcome.append(e)

    t = threading.Thread(target=client)
    t.start()
    seen = False
    while t.is_alive() and not seen:
        active, live, _ = kv_state(grpc_stub)
        seen = active >= 1 and live > 0
        time.sleep(0.1)
    t.join(timeout=60)
    assert seen, "never saw the request running in the daemon"
    assert outcome and isinstance(outcome[0], OSError), f"the client did not time out: {outcome}"
    state = wait_kv_free(grpc_stub)
    assert state == (0, 0, 0), f"(active requests, live KV tokens, heartbeat KV tokens) after the client left: {state}"
    assert chat(router, model, max_tokens=32)["choices"][0]["message"]["content"] == reference[0]


@pytest.mark.parametrize("n", [1, 2])
def test_stream_disconnect_frees_kv(router, model, grpc_stub, reference, n):
    """A streaming chat client leaves after a few deltas: the router sends Abort with the
    parent rid; the daemon must stop every choice and free every KV block, and keep serving."""
    assert wait_kv_free(grpc_stub) == (0, 0, 0), "KV held before the test started"
    body = {
        "model": model,
        "messages": STORY,
        "temperature": 0.7,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "n": n,
    }
    gen = router.sse("/v1/chat/completions", body, timeout=TIMEOUT)
    got = 0
    for payload in gen:
        assert payload != "[DONE]", "the answer ended before the client left"
        ev = json.loads(payload)
        if any((c.get("delta") or {}).get("content") for c in ev.get("choices") or []):
            got += 1
        if got >= 4:
            break
    # mid-answer: the daemon is generating and holds KV for it
    active, live, _ = kv_state(grpc_stub)
    assert active >= 1 and live > 0, (active, live)
    gen.close()  # closes the HTTP response: the router sees the client leave
    state = wait_kv_free(grpc_stub)
    assert state == (0, 0, 0), f"(active requests, live KV tokens, heartbeat KV tokens) after the client left: {state}"
    # and the daemon still answers, directly and through the router
    assert grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    assert chat(router, model, max_tokens=32)["choices"][0]["message"]["content"] == reference[0]
