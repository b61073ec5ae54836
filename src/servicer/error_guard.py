"""A gRPC server interceptor that turns an unexpected exception in any handler into INTERNAL
with a generic message, the traceback going to the daemon's log: grpc.aio would otherwise
send the exception's type and text to the client (paths, internal state)."""

from __future__ import annotations

import inspect
import logging

import grpc

logger = logging.getLogger("servicer")

INTERNAL_MESSAGE = "internal error (the daemon's log has the details)"


class InternalErrorGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=_guard(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_guard(handler.unary_stream, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=_guard(handler.stream_unary, method))
        return handler._replace(stream_stream=_guard(handler.stream_stream, method))


def _guard(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _internal_error(context, method, e)

        return guarded_stream

    async def guarded(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _internal_error(context, method, e)

    return guarded


async def _internal_error(context, method: str, error: Exception) -> None:
    logger.error("%s failed", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
