"""The scheduler process: receives requests over ZMQ, steps the engine, streams outputs back.

Started by the servicer as ``python -m scheduler.process --config JSON --inbox ADDR --outbox ADDR``.
Sends EngineReady once the model is loaded and a StepOutput after every step that
produced something. A separate thread sends a Heartbeat every ``HEARTBEAT_S``, also
while a long step runs, carrying the load (as of the running step's start, else the
latest) and how long the current step has been running: the servicer tells a busy
scheduler from a dead or stuck one.

Only the servicer stops this process (a "shutdown" control call, or SIGKILL): a
SIGTERM/SIGINT sent to the whole process group is ignored while the parent lives, so
the servicer can drain in-flight requests first.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

import msgspec
import zmq

from kernels import envs, owned_cache

from .config import EngineConfig
from .logs import LOG_FORMATS, configure_logging
from .messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineDead,
    EngineReady,
    Heartbeat,
    KvEvents,
    MalformedFrames,
    ModelInfo,
    RequestOutput,
    StepOutput,
    from_scheduler_encoder,
    to_scheduler_decoder,
)
from .profiler import StepProfiler, TraceWrite

logger = logging.getLogger("scheduler")
OUTBOX_LINGER_MS = 1000  # how long the last outputs may take to leave at exit
HEARTBEAT_S = 0.25
STATS_LOG_S = 10.0  # while busy, one line of load every this often (as SGLang's decode log)


def _tie_lifetime_to_parent() -> None:
    """Die with the servicer (no orphan holding memory); ignore group-wide TERM/INT."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.getppid()

    def on_signal(signum, frame):
        if os.getppid() != parent:  # the servicer is gone: nobody will drain us
            owned_cache.remove_private_dirs()
            os._exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def model_info(engine) -> ModelInfo:
    """What the servicer needs to know of the model and the resolved limits (resolve.py)."""
    from .model_source import prepare_tokenizer_dir

    runner, rc = engine.runner, engine.config
    mc = runner.model_config
    return ModelInfo(
        model_path=runner.model_path,
        tokenizer_path=prepare_tokenizer_dir(runner.model_path),
        served_model_name=rc.served_model_name,
        max_context_length=rc.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=list(mc.eos_token_ids),
        bos_token_id=mc.bos_token_id if mc.bos_token_id is not None else 0,
        pad_token_id=mc.pad_token_id if mc.pad_token_id is not None else 0,
        model_type=mc.model_type,
        architectures=[mc.architecture],
        max_total_num_tokens=engine.kv.capacity_tokens,
        max_running_requests=rc.max_running_requests,
        max_queued_requests=rc.max_queued_requests,
        max_logprobs=rc.max_logprobs,
        max_num_batched_tokens=rc.max_num_batched_tokens,
        long_prefill_token_threshold=rc.long_prefill_token_threshold,
        block_size=rc.block_size,
        enable_prefix_caching=rc.enable_prefix_caching,
        device=str(rc.device),
        dtype=str(rc.dtype).removeprefix("torch."),
        weight_gb=runner.weight_bytes / 2**30,
        kv_cache_gb=runner.kv_cache_bytes / 2**30,
        tp_size=rc.tp_size,
        **_disaggregation_info(rc.disaggregation),
        is_generation=rc.pooling is None,
        labels=list(rc.pooling.labels) if rc.pooling is not None else [],
    )


def _disaggregation_info(settings) -> dict:
    if settings is None:
        return {}
    return {
        "disaggregation_mode": settings.mode,
        "disaggregation_bootstrap_port": settings.bootstrap_port,
        "disaggregation_transfer_backend": settings.transfer_backend,
    }


class HeartbeatThread(threading.Thread):
    """Proves the process is alive even while a long step holds the main loop."""

    def __init__(self, ctx: zmq.Context, outbox_addr: str, loop: SchedulerLoop):
        super().__init__(name="heartbeat", daemon=True)
        self.loop = loop
        self.socket = ctx.socket(zmq.PUSH)  # zmq sockets are not thread-safe: its own
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(outbox_addr)
        self.stopping = threading.Event()

    def current(self) -> Heartbeat:
        load, started = self.loop.beat  # one read: see SchedulerLoop.beat
        return Heartbeat(load, time.monotonic() - started if started else 0.0)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.socket.send(from_scheduler_encoder.encode(self.current()))
            self.stopping.wait(HEARTBEAT_S)
        self.socket.close()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop beating and close the socket; whether the thread ended within ``timeout``."""
        self.stopping.set()
        self.join(timeout)
        return not self.is_alive()


class SchedulerLoop:
    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, profiler: StepProfiler | None = None):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        # What the heartbeat reports: (load, monotonic start of the running step or 0), one
        # tuple replaced whole. The engine publishes a step's final load before the step
        # returns; paired apart, a heartbeat could send that load with the step's running
        # time, and the servicer would keep it (same version as the step's output).
        self.beat = (engine.load, 0.0)
        self.running = True
        self.profiler = profiler if profiler is not None else StepProfiler(str(engine.runner.device))  # profiling off
        self.last_stats_log = time.monotonic()
        self.malformed = MalformedFrames(logger, "scheduler inbox")
        self.polled: set[zmq.Socket] = set()  # PD sockets in the poller

    def send(self, msg) -> None:
        self.outbox.send(from_scheduler_encoder.encode(msg), copy=False)

    def run(self) -> None:
        while self.running:
            # (PD legs waiting for their partner need no step: their sockets wake the poll)
            timeout_ms = 0 if self.engine.has_step_work() else int(HEARTBEAT_S * 1000)
            if self.poller.poll(timeout_ms):
                self._drain_inbox()
            if self.engine.disagg is not None:
                self._poll_disagg()
            self._answer_written_trace()
            self.engine.runner.check_ranks()  # (a lost rank ends the scheduler, as its own death would)
            if self.engine.has_step_work():
                self.beat = (self.engine.load, time.monotonic())
                out = self.engine.step()
                self.beat = (out.load, 0.0)
                if out.outputs:
                    self.send(out)
                self._publish_kv_events()
                self.profiler.on_step()
                if time.monotonic() - self.last_stats_log >= STATS_LOG_S:
                    self._log_stats()
            else:
                self.engine.refresh_load()  # idle: the load's throughput window empties out
                self.beat = (self.engine.load, 0.0)

    def _poll_disagg(self) -> None:
        """PD: the partner daemons' messages and time limits (sockets opened meanwhile join the poll)."""
        outputs = self.engine.poll_disagg()
        if outputs:
            self.send(StepOutput(outputs=outputs, load=self.engine.load))
        sockets = set(self.engine.disagg.sockets)
        for sock in sockets - self.polled:
            self.poller.register(sock, zmq.POLLIN)
        for sock in self.polled - sockets:
            self.poller.unregister(sock)
        self.polled = sockets

    def _log_stats(self) -> None:
        self.last_stats_log = time.monotonic()
        load = self.engine.load
        logger.info(
            "running %d, waiting %d, KV %d/%d tokens (%.0f%%), generating %.1f tok/s, prefix-cache hits %.0f%%",
            load.num_running,
            load.num_waiting,
            load.num_used_tokens,
            load.max_total_num_tokens,
            100 * load.token_usage,
            load.gen_throughput,
            100 * load.cache_hit_rate,
        )

    def _answer_written_trace(self) -> None:
        """Answer the StopProfile calls waiting for a trace once it is written."""
        write = self.profiler.take_finished_write()
        if write is not None:
            ok, message = write.result
            for call_id in write.waiters:
                self.send(ControlReply(call_id, ok, message=message))

    def _publish_kv_events(self) -> None:
        """Send the prefix cache's changes since the last call as one KvEvents batch."""
        events = self.engine.pool.take_events()
        if events:
            self.send(KvEvents(events, time.time()))

    def _drain_inbox(self) -> None:
        refused: list[RequestOutput] = []
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = to_scheduler_decoder.decode(raw.buffer)
            except msgspec.DecodeError as e:  # (a ValidationError too: msgpack of another shape)
                self.malformed.drop(raw.buffer, e)
                continue
            if isinstance(msg, AddRequest):
                err = self._add(msg)
                if err is not None:
                    refused.append(err)
            elif isinstance(msg, AbortRequest):
                self.engine.abort(msg.request_id, (msg.error_code, msg.reason) if msg.error_code else None)
            elif isinstance(msg, ControlRequest):
                reply = self._control(msg)
                self._publish_kv_events()  # e.g. a flush's "cleared": streamed before the reply
                if reply is not None:
                    self.send(reply)
        # Aborts finish requests outside a step: report them (and refusals) right away.
        finished = self.engine.finished_outputs()
        self.engine.refresh_load()
        self.beat = (self.engine.load, 0.0)
        if refused or finished:
            self.send(StepOutput(outputs=refused + finished, load=self.engine.load))

    def _add(self, msg: AddRequest) -> RequestOutput | None:
        from .scheduler import AdmissionError

        try:
            self.engine.add_request(msg)
            return None
        except AdmissionError as e:
            return RequestOutput.refused(msg, e.code, str(e))

    def _control(self, msg: ControlRequest) -> ControlReply | None:
        """The reply, or None for a StopProfile answered when its trace is written."""
        try:
            if msg.method == "stats":
                return ControlReply(msg.call_id, True, self.engine.stats_dict())
            if msg.method == "flush_cache":
                ok, message = self.engine.flush_cache()
                return ControlReply(msg.call_id, ok, message=message)
            if msg.method in ("start_profile", "stop_profile"):
                self._answer_written_trace()  # a trace written meanwhile is the last one, not pending
            if msg.method == "start_profile":
                ok, message = self.profiler.start(**msg.args)
                return ControlReply(msg.call_id, ok, message=message)
            if msg.method == "stop_profile":
                result = self.profiler.stop()
                if isinstance(result, TraceWrite):
                    result.waiters.append(msg.call_id)
                    return None
                ok, message = result
                return ControlReply(msg.call_id, ok, message=message)
            if msg.method == "shutdown":
                self.running = False
                return ControlReply(msg.call_id, True, message="scheduler stopping")
            return ControlReply(msg.call_id, False, message=f"unknown control method {msg.method!r}")
        except Exception:  # an admin call must never take the scheduler down
            logger.exception("control call %s failed", msg.method)
            return ControlReply(msg.call_id, False, message=f"{msg.method} failed; the daemon's log has the details")


def _preload_tokenizer(model: str) -> None:
    from .model_source import resolve_model
    from .stop_strings import load_tokenizer

    try:
        path = resolve_model(model)
    except OSError:  # (the engine's start-up reports a model it cannot find)
        return
    try:
        load_tokenizer(path)
    except Exception as e:  # noqa: BLE001  (a stop request will be refused with the reason)
        logger.warning("no tokenizer for stop strings: %s", e)


def _close_sockets(ctx: zmq.Context, inbox: zmq.Socket, outbox: zmq.Socket, heartbeat: HeartbeatThread | None):
    """Close every socket, delivering what the outbox still queues (up to its linger): the
    process then ends with os._exit, which would drop it."""
    heartbeat_closed = heartbeat is None or heartbeat.stop()
    inbox.close(0)
    outbox.close()
    if heartbeat_closed:
        ctx.term()
    else:  # term() would wait forever for the heartbeat's socket, but delivers the outbox meanwhile
        terminating = threading.Thread(target=ctx.term, daemon=True)
        terminating.start()
        terminating.join(OUTBOX_LINGER_MS / 1000)


def _exit_without_teardown(code: int) -> NoReturn:
    """End the process once its logs are flushed, skipping the interpreter's teardown: there
    Triton's nanobind bindings report dozens of "leaked" objects, and Python would join grammar
    compiles still running on worker threads (they cannot be interrupted)."""
    owned_cache.remove_private_dirs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Serve until the servicer's shutdown call; the exit code (sockets already closed)."""
    parser = argparse.ArgumentParser(description="scheduler process (started by the servicer)")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--inbox", required=True, help="ZMQ address to PULL requests from")
    parser.add_argument("--outbox", required=True, help="ZMQ address to PUSH outputs to")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format, "scheduler")
    _tie_lifetime_to_parent()
    config = msgspec.json.decode(args.config, type=EngineConfig)

    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a full pipe (or drop)
    ctx.setsockopt(zmq.RCVHWM, 0)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, OUTBOX_LINGER_MS)
    outbox.connect(args.outbox)

    def send(msg) -> None:
        outbox.send(from_scheduler_encoder.encode(msg))

    # Stop strings need the tokenizer on the step loop. Loading it takes seconds (mostly
    # importing transformers): done beside the model's load and finished before the daemon
    # reports ready, rather than stall the first stop request or slow the first requests.
    tokenizer = threading.Thread(target=_preload_tokenizer, args=(config.model,), name="tokenizer", daemon=True)
    tokenizer.start()
    try:
        from .engine import Engine

        engine = Engine(config)
        tokenizer.join()
        # What start-up made (model, kernels, tokenizer, imports) is kept for good: out of the cyclic
        # GC's sight, as vLLM does, a full collection no longer scans it (a pause of several
        # steps whenever one came due; docs/performance.md).
        gc.collect()
        gc.freeze()
        send(EngineReady(model_info(engine)))
    except Exception as e:
        # A bad model, flag or device is the operator's to fix: the message says it all.
        expected = isinstance(e, (ValueError, NotImplementedError, OSError))
        logger.error("scheduler start-up failed: %s%s", e, "" if expected else "\n" + traceback.format_exc())
        # (the line above names the cause for the operator; clients may see this reason)
        send(EngineDead(f"the scheduler could not start ({type(e).__name__}); the daemon's log says why"))
        _close_sockets(ctx, inbox, outbox, None)
        return 1
    logger.info("scheduler ready (pid %d)", os.getpid())
    heartbeat = None
    try:
        profile_dir = config.profile_dir or envs.profile_dir()
        if profile_dir:
            logger.info(
                "StartProfile may write traces under %s (the newest %d kept)", profile_dir, config.profile_max_traces
            )
        profiler = StepProfiler(str(engine.runner.device), profile_dir, config.profile_max_traces)
        loop = SchedulerLoop(engine, inbox, outbox, profiler)
        heartbeat = HeartbeatThread(ctx, args.outbox, loop)
        heartbeat.start()
        loop.run()
    except Exception as e:
        logger.error("scheduler loop crashed: %s\n%s", e, traceback.format_exc())
        # (clients see this reason: the exception's text stays in the log)
        send(EngineDead(f"the scheduler crashed ({type(e).__name__}); the daemon's log has the traceback"))
        _close_sockets(ctx, inbox, outbox, heartbeat)
        return 1
    writing = loop.profiler.writing
    if writing is not None and not writing.wait(timeout=2.0):
        logger.warning("stopping before the profile trace %s was written", writing.path)
        writing.discard()
    if engine.disagg is not None:
        engine.disagg.close()
    engine.runner.close()
    _close_sockets(ctx, inbox, outbox, heartbeat)
    logger.info("scheduler stopped")
    return 0


if __name__ == "__main__":
    _exit_without_teardown(main())
