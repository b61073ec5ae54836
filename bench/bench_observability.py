"""What watching the daemon costs: W64 through the daemon over gRPC with Prometheus metrics
and OpenTelemetry tracing on (``--enable-metrics --enable-trace``, spans exported to an OTLP
collector in this process, scraped once a second as Prometheus would) against both off, rounds
alternated in one run.

    python bench/bench_observability.py [--rounds 2] [--requests 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import urllib.request
from concurrent import futures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import workloads  # noqa: E402
from bench_pd import free_port  # noqa: E402
from bench_w64 import daemon_defaults, run_daemon  # noqa: E402


def collector() -> tuple[object, int, list[int]]:
    """An OTLP/gRPC trace sink: (server, port, [spans received])."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = [0]

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received[0] += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, received


def scraper(url: str, stop: threading.Event, scrapes: list[int]) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while not stop.wait(1.0):
        try:
            with opener.open(url, timeout=5) as r:
                r.read()
            scrapes[0] += 1
        except OSError:  # (before the daemon serves, and after it stops)
            pass


def run(work, observed: bool, model: str, trace_port: int) -> dict:
    metrics_port = free_port()
    args = daemon_defaults(model, os.cpu_count() or 2, [])
    stop, scrapes = threading.Event(), [0]
    if observed:
        args.daemon_args = ["--enable-metrics", "--metrics-port", str(metrics_port), "--enable-trace"]
        args.daemon_args += ["--otlp-traces-endpoint", f"127.0.0.1:{trace_port}"]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        threading.Thread(target=scraper, args=(url, stop, scrapes), daemon=True).start()
    try:
        result = run_daemon(work, args)
    finally:
        stop.set()
    result["name"] = "metrics and tracing on" if observed else "metrics and tracing off"
    result["scrapes"] = scrapes[0]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    work = workloads.w64(args.requests)
    server, port, spans = collector()
    runs = {"off": [], "on": []}
    try:
        for _ in range(args.rounds):
            for key in ("off", "on"):
                runs[key].append(run(work, key == "on", args.model, port))
    finally:
        server.stop(1.0)
    print(f"\nW64 ({args.requests} requests) through the daemon over gRPC, {args.model}, {os.cpu_count()} cores")
    print(f"{'':26} {'tok/s per round':>30} {'median':>8}")
    median = {}
    for key, rs in runs.items():
        rates = [r["tok_per_s"] for r in rs]
        median[key] = statistics.median(rates)
        print(f"{rs[0]['name']:26} {' / '.join(f'{x:.1f}' for x in rates):>30} {median[key]:8.1f}")
    print(f"on / off: {median['on'] / median['off']:.3f}x; {spans[0]} spans exported, "
          f"{sum(r['scrapes'] for r in runs['on'])} scrapes")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "w64", "runs": runs, "spans": spans[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
