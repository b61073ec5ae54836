"""grpc.health.v1: SERVING only while the scheduler is alive, warmed up and stepping.

The status is computed from the scheduler's liveness signal on every Check (no cached
flag that could go stale); Watch re-evaluates it periodically and streams every change
until the client leaves.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE_NAME = "sglang.grpc.scheduler.SglangScheduler"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthState:
    """What the daemon knows about its own health; read by both health surfaces."""

    # stuck_after: SGLang's readiness turns NOT_SERVING after 30 s without output while
    # requests are pending; a step (always pending work) running that long is that case.
    def __init__(self, client, max_heartbeat_age: float = 2.0, stuck_after: float = 30.0):
        self.client = client
        self.max_heartbeat_age = max_heartbeat_age
        self.stuck_after = stuck_after
        self.warmed_up = False
        self.shutting_down = False

    def problem(self) -> str | None:
        """Why the daemon cannot serve right now, or None when it can."""
        if self.shutting_down:
            return "the server is shutting down"
        if self.client.died.is_set():
            return f"the scheduler is gone: {self.client.dead_reason}"
        if not self.client.ready.is_set():
            return "the model is still loading"
        if not self.warmed_up:
            return "warm-up generation has not completed"
        age = self.client.heartbeat_age()
        if age > self.max_heartbeat_age:
            return f"no heartbeat from the scheduler for {age:.1f} s"
        in_step = self.client.liveness.in_step_s
        if in_step > self.stuck_after:
            return f"the scheduler has been stuck in one step for {in_step:.0f} s"
        return None

    def status(self, service: str) -> int:
        if service not in ("", SERVICE_NAME):
            return SERVICE_UNKNOWN
        return SERVING if self.problem() is None else NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, state: HealthState, watch_interval: float = 0.2):
        self.state = state
        self.watch_interval = watch_interval

    async def Check(self, request, context):
        status = self.state.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        last = None
        while True:
            status = self.state.status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self.watch_interval)

    async def List(self, request, context):
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=self.state.status(name)) for name in ("", SERVICE_NAME)
            }
        )
