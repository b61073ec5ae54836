"""End-to-end: prefill/decode disaggregation (PD). A prefill daemon computes the prompt's KV
and first token, a decode daemon receives that KV (the Mooncake transfer engine, over TCP)
and decodes; the real `smg` router runs them with `--pd-disaggregation` and sends both legs
the same GenerateRequest with `disaggregated_params{bootstrap_host, bootstrap_port,
bootstrap_room}`. Some tests send the legs themselves over gRPC to reach the failure paths.

One pair (and its router) serves the module; the last test kills its prefill daemon.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from conftest import E2E_KV_CACHE_TOKENS, E2E_MAX_RUNNING_REQUESTS
from helpers import (
    SCHEDULER_SERVICE,
    Daemon,
    Router,
    free_port,
    free_ports,
    install_sigterm_cleanup,
    wait_kv_free,
    wait_until,
)
from test_e2e_grpc import make_request

try:
    import mooncake.engine  # noqa: F401
except ImportError as e:  # (a missing libibverbs.so.1 is an ImportError too)
    pytest.skip(
        f"the Mooncake transfer engine does not load ({e}): PD needs the Debian package "
        "libibverbs1 and the pip extra `.[pd]` (pip install -e '.[pd]')",
        allow_module_level=True,
    )

BOOTSTRAP_TIMEOUT_S = 4
WAITING_TIMEOUT_S = 20
RPC_TIMEOUT = 120
# A decode daemon that lost its prefill mid-request holds the blocks the prefill might still
# have been writing into for a while (a quarantine of about 35 s) before it reuses them.
ABANDONED_KV_RELEASE_S = WAITING_TIMEOUT_S + 70
KV_FREE = (0, 0, 0)  # wait_kv_free: (requests in flight, KV tokens held, KV tokens in the last load)
# What each side counts (GetServerInfo.scheduler_info): the prefill what it sent, the decode
# what it received.
PREFILL_STATS = ("pd_transfers", "pd_transfer_failures", "pd_transferred_blocks", "pd_transferred_bytes")
DECODE_STATS = ("pd_received_requests", "pd_received_prompt_tokens")
PD_STATS = PREFILL_STATS + DECODE_STATS + ("num_computed_prompt_tokens",)
E2E_MODEL = os.environ.get("E2E_MODEL", "smollm2")
# A prompt of synthetic token ids for the legs sent by hand (no tokenizer needed).
PROMPT = [1000 + 7 * i for i in range(40)]


def pd_args(mode: str, bootstrap_port: int) -> list[str]:
    return [
        "--disaggregation-mode",
        mode,
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
        "--disaggregation-transfer-backend",
        "mooncake",
        "--disaggregation-bootstrap-timeout",
        str(BOOTSTRAP_TIMEOUT_S),
        "--disaggregation-waiting-timeout",
        str(WAITING_TIMEOUT_S),
    ]


@dataclasses.dataclass
class PDPair:
    prefill: Daemon
    decode: Daemon
    router: Router
    bootstrap_port: int
    p: pb_grpc.SglangSchedulerStub  # on the prefill daemon
    d: pb_grpc.SglangSchedulerStub  # on the decode daemon

    @property
    def model(self) -> str:
        return self.router.model

    def logs(self, lines: int = 30) -> str:
        """Both daemons' log tails, for failure messages."""
        return "\n".join(
            f"--- {name} log {dm.log_path} (tail):\n{dm.log_tail(lines)}"
            for name, dm in (("prefill", self.prefill), ("decode", self.decode))
        )


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory):
    """A prefill and a decode daemon (loading at the same time) and a PD router in front of
    them. Same engine sizes and (default) thread count as the session daemon, so greedy
    outputs can be compared bit for bit."""
    install_sigterm_cleanup()
    # (only the prefill daemon listens on its bootstrap port; the decode daemon gets a free
    # one of its own all the same, so that no default port is ever assumed free)
    bootstrap_port, decode_bootstrap_port = free_ports(2)
    sizes = dict(max_running_requests=E2E_MAX_RUNNING_REQUESTS, kv_cache_tokens=E2E_KV_CACHE_TOKENS)
    # Both daemons' threads share the machine's cores (as many each as the session daemon, for
    # equal floats): threads that sleep at their barriers instead of spinning keep a busy
    # step of one from starving the other's, which the router would take for a stuck worker.
    sizes["env"] = {"OMP_WAIT_POLICY": "PASSIVE"}
    prefill = Daemon(
        model=E2E_MODEL,
        extra_args=pd_args("prefill", bootstrap_port),
        log_dir=tmp_path_factory.mktemp("pd-prefill"),
        wait_serving=False,
        **sizes,
    )
    decode = Daemon(
        model=E2E_MODEL,
        extra_args=pd_args("decode", decode_bootstrap_port),
        log_dir=tmp_path_factory.mktemp("pd-decode"),
        wait_serving=False,
        **sizes,
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(prefill)  # (starts the process only)
        stack.enter_context(decode)
        prefill.wait_until_serving()
        decode.wait_until_serving()
        router = stack.enter_context(
            Router(
                None,
                policy="round_robin",
                log_dir=tmp_path_factory.mktemp("pd-router"),
                worker_args=[
                    "--pd-disaggregation",
                    "--prefill",
                    f"grpc://{prefill.address}",
                    str(bootstrap_port),
                    "--decode",
                    f"grpc://{decode.address}",
                ],
            )
        )
        p_channel = stack.enter_context(contextlib.closing(prefill.channel()))
        d_channel = stack.enter_context(contextlib.closing(decode.channel()))
        yield PDPair(
            prefill,
            decode,
            router,
            bootstrap_port,
            pb_grpc.SglangSchedulerStub(p_channel),
            pb_grpc.SglangSchedulerStub(d_channel),
        )


# ------------------------------------------------------------------ helpers


def ok_json(resp):
    assert resp.status == 200, resp
    return resp.json()


def chat(router, content, max_tokens=16, system=None, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": router.model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}
    return ok_json(router.post("/v1/chat/completions", body))


def server_args(stub) -> dict:
    return MessageToDict(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args)


def sched_stats(stub) -> dict:
    """The scheduler's numeric stats (GetServerInfo.scheduler_info); {} when they did not
    answer in time."""
    fields = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).scheduler_info.fields
    if "error" in fields:
        return {}
    return {k: v.number_value for k, v in fields.items() if v.WhichOneof("kind") == "number_value"}


def stats_now(stub) -> dict:
    return wait_until(lambda: sched_stats(stub), 30, "the scheduler's stats")


def deltas(stub, before: dict) -> dict:
    now = stats_now(stub)
    return {k: now[k] - before[k] for k in PD_STATS if k in now and k in before}


def disagg(stub, include=("disagg",)) -> pb.DisaggregationMetrics:
    load = stub.GetLoads(pb.GetLoadsRequest(include=list(include)), timeout=10).loads[0]
    assert load.HasField("disaggregation"), load
    return load.disaggregation


def leg(input_ids, room, host, port, max_new_tokens=8, **kw) -> pb.GenerateRequest:
    """One leg of a PD request as the router builds it, sent by hand."""
    req = make_request(input_ids, max_new_tokens=max_new_tokens, **kw)
    req.disaggregated_params.CopyFrom(
        pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
    )
    return req


def new_room() -> int:
    return random.randrange(1, 2**31 - 1)


def drain(call) -> tuple[list, grpc.RpcError | None]:
    """Read a Generate call to its end: (the responses, its status error or None)."""
    got = []
    try:
        for m in call:
            got.append(m)
    except grpc.RpcError as e:
        return got, e
    return got, None


def rpc_error(call) -> grpc.RpcError | None:
    """Drain a Generate call; its status error, or None when it ended normally."""
    return drain(call)[1]


def check_both_free_and_serving(pair: PDPair, timeout: float = 60.0) -> None:
    for name, daemon, stub in (("prefill", pair.prefill, pair.p), ("decode", pair.decode, pair.d)):
        state = wait_kv_free(stub, timeout)
        assert state == KV_FREE, f"the {name} daemon still runs a request or holds KV: {state}\n{pair.logs()}"
        assert daemon.health_status() == "SERVING", f"the {name} daemon is not SERVING\n{pair.logs()}"


def unique_text(words: int) -> str:
    """Plain prose of about `words` words that starts with a fresh nonce (no cached prefix)."""
    base = (
        "The lighthouse keeper wrote in his log every evening about the ships that passed, "
        "the colour of the sea, the birds on the rocks and the weather coming from the west. "
    ).split()
    out = [f"Log {uuid.uuid4().hex[:12]}:"]
    while len(out) < words:
        out += base
    return " ".join(out[:words])


# ------------------------------------------------------------------ configuration


def test_server_info_and_loads_report_the_mode(pd_pair, grpc_stub):
    """GetServerInfo names each daemon's mode, transfer backend and bootstrap port, and the
    KV layout the two must share (page size, KV dtype); GetLoads' disaggregation section
    names the mode; the PD stats exist on both, `num_computed_prompt_tokens` everywhere."""
    p_args, d_args, n_args = server_args(pd_pair.p), server_args(pd_pair.d), server_args(grpc_stub)
    assert p_args["disaggregation_mode"] == "prefill", p_args
    assert d_args["disaggregation_mode"] == "decode", d_args
    assert n_args["disaggregation_mode"] == "null", n_args
    assert p_args["disaggregation_transfer_backend"] == d_args["disaggregation_transfer_backend"] == "mooncake"
    assert n_args["disaggregation_transfer_backend"] == "", n_args
    assert int(p_args["disaggregation_bootstrap_port"]) == pd_pair.bootstrap_port, p_args
    for a in (p_args, d_args, n_args):
        assert int(a["page_size"]) > 0 and a["kv_cache_dtype"], a
    assert p_args["page_size"] == d_args["page_size"] == n_args["page_size"]
    assert p_args["kv_cache_dtype"] == d_args["kv_cache_dtype"] == n_args["kv_cache_dtype"]

    for stub, mode in ((pd_pair.p, "prefill"), (pd_pair.d, "decode"), (grpc_stub, "null")):
        for include in (["disagg"], ["all"]):
            assert disagg(stub, include).mode == mode, (mode, include)
        stats = stats_now(stub)
        assert "num_computed_prompt_tokens" in stats, sorted(stats)
        if mode != "null":
            missing = [k for k in (PREFILL_STATS if mode == "prefill" else DECODE_STATS) if k not in stats]
            assert not missing, f"{mode} daemon's scheduler_info lacks {missing}: {sorted(stats)}"


def test_pd_daemons_refuse_requests_without_disaggregated_params(pd_pair):
    """A PD daemon serves only legs of PD requests: a plain Generate is INVALID_ARGUMENT."""
    for stub in (pd_pair.p, pd_pair.d):
        e = rpc_error(stub.Generate(make_request(PROMPT, max_new_tokens=4), timeout=RPC_TIMEOUT))
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    check_both_free_and_serving(pd_pair)


def test_null_mode_daemon_refuses_disaggregated_params(grpc_stub):
    """The ordinary daemon has no peer to move KV to or from: a leg of a PD request is
    INVALID_ARGUMENT, and the message says why."""
    req = leg(PROMPT, new_room(), "127.0.0.1", free_port())
    e = rpc_error(grpc_stub.Generate(req, timeout=RPC_TIMEOUT))
    assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    assert "disaggregat" in e.details(), e.details()


# ------------------------------------------------------------------ through the PD router


def test_pd_greedy_equals_one_daemon(pd_pair, router, model):
    """Greedy answers through the PD router are those of one ordinary daemon behind an
    ordinary router: the decode daemon continues from the prefill's KV and first token as if
    it had computed them itself (same engine, threads and sizes: equal floats)."""
    questions = ["What is the capital of France?", "Name three colours of the rainbow."]
    for q in questions:
        mine = chat(pd_pair.router, q, max_tokens=24)
        ref = chat(router, q, max_tokens=24)
        if "France" in q:
            assert "Paris" in mine["choices"][0]["message"]["content"], mine
        assert mine["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"], (q, mine, ref)
        assert mine["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
        for k in ("prompt_tokens", "completion_tokens"):
            assert mine["usage"][k] == ref["usage"][k], (k, mine["usage"], ref["usage"])
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    mine = ok_json(pd_pair.router.post("/v1/completions", dict(body, model=pd_pair.model)))
    ref = ok_json(router.post("/v1/completions", dict(body, model=model)))
    assert mine["choices"][0]["text"] == ref["choices"][0]["text"], (mine, ref)
    check_both_free_and_serving(pd_pair)


def test_sixteen_concurrent_prompts_equal_one_daemons(pd_pair, router, model):
    """16 completions at once through each router: the PD pair's greedy texts are the single
    daemon's, and the decode daemon computed none of their prompt tokens."""
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]

    def complete(r, name, prompt):
        return ok_json(r.post("/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0}))

    before = stats_now(pd_pair.d)
    with ThreadPoolExecutor(16) as pool:
        mine = list(pool.map(lambda p: complete(pd_pair.router, pd_pair.model, p), prompts))
        ref = list(pool.map(lambda p: complete(router, model, p), prompts))
    assert [m["choices"][0]["text"] for m in mine] == [r["choices"][0]["text"] for r in ref]
    moved = deltas(pd_pair.d, before)
    assert moved["pd_received_requests"] == 16 and moved["num_computed_prompt_tokens"] == 0, moved
    check_both_free_and_serving(pd_pair)


def test_a_request_moves_its_kv_from_prefill_to_decode(pd_pair):
    """One PD request: the prefill daemon computes the prompt and sends its KV once (blocks
    and bytes counted, no failure), the decode daemon receives it and computes no prompt
    token itself; GetLoads then shows the prefill's transfer speed and latency. Neither
    daemon holds KV afterwards."""
    p0, d0 = stats_now(pd_pair.p), stats_now(pd_pair.d)
    data = chat(pd_pair.router, unique_text(40), max_tokens=8)
    prompt_tokens = data["usage"]["prompt_tokens"]
    assert data["usage"]["completion_tokens"] > 0, data

    dp = wait_until(
        lambda: (x := deltas(pd_pair.p, p0)).get("pd_transfers", 0) >= 1 and x,
        30,
        "the prefill daemon counting its transfer",
    )
    dd = wait_until(
        lambda: (x := deltas(pd_pair.d, d0)).get("pd_received_requests", 0) >= 1 and x,
        30,
        "the decode daemon counting what it received",
    )
    assert dp["pd_transfers"] == 1 and dp["pd_transfer_failures"] == 0, dp
    assert dp["pd_transferred_blocks"] > 0 and dp["pd_transferred_bytes"] > 0, dp
    assert 0 < dp["num_computed_prompt_tokens"] <= prompt_tokens, (dp, prompt_tokens)
    assert dd["pd_received_requests"] == 1, dd
    assert 0 < dd["pd_received_prompt_tokens"] <= prompt_tokens, (dd, prompt_tokens)
    assert dd["num_computed_prompt_tokens"] == 0, f"the decode daemon computed prompt tokens itself: {dd}"
    assert dd.get("pd_transfers", 0) == 0 and dp.get("pd_received_requests", 0) == 0, (dp, dd)

    m = wait_until(
        lambda: (x := disagg(pd_pair.p)).kv_transfer_speed_gb_s > 0 and x.kv_transfer_latency_ms > 0 and x,
        10,
        "the prefill's GetLoads showing its KV transfer speed and latency",
    )
    assert m.mode == "prefill", m
    assert disagg(pd_pair.d, ["all"]).decode_transfer_queue_reqs == 0
    check_both_free_and_serving(pd_pair)


def test_streamed_content_equals_nonstreamed(pd_pair):
    """The decode daemon streams through the router: the deltas add up to the non-streamed
    greedy answer, and the stream ends with a finish reason and [DONE]."""
    q = "Write one sentence about the sea."
    ref = chat(pd_pair.router, q, max_tokens=24)["choices"][0]["message"]["content"]
    body = {
        "model": pd_pair.model,
        "messages": [{"role": "user", "content": q}],
        "temperature": 0,
        "max_tokens": 24,
        "stream": True,
    }
    raw = list(pd_pair.router.sse("/v1/chat/completions", body))
    assert raw and raw[-1] == "[DONE]", raw[-3:]
    events = [json.loads(x) for x in raw[:-1]]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
    assert text == ref, (text, ref)
    finishes = [c["finish_reason"] for e in events for c in e.get("choices") or [] if c.get("finish_reason")]
    assert finishes and finishes[-1] in ("stop", "length"), finishes


def test_decode_prefix_hit_transfers_fewer_blocks(pd_pair):
    """Two requests behind the same long system prompt: for the second the decode daemon
    already holds the prompt's prefix, so the prefill daemon sends fewer blocks (the
    differing tail still moves)."""
    system = unique_text(260)
    sent = []
    for q in ("Summarise the log in one line.", "What colour was the sea?"):
        before = stats_now(pd_pair.p)
        data = chat(pd_pair.router, q, max_tokens=8, system=system)
        assert data["usage"]["prompt_tokens"] > 200, data["usage"]
        d = wait_until(
            lambda b=before: (x := deltas(pd_pair.p, b)).get("pd_transfers", 0) >= 1 and x,
            30,
            "the prefill daemon counting its transfer",
        )
        assert d["pd_transfers"] == 1, d
        sent.append(d["pd_transferred_blocks"])
    assert 0 < sent[1] < sent[0], f"blocks sent for the first and second request: {sent}"


def test_client_disconnects_free_kv_on_both_daemons(pd_pair):
    """32 streaming chats at once through the PD router, half of them closed by their client
    after a few events: the others finish whole, and afterwards neither daemon holds a
    request or KV (the router's aborts reach the decode daemon, the prefill's KV was
    released after it was sent)."""
    n = 32

    def one(i):
        closer = i % 2 == 0
        body = {
            "model": pd_pair.model,
            "messages": [{"role": "user", "content": f"Count from {i} upwards, one number a line."}],
            "temperature": 0,
            "max_tokens": 200 if closer else 12,
            "stream": True,
        }
        if closer:
            body["ignore_eos"] = True
        gen = pd_pair.router.sse("/v1/chat/completions", body)
        got = []
        for payload in gen:
            got.append(payload)
            if closer and len(got) >= 3:
                gen.close()  # the client leaves: the router sees the connection close
                return "closed", got
        return "done", got

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    closed = [r for r in results if r[0] == "closed"]
    done = [r for r in results if r[0] == "done"]
    assert len(closed) == n // 2, [(k, len(g)) for k, g in results]
    for _, got in done:
        assert got and got[-1] == "[DONE]", got[-3:]
    check_both_free_and_serving(pd_pair, timeout=120)


# ------------------------------------------------------------------ legs sent by hand


def test_aborting_a_decode_leg_waiting_for_kv_ends_it_at_once(pd_pair):
    """A decode leg whose prefill leg never comes (a room the prefill daemon never gets)
    waits for its KV, counted in GetLoads' decode_transfer_queue_reqs; Abort ends it at
    once, long before the bootstrap timeout, and frees the KV it had reserved."""
    check_both_free_and_serving(pd_pair)
    req = leg(PROMPT, new_room(), "127.0.0.1", pd_pair.bootstrap_port, max_new_tokens=8)
    call = pd_pair.d.Generate(req, timeout=RPC_TIMEOUT)
    result = {}
    reader = threading.Thread(target=lambda: result.update(end=drain(call), at=time.monotonic()))
    reader.start()
    try:
        wait_until(
            lambda: disagg(pd_pair.d).decode_transfer_queue_reqs == 1 or "at" in result,
            BOOTSTRAP_TIMEOUT_S,
            "the decode leg waiting for its KV",
            interval=0.05,
        )
        assert "at" not in result, f"the decode leg ended before the Abort: {result}\n{pd_pair.logs()}"
        assert disagg(pd_pair.d).decode_transfer_queue_reqs == 1
        sent = time.monotonic()
        reply = pd_pair.d.Abort(pb.AbortRequest(request_id=req.request_id, reason="test"), timeout=10)
        assert reply.success, reply
    finally:
        reader.join(RPC_TIMEOUT)
    assert "at" in result, "the decode leg did not end"
    took = result["at"] - sent
    assert took < BOOTSTRAP_TIMEOUT_S / 2, f"the aborted decode leg ended {took:.1f} s after the Abort"
    got, e = result["end"]
    # A non-streaming call ends either with a Complete(finish_reason "abort") or CANCELLED.
    if e is not None:
        assert e.code() == grpc.StatusCode.CANCELLED, (e.code(), e.details())
    else:
        assert [m.WhichOneof("response") for m in got] == ["complete"], got
        assert got[0].complete.finish_reason == "abort", got[0].complete
    check_both_free_and_serving(pd_pair)
    assert disagg(pd_pair.d).decode_transfer_queue_reqs == 0


def _decode_leg_unknown_room(pair):
    return pair.d, leg(PROMPT, new_room(), "127.0.0.1", pair.bootstrap_port)


def _decode_leg_closed_port(pair):
    return pair.d, leg(PROMPT, new_room(), "127.0.0.1", free_port())


def _prefill_leg_no_decode(pair):
    return pair.p, leg(PROMPT, new_room(), "127.0.0.1", pair.bootstrap_port)


@pytest.mark.parametrize(
    "case",
    [_decode_leg_unknown_room, _decode_leg_closed_port, _prefill_leg_no_decode],
    ids=["decode-room-no-prefill-gets", "decode-prefill-port-closed", "prefill-no-decode-registers"],
)
def test_a_leg_whose_peer_never_comes_fails_with_bootstrap(pd_pair, case):
    """A leg whose peer never shows up (a decode leg for a room the prefill never gets, or
    naming a closed bootstrap port; a prefill leg no decode registers for) ends with
    UNAVAILABLE naming the bootstrap, within the bootstrap timeout plus slack rather than
    the KV waiting timeout; both daemons then hold no KV and stay SERVING."""
    stub, req = case(pd_pair)
    t0 = time.monotonic()
    e = rpc_error(stub.Generate(req, timeout=RPC_TIMEOUT))
    took = time.monotonic() - t0
    assert e is not None, f"the lone leg succeeded\n{pd_pair.logs()}"
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "bootstrap" in e.details(), (e.code(), e.details())
    assert took < WAITING_TIMEOUT_S, f"the leg failed only after {took:.1f} s"
    check_both_free_and_serving(pd_pair)


# ------------------------------------------------------------------ health


@pytest.mark.slow  # (a third daemon's start-up)
def test_health_reports_a_held_bootstrap_port_until_it_is_free(tmp_path):
    """A prefill daemon whose bootstrap port is taken cannot serve PD requests: health says
    NOT_SERVING and HealthCheck names the bootstrap; once the port is free the daemon binds
    it (it retries every second) and turns SERVING."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    d = Daemon(
        model=E2E_MODEL, kv_cache_tokens=2048, extra_args=pd_args("prefill", port), log_dir=tmp_path, wait_serving=False
    )
    try:
        with d, contextlib.closing(d.channel()) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)

            def bootstrap_problem():
                assert d.alive(), f"the daemon exited\n{d.log_tail()}"
                try:
                    r = stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
                except grpc.RpcError:  # (still loading)
                    return None
                return r if "bootstrap" in r.message else None

            r = wait_until(bootstrap_problem, 180, lambda: f"HealthCheck naming the bootstrap\n{d.log_tail()}", 0.25)
            assert not r.healthy, r
            assert d.health_status("") == "NOT_SERVING"
            assert d.health_status(SCHEDULER_SERVICE) == "NOT_SERVING"

            holder.close()
            wait_until(
                lambda: d.health_status("") == "SERVING" and d.health_status(SCHEDULER_SERVICE) == "SERVING",
                15,
                lambda: f"SERVING once the bootstrap port is free\n{d.log_tail()}",
                0.25,
            )
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
            assert int(server_args(stub)["disaggregation_bootstrap_port"]) == port
    finally:
        holder.close()


# ------------------------------------------------------------------ last: kills the prefill daemon


@pytest.mark.slow  # (the decode side holds the blocks for its quarantine, 35 s)
def test_killing_the_prefill_mid_request_fails_it_and_frees_the_decode(pd_pair, tokenizer):
    """kill -9 of the whole prefill daemon while two long prompts are in flight, one through
    the router and one as legs sent by hand: the router's client gets a server error and the
    hand-sent decode leg UNAVAILABLE naming the lost KV transfer (or the bootstrap, had it
    not registered yet), not a hang and not a made-up answer; the decode daemon then gives
    up what it reserved for them and stays SERVING.
    Runs last in the module: the pair has no prefill daemon afterwards."""

    def long_prompt():
        text = unique_text(40)
        while len(tokenizer.encode(text, add_special_tokens=False)) < 1500:
            text += " " + unique_text(200)
        return text

    d0 = stats_now(pd_pair.d)
    ids = tokenizer.encode(long_prompt(), add_special_tokens=False)
    room = new_room()
    legs = {
        "decode": pd_pair.d.Generate(leg(ids, room, "127.0.0.1", pd_pair.bootstrap_port, 64), timeout=RPC_TIMEOUT),
        "prefill": pd_pair.p.Generate(leg(ids, room, "127.0.0.1", pd_pair.bootstrap_port, 64), timeout=RPC_TIMEOUT),
    }
    body = {"model": pd_pair.model, "prompt": long_prompt(), "max_tokens": 64, "temperature": 0}
    result = {}
    threads = [threading.Thread(target=lambda: result.update(resp=pd_pair.router.post("/v1/completions", body)))]
    threads += [threading.Thread(target=lambda k=k, c=c: result.update({k: drain(c)})) for k, c in legs.items()]
    for t in threads:
        t.start()
    try:

        def prefill_busy():
            load = pd_pair.p.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
            return load.num_running_reqs + load.num_waiting_reqs > 0 or result

        wait_until(prefill_busy, 60, "the prefill daemon taking the requests", interval=0.02)
        assert not result, f"a request ended before the prefill was killed: {result}"
        os.killpg(pd_pair.prefill.proc.pid, signal.SIGKILL)
    finally:
        for t in threads:
            t.join(RPC_TIMEOUT + 30)
    received = deltas(pd_pair.d, d0)["pd_received_requests"]
    resp = result.get("resp")
    assert resp is not None, "the router's client got no answer"
    assert 500 <= resp.status < 600, f"{resp} (KV received by decode: {received})\n{pd_pair.logs()}"
    assert result["prefill"][1] is not None, "the prefill leg succeeded although its daemon was killed"
    e = result["decode"][1]
    assert e is not None, f"the decode leg succeeded without its prefill: {result['decode'][0]}"
    assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
    assert "KV transfer" in e.details() or "bootstrap" in e.details(), e.details()
    state = wait_kv_free(pd_pair.d, timeout=ABANDONED_KV_RELEASE_S)
    assert state == KV_FREE, f"the decode daemon still holds the request or its KV: {state}\n{pd_pair.logs()}"
    assert pd_pair.decode.health_status() == "SERVING"
    assert pd_pair.decode.health_status(SCHEDULER_SERVICE) == "SERVING"
