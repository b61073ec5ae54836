"""grpc.health.v1: SERVING only while the scheduler is alive, warmed up and stepping.

The status is computed from the scheduler's liveness signal on every Check (no cached
flag that could go stale). Watch streams wait for a change: :class:`HealthState` runs one
timer task while any are open that recomputes the status every ``recheck_interval`` (the
heartbeat's age moves without any event) and wakes them all only when it changed; setting
``warmed_up`` or ``shutting_down`` wakes them at once. At most ``MAX_WATCHES`` Watch
streams at once; more are refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "sglang.grpc.scheduler.SglangScheduler"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
MAX_WATCHES = 1024  # concurrent Watch streams (load balancers and probes hold one each)


class HealthState:
    """What the daemon knows about its own health; read by both health surfaces."""

    # stuck_after: SGLang's readiness turns NOT_SERVING after 30 s without output while
    # requests are pending; a step (always pending work) running that long is that case.
    def __init__(
        self, client, max_heartbeat_age: float = 2.0, stuck_after: float = 30.0, recheck_interval: float = 0.2
    ):
        self.client = client
        self.max_heartbeat_age = max_heartbeat_age
        self.stuck_after = stuck_after
        self.recheck_interval = recheck_interval
        self._warmed_up = False
        self._shutting_down = False
        # What watchers see: the serving flag as last computed, and the event set (then
        # replaced) when it changes.
        self._serving: bool | None = None
        self._changed = asyncio.Event()
        self.watchers = 0
        self._timer: asyncio.Task | None = None

    @property
    def warmed_up(self) -> bool:
        return self._warmed_up

    @warmed_up.setter
    def warmed_up(self, value: bool) -> None:
        self._warmed_up = value
        self.recheck()

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @shutting_down.setter
    def shutting_down(self, value: bool) -> None:
        self._shutting_down = value
        self.recheck()

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
        disagg = self.client.liveness.load.disagg
        if disagg is not None and disagg.bootstrap_problem is not None:  # decode daemons cannot reach us
            return disagg.bootstrap_problem
        return None

    def status(self, service: str) -> int:
        return _status_of(service, self.problem() is None)

    def recheck(self) -> None:
        """Recompute the status; wake every watcher if it changed."""
        serving = self.problem() is None
        if serving != self._serving:
            self._serving = serving
            self._changed.set()
            self._changed = asyncio.Event()

    async def watch(self, service: str):
        """The status of ``service`` now, then each change of it, until the caller stops."""
        self.watchers += 1
        try:
            self.recheck()
            if self._timer is None or self._timer.done():
                self._timer = asyncio.get_running_loop().create_task(self._recheck_while_watched())
            last = None
            while True:
                changed = self._changed
                status = _status_of(service, self._serving)
                if status == last:
                    await changed.wait()
                    continue
                yield status
                last = status
        finally:
            self.watchers -= 1

    async def _recheck_while_watched(self) -> None:
        while self.watchers:
            await asyncio.sleep(self.recheck_interval)
            self.recheck()


def _status_of(service: str, serving: bool) -> int:
    if service not in ("", SERVICE_NAME):
        return SERVICE_UNKNOWN
    return SERVING if serving else NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, state: HealthState, max_watches: int = MAX_WATCHES):
        self.state = state
        self.max_watches = max_watches

    async def Check(self, request, context):
        status = self.state.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        if self.state.watchers >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this server already has {self.state.watchers} health Watch streams "
                f"(at most {self.max_watches}); use Check, or retry later",
            )
        logger.debug("health Watch stream opened (%d open)", self.state.watchers + 1)
        try:
            async with contextlib.aclosing(self.state.watch(request.service)) as statuses:
                async for status in statuses:
                    yield health_pb2.HealthCheckResponse(status=status)
        finally:
            logger.debug("health Watch stream closed (%d open)", self.state.watchers)

    async def List(self, request, context):
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=self.state.status(name)) for name in ("", SERVICE_NAME)
            }
        )
