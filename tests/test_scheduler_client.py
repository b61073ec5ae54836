"""The servicer's scheduler client reading the scheduler's outbox over a real ZMQ socket
(no scheduler process: a PUSH socket plays its part)."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import zmq
import zmq.asyncio

from scheduler.config import EngineConfig
from scheduler.messages import (
    Heartbeat,
    KvEvents,
    LoadSnapshot,
    RequestOutput,
    StepOutput,
    from_scheduler_encoder,
)
from servicer.scheduler_client import SchedulerClient, _Route


async def _wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _reading_client():
    """A client reading its outbox, with a PUSH socket playing the scheduler's part."""
    client = SchedulerClient(EngineConfig(model="unused"))
    reader = asyncio.create_task(client._read_loop())
    scheduler = client.ctx.socket(zmq.PUSH)
    scheduler.connect(client.outbox_addr)
    try:
        yield client, scheduler
    finally:
        scheduler.close(0)
        reader.cancel()
        client._reader = reader
        await client.stop()


def test_a_trailing_heartbeat_never_brings_back_an_older_load():
    """The heartbeat thread may read the load before a step ends and send it after the
    step's output (its own socket): GetLoads must keep showing the step's newer load."""

    async def scenario():
        async with _reading_client() as (client, scheduler):
            running = LoadSnapshot(version=7, num_running=1)
            idle = LoadSnapshot(version=8, num_running=0)
            await scheduler.send(from_scheduler_encoder.encode(StepOutput([], load=idle)))
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(running, 0.0)))
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(LoadSnapshot(version=9, num_waiting=2), 0.0)))
            await _wait_for(lambda: client.liveness.load.version == 9)
            assert client.liveness.load.num_running == 0 and client.liveness.load.num_waiting == 2

            # ... and an equal version (heartbeats between steps) is taken
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(LoadSnapshot(version=9, num_waiting=0), 0.0)))
            await _wait_for(lambda: client.liveness.load.num_waiting == 0)

            # A heartbeat from inside a step that trails the step's output: its in-step time
            # is as stale as its load (the watchdog and health read it).
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(LoadSnapshot(version=9), 70.0)))
            await _wait_for(lambda: client.liveness.in_step_s == 70.0)
            await scheduler.send(from_scheduler_encoder.encode(StepOutput([], load=LoadSnapshot(version=10))))
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(LoadSnapshot(version=9), 70.5)))
            marks = []  # a message after it that touches neither the load nor the in-step time
            client.kv_event_listener = marks.append
            await scheduler.send(from_scheduler_encoder.encode(KvEvents([], 0.0)))
            await _wait_for(lambda: marks)
            assert client.liveness.in_step_s == 0.0 and client.liveness.load.version == 10

    asyncio.run(scenario())


def test_a_failure_in_the_read_loop_marks_the_scheduler_dead_at_once():
    """A failure in the read loop must not leave every request waiting for the watchdog."""

    def broken_dispatch(msg):
        raise RuntimeError("a bug in dispatch")

    async def scenario():
        async with _reading_client() as (client, scheduler):
            waiter = asyncio.Queue()
            client._routes["r1"] = _Route(waiter)  # (not ready: submit would refuse)
            client._dispatch = broken_dispatch
            await scheduler.send(from_scheduler_encoder.encode(StepOutput([])))
            error = await asyncio.wait_for(waiter.get(), 5)
            assert client.died.is_set() and "could not read the scheduler's messages" in str(error), error

    asyncio.run(scenario())


def test_a_malformed_frame_is_dropped_and_the_requests_go_on():
    """Any process of our user can push a frame into the servicer's socket: one that is not
    msgpack, or msgpack of another shape, is dropped with a warning, and the outputs after it
    still reach their request."""

    async def scenario():
        async with _reading_client() as (client, scheduler):
            waiter = asyncio.Queue()
            client._routes["r1"] = _Route(waiter)
            for frame in (b"not msgspec", b"\xc1", msgspec.msgpack.encode({"type": "StepOutput", "outputs": 7})):
                await scheduler.send(frame)
            out = RequestOutput("r1", [5], 3, 0, 1, finish_reason="length")
            await scheduler.send(from_scheduler_encoder.encode(StepOutput([out])))
            assert await asyncio.wait_for(waiter.get(), 5) == out
            assert client.malformed.dropped == 3 and not client.died.is_set()

    asyncio.run(scenario())


def test_a_cancelled_id_stays_taken_until_the_scheduler_lets_go_of_it():
    """The caller of a request left: the client sends Abort and drops the request's
    outputs; its id is free again only after the scheduler's final output for it, so a
    new request reusing the id never receives the old one's tokens or abort notice."""
    from scheduler.messages import AbortRequest, AddRequest, RequestOutput, SamplingParams, to_scheduler_decoder

    def output(rid, tokens, finish=None):
        return StepOutput([RequestOutput(rid, tokens, 3, 0, len(tokens), finish)])

    async def scenario():
        client = SchedulerClient(EngineConfig(model="unused"))
        client.ready.set()  # alive, without a scheduler process
        reader = asyncio.create_task(client._read_loop())
        inbox = client.ctx.socket(zmq.PULL)
        inbox.connect(client.inbox_addr)
        outbox = client.ctx.socket(zmq.PUSH)
        outbox.connect(client.outbox_addr)
        try:
            old = asyncio.Queue()
            client.submit(AddRequest("cz", [1, 2, 3], SamplingParams(max_new_tokens=50)), old)
            assert isinstance(to_scheduler_decoder.decode(await inbox.recv()), AddRequest)
            assert client.num_open == 1
            client.cancel("cz", "client cancelled")
            abort = to_scheduler_decoder.decode(await inbox.recv())
            assert isinstance(abort, AbortRequest) and abort.request_id == "cz"
            assert client.has_request("cz") and client.num_in_flight == 1  # not reusable yet
            assert client.num_open == 0  # but no longer an active request (GetServerInfo)

            await outbox.send(from_scheduler_encoder.encode(output("cz", [7])))  # a step already under way
            await outbox.send(from_scheduler_encoder.encode(output("cz", [8], "abort")))
            await _wait_for(lambda: not client.has_request("cz"))
            assert old.empty() and client.num_in_flight == 0

            new = asyncio.Queue()
            client.submit(AddRequest("cz", [1, 2, 3], SamplingParams(max_new_tokens=2)), new)
            await outbox.send(from_scheduler_encoder.encode(output("cz", [5, 6], "length")))
            got = await asyncio.wait_for(new.get(), 5)
            assert got.new_token_ids == [5, 6] and got.finish_reason == "length"

            # Finished, its caller not done reading (an n > 1 call, a slow stream): an Abort
            # finds nothing to abort, and a cancel frees the id at once (no final output comes).
            assert client.abort("cz") is False
            client.cancel("cz", "client cancelled")
            assert not client.has_request("cz")
        finally:
            inbox.close(0)
            outbox.close(0)
            reader.cancel()
            client._reader = reader
            await client.stop()

    asyncio.run(scenario())


def test_readiness_turns_not_serving_after_30_s_in_one_step():
    """As SGLang's readiness: a scheduler that has pushed nothing for 30 s while requests
    are pending is stuck; one step running that long is that case (steps are pending work)."""
    import time
    from types import SimpleNamespace

    from servicer.health import NOT_SERVING, SERVICE_NAME, SERVING, HealthState
    from servicer.scheduler_client import Liveness

    ready, died = asyncio.Event(), asyncio.Event()
    ready.set()
    liveness = Liveness(last_message=time.monotonic())
    client = SimpleNamespace(
        died=died, ready=ready, liveness=liveness, heartbeat_age=lambda: time.monotonic() - liveness.last_message
    )
    health = HealthState(client)
    health.warmed_up = True
    liveness.in_step_s = 29.0
    assert health.status(SERVICE_NAME) == SERVING
    liveness.in_step_s = 31.0
    assert health.status(SERVICE_NAME) == NOT_SERVING and "stuck in one step for 31 s" in health.problem()
