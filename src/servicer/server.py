"""Daemon lifecycle: bind the gRPC server, start the scheduler process, warm up,
serve, and shut down cleanly (SIGTERM drains, a dead scheduler exits non-zero)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from scheduler.config import EngineConfig
from scheduler.messages import AddRequest, SamplingParams

from .error_guard import InternalErrorGuard
from .generated import sglang_scheduler_pb2 as pb
from .generated import sglang_scheduler_pb2_grpc as pb_grpc
from .health import HealthServicer, HealthState
from .replicas import Replicas
from .scheduler_client import SchedulerUnavailable
from .scheduler_service import SglangSchedulerService
from .tls import TLSConfigError, exposure_warning, load_server_credentials

logger = logging.getLogger("servicer")

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 2**20),  # e.g. a long output's logprobs in one GenerateComplete
    # grpc.aio parses requests on the event loop: a huge one stalls every call, health probes
    # included, for seconds. 16 MiB is millions of prompt tokens.
    ("grpc.max_receive_message_length", 16 * 2**20),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", True),
    ("grpc.so_reuseport", 0),  # a second daemon on our port must fail, not split the traffic
    # Calls that reached gRPC but not yet the event loop: past 1000 (its default) gRPC
    # cancels a growing random share of new ones, with no status of ours (seen in a burst:
    # docs/performance.md). The scheduler's queue is what bounds waiting work
    # (--max-queued-requests answers RESOURCE_EXHAUSTED, which the router retries).
    ("grpc.server.max_pending_requests", 1 << 16),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
    # Streams per HTTP/2 connection (gRPC's default: no limit). The router multiplexes all
    # its calls to us over a few connections, so this sits far above what one carries in
    # use (running and queued Generates, one KV event stream, a health Watch); a client
    # past it waits for a free stream rather than failing.
    ("grpc.max_concurrent_streams", 8192),
]
WARMUP_PROMPT = [123, 456, 789, 234, 567, 890, 345]


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    log_format: str = "text"  # "text" | "json" (one object per line)
    enable_metrics: bool = False  # Prometheus /metrics on metrics_host:metrics_port
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 30001
    enable_trace: bool = False  # OpenTelemetry spans exported over OTLP/gRPC
    otlp_traces_endpoint: str = "localhost:4317"
    shutdown_grace_s: float = 30.0
    watchdog_timeout_s: float = 300.0  # 0: never kill a scheduler that stopped making progress
    ssl_certfile: str | None = None  # PEM certificate chain: TLS on the whole port
    ssl_keyfile: str | None = None  # its PEM private key
    ssl_ca_certs: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)


class StartupError(Exception):
    pass


async def warm_up(client: Replicas, timeout: float = 120.0) -> None:
    """One real request through the whole engine (a greedy generation, or an embedding model's
    vector; on every replica) before we say SERVING."""
    await asyncio.gather(*(_warm_up_rank(client, rank, timeout) for rank in range(client.size)))


async def _warm_up_rank(client: Replicas, rank: int, timeout: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    rid = f"warmup-{rank}-{time.time_ns()}"
    context = client.model_info.max_context_length
    # (fits whatever --max-model-len says, and any vocabulary)
    prompt = [t % client.model_info.vocab_size for t in WARMUP_PROMPT[: max(1, context - 2)]]
    if client.model_info.is_generation:
        max_new = max(1, min(8, context - len(prompt)))
        request = AddRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    else:  # an embedding model answers Embed only
        request = AddRequest(rid, prompt, SamplingParams(max_new_tokens=0), embed=True)
    client.submit(request, queue, rank=rank)

    async def finished() -> None:
        while True:
            out = await queue.get()
            if isinstance(out, Exception):
                raise StartupError(f"warm-up failed: {out}")
            if out.error:
                raise StartupError(f"warm-up refused: {out.error}")
            if out.finish_reason:
                return

    try:
        await asyncio.wait_for(finished(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        raise StartupError(f"warm-up generation did not finish in {timeout:.0f} s") from None
    finally:
        client.release(rid)  # (after a time-out the daemon does not start: nothing to drain)


def _build_server(service: SglangSchedulerService, health_servicer: HealthServicer) -> grpc.aio.Server:
    """The SGLang scheduler service, grpc.health.v1 and reflection on one server."""
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[InternalErrorGuard()])
    pb_grpc.add_SglangSchedulerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    return server


def _bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> str | None:
    """Listen on host:port, with TLS given ``credentials``; the address, or None (logged)
    when it cannot."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 literal
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        bound = 0
    if bound == 0:
        logger.error("cannot listen on %s:%d (address in use, or not an address of this machine)", host, port)
        return None
    return f"{host}:{bound}"


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT (exit 0) or scheduler failure (exit 1)."""
    try:
        credentials = load_server_credentials(
            server_config.ssl_certfile, server_config.ssl_keyfile, server_config.ssl_ca_certs
        )
    except TLSConfigError as e:
        logger.error("start-up failed: %s", e)
        return 1
    client = Replicas(engine_config, server_config.log_level, server_config.log_format)
    health = HealthState(client)
    try:
        metrics, tracing = _observability(engine_config, server_config, client)
    except (OSError, ImportError) as e:
        logger.error("start-up failed: %s", e)
        await client.stop()
        return 1
    service = SglangSchedulerService(client, health, metrics, tracing)

    server = _build_server(service, HealthServicer(health))
    address = _bind(server, server_config.host, server_config.port, credentials)
    if address is None:
        await client.stop()
        return 1
    await server.start()
    security = "plaintext" if credentials is None else "mTLS" if server_config.ssl_ca_certs else "TLS"
    logger.info(
        "gRPC server listening on %s, %s (NOT_SERVING until the model is loaded and warmed up)", address, security
    )
    warning = exposure_warning(server_config.host, credentials is not None, bool(server_config.ssl_ca_certs))
    if warning:
        logger.warning("%s", warning)

    stop_requested, abort_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop_requested.is_set():  # a second Ctrl-C: no more waiting for requests
            logger.warning("second stop signal: aborting in-flight requests now")
            abort_now.set()
        stop_requested.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    try:
        startup = asyncio.create_task(_start_engine(client))
        stop_wait = asyncio.create_task(stop_requested.wait())
        await asyncio.wait([startup, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            startup.cancel()
            logger.info("stop requested during start-up")
            return 0
        stop_wait.cancel()
        try:
            startup.result()
        except (StartupError, SchedulerUnavailable) as e:
            logger.error("start-up failed: %s", e)
            return 1
        health.warmed_up = True
        # Start-up's long-lived objects out of the cyclic GC's sight: a full collection would
        # scan them all on the event loop whenever one came due.
        gc.collect()
        gc.freeze()
        logger.info("SERVING %s on %s", client.model_info.model_path, address)

        died = asyncio.create_task(client.died.wait())
        stop_wait = asyncio.create_task(stop_requested.wait())
        watchdog = asyncio.create_task(_watchdog(client, server_config.watchdog_timeout_s))
        await asyncio.wait([died, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        watchdog.cancel()
        if not client.failed:
            await _drain(client, health, server_config.shutdown_grace_s, abort_now)
        if client.failed:  # before or while draining
            logger.error("scheduler failed: %s; exiting so a supervisor can restart us", client.failure_reason)
            return 1
        return 0
    finally:
        health.shutting_down = True
        await server.stop(grace=1.0)
        await client.stop()
        if metrics is not None:
            metrics.close()
        if tracing is not None:
            tracing.shutdown()
        logger.info("stopped")


def _observability(engine_config: EngineConfig, server_config: ServerConfig, client: Replicas):
    """(ServingMetrics or None, Tracing or None) as the flags ask; the metrics endpoint serves
    from now on (its gauges read zero until the model is loaded)."""
    metrics = tracing = None
    if server_config.enable_metrics:
        from .metrics import ServingMetrics

        pd = engine_config.disaggregation
        metrics = ServingMetrics(
            engine_config.served_model_name or engine_config.model, client, pd.mode if pd is not None else "unified"
        )
        try:
            metrics.serve(server_config.metrics_host, server_config.metrics_port)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {server_config.metrics_host}:{server_config.metrics_port}: {e}"
            ) from None
    if server_config.enable_trace:
        from .tracing import Tracing

        try:
            tracing = Tracing(server_config.otlp_traces_endpoint)
        except ImportError as e:
            if metrics is not None:  # (start-up fails: no endpoint left serving)
                metrics.close()
            raise ImportError(f"--enable-trace needs OpenTelemetry: pip install 'servicer[trace]' ({e})") from None
    return metrics, tracing


async def _watchdog(client: Replicas, timeout_s: float) -> None:
    """Kill a scheduler that has made no progress for ``timeout_s`` (one step that never
    ends, or no heartbeat at all: a stopped or wedged process). Health already says
    NOT_SERVING by then, but its requests would hang until their clients give up; dead, it
    fails them with UNAVAILABLE and the daemon exits 1 for its supervisor to restart, as
    SGLang's --watchdog-timeout does. 0: off."""
    while timeout_s > 0 and client.alive:
        await asyncio.sleep(min(1.0, timeout_s / 4))
        stalled = max(client.heartbeat_age(), client.liveness.in_step_s)
        if stalled > timeout_s and client.alive:
            client.kill(f"the scheduler made no progress for {stalled:.0f} s (--watchdog-timeout {timeout_s:g})")
            return


async def _start_engine(client: Replicas) -> None:
    await client.start()
    await warm_up(client)


async def _drain(client: Replicas, health: HealthState, grace_s: float, abort_now: asyncio.Event) -> None:
    """Stop admitting, let in-flight requests finish up to the grace period (or a second
    stop signal), abort the rest."""
    health.shutting_down = True
    logger.info("draining %d in-flight request(s), up to %.0f s", client.num_in_flight, grace_s)
    deadline = time.monotonic() + grace_s
    while client.num_in_flight and time.monotonic() < deadline and client.alive and not abort_now.is_set():
        await asyncio.sleep(0.05)
    if client.num_in_flight:
        logger.warning("aborting %d request(s) still in flight", client.num_in_flight)
    for rid in client.in_flight_ids():
        # UNAVAILABLE, not a truncated answer that looks complete: the router retries it elsewhere
        client.abort(rid, "the server is shutting down; retry on another worker", error_code="UNAVAILABLE")
    # Give aborted calls a moment to end with their status.
    deadline = time.monotonic() + 2.0
    while client.num_in_flight and time.monotonic() < deadline and client.alive:
        await asyncio.sleep(0.05)
