"""Logging filters for the daemon's third-party noise (no gRPC stubs imported here)."""

from __future__ import annotations

import logging


class ClientGoneFilter(logging.Filter):
    """grpc.aio logs a write to a stream whose client has gone (disconnected while flow
    control held the write) as an ERROR with a traceback, yet nothing failed on our side:
    the handler's cleanup has run and the request's KV is freed. One debug line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("ExecuteBatchError raised in core by servicer method"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger("servicer").isEnabledFor(logging.DEBUG)
        return True
