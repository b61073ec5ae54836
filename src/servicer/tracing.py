"""OpenTelemetry tracing (``--enable-trace``): the W3C ``traceparent`` a caller (the smg router
with ``--enable-trace``) puts in a call's gRPC metadata becomes the parent of the daemon's span
for that call, exported over OTLP/gRPC to ``--otlp-traces-endpoint``.

A Generate or Embed gets a ``request`` span (its request id, token counts and finish reason)
with three children laid end to end: ``queue_wait`` (until the scheduler first ran it, as the
scheduler measured it), ``prefill`` (until its first token or vector reached the servicer) and
``decode`` (until its last). They are recorded when the call ends, with the times it had, so a
request costs nothing between its outputs. Admin calls get one span each. Without the flag
nothing here is imported or called.
"""

from __future__ import annotations

import contextlib
import logging
import time

logger = logging.getLogger(__name__)


class Tracing:
    def __init__(self, endpoint: str, service_name: str = "servicer"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        url = endpoint if "://" in endpoint else f"http://{endpoint}"  # (HOST:PORT, as the router takes it)
        exporter = OTLPSpanExporter(endpoint=url, insecure=not url.startswith("https://"))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("servicer")
        self.propagator = TraceContextTextMapPropagator()
        logger.info("tracing: spans exported over OTLP/gRPC to %s", endpoint)

    def parent(self, context):
        """The trace context the call's metadata carries (an empty one without ``traceparent``)."""
        carrier = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        return self.propagator.extract(carrier)

    def request(self, context, name: str, request_id: str) -> RequestTrace:
        return RequestTrace(self, self.parent(context), name, request_id)

    @contextlib.contextmanager
    def span(self, context, name: str, **attributes):
        """A span around an admin call."""
        from opentelemetry.trace import SpanKind

        with self.tracer.start_as_current_span(
            name, context=self.parent(context), kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield span

    def shutdown(self) -> None:
        self.provider.shutdown()  # (flushes what is batched)


class RequestTrace:
    """One Generate or Embed call: its times as its outputs arrive, its spans when it ends."""

    __slots__ = ("tracing", "parent", "name", "attributes", "started_ns", "queue_s", "first_ns", "error", "ended")

    def __init__(self, tracing: Tracing, parent, name: str, request_id: str):
        self.tracing = tracing
        self.parent = parent
        self.name = name
        self.attributes: dict = {"request_id": request_id}
        self.started_ns = time.time_ns()
        self.queue_s: float | None = None
        self.first_ns: int | None = None  # when its first token (or vector) arrived
        self.error: str | None = None
        self.ended = False

    def on_output(self, out) -> None:
        if out.queue_time_s is not None and self.queue_s is None:
            self.queue_s = out.queue_time_s
        if self.first_ns is None and (out.new_token_ids or out.embedding is not None):
            self.first_ns = time.time_ns()
        if out.error is not None:
            self.error = out.error
        if out.finish_reason is not None and "finish_reason" not in self.attributes:
            self.attributes.update(
                prompt_tokens=out.num_prompt_tokens,
                cached_tokens=out.num_cached_tokens,
                completion_tokens=out.num_output_tokens,
                finish_reason=out.finish_reason if out.error is None else "error",
            )

    def end(self) -> None:
        """Record the spans (once; a call whose request did not finish is an error span)."""
        if self.ended:
            return
        self.ended = True
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        now = time.time_ns()
        tracer = self.tracing.tracer
        span = tracer.start_span(
            self.name, context=self.parent, kind=SpanKind.SERVER, start_time=self.started_ns, attributes=self.attributes
        )
        if self.error is not None or "finish_reason" not in self.attributes:
            span.set_status(Status(StatusCode.ERROR, self.error or "the call ended before its request finished"))
        inside = trace.set_span_in_context(span)
        queued_until = self.started_ns + int((self.queue_s or 0.0) * 1e9)
        first = self.first_ns if self.first_ns is not None else now
        for name, start, stop in (
            ("queue_wait", self.started_ns, min(queued_until, first)),
            ("prefill", min(queued_until, first), first),
            ("decode", first, now),
        ):
            if name != "decode" or self.first_ns is not None:
                tracer.start_span(name, context=inside, start_time=start).end(end_time=stop)
        span.end(end_time=now)
