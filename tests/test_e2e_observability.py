"""What an operator watches, on the real daemon behind the real router: Prometheus metrics
(scraped and parsed with prometheus_client's parser), OpenTelemetry traces (the daemon's and
the router's spans, received by a test OTLP collector: a gRPC TraceService from
opentelemetry-proto) and JSON logs."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from helpers import Daemon, Router, free_ports, scheduler_stub, wait_until
from test_e2e_grpc import make_request, one_complete

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector keeping every span with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                service = attrs.get("service.name", "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of(self, service: str) -> list:
        with self.lock:
            return [span for s, span in self.spans if s == service]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(daemon, router, collector, metrics URL): the daemon with metrics, tracing and JSON logs,
    the router tracing to the same collector."""
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    collector_port, metrics_port = free_ports(2)
    server.add_insecure_port(f"127.0.0.1:{collector_port}")
    server.start()
    logs = tmp_path_factory.mktemp("observability")
    endpoint = f"127.0.0.1:{collector_port}"
    args = ["--enable-metrics", "--metrics-port", str(metrics_port), "--enable-trace", "--otlp-traces-endpoint"]
    args += [endpoint, "--log-format", "json"]
    try:
        with Daemon(extra_args=args, log_dir=logs) as daemon:
            # (the router exports only the spans its log level lets through: info has them)
            tracing = ["--enable-trace", "--otlp-traces-endpoint", endpoint]
            with Router(daemon.port, log_dir=logs, extra_args=tracing, log_level="info") as r:
                yield daemon, r, collector, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        server.stop(0)


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every sample of the endpoint, by name and labels (``name{a="x"}``), parsed by prometheus_client."""
    with OPENER.open(url, timeout=timeout) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def test_counters_and_histograms_move_by_what_was_sent(stack):
    daemon, _, _, url = stack
    before = scrape(url)
    prompts = [[5, 17, 300, 42], list(range(100, 140)), [7] * 9]
    new = 5
    with scheduler_stub(daemon.address) as stub:
        for prompt in prompts:
            one_complete(stub, make_request(prompt, max_new_tokens=new, ignore_eos=True))
    after = scrape(url)
    moved = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    n = len(prompts)
    assert moved("sglang:num_requests_total{}") == n
    assert moved('sglang:num_finished_requests_total{finish_reason="length"}') == n
    assert moved("sglang:prompt_tokens_total{}") == sum(map(len, prompts))
    assert moved("sglang:generation_tokens_total{}") == n * new
    assert moved("sglang:time_to_first_token_seconds_count{}") == n
    assert moved("sglang:e2e_request_latency_seconds_count{}") == n
    assert moved("sglang:queue_time_seconds_count{}") == n
    assert moved("sglang:inter_token_latency_seconds_count{}") == n * (new - 1)  # (one token a step)
    gauges = 'engine_type="unified",pp_rank="0",tp_rank="0"'
    assert after[f"sglang:num_running_reqs{{{gauges}}}"] == 0
    assert after[f"sglang:max_total_num_tokens{{{gauges}}}"] > 0


def test_the_endpoint_answers_while_the_scheduler_prefills(stack):
    """Scrapes read the scheduler's last pushed load: none waits for the long step to end."""
    daemon, _, _, url = stack
    gauge = 'sglang:num_running_reqs{engine_type="unified",pp_rank="0",tp_rank="0"}'
    with scheduler_stub(daemon.address) as stub:
        call = stub.Generate(make_request(list(range(100, 6100)), max_new_tokens=1), timeout=300)
        wait_until(lambda: scrape(url)[gauge] == 1, 60, "the long prefill to be running")
        slowest = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            scrape(url, timeout=2.0)
            slowest = max(slowest, time.perf_counter() - t0)
        list(call)
    assert slowest < 1.0, f"a scrape took {slowest:.2f} s during the prefill"


def test_the_daemons_spans_are_children_of_the_routers(stack):
    _, router, collector, _ = stack
    r = router.post(
        "/v1/chat/completions",
        {"model": router.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
    )
    assert r.status == 200, r.text
    # (the other tests' calls came without a traceparent: their spans have no parent)
    request = wait_until(
        lambda: next((s for s in collector.of("servicer") if s.name == "Generate" and s.parent_span_id), None),
        30,
        "the daemon's span of the routed call",
    )
    ours = {s.name: s for s in collector.of("servicer") if s.parent_span_id == request.span_id}
    # (each side exports in its own batches: the router's span may come later)
    parent = wait_until(
        lambda: next((s for s in collector.of("smg") if s.span_id == request.parent_span_id), None),
        30,
        "the router's span that is the request span's parent",
    )
    assert parent.trace_id == request.trace_id and parent.name == "grpc_execute"
    for child in ("queue_wait", "prefill", "decode"):
        assert ours[child].trace_id == request.trace_id and ours[child].parent_span_id == request.span_id
    attributes = {a.key: a.value for a in request.attributes}
    assert attributes["completion_tokens"].int_value == 4
    assert attributes["finish_reason"].string_value == "length"


def test_logs_are_one_json_object_a_line(stack):
    daemon = stack[0]
    lines = [line for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
    assert len(lines) > 5
    entries = [json.loads(line) for line in lines]
    assert {"time", "level", "process", "pid", "logger", "message"} <= entries[0].keys()
    assert {e["process"] for e in entries} >= {"servicer", "scheduler"}


def test_json_lines_name_the_request_being_served():
    from scheduler import logs

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("servicer"))
    logger = logging.getLogger("servicer.test_json_lines")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        token = logs.request_id.set("req-42")
        logger.warning("inside")
        logs.request_id.reset(token)
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["request_id"] == "req-42" and inside["message"] == "inside" and inside["process"] == "servicer"
    assert "request_id" not in outside
