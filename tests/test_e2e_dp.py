"""End-to-end: the daemon with two data-parallel replicas of the bundled model behind one
port, over gRPC and behind the real router with --dp-aware; then one replica killed with
SIGKILL takes the whole daemon down cleanly."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from helpers import Daemon, Router, child_pids, http_get, install_sigterm_cleanup, wait_until, watch_health

DP = 2
GREEDY = pb.SamplingParams(temperature=0.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def dp_daemon(tmp_path_factory):
    install_sigterm_cleanup()
    daemon = Daemon(
        max_running_requests=8,
        kv_cache_tokens=4096,
        extra_args=["--dp-size", str(DP)],
        log_dir=tmp_path_factory.mktemp("dp-daemon"),
    )
    with daemon:
        yield daemon


def stub_of(channel) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(channel)


def generated_per_rank(stub) -> list[int]:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return [int(rank["num_generated_tokens"]) for rank in info.scheduler_info["dp_ranks"]]


def generate(stub, rid: str, tokens: list[int], rank: int | None = None) -> pb.GenerateComplete:
    request = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=tokens), sampling_params=GREEDY)
    if rank is not None:
        request.data_parallel_rank = rank
    (last,) = [r for r in stub.Generate(request, timeout=60) if r.HasField("complete")]
    return last.complete


def test_the_daemon_reports_its_ranks(dp_daemon):
    with dp_daemon.channel() as ch:
        stub = stub_of(ch)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.server_args["dp_size"] == DP
        loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
        assert loads.dp_rank_count == DP and [x.dp_rank for x in loads.loads] == [0, 1]
        one = stub.GetLoads(pb.GetLoadsRequest(dp_rank=1), timeout=10)
        assert [x.dp_rank for x in one.loads] == [1]
        with pytest.raises(grpc.RpcError) as e:
            stub.GetLoads(pb.GetLoadsRequest(dp_rank=DP), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, "no-such-rank", [1, 2, 3], rank=DP)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_size 2" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # (rank 0's cursor: never sent)
            next(iter(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**6))))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_a_pinned_request_runs_on_its_rank_and_its_kv_events_name_it(dp_daemon):
    prompt = list(range(1000, 1040))
    batches = []
    with dp_daemon.channel() as ch:
        stub = stub_of(ch)
        events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)

        def read() -> None:
            try:
                for batch in events:
                    batches.append(batch)
            except grpc.RpcError:  # (cancelled below)
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for rank in (1, 0):
            before = generated_per_rank(stub)
            generate(stub, f"pinned-{rank}", prompt, rank=rank)
            after = generated_per_rank(stub)
            assert [a - b for a, b in zip(after, before)] == [4 if r == rank else 0 for r in range(DP)]

        def stored_on(rank: int) -> bool:
            return any(b.dp_rank == rank and any(e.HasField("stored") for e in b.events) for b in list(batches))

        wait_until(lambda: stored_on(0) and stored_on(1), 10, "both ranks' stored-block events")
        events.cancel()
        reader.join(10)


def test_an_unpinned_request_follows_its_cached_prefix(dp_daemon):
    """Both ranks take requests; a repeated long prompt goes back to the rank that holds it."""
    with dp_daemon.channel() as ch:
        stub = stub_of(ch)
        first = generate(stub, "affine-0", list(range(2000, 2100)), rank=1)
        assert first.cached_tokens == 0
        again = generate(stub, "affine-1", list(range(2000, 2100)) + [7])
        assert again.cached_tokens >= 96  # (the full blocks rank 1 cached)
        flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
        assert flushed.success, flushed.message
        assert generate(stub, "affine-2", list(range(2000, 2100)) + [8]).cached_tokens == 0


def test_admin_calls_reach_every_rank(dp_daemon):
    with dp_daemon.channel() as ch:
        reply = stub_of(ch).StartProfile(common_pb2.StartProfileRequest(), timeout=30)
    assert not reply.success  # (no --profile-dir): each rank says so
    assert "DP rank 0:" in reply.message and "DP rank 1:" in reply.message


def chat(router, content: str, max_tokens: int = 8) -> dict:
    body = {
        "model": router.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    resp = router.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    return resp.json()


def test_the_router_with_dp_aware_uses_every_rank(dp_daemon, tmp_path):
    with dp_daemon.channel() as ch:
        before = generated_per_rank(stub_of(ch))
    with Router(dp_daemon.port, policy="round_robin", extra_args=["--dp-aware"], log_dir=tmp_path) as router:
        workers = router.get("/workers").json()
        urls = sorted(w["url"] for w in workers["workers"])
        assert urls == [f"grpc://127.0.0.1:{dp_daemon.port}@{r}" for r in range(DP)], workers
        assert "Paris" in chat(router, "What is the capital of France?")["choices"][0]["message"]["content"]
        for question in ["Name a colour.", "What is 2+2?", "Say hello.", "Name a fruit.", "Count to three."]:
            chat(router, question)
        metrics = http_get(f"http://{router.host}:{router.prometheus_port}/metrics", timeout=10).text
    # The router sent to both rank workers (its @1 requests name rank 1: pinning itself is
    # checked over gRPC above), and both ranks generated.
    sent = {
        line.split("@", 1)[1][0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("smg_worker_requests_total{") and f":{dp_daemon.port}@" in line
    }
    assert sent.keys() == {"0", "1"} and all(n > 0 for n in sent.values()), sent
    with dp_daemon.channel() as ch:
        after = generated_per_rank(stub_of(ch))
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_the_routers_cache_aware_policy_finds_a_repeated_prefix(dp_daemon, tmp_path):
    """Repeats of a long prompt find it cached. The router pools whatever a rank worker's KV
    stream carries into that worker's index, so the daemon sends a connection only the rank
    its requests name once one has (rank 0, left off the wire, is never named): before
    that, the router may pick the wrong rank once (any time before), and then both hold
    the prefix."""
    text = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    with Router(dp_daemon.port, policy="cache_aware", extra_args=["--dp-aware"], log_dir=tmp_path) as router:
        answers = [chat(router, text + f" What is {n} squared?", max_tokens=2) for n in range(5)]
    prompt = answers[0]["usage"]["prompt_tokens"]
    cached = [(a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for a in answers]
    misses = [c < prompt - 32 for c in cached[1:]]
    assert sum(misses) <= 1 and not misses[-1], (prompt, cached)


def test_a_killed_replica_takes_the_daemon_down(dp_daemon):
    """(Last: this ends the module's daemon.) A request in flight on the other rank ends
    UNAVAILABLE, health watchers hear NOT_SERVING, the daemon exits non-zero, and no
    scheduler process is left."""
    schedulers = child_pids(dp_daemon.proc.pid)
    assert len(schedulers) == DP
    with dp_daemon.channel() as ch:
        outcome, started = {}, threading.Event()

        def long_request() -> None:
            request = pb.GenerateRequest(
                request_id="in-flight",
                tokenized=pb.TokenizedInput(input_ids=list(range(3000, 3020))),
                sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=4000, ignore_eos=True),
                stream=True,
                data_parallel_rank=0,
            )
            try:
                for _ in stub_of(ch).Generate(request, timeout=120):
                    started.set()
            except grpc.RpcError as e:
                outcome["code"] = e.code()

        statuses, watcher = watch_health(ch)
        threads = [watcher, threading.Thread(target=long_request, daemon=True)]
        threads[1].start()
        assert started.wait(60)
        wait_until(lambda: statuses, 10, "the first health status")
        os.kill(schedulers[1], signal.SIGKILL)
        wait_until(lambda: dp_daemon.proc.poll() is not None, 60, "the daemon exiting")
        for t in threads:
            t.join(30)
    assert dp_daemon.proc.returncode != 0
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE
    assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    for pid in schedulers:
        wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10, f"process {pid} gone")
    assert "DP rank 1" in dp_daemon.log_tail(200)
