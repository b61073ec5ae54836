"""The SglangScheduler gRPC service, as the smg router expects it
(see shared/router-contract.md): Generate, Abort and the info/health RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import json
import logging
import math
import time

import grpc
import msgspec
from google.protobuf import struct_pb2, timestamp_pb2

from scheduler import logs
from scheduler.messages import CONSTRAINT_FAILED, ModelInfo

from .generate_responses import GenerateResponses
from .generated import common_pb2
from .generated import sglang_scheduler_pb2 as pb
from .generated import sglang_scheduler_pb2_grpc as pb_grpc
from .health import HealthState
from .kv_events import KvEventHub, disaggregation_metrics, merged_rank_streams
from .replicas import Replicas
from .request_conversion import MAX_SEED, InvalidRequest, check_request_id, to_add_request, to_embed_request
from .scheduler_client import SchedulerUnavailable
from .tokenizer_bundle import UnshippableFile, build_bundle, chunks

logger = logging.getLogger(__name__)
try:
    VERSION = importlib.metadata.version("servicer")
except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
    VERSION = "0+unknown"
FLUSH_ANSWER_S = 10.0  # the scheduler answers a flush between steps
MAX_PEER_RANKS = 1024  # connections whose DP rank is remembered (the newest)
# An Abort may overtake its Generate (the router aborts when the client drops, once): ids
# aborted while unknown are remembered this long (and at most this many), and a Generate
# with one ends at once instead of running to its length limit for nobody.
EARLY_ABORT_TTL_S = 5.0  # (the race is milliseconds wide; an id reused later must still run)
MAX_EARLY_ABORTS = 4096


def _struct(values: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({k: v for k, v in values.items() if v is not None})
    return s


class SglangSchedulerService(pb_grpc.SglangSchedulerServicer):
    def __init__(self, client: Replicas, health: HealthState, metrics=None, tracing=None):
        """What the engine runs with comes from the scheduler (``client.model_info``, resolved
        there), never from the command line's EngineConfig. ``metrics`` (metrics.ServingMetrics)
        and ``tracing`` (tracing.Tracing): None when off, and then nothing is observed."""
        self.client = client
        self.health = health
        self.metrics = metrics
        self.tracing = tracing
        self.start_time = time.time()
        self.last_receive_time = 0.0
        self.children: dict[str, list[str]] = {}  # parent request id -> scheduler request ids
        self.early_aborts: dict[str, float] = {}  # id aborted before its Generate came -> when (monotonic)
        self._bundle: asyncio.Task | None = None  # (zip bytes, sha256), built once
        # Numbered from the first batch, subscribers or not; one hub per DP rank (each numbers
        # its own batches, as the router's per-rank cursors expect).
        self.rank_hubs = [KvEventHub() for _ in range(client.size)]
        self.kv_events = self.rank_hubs[0]
        self.peer_ranks: dict[str, int] = {}  # connection -> the DP rank its requests named
        client.kv_event_listener = self._publish_kv_events
        client.cached = [hub.live for hub in self.rank_hubs]  # (where a request's prefix is cached)

    @property
    def info(self) -> ModelInfo:
        """Set once the model is loaded, which _require_ready checks before every use."""
        return self.client.model_info

    async def _require_ready(self, context) -> None:
        if self.health.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self.client.alive:
            reason = self.client.dead_reason or "the model is still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {reason}")

    # -- Generate ----------------------------------------------------------------------
    async def _convert(self, request, context, embed: bool):
        """The call's scheduler message, validated at the edge once the engine is up (whether
        the model serves this kind of call is the scheduler's admission's to say)."""
        await self._require_ready(context)
        self.last_receive_time = time.time()
        try:
            return (to_embed_request if embed else to_add_request)(request, self.info)
        except InvalidRequest as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))

    async def Generate(self, request, context):
        base = await self._convert(request, context, embed=False)
        rid = request.request_id
        aborted_at = self.early_aborts.pop(rid, None)
        if aborted_at is not None and time.monotonic() - aborted_at < EARLY_ABORT_TTL_S:
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted before it arrived")
        ids = await self._sequence_ids(request, context)
        rank = await self._dp_rank(request, base, context)
        logs.request_id.set(rid)
        observers = self._observers(context, "Generate", rid, ids)
        responses = GenerateResponses(request, ids)
        self.children[rid] = ids
        queue: asyncio.Queue = asyncio.Queue()
        started = time.monotonic()
        logger.debug(
            "request %s: %d prompt tokens, n=%d, max_new_tokens=%s, stream=%s, DP rank %d%s",
            rid,
            len(base.input_ids),
            len(ids),
            base.sampling.max_new_tokens,
            request.stream,
            rank,
            " (asked)" if request.HasField("data_parallel_rank") else "",
        )
        try:
            self._submit(base, ids, queue, rank)
            if base.disagg is not None:
                # A PD leg may produce nothing for seconds (the prefill until its KV is sent, the
                # decode until it arrives): the headers tell the router the leg was dispatched,
                # which it otherwise takes for a stuck worker after a few seconds.
                await context.send_initial_metadata(())
            while not responses.done:
                out = await self._next_output(queue, context, observers)
                for response in responses.on_output(out):
                    yield response
                if out.finish_reason is not None:
                    logger.debug(
                        "request %s: %s after %d tokens (%d cached prompt tokens) in %.2f s",
                        out.request_id,
                        out.finish_reason,
                        out.num_output_tokens,
                        out.num_cached_tokens,
                        time.monotonic() - started,
                    )
        finally:
            # Every sequence's id is let go of: a finished one's at once (the client knows
            # which final outputs arrived, read or not); one still running (client gone, or
            # an error) is aborted, its KV freed now, its id kept until the scheduler lets go.
            for cid in ids:
                self.client.cancel(cid, "client cancelled")
            self.children.pop(rid, None)
            if observers is not None:
                observers.end()

    async def _next_output(self, queue: asyncio.Queue, context, observers):
        """A call's next output from the scheduler, observed; the call ends here with the
        status of a scheduler gone or a request ended in error."""
        out = await queue.get()
        if isinstance(out, Exception):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {out}")
        if observers is not None:
            observers.on_output(out)
        if out.error is not None:
            await _abort_with_error(context, out.error_code, out.error)
        return out

    def _observers(self, context, name: str, rid: str, ids: list[str]):
        """What watches a call's outputs for metrics and traces; None when both are off."""
        if self.metrics is None and self.tracing is None:
            return None
        return CallObservers(
            {cid: self.metrics.request() for cid in ids} if self.metrics is not None else None,
            self.tracing.request(context, name, rid) if self.tracing is not None else None,
        )

    def _admin_span(self, context, name: str):
        return self.tracing.span(context, name) if self.tracing is not None else contextlib.nullcontext()

    async def _sequence_ids(self, request, context) -> list[str]:
        """The scheduler's ids of the call's n sequences: n > 1 names them "<id>-n<i>". No
        id of this call may clash with one in flight, whether a caller's id or a
        sequence's (a clash would cross their outputs)."""
        rid = request.request_id
        n = max(request.sampling_params.n, 1)
        ids = [rid] if n == 1 else [f"{rid}-n{i}" for i in range(n)]
        if any(x in self.children or self.client.has_request(x) for x in (rid, *ids)):
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight (or still being cancelled)"
            )
        return ids

    async def _dp_rank(self, request, base, context) -> int:
        """The replica the call runs on: the one ``data_parallel_rank`` names, else the one
        caching most of the prompt, then the least busy (all n sequences on one, sharing the
        prompt's KV)."""
        wanted = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        if wanted is not None and not 0 <= wanted < self.client.size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"data_parallel_rank {wanted} does not exist (dp_size {self.client.size})",
            )
        if wanted is not None and self.client.size > 1:
            self._learn_peer_rank(context.peer(), wanted)
        return self.client.pick_rank(wanted, base.input_ids, base.cache_salt)

    def _learn_peer_rank(self, peer: str, rank: int) -> None:
        """The router with --dp-aware keeps one connection per rank worker, and names the rank
        in that worker's requests (but rank 0, which proto3 leaves off the wire). Its KV event
        stream on that connection then gets that rank's batches only: it pools whatever a
        stream carries into the one worker's index."""
        self.peer_ranks.pop(peer, None)
        self.peer_ranks[peer] = rank
        if len(self.peer_ranks) > MAX_PEER_RANKS:
            del self.peer_ranks[next(iter(self.peer_ranks))]

    def _submit(self, base, ids: list[str], queue: asyncio.Queue, rank: int) -> None:
        for i, cid in enumerate(ids):
            child = msgspec.structs.replace(base, request_id=cid)
            if i and base.sampling.seed is not None:  # n seeded samples must differ, reproducibly
                child.sampling = msgspec.structs.replace(base.sampling, seed=(base.sampling.seed + i) % MAX_SEED)
            self.client.submit(child, queue, rank)

    async def Abort(self, request, context):
        try:  # (an early abort is remembered: no id may cost more than a Generate's would)
            check_request_id(request.request_id)
        except InvalidRequest as e:  # Abort never fails (the router's contract): no such request
            return pb.AbortResponse(success=False, message=str(e))
        ids = self.children.get(request.request_id, [request.request_id])
        found = [cid for cid in ids if self.client.abort(cid, request.reason)]
        if found:
            return pb.AbortResponse(success=True, message=f"aborted {len(found)} sequence(s)")
        if request.request_id not in self.children:  # not running (nor finishing): may still come
            self._remember_early_abort(request.request_id)
        return pb.AbortResponse(success=False, message=f"request {request.request_id!r} not found")

    def _remember_early_abort(self, rid: str) -> None:
        now = time.monotonic()
        while self.early_aborts:  # oldest first: drop the expired, and the oldest beyond the cap
            old, at = next(iter(self.early_aborts.items()))
            if now - at < EARLY_ABORT_TTL_S and len(self.early_aborts) < MAX_EARLY_ABORTS:
                break
            del self.early_aborts[old]
        self.early_aborts[rid] = now

    # -- health and info ---------------------------------------------------------------
    async def HealthCheck(self, request, context):
        if not self.client.ready.is_set() and not self.client.died.is_set():
            # Refuse rather than answer "unhealthy": the router would register a worker
            # without metadata. It retries until we can serve.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        problem = self.health.problem()
        return pb.HealthCheckResponse(healthy=problem is None, message=problem or "ok")

    async def GetModelInfo(self, request, context):
        await self._require_ready(context)
        i = self.info
        return pb.GetModelInfoResponse(
            model_path=i.model_path,
            tokenizer_path=i.tokenizer_path,
            is_generation=i.is_generation,
            served_model_name=i.served_model_name,
            max_context_length=i.max_context_length,
            vocab_size=i.vocab_size,
            supports_vision=False,
            model_type=i.model_type,
            eos_token_ids=i.eos_token_ids,
            pad_token_id=i.pad_token_id,
            bos_token_id=i.bos_token_id,
            max_req_input_len=min(i.max_context_length, i.max_total_num_tokens) - 1,
            architectures=i.architectures,
            # a classifier's labels, as HF's config.json writes id2label (the router names its answers so)
            id2label_json=json.dumps({str(k): label for k, label in enumerate(i.labels)}) if i.labels else "",
            num_labels=len(i.labels),
        )

    def server_args(self) -> dict:
        i = self.info
        return {
            "model_path": i.model_path,
            "served_model_name": i.served_model_name,
            "tokenizer_path": i.tokenizer_path,
            "tp_size": i.tp_size,
            "dp_size": self.client.size,
            "pp_size": 1,
            "context_length": i.max_context_length,
            "max_total_tokens": i.max_total_num_tokens,
            "max_running_requests": i.max_running_requests,
            "max_queued_requests": i.max_queued_requests,
            "max_num_batched_tokens": i.max_num_batched_tokens,
            "long_prefill_token_threshold": i.long_prefill_token_threshold,
            "page_size": i.block_size,
            "device": i.device,
            "dtype": i.dtype,
            "is_embedding": not i.is_generation,
            "vocab_size": i.vocab_size,
            "disaggregation_mode": i.disaggregation_mode,
            "disaggregation_transfer_backend": i.disaggregation_transfer_backend,
            "disaggregation_bootstrap_port": i.disaggregation_bootstrap_port or None,
            "kv_cache_dtype": i.dtype,  # the KV is stored in the model's dtype
            "enable_prefix_caching": i.enable_prefix_caching,
        }

    async def GetServerInfo(self, request, context):
        await self._require_ready(context)
        reply, failure = await self._call_scheduler("stats", timeout=2.0)
        stats = reply.result if reply is not None else {"error": f"no scheduler stats: {failure}"}
        start = timestamp_pb2.Timestamp()
        start.FromSeconds(int(self.start_time))
        return pb.GetServerInfoResponse(
            server_args=_struct(self.server_args()),
            scheduler_info=_struct(stats),
            active_requests=self.client.num_open,
            is_paused=False,
            last_receive_timestamp=self.last_receive_time,
            uptime_seconds=time.time() - self.start_time,
            sglang_version=VERSION,
            server_type="grpc",
            start_time=start,
            max_total_num_tokens=self.info.max_total_num_tokens,
        )

    async def GetLoads(self, request, context):
        """Answered from the scheduler's latest heartbeat: never waits for a step."""
        await self._require_ready(context)
        size = self.client.size
        if request.HasField("dp_rank") and not 0 <= request.dp_rank < size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {request.dp_rank} does not exist (dp_size {size})"
            )
        include = set(request.include) or {"all"}
        ranks = [request.dp_rank] if request.HasField("dp_rank") else range(size)
        loads = [self._load(rank, include) for rank in ranks]
        n = len(loads)
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version=VERSION,
            dp_rank_count=size,
            loads=loads,
            aggregate=pb.AggregateMetrics(
                total_running_reqs=sum(x.num_running_reqs for x in loads),
                total_waiting_reqs=sum(x.num_waiting_reqs for x in loads),
                total_reqs=sum(x.num_total_reqs for x in loads),
                avg_token_usage=sum(x.token_usage for x in loads) / n,
                avg_throughput=sum(x.gen_throughput for x in loads) / n,
                avg_utilization=sum(x.utilization for x in loads) / n,
            ),
        )

    def _load(self, rank: int, include: set[str]) -> pb.SchedulerLoad:
        """One replica's load, from its latest heartbeat."""
        s = self.client.ranks[rank].liveness.load
        wanted = lambda section: "all" in include or section in include  # noqa: E731
        total = s.max_total_num_tokens
        max_running = self.info.max_running_requests
        load = pb.SchedulerLoad(
            dp_rank=rank,
            num_running_reqs=s.num_running,
            num_waiting_reqs=s.num_waiting,
            num_total_reqs=s.num_running + s.num_waiting,
            num_used_tokens=s.num_used_tokens,
            max_total_num_tokens=total,
            token_usage=s.token_usage,
            gen_throughput=s.gen_throughput,
            cache_hit_rate=s.cache_hit_rate,
            utilization=s.num_running / max_running if max_running else 0.0,
            max_running_requests=max_running,
            num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
        )
        if wanted("memory"):
            load.memory.CopyFrom(
                pb.MemoryMetrics(weight_gb=self.info.weight_gb, kv_cache_gb=self.info.kv_cache_gb, token_capacity=total)
            )
        if wanted("queues"):
            load.queues.CopyFrom(pb.QueueMetrics(waiting=s.num_waiting))
        if wanted("disagg"):
            load.disaggregation.CopyFrom(pb.DisaggregationMetrics(**disaggregation_metrics(s.disagg)))
        return load

    # -- admin -------------------------------------------------------------------------
    async def FlushCache(self, request, context):
        """timeout_s 0: flush now or fail if busy; > 0: wait up to that long for idle."""
        await self._require_ready(context)
        if math.isnan(request.timeout_s):  # (+inf: wait as long as the caller's deadline allows)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be a number, got {request.timeout_s}"
            )
        deadline = time.monotonic() + max(request.timeout_s, 0)
        with self._admin_span(context, "FlushCache"):
            return await self._flush(deadline)

    async def _flush(self, deadline: float):
        while True:
            reply, failure = await self._call_scheduler("flush_cache", timeout=FLUSH_ANSWER_S)
            if reply is None:
                return common_pb2.FlushCacheResponse(success=False, message=failure)
            if reply.ok or time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(success=reply.ok, message=reply.message)
            await asyncio.sleep(0.05)

    async def _call_scheduler(self, method: str, timeout: float, **args):
        """(the scheduler's ControlReply to an admin call, "") or (None, why none came)."""
        try:
            return await self.client.call(method, timeout=timeout, **args), ""
        except SchedulerUnavailable as e:
            return None, f"scheduler unavailable: {e}"
        except (TimeoutError, asyncio.TimeoutError):  # answered between steps: one ran that long
            return None, f"the scheduler is busy: no answer within {timeout:g} s"

    async def _unimplemented(self, context, what: str):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this server does not support {what}")

    # -- Embed -------------------------------------------------------------------------
    async def Embed(self, request, context):
        """An embedding model's vector for one tokenized text (a classifier's: its logits),
        computed in the continuous batch as a prefill-only request."""
        msg = await self._convert(request, context, embed=True)
        rid = msg.request_id
        if rid in self.children or self.client.has_request(rid):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight")
        wanted = request.data_parallel_rank or None  # (a plain int32: 0 is also "unset")
        if wanted is not None and not 0 <= wanted < self.client.size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"data_parallel_rank {wanted} does not exist (dp_size {self.client.size})",
            )
        queue: asyncio.Queue = asyncio.Queue()
        self.children[rid] = [rid]  # (Abort finds it)
        logs.request_id.set(rid)
        observers = self._observers(context, "Embed", rid, [rid])
        try:
            self.client.submit(msg, queue, self.client.pick_rank(wanted, msg.input_ids, ""))
            while True:
                out = await self._next_output(queue, context, observers)
                if out.finish_reason is None:
                    continue
                if out.embedding is None:  # ended by an Abort
                    await context.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted")
                return pb.EmbedResponse(
                    embedding=out.embedding, embedding_dim=len(out.embedding), prompt_tokens=out.num_prompt_tokens
                )
        finally:  # a caller gone (or an error) aborts it: its KV is freed now
            self.client.cancel(rid, "client cancelled")
            self.children.pop(rid, None)
            if observers is not None:
                observers.end()

    def _publish_kv_events(self, msg, rank: int = 0) -> None:
        self.rank_hubs[rank].publish(msg)

    async def SubscribeKvEvents(self, request, context):
        """Prefix-cache events with load records, replayable by cursor (contract §8). With
        several DP ranks one stream carries every rank's batches, each naming its rank and
        numbered per rank; the cursor resumes rank 0's (as the router does). A connection whose
        requests named a rank hears that rank's only (``_learn_peer_rank``)."""
        await self._require_ready(context)
        if len(self.rank_hubs) == 1:
            async for batch in self.kv_events.stream(request, context, self.client):
                yield batch
            return
        peer = context.peer()
        wants = lambda rank: self.peer_ranks.get(peer, rank) == rank  # noqa: E731
        async for batch in merged_rank_streams(self.rank_hubs, request, context, self.client.ranks, wants):
            yield batch

    async def StartProfile(self, request, context):
        """A torch.profiler session in the scheduler process (contract §6)."""
        await self._require_ready(context)
        if request.profile_by_stage:
            return common_pb2.ProfileResponse(
                success=False, message="profile_by_stage is not supported: this server profiles whole steps"
            )
        args = {"activities": list(request.activities)}
        for name in ("output_dir", "start_step", "num_steps", "with_stack", "record_shapes"):
            if request.HasField(name):
                args[name] = getattr(request, name)
        with self._admin_span(context, "StartProfile"):
            reply, failure = await self._call_scheduler("start_profile", timeout=60.0, **args)
        if reply is None:
            return common_pb2.ProfileResponse(success=False, message=failure)
        return common_pb2.ProfileResponse(success=reply.ok, message=reply.message)

    async def StopProfile(self, request, context):
        """Stop the profiler and write its Chrome trace; the message names the file."""
        await self._require_ready(context)
        with self._admin_span(context, "StopProfile"):
            reply, failure = await self._call_scheduler("stop_profile", timeout=600.0)
        if reply is None:
            return common_pb2.ProfileResponse(success=False, message=failure)
        return common_pb2.ProfileResponse(success=reply.ok, message=reply.message)

    async def LoadLoRAAdapter(self, request, context):
        await self._unimplemented(context, "LoRA adapters")

    async def UnloadLoRAAdapter(self, request, context):
        await self._unimplemented(context, "LoRA adapters")

    async def ListLoadedLoRAAdapters(self, request, context):
        return pb.ListLoadedLoRAAdaptersResponse()  # none: adapters cannot be loaded

    # -- tokenizer -----------------------------------------------------------------------
    async def GetTokenizer(self, request, context):
        await self._require_ready(context)
        path = self.info.tokenizer_path
        if not path:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no tokenizer path is configured")
        if self._bundle is None or (self._bundle.done() and self._bundle.exception() is not None):
            self._bundle = asyncio.ensure_future(asyncio.to_thread(build_bundle, path))
        try:
            data, sha256 = await asyncio.shield(self._bundle)
        except UnshippableFile as e:
            logger.error("GetTokenizer refused: %s", e)  # the path is for the operator, not the caller
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a tokenizer file lies outside the model directory, is not a regular file or is too large "
                "to ship (the daemon's log names it)",
            )
        except Exception as e:
            logger.error("cannot build the tokenizer bundle: %s", e)
            await context.abort(
                grpc.StatusCode.INTERNAL, "cannot build the tokenizer bundle (the daemon's log says why)"
            )
        parts = list(chunks(data))
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            yield common_pb2.GetTokenizerChunk(data=part, sha256=sha256 if last else "")


class CallObservers:
    """A call's metrics (one record per sequence) and trace, fed each of its outputs."""

    __slots__ = ("meters", "trace")

    def __init__(self, meters: dict | None, trace):
        self.meters = meters
        self.trace = trace

    def on_output(self, out) -> None:
        if self.meters is not None:
            self.meters[out.request_id].on_output(out)
        if self.trace is not None:
            self.trace.on_output(out)

    def end(self) -> None:
        """The call is over: sequences that never finished count as aborted (their caller left)."""
        if self.meters is not None:
            for meter in self.meters.values():
                meter.finish("abort")
        if self.trace is not None:
            self.trace.end()


async def _abort_with_error(context, error_code: str | None, message: str) -> None:
    """End the call with a request's error from the scheduler (a gRPC status name, or
    CONSTRAINT_FAILED: FAILED_PRECONDITION with the trailer the router maps to HTTP 422)."""
    if error_code == CONSTRAINT_FAILED:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, message, trailing_metadata=(("smg-constraint-failed", "engine"),)
        )
    await context.abort(getattr(grpc.StatusCode, error_code or "INTERNAL", grpc.StatusCode.INTERNAL), message)
