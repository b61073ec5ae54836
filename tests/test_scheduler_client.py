"""The servicer's scheduler client reading the scheduler's outbox over a real ZMQ socket
(no scheduler process: a PUSH socket plays its part)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from scheduler.config import EngineConfig
from scheduler.messages import Heartbeat, LoadSnapshot, StepOutput, from_scheduler_encoder
from servicer.scheduler_client import SchedulerClient


async def _wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_trailing_heartbeat_never_brings_back_an_older_load():
    """The heartbeat thread may read the load before a step ends and send it after the
    step's output (its own socket): GetLoads must keep showing the step's newer load."""

    async def scenario():
        client = SchedulerClient(EngineConfig(model="unused"))
        reader = asyncio.create_task(client._read_loop())
        scheduler = client.ctx.socket(zmq.PUSH)
        scheduler.connect(client.outbox_addr)
        try:
            running = LoadSnapshot(version=7, num_running=1)
            idle = LoadSnapshot(version=8, num_running=0)
            await scheduler.send(from_scheduler_encoder.encode(StepOutput([], step=3, batch_size=1, num_tokens=1, load=idle)))
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(running, 0.0)))
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(LoadSnapshot(version=9, num_waiting=2), 0.0)))
            await _wait_for(lambda: client.liveness.load.version == 9)
            assert client.liveness.load.num_running == 0 and client.liveness.load.num_waiting == 2

            # ... and an equal version (heartbeats between steps) is taken
            await scheduler.send(from_scheduler_encoder.encode(Heartbeat(LoadSnapshot(version=9, num_waiting=0), 0.0)))
            await _wait_for(lambda: client.liveness.load.num_waiting == 0)
        finally:
            scheduler.close(0)
            reader.cancel()
            client._reader = reader
            await client.stop()

    asyncio.run(scenario())
