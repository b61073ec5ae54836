"""Long-lived streams are bounded and cost nothing while idle: SubscribeKvEvents and
grpc.health.v1 Watch refuse streams beyond their caps with RESOURCE_EXHAUSTED, and streams
wait for events rather than polling, so a full load of idle ones neither slows a Generate's
first token nor keeps the daemon's event loop busy. End-to-end on the session daemon, plus
a unit test of the health watchers' shared timer."""

from __future__ import annotations

import ast
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from servicer.health import MAX_WATCHES, NOT_SERVING, SERVICE_NAME, SERVING, HealthServicer, HealthState

# The server's generated stubs cannot share a process with smg-grpc-proto's (both register
# common.proto), so the KV event cap is read from the source rather than imported.
_KV_EVENTS_SOURCE = Path(__file__).resolve().parent.parent / "src" / "servicer" / "kv_events.py"


def module_constant(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} is not assigned in {path}")


MAX_SUBSCRIBERS = module_constant(_KV_EVENTS_SOURCE, "MAX_SUBSCRIBERS")
IDLE_WATCHES = 1000


# ------------------------------------------------------------------ unit: one timer for all watchers


class Client:
    """What HealthState reads of a SchedulerClient; counts how often its status is computed."""

    def __init__(self):
        from servicer.scheduler_client import Liveness

        self.died, self.ready = asyncio.Event(), asyncio.Event()
        self.ready.set()
        self.dead_reason = None
        self.age = 0.1
        self.liveness = Liveness(last_message=time.monotonic())
        self.reads = 0

    def heartbeat_age(self) -> float:
        self.reads += 1
        return self.age


def test_watchers_share_one_timer_and_wake_only_on_a_change():
    client = Client()
    health = HealthState(client, recheck_interval=0.01)
    health.warmed_up = True
    servicer = HealthServicer(health)

    async def scenario():
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        streams = [servicer.Watch(request, None) for _ in range(500)]
        firsts = [(await anext(s)).status for s in streams]
        assert firsts == [SERVING] * 500
        pending = [asyncio.ensure_future(anext(s)) for s in streams]
        reads = client.reads
        await asyncio.sleep(0.5)  # idle: about 50 rechecks, whatever the number of watchers
        assert not any(p.done() for p in pending)
        assert client.reads - reads < 200, client.reads - reads
        client.age = 60.0  # heartbeats stop: every watcher hears it once
        changed = await asyncio.wait_for(asyncio.gather(*pending), 10)
        assert [r.status for r in changed] == [NOT_SERVING] * 500
        client.age = 0.1  # and back
        changed = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams)), 10)
        assert [r.status for r in changed] == [SERVING] * 500
        health.recheck_interval = 3600.0
        await asyncio.sleep(0.1)  # the timer now sleeps for an hour
        pending = [asyncio.ensure_future(anext(s)) for s in streams]
        health.shutting_down = True  # heard at once, not at the next recheck
        changed = await asyncio.wait_for(asyncio.gather(*pending), 5)
        assert [r.status for r in changed] == [NOT_SERVING] * 500
        for s in streams:
            await s.aclose()
        assert health.watchers == 0

    asyncio.run(scenario())


class Context:
    async def abort(self, code, details):
        raise grpc.RpcError(code, details)


def test_watch_streams_beyond_the_cap_are_refused():
    client = Client()
    health = HealthState(client)
    health.warmed_up = True
    servicer = HealthServicer(health, max_watches=2)

    async def scenario():
        request = health_pb2.HealthCheckRequest(service="")
        open_ = [servicer.Watch(request, Context()) for _ in range(2)]
        assert [(await anext(s)).status for s in open_] == [SERVING, SERVING]
        with pytest.raises(grpc.RpcError) as e:
            await anext(servicer.Watch(request, Context()))
        assert e.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2" in e.value.args[1]
        await open_.pop().aclose()  # one leaves: room for another
        again = servicer.Watch(request, Context())
        assert (await anext(again)).status == SERVING
        await again.aclose()
        await open_[0].aclose()

    asyncio.run(scenario())


# ------------------------------------------------------------------ end-to-end (session daemon)


def first_token_s(stub) -> float:
    """Seconds from sending a Generate (a fresh 12-token prompt: no full KV block, so no KV
    events) to its first response."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    rng = random.Random(time.time_ns())
    req = pb.GenerateRequest(
        request_id=f"ttft-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=[rng.randrange(1000, 40000) for _ in range(12)]),
        sampling_params=pb.SamplingParams(max_new_tokens=2, top_k=-1, top_p=1.0),
        logprob_start_len=-1,
    )
    t0 = time.perf_counter()
    call = stub.Generate(req, timeout=120)
    next(call)
    took = time.perf_counter() - t0
    for _ in call:
        pass
    return took


def median_first_token_s(stub, n: int = 5) -> float:
    first_token_s(stub)  # (warm)
    return statistics.median(first_token_s(stub) for _ in range(n))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its own, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_s(pid: int, window_s: float = 2.0) -> float:
    before = cpu_seconds(pid)
    time.sleep(window_s)
    return cpu_seconds(pid) - before


def open_until_refused(open_one, limit: int) -> tuple[list, grpc.RpcError | None]:
    """Open streams with ``open_one()`` (which returns a call, or raises the refusal) until
    one is refused or ``limit`` are open."""
    calls = []
    try:
        while len(calls) < limit:
            calls.append(open_one())
    except grpc.RpcError as e:
        return calls, e
    return calls, None


def kv_subscriber(stub, before_first: bool):
    from smg_grpc_proto.generated import common_pb2 as spb

    call = stub.SubscribeKvEvents(spb.SubscribeKvEventsRequest(load_records_before_first_batch=before_first))
    if before_first:
        next(call)  # an accepted stream sends a load record at once; a refused one raises
    else:
        call.initial_metadata()  # registered (idle streams send nothing until a KV event)
    return call


def watch_stream(health_stub):
    call = health_stub.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(call).status == SERVING
    return call


def close_all(calls):
    for call in calls:
        call.cancel()


# KV event subscribers the fixture opens: a few that send load records, idle ones up to
# near the cap (an idle stream's refusal cannot be told from its acceptance without a wait);
# the cap test fills the rest.
LOAD_SUBSCRIBERS = 8
IDLE_SUBSCRIBERS = MAX_SUBSCRIBERS - LOAD_SUBSCRIBERS - 16


@pytest.fixture(scope="module")
def idle_streams(daemon, grpc_stub, health_stub):
    """A baseline (first-token time, the daemon's idle CPU), then a full load of idle streams
    on the session daemon: KV event subscribers (most of them idle, a few with load records)
    and IDLE_WATCHES health Watch streams. Closed afterwards, waiting until the daemon has let
    them go."""
    from helpers import wait_until

    baseline = {"first_token_s": median_first_token_s(grpc_stub), "idle_cpu_s": idle_cpu_s(daemon.proc.pid)}
    streams = {"kv": [], "watches": [], "baseline": baseline}
    try:
        streams["kv"] += [kv_subscriber(grpc_stub, before_first=True) for _ in range(LOAD_SUBSCRIBERS)]
        streams["kv"] += [kv_subscriber(grpc_stub, before_first=False) for _ in range(IDLE_SUBSCRIBERS)]
        streams["watches"] += [watch_stream(health_stub) for _ in range(IDLE_WATCHES)]
        yield streams
    finally:
        close_all(streams["kv"] + streams["watches"])

        def released():  # the server sees the cancellations a moment later
            try:
                kv_subscriber(grpc_stub, before_first=True).cancel()
                watch_stream(health_stub).cancel()
                return True
            except grpc.RpcError:
                return False

        wait_until(released, 30, "the daemon letting go of the closed streams")


def test_e2e_kv_event_subscribers_beyond_the_cap_are_refused(grpc_stub, idle_streams):
    from helpers import wait_until

    more, refusal = open_until_refused(lambda: kv_subscriber(grpc_stub, before_first=True), MAX_SUBSCRIBERS + 1)
    idle_streams["kv"] += more
    assert refusal is not None, f"{len(idle_streams['kv'])} subscribers open, the cap is {MAX_SUBSCRIBERS}"
    assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
    assert f"(at most {MAX_SUBSCRIBERS})" in refusal.details(), refusal.details()
    assert len(more) <= MAX_SUBSCRIBERS - LOAD_SUBSCRIBERS - IDLE_SUBSCRIBERS
    idle_streams["kv"].pop().cancel()  # one leaves: room for another, once the server saw it go
    again = []

    def reopened():
        try:
            again.append(kv_subscriber(grpc_stub, before_first=True))
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            return False

    wait_until(reopened, 30, "a subscriber accepted after one left")
    idle_streams["kv"] += again


def test_e2e_watch_streams_beyond_the_cap_are_refused(health_stub, idle_streams):
    more, refusal = open_until_refused(lambda: watch_stream(health_stub), MAX_WATCHES + 1 - IDLE_WATCHES)
    idle_streams["watches"] += more
    assert refusal is not None, f"{IDLE_WATCHES + len(more)} Watch streams open, the cap is {MAX_WATCHES}"
    assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
    assert f"(at most {MAX_WATCHES})" in refusal.details(), refusal.details()
    assert len(more) <= MAX_WATCHES - IDLE_WATCHES
    # Check still answers when no Watch stream is left.
    assert health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING


def test_e2e_idle_streams_cost_no_first_token_time_and_no_cpu(daemon, grpc_stub, idle_streams):
    """With the caps' worth of idle streams open, a Generate's first token comes as fast
    (within a generous bound, for a loaded 2-core machine) and the daemon's event loop stays
    as idle as without them (streams that polled would wake thousands of times a second)."""
    baseline = idle_streams["baseline"]
    n = len(idle_streams["kv"]) + len(idle_streams["watches"])
    # The quietest of three windows: a stray collection or log line can land in one window,
    # while streams that polled would fill every one.
    cpu = min(idle_cpu_s(daemon.proc.pid) for _ in range(3))
    ttft = median_first_token_s(grpc_stub)
    assert cpu < 2 * baseline["idle_cpu_s"] + 0.1, f"{n} idle streams: {cpu:.2f} s of CPU in 2 s, baseline {baseline}"
    assert ttft < 3 * baseline["first_token_s"] + 1.0, f"{n} idle streams: first token {ttft:.3f} s, {baseline}"
