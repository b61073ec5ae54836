"""Prometheus metrics (``--enable-metrics``) under SGLang's names and meanings, so the dashboards
and autoscalers written for SGLang read them unchanged.

Two kinds, both served by the servicer process from one registry (prometheus_client's HTTP
server, on a thread of its own: a scrape never waits for the event loop or a step):
- the scheduler's state (running and queued requests, KV usage, cache hit rate, throughput,
  speculative acceptance): read at scrape time from each replica's latest load, which the
  scheduler pushes with every step and heartbeat;
- per-request counters and histograms (tokens, requests by finish reason, time to first
  token, inter-token latency, end-to-end latency, queue time): observed as each request's
  outputs reach the servicer (:class:`RequestMetrics`).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

# SGLang's default buckets (srt/metrics/collector.py).
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
               0.4, 0.6, 0.8, 1, 2, 4, 6, 8]  # fmt: skip
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
QUEUE_BUCKETS = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]  # fmt: skip


class ServingMetrics:
    """The registry, its request metrics (bound to the model's name once: no label lookup per
    token), and the collector of the scheduler's gauges."""

    def __init__(self, model_name: str, client, engine_type: str = "unified"):
        self.registry = CollectorRegistry()

        def counter(name: str, text: str):
            return Counter(f"sglang:{name}", text, ["model_name"], registry=self.registry).labels(model_name)

        def histogram(name: str, text: str, buckets: list[float]):
            metric = Histogram(f"sglang:{name}", text, ["model_name"], buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("num_requests", "Number of requests processed.")
        self.aborted = counter("num_aborted_requests", "Number of requests aborted.")
        finished = Counter(
            "sglang:num_finished_requests",
            "Number of requests finished, by finish reason (stop, length, abort, error).",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )
        self.finished = {reason: finished.labels(model_name, reason) for reason in ("stop", "length", "abort", "error")}
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS
        )
        self.queue_time = histogram("queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_BUCKETS)
        self.registry.register(SchedulerGauges(model_name, client, engine_type))
        self.server = None

    def serve(self, host: str, port: int) -> None:
        """Start the /metrics HTTP endpoint (a thread of its own)."""
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, self.server.server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def request(self) -> RequestMetrics:
        return RequestMetrics(self)


class RequestMetrics:
    """One scheduler request's observations, from its submission to its final output."""

    __slots__ = ("metrics", "started", "last", "tokens", "done")

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics
        self.started = time.perf_counter()
        self.last: float | None = None  # when its last tokens arrived
        self.tokens = 0
        self.done = False

    def on_output(self, out) -> None:
        m = self.metrics
        now = time.perf_counter()
        if out.queue_time_s is not None:
            m.queue_time.observe(out.queue_time_s)
        new = out.num_output_tokens - self.tokens
        if new > 0 or out.embedding is not None:
            if self.last is None:
                m.ttft.observe(now - self.started)
            elif new > 0:  # (SGLang's: each of a batch's tokens counts its share of the interval)
                share = (now - self.last) / new
                for _ in range(new):
                    m.itl.observe(share)
            self.last, self.tokens = now, out.num_output_tokens
        if out.finish_reason is not None:
            self.finish(out.finish_reason if out.error is None else "error", out)

    def finish(self, reason: str, out=None) -> None:
        """The request ended (``out``: its final output; None when its caller left first)."""
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.requests.inc()
        m.finished[reason].inc()
        if reason == "abort":
            m.aborted.inc()
        m.e2e.observe(time.perf_counter() - self.started)
        if out is not None:
            m.prompt_tokens.inc(out.num_prompt_tokens)
            m.generation_tokens.inc(out.num_output_tokens)
            if out.num_cached_tokens:
                m.cached_tokens.inc(out.num_cached_tokens)


class SchedulerGauges:
    """The scheduler's state at scrape time, one sample per replica, from its latest load."""

    GAUGES = (
        ("num_running_reqs", "The number of running requests.", lambda s: s.num_running),
        ("num_queue_reqs", "The number of requests in the waiting queue.", lambda s: s.num_waiting),
        ("num_used_tokens", "The number of used tokens.", lambda s: s.num_used_tokens),
        ("max_total_num_tokens", "Maximum total number of tokens in the KV cache.", lambda s: s.max_total_num_tokens),
        ("token_usage", "The token usage.", lambda s: s.token_usage),
        ("gen_throughput", "The generation throughput (token/s).", lambda s: s.gen_throughput),
        ("cache_hit_rate", "The prefix cache hit rate.", lambda s: s.cache_hit_rate),
        (
            "spec_accept_rate",
            "The ratio of accepted to verified speculative draft tokens.",
            lambda s: s.num_accepted_drafts / s.num_draft_tokens if s.num_draft_tokens else 0.0,
        ),
    )

    def __init__(self, model_name: str, client, engine_type: str):
        self.model_name = model_name
        self.client = client
        self.engine_type = engine_type

    def collect(self):
        ranks = self.client.ranks
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank"] + (["dp_rank"] if len(ranks) > 1 else [])
        loads = [rank.liveness.load for rank in ranks]  # (each replaced whole: a consistent snapshot)
        for name, help_text, value in self.GAUGES:
            family = GaugeMetricFamily(f"sglang:{name}", help_text, labels=labels)
            for r, load in enumerate(loads):
                values = [self.model_name, self.engine_type, "0", "0"] + ([str(r)] if len(ranks) > 1 else [])
                family.add_metric(values, value(load))
            yield family
