"""End-to-end: the real `smg` router (PyPI smg 1.13) in front of the session daemon,
OpenAI HTTP in, gRPC to the daemon (router contract §1, §2, §5, §11)."""

from __future__ import annotations

import json
import time

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import Router
from test_e2e_grpc import wait_idle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def ok_json(resp):
    assert resp.status == 200, resp
    return resp.json()


def read_sse(router, path, body):
    """(parsed JSON events, raw payloads) of one streamed request."""
    raw = list(router.sse(path, body))
    events = [json.loads(p) for p in raw if p != "[DONE]"]
    return events, raw


def test_models_lists_the_model(router, model_info):
    data = ok_json(router.get("/v1/models"))
    ids = [m["id"] for m in data["data"]]
    assert model_info.served_model_name in ids, data


def test_chat_completion_greedy(router, model, tokenizer):
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
    data = ok_json(router.post("/v1/chat/completions", body))
    choice = data["choices"][0]
    content = choice["message"]["content"]
    assert "Paris" in content, content
    assert choice["finish_reason"] in ("stop", "length")
    usage = data["usage"]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert usage["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert 0 < usage["completion_tokens"] <= 32
    # greedy is deterministic through the router as well
    again = ok_json(router.post("/v1/chat/completions", body))
    assert again["choices"][0]["message"]["content"] == content


def test_chat_completion_stream(router, model):
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
    ref = ok_json(router.post("/v1/chat/completions", body))["choices"][0]["message"]["content"]
    events, raw = read_sse(
        router, "/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True})
    )
    assert raw and raw[-1] == "[DONE]", raw[-3:]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
    assert "Paris" in text, text
    assert text == ref, "streamed text differs from the non-streamed greedy answer"
    content_events = [e for e in events for c in e.get("choices") or [] if (c.get("delta") or {}).get("content")]
    assert len(content_events) >= 2, "the answer should arrive in several deltas"
    finishes = [c["finish_reason"] for e in events for c in e.get("choices") or [] if c.get("finish_reason")]
    assert finishes and finishes[-1] in ("stop", "length"), finishes
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] > 0


def test_completions_max_tokens_length(router, model):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    data = ok_json(router.post("/v1/completions", body))
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length", data
    assert data["usage"]["completion_tokens"] == 5
    assert choice["text"]


def test_over_context_request_is_400(router, model, grpc_stub):
    """prompt + max_tokens over the context: the router forwards it, the daemon must refuse
    (INVALID_ARGUMENT -> HTTP 400) and stay usable."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 9000}
    r = router.post("/v1/completions", body)
    assert r.status == 400, r
    h = grpc_stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert h.healthy
    ok_json(router.post("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 2}))


def test_stream_disconnect_aborts_in_daemon(router, model, grpc_stub):
    """A streaming client that goes away makes the router send Abort; the daemon must stop."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    gen = router.sse("/v1/completions", body)
    got = 0
    for payload in gen:
        if payload != "[DONE]":
            got += 1
        if got >= 3:
            break
    gen.close()  # closes the HTTP response: the router sees the client leave
    assert wait_idle(grpc_stub) == 0, "the daemon kept generating after the client left"


@pytest.mark.parametrize("policy", ["least_load", "round_robin"])
def test_other_policies(daemon, tmp_path_factory, policy):
    with Router(daemon.port, policy=policy, log_dir=tmp_path_factory.mktemp(f"router-{policy}")) as r:
        data = ok_json(
            r.post("/v1/chat/completions", {"model": r.model, "messages": QUESTION, "temperature": 0, "max_tokens": 32})
        )
        assert "Paris" in data["choices"][0]["message"]["content"]


def test_router_admin_endpoints_reach_the_daemon(router, model, grpc_stub, tmp_path):
    """The router's operator endpoints (contract §4): /flush_cache -> FlushCache(0),
    /start_profile -> StartProfile (refused: the session daemon has no --profile-dir;
    test_profile.py profiles through a daemon that has one), /get_loads."""
    assert wait_idle(grpc_stub) == 0
    flushed = ok_json(router.post("/flush_cache", {}))
    assert flushed.get("status") == "success" and flushed.get("workers_flushed") == 1, flushed

    out_dir = tmp_path / "profile"
    refused = router.post("/start_profile", {"output_dir": str(out_dir)})
    assert refused.status != 200 and "profiling is off" in refused.text, refused
    assert not out_dir.exists()
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 4}
    ok_json(router.post("/v1/chat/completions", body))

    # The router serves /get_loads from its cache of our pushed load records (contract §6),
    # which trails the completion it just relayed by about one 100 ms change check.
    deadline = time.monotonic() + 60.0
    while True:
        loads = router.get("/get_loads")
        assert loads.status == 200, loads
        (worker,) = loads.json()["loads"]  # the daemon's own numbers, relayed by the router
        if worker["num_running_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ours = pb.GetLoadsRequest(include=["core", "memory"])
    direct = grpc_stub.GetLoads(ours, timeout=10).loads[0]
    assert worker["max_total_num_tokens"] == direct.max_total_num_tokens > 0, worker
    assert worker["max_running_requests"] == direct.max_running_requests, worker
    assert worker["num_running_reqs"] == 0 and worker["memory"]["weight_gb"] > 0, worker
