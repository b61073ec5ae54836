"""servicer.health: when the daemon says NOT_SERVING and why, with a stand-in scheduler
client (a clock the test moves), and the health service's Check and Watch on top of it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2

from servicer.health import NOT_SERVING, SERVICE_NAME, SERVICE_UNKNOWN, SERVING, HealthServicer, HealthState
from servicer.scheduler_client import Liveness

SERVICES = ("", SERVICE_NAME)


class Client(SimpleNamespace):
    """What HealthState reads of a SchedulerClient; `age` is the heartbeat age it reports."""

    def __init__(self):
        super().__init__(
            died=asyncio.Event(),
            ready=asyncio.Event(),
            dead_reason=None,
            age=0.1,
            liveness=Liveness(last_message=time.monotonic()),
        )
        self.ready.set()

    def heartbeat_age(self) -> float:
        return self.age


def serving_state(**kw) -> tuple[HealthState, Client]:
    client = Client()
    health = HealthState(client, **kw)
    health.warmed_up = True
    assert health.problem() is None and all(health.status(s) == SERVING for s in SERVICES)
    return health, client


def assert_not_serving(health: HealthState, reason: str) -> None:
    assert all(health.status(s) == NOT_SERVING for s in SERVICES)
    assert reason in health.problem(), health.problem()


def test_a_missing_heartbeat_turns_not_serving_after_max_age_and_back():
    health, client = serving_state(max_heartbeat_age=2.0)
    client.age = 1.9
    assert health.status(SERVICE_NAME) == SERVING
    client.age = 2.5
    assert_not_serving(health, "no heartbeat from the scheduler for 2.5 s")
    client.age = 0.1  # a heartbeat again (e.g. after a long GC pause): serving again
    assert health.status(SERVICE_NAME) == SERVING


def test_not_serving_while_the_model_loads_and_before_warm_up():
    client = Client()
    client.ready.clear()
    health = HealthState(client)
    health.warmed_up = True
    assert_not_serving(health, "the model is still loading")
    client.ready.set()
    health.warmed_up = False
    assert_not_serving(health, "warm-up generation has not completed")
    health.warmed_up = True
    assert health.problem() is None


def test_a_dead_scheduler_and_shutdown_are_not_serving_for_good():
    health, client = serving_state()
    client.dead_reason = "exit code -9"
    client.died.set()
    assert_not_serving(health, "the scheduler is gone: exit code -9")
    health.shutting_down = True  # the reason a client sees first
    assert_not_serving(health, "the server is shutting down")


def test_unknown_service():
    health, _ = serving_state()
    assert health.status("no.such.Service") == SERVICE_UNKNOWN


class Context:
    """The part of a grpc.aio ServicerContext the health servicer uses."""

    async def abort(self, code, details):
        raise grpc.RpcError(code, details)


def test_check_answers_the_state_and_refuses_an_unknown_service():
    health, client = serving_state()
    servicer = HealthServicer(health)

    async def check(service):
        return (await servicer.Check(health_pb2.HealthCheckRequest(service=service), Context())).status

    assert asyncio.run(check(SERVICE_NAME)) == SERVING
    client.age = 60.0
    assert asyncio.run(check("")) == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        asyncio.run(check("no.such.Service"))
    assert e.value.args[0] == grpc.StatusCode.NOT_FOUND


def test_watch_sends_the_status_then_each_change_only():
    health, client = serving_state(recheck_interval=0.01)
    servicer = HealthServicer(health)

    async def scenario():
        stream = servicer.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), Context())
        got = [(await anext(stream)).status]
        client.age = 60.0  # heartbeats stop
        got.append((await asyncio.wait_for(anext(stream), 10)).status)
        client.age = 0.1
        got.append((await asyncio.wait_for(anext(stream), 10)).status)
        with pytest.raises(asyncio.TimeoutError):  # no change: nothing more is sent
            await asyncio.wait_for(anext(stream), 0.2)
        return got

    assert asyncio.run(scenario()) == [SERVING, NOT_SERVING, SERVING]
