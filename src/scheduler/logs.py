"""Log set-up shared by the daemon's processes: the text format people read, or (``--log-format
json``) one JSON object per line for log pipelines, with the request id of the call being
served where there is one (:data:`request_id`, set by the servicer's handlers).

Kept free of torch imports: the servicer process imports this module too.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

LOG_FORMATS = ("text", "json")
# The request a servicer handler is serving (asyncio tasks each see their own value).
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, process (name and pid), logger,
    message, request_id when a request is being served, and the traceback when there is one."""

    def __init__(self, process_name: str):
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "process": self.process_name,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id.get()
        if rid is not None:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str, process_name: str) -> None:
    """The root logger's level and format for this process (``process_name``: e.g. "servicer")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r} (have {', '.join(LOG_FORMATS)})")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {process_name}[%(process)d]: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
