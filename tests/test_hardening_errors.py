"""A bug in a handler reaches the client as INTERNAL with a generic message, never as the
exception's type and text (grpc.aio's default), and the traceback goes to the log."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicer.error_guard import INTERNAL_MESSAGE, InternalErrorGuard

SECRET = "/home/daemon/.ssh/id_ed25519"


class FailingHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        raise KeyError(SECRET)

    async def Watch(self, request, context):
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        raise FileNotFoundError(2, "No such file or directory", SECRET)

    async def List(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")


async def call_each(guarded: bool) -> dict[str, tuple]:
    server = grpc.aio.server(interceptors=[InternalErrorGuard()] if guarded else [])
    health_pb2_grpc.add_HealthServicer_to_server(FailingHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    results = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name, call in [
                ("Check", lambda: stub.Check(health_pb2.HealthCheckRequest())),
                ("List", lambda: stub.List(health_pb2.HealthListRequest())),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await call()
                results[name] = (ei.value.code(), ei.value.details())
            statuses = []
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for response in stub.Watch(health_pb2.HealthCheckRequest()):
                    statuses.append(response.status)
            results["Watch"] = (ei.value.code(), ei.value.details(), statuses)
    finally:
        await server.stop(0)
    return results


def test_grpc_aio_alone_would_send_the_exception_text():
    results = asyncio.run(call_each(guarded=False))
    assert SECRET in results["Check"][1] and SECRET in results["Watch"][1]


def test_unexpected_exceptions_become_a_generic_internal_error(caplog):
    with caplog.at_level(logging.ERROR, logger="servicer"):
        results = asyncio.run(call_each(guarded=True))
    assert results["Check"] == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    assert results["Watch"] == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, [health_pb2.HealthCheckResponse.SERVING])
    assert results["List"] == (grpc.StatusCode.UNIMPLEMENTED, "not here"), "a handler's own status passes through"
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "/grpc.health.v1.Health/Check failed" in logged and "/grpc.health.v1.Health/Watch failed" in logged
