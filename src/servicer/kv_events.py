"""SubscribeKvEvents: the prefix cache's changes as numbered KvEventBatch streams
(router contract §8).

The scheduler process sends one ``KvEvents`` message per step (or flush) that changed
the prefix cache. :class:`KvEventHub` numbers them 1, 2, 3, ... as proto batches, keeps
the last ``HISTORY_BATCHES`` (at most ``HISTORY_BLOCKS`` blocks in all) for replay, and
fans each one out to every subscriber's own bounded queue (a subscriber that falls that
far behind is dropped with DATA_LOSS; the others never wait for it).

A stream (:meth:`KvEventHub.stream`):

* ``start_sequence_number`` 0: a snapshot of the blocks cached now (one batch, numbered
  like the last batch, whose state it holds; none while nothing is cached), then live. A
  non-zero cursor inside the history replays exactly the batches after it, then goes live;
  a cursor older than the history, or beyond the last batch (e.g. from before a restart),
  is OUT_OF_RANGE and the router resubscribes from 0.
* Several DP ranks (``merged_rank_streams``): each rank's hub numbers its own batches;
  one stream carries them all, each batch naming its ``dp_rank``.
* Every batch carries an ``EngineLoad`` record (from the scheduler's heartbeat snapshot).
  Between batches a ``load_only`` batch (no events, repeating the last sequence number)
  goes out when the load changed, or as a heartbeat after 1 s of silence (5 s after two
  unchanged heartbeats). Before the stream's first real batch such records are numbered 0
  and sent only if ``load_records_before_first_batch``. Telemetry (cache hit rate, token
  counts, memory, queues) rides on the stream's first record and on heartbeats.

Streams do not poll: each one sleeps until its subscriber is woken (a batch, a load
change, the engine's death) or its next heartbeat is due. One watcher task per hub looks
at the load every 100 ms and wakes only the streams that send load records, and only when
it changed, so idle subscribers cost nothing. At most ``MAX_SUBSCRIBERS`` streams at once;
more are refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque

import grpc

from scheduler.messages import DisaggLoad, KvCleared, KvEvents, KvRemoved, KvStored

from .cached_blocks import CachedBlocks, well_formed
from .generated import common_pb2

logger = logging.getLogger(__name__)

HISTORY_BATCHES = 1024  # batches kept for replay ...
# ... and at most this many blocks in them (stored blocks and removed hashes): a GPU's
# prefill step publishes hundreds of blocks, so a bound in batches alone would let the
# history grow large (sizes: docs/performance.md).
HISTORY_BLOCKS = 65536
SUBSCRIBER_QUEUE = 1024  # batches (or HISTORY_BLOCKS blocks) a subscriber may lag behind before it is dropped
LOAD_CHECK_S = 0.1  # how often the hub's watcher looks for a load change
HEARTBEAT_S = 1.0  # load_only heartbeat after this much silence ...
SLOW_HEARTBEAT_S = 5.0  # ... or this much after two unchanged heartbeats
# Concurrent SubscribeKvEvents streams: a router opens one per worker; each stream holds a
# queue of up to SUBSCRIBER_QUEUE batches.
MAX_SUBSCRIBERS = 256
UINT32_MAX = 2**32 - 1


class CursorOutOfRange(Exception):
    """A replay cursor the history cannot serve."""


class TooManySubscribers(Exception):
    """The hub already streams to its maximum of subscribers."""


def to_proto_events(events: list, event_ids) -> list[common_pb2.KvCacheEvent]:
    """Scheduler KV events -> proto events. Stored blocks that chain (each one's parent is
    the previous block) share one KvBlocksStored; partial blocks are never published."""
    out: list[common_pb2.KvCacheEvent] = []
    run = None  # the KvBlocksStored being extended
    run_tail = None  # hash of its last block
    for ev in events:
        if isinstance(ev, KvStored):
            if not well_formed(ev):
                logger.warning(
                    "dropping a malformed stored KV block (hash %d, %d tokens, block size %d)",
                    ev.block_hash,
                    len(ev.token_ids),
                    ev.block_size,
                )
                run = None
                continue
            block = common_pb2.KvBlock(block_hash=ev.block_hash, token_ids=ev.token_ids, block_size=ev.block_size)
            if run is not None and ev.parent_hash is not None and ev.parent_hash == run_tail:
                run.blocks.append(block)
            else:
                stored = common_pb2.KvBlocksStored(blocks=[block])
                if ev.parent_hash is not None:
                    stored.parent_block_hash = ev.parent_hash
                out.append(common_pb2.KvCacheEvent(event_id=next(event_ids), stored=stored))
                run = out[-1].stored  # a live reference: later blocks append in place
            run_tail = ev.block_hash
            continue
        run = None
        if isinstance(ev, KvRemoved):
            if ev.block_hashes:
                removed = common_pb2.KvBlocksRemoved(block_hashes=ev.block_hashes)
                out.append(common_pb2.KvCacheEvent(event_id=next(event_ids), removed=removed))
        elif isinstance(ev, KvCleared):
            out.append(common_pb2.KvCacheEvent(event_id=next(event_ids), cleared=common_pb2.KvCacheCleared()))
    return out


def batch_blocks(batch: common_pb2.KvEventBatch) -> int:
    """A batch's size for the history's budget: its stored blocks and removed hashes (>= 1)."""
    return max(1, sum(len(e.stored.blocks) + len(e.removed.block_hashes) for e in batch.events))


class _Subscriber:
    __slots__ = ("queue", "overflowed", "queued_blocks", "wake")

    def __init__(self, maxsize: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.overflowed = False
        self.queued_blocks = 0
        self.wake = asyncio.Event()  # set with each batch, on overflow, and by the hub's watcher

    def offer(self, batch: common_pb2.KvEventBatch, blocks: int, max_blocks: int) -> bool:
        """Queue a batch; False (and overflowed) when it lags too far behind to take it."""
        self.wake.set()
        if self.queued_blocks + blocks > max_blocks and not self.queue.empty():
            self.overflowed = True
            return False
        try:
            self.queue.put_nowait((batch, blocks))
        except asyncio.QueueFull:
            self.overflowed = True
            return False
        self.queued_blocks += blocks
        return True

    async def next(self, timeout: float | None) -> common_pb2.KvEventBatch | None:
        """The next queued batch; None when woken without one (a load change, overflow, the
        engine's death: the caller looks) or after ``timeout`` seconds (None: no limit)."""
        if self.queue.empty():
            try:
                if timeout is None:
                    await self.wake.wait()
                else:
                    await asyncio.wait_for(self.wake.wait(), timeout)
            except (TimeoutError, asyncio.TimeoutError):
                return None
            self.wake.clear()  # (a wake that came while batches were queued ends here, spuriously)
        return self.take()

    def take(self) -> common_pb2.KvEventBatch | None:
        """The next queued batch, or None: no waiting."""
        if self.queue.empty():
            return None
        batch, blocks = self.queue.get_nowait()
        self.queued_blocks -= blocks
        return batch


def load_key(client) -> tuple:
    """What counts as a load change (not age, not the throughput average)."""
    s = client.liveness.load
    return (s.num_running, s.num_waiting, s.num_waiting_uncached_tokens, s.num_used_tokens, s.max_total_num_tokens)


class _LoadRecords:
    """EngineLoad records of one stream, from the client's latest load snapshot."""

    def __init__(self, client):
        self.client = client
        self.sample = 0
        self.last_key = None

    def changed(self) -> bool:
        return load_key(self.client) != self.last_key

    def record(self, load_only: bool, telemetry: bool) -> common_pb2.EngineLoad:
        client = self.client
        s = client.liveness.load
        info = client.model_info  # (None while the model loads)
        total = s.max_total_num_tokens
        self.sample += 1
        self.last_key = load_key(client)
        age_s = time.monotonic() - client.liveness.last_message if client.liveness.last_message else 0.0
        load = common_pb2.EngineLoad(
            running_requests=s.num_running,
            waiting_requests=s.num_waiting,
            waiting_uncached_tokens=min(s.num_waiting_uncached_tokens, UINT32_MAX),
            token_usage=s.token_usage,
            gen_throughput=s.gen_throughput,
            max_running_requests=info.max_running_requests if info else 0,
            age_ms=min(max(int(age_s * 1000), 0), UINT32_MAX),
            sample=self.sample,
            load_only=load_only,
        )
        if telemetry:
            load.cache_hit_rate = s.cache_hit_rate
            load.num_used_tokens = s.num_used_tokens
            load.max_total_num_tokens = total
            load.memory.CopyFrom(
                common_pb2.EngineMemory(
                    weight_gb=info.weight_gb if info else 0.0,
                    kv_cache_gb=info.kv_cache_gb if info else 0.0,
                    token_capacity=total,
                )
            )
            load.queues.CopyFrom(common_pb2.EngineQueues(waiting=s.num_waiting))
            load.disaggregation.CopyFrom(common_pb2.EngineDisaggregation(**disaggregation_metrics(s.disagg)))
        return load


def disaggregation_metrics(load: DisaggLoad | None) -> dict:
    """The fields of the PD metrics messages (EngineDisaggregation, DisaggregationMetrics)."""
    if load is None:
        return {"mode": "null"}
    return {
        "mode": load.mode,
        "prefill_prealloc_queue_reqs": load.prefill_bootstrapping,
        "decode_prealloc_queue_reqs": load.decode_prealloc,
        "decode_transfer_queue_reqs": load.decode_receiving,
        "kv_transfer_speed_gb_s": load.kv_transfer_speed_gb_s,
        "kv_transfer_latency_ms": load.kv_transfer_latency_ms,
    }


class KvEventHub:
    def __init__(
        self,
        history: int = HISTORY_BATCHES,
        queue_size: int = SUBSCRIBER_QUEUE,
        history_blocks: int = HISTORY_BLOCKS,
        max_subscribers: int = MAX_SUBSCRIBERS,
    ):
        self.history: deque[tuple[common_pb2.KvEventBatch, int]] = deque()  # (batch, batch_blocks)
        self.history_batches = history
        self.history_blocks = history_blocks
        self._kept_blocks = 0  # sum of the history's batch_blocks
        self.queue_size = queue_size
        self.max_subscribers = max_subscribers
        self.last_seq = 0
        # The highest batch number streamed to any subscriber: a cursor above it cannot come
        # from this run (numbers restart at 1 with the daemon), however many batches it published.
        self.sent_seq = 0
        self.subscribers: set[_Subscriber] = set()
        self.live = CachedBlocks()  # (a new subscriber's snapshot)
        self._event_ids = itertools.count(1)
        # The watcher's view of the load, and whom it wakes: every stream that sends load
        # records when the load changes; at its next check, also those whose last record
        # differs from its view (the load moved between their record and its check).
        self._watcher: asyncio.Task | None = None
        self._load_key: tuple | None = None
        self._load_subscribers: set[_Subscriber] = set()
        self._load_recheck: set[_Subscriber] = set()

    # -- publisher side (called from the client's read loop) ----------------------------
    def publish(self, msg: KvEvents) -> common_pb2.KvEventBatch | None:
        self.live.apply(msg.events)
        events = to_proto_events(msg.events, self._event_ids)
        if not events:
            return None
        self.last_seq += 1
        batch = common_pb2.KvEventBatch(sequence_number=self.last_seq, timestamp=msg.timestamp, events=events)
        blocks = batch_blocks(batch)
        self.history.append((batch, blocks))
        self._kept_blocks += blocks
        # The newest batch stays whatever its size: a cursor just behind it can resume.
        while len(self.history) > self.history_batches or (
            len(self.history) > 1 and self._kept_blocks > self.history_blocks
        ):
            self._kept_blocks -= self.history.popleft()[1]
        for sub in list(self.subscribers):
            if not sub.offer(batch, blocks, self.history_blocks):
                self.unsubscribe(sub)
        return batch

    def snapshot(self) -> common_pb2.KvEventBatch | None:
        """The blocks cached now, as one batch numbered like the last one (it stands for
        every batch up to it); None when none are."""
        events = to_proto_events(self.live.blocks(), self._event_ids)
        if not events:
            return None
        return common_pb2.KvEventBatch(sequence_number=self.last_seq, timestamp=time.time(), events=events)

    # -- subscriber side ------------------------------------------------------------------
    def subscribe(self, start: int) -> tuple[_Subscriber, list[common_pb2.KvEventBatch]]:
        """Register a subscriber; returns it with the batches to replay first: those after
        ``start``, or from 0 the snapshot of what is cached now (a router that joins late
        must learn the blocks stored before it came: a block whose parent it never saw
        would be indexed at the wrong place)."""
        if len(self.subscribers) >= self.max_subscribers:
            raise TooManySubscribers(
                f"this server already streams KV events to {len(self.subscribers)} subscribers "
                f"(at most {self.max_subscribers}); close one or retry later"
            )
        replay: list[common_pb2.KvEventBatch] = []
        if start:
            if start > self.sent_seq:
                raise CursorOutOfRange(
                    f"cursor {start} is beyond the last KV event batch this server run sent ({self.sent_seq}; "
                    "the server restarted?); resubscribe from 0"
                )
            oldest = self.history[0][0].sequence_number if self.history else self.last_seq + 1
            if start < oldest - 1:
                raise CursorOutOfRange(
                    f"cursor {start} is older than the replay history (oldest batch {oldest}); resubscribe from 0"
                )
            replay = [b for b, _ in self.history if b.sequence_number > start]
        elif (state := self.snapshot()) is not None:
            replay = [state]
        sub = _Subscriber(self.queue_size)
        self.subscribers.add(sub)
        return sub, replay

    def unsubscribe(self, sub: _Subscriber) -> None:
        self.subscribers.discard(sub)
        self._load_subscribers.discard(sub)
        self._load_recheck.discard(sub)

    def _sent_load(self, sub: _Subscriber, key: tuple) -> None:
        """``sub`` streams load records and just sent one for ``key``."""
        self._load_subscribers.add(sub)
        if key != self._load_key:
            self._load_recheck.add(sub)

    def _start_watcher(self, client) -> None:
        if self._watcher is None or self._watcher.done():
            self._load_key = load_key(client)
            self._watcher = asyncio.get_running_loop().create_task(self._watch(client))

    async def _watch(self, client) -> None:
        """Wake streams when the load changes or the engine dies: one check per LOAD_CHECK_S
        for all of them, while any are open."""
        while self.subscribers:
            await asyncio.sleep(LOAD_CHECK_S)
            if client.died.is_set():
                for sub in self.subscribers:
                    sub.wake.set()
                return
            key = load_key(client)
            woken, self._load_recheck = self._load_recheck, set()
            if key != self._load_key:
                self._load_key = key
                woken = self._load_subscribers
            for sub in woken:
                sub.wake.set()

    async def stream(self, request, context, client):
        """The KvEventBatch messages of one SubscribeKvEvents call."""
        start = request.start_sequence_number
        try:
            sub, replay = self.subscribe(start)
        except CursorOutOfRange as e:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except TooManySubscribers as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        # Registered before the headers go out: a client that has them misses no batch.
        try:
            await context.send_initial_metadata(())
        except BaseException:
            self.unsubscribe(sub)
            raise
        logger.debug(
            "KV event subscriber joined (cursor %d, %d batch(es) to replay, %d subscriber(s))",
            start,
            len(replay),
            len(self.subscribers),
        )
        self._start_watcher(client)
        loads = _LoadRecords(client)
        first = True
        last_seq = start  # what load_only batches repeat; 0 until the stream's first batch
        last_sent = time.monotonic()
        unchanged_heartbeats = 0
        try:
            for batch in replay:
                yield self._with_load(batch, loads.record(load_only=False, telemetry=first))
                self._sent_load(sub, loads.last_key)
                first = False
                last_seq = batch.sequence_number
                self.sent_seq = max(self.sent_seq, last_seq)
                last_sent = time.monotonic()
            while True:
                if sub.overflowed:
                    await context.abort(
                        grpc.StatusCode.DATA_LOSS,
                        f"subscriber fell more than {self.queue_size} KV event batches "
                        f"or {self.history_blocks} blocks behind; resubscribe",
                    )
                if client.died.is_set():
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {client.dead_reason}")
                batch = sub.take()
                # Older subscribers get load records only with real batches until the first one.
                if batch is None and (last_seq or request.load_records_before_first_batch):
                    changed = loads.changed()
                    interval = SLOW_HEARTBEAT_S if unchanged_heartbeats >= 2 else HEARTBEAT_S
                    due_in = last_sent + interval - time.monotonic()
                    if changed or due_in <= 0:
                        unchanged_heartbeats = 0 if changed else unchanged_heartbeats + 1
                        record = loads.record(load_only=True, telemetry=first or not changed)
                        first = False
                        yield common_pb2.KvEventBatch(sequence_number=last_seq, timestamp=time.time(), load=record)
                        self._sent_load(sub, loads.last_key)
                        last_sent = time.monotonic()
                        continue
                    batch = await sub.next(due_in)
                elif batch is None:
                    batch = await sub.next(None)
                if batch is None or sub.overflowed:
                    continue  # woken, or timed out, without a batch; (overflowed: DATA_LOSS, not a hole)
                yield self._with_load(batch, loads.record(load_only=False, telemetry=first))
                self._sent_load(sub, loads.last_key)
                first = False
                last_seq = batch.sequence_number
                self.sent_seq = max(self.sent_seq, last_seq)
                last_sent, unchanged_heartbeats = time.monotonic(), 0
        finally:
            self.unsubscribe(sub)
            logger.debug("KV event subscriber left (%d subscriber(s))", len(self.subscribers))

    @staticmethod
    def _with_load(batch: common_pb2.KvEventBatch, load: common_pb2.EngineLoad) -> common_pb2.KvEventBatch:
        out = common_pb2.KvEventBatch()
        out.CopyFrom(batch)  # the stored batch is shared by every subscriber: never mutate it
        out.load.CopyFrom(load)
        return out


class _RankContext:
    """The call's context as one rank's stream sees it: the merged stream sends the headers
    once every rank has subscribed."""

    def __init__(self, context):
        self.context = context
        self.subscribed = asyncio.Event()

    async def send_initial_metadata(self, metadata) -> None:
        self.subscribed.set()

    async def abort(self, code, details):
        await self.context.abort(code, details)


async def merged_rank_streams(hubs: list[KvEventHub], request, context, clients, wants=lambda rank: True):
    """One SubscribeKvEvents stream over several DP ranks' hubs: each rank's batches (and
    load records) as its own stream would send them, with ``dp_rank`` set, while
    ``wants(rank)``. The cursor is rank 0's; the other ranks start from their current state."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(hubs))  # (a slow reader holds the pumps back)
    contexts = [_RankContext(context) for _ in hubs]
    failures: list[BaseException] = []

    async def pump(rank: int) -> None:
        ranked = request
        if rank:
            ranked = type(request)(load_records_before_first_batch=request.load_records_before_first_batch)
        try:
            async for batch in hubs[rank].stream(ranked, contexts[rank], clients[rank]):
                if wants(rank):
                    batch.dp_rank = rank
                    await queue.put(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # (an abort: OUT_OF_RANGE, DATA_LOSS, UNAVAILABLE; the call ends with it)
            failures.append(e)
            contexts[rank].subscribed.set()
            await queue.put(None)  # (wakes the reader)

    pumps = [asyncio.create_task(pump(rank)) for rank in range(len(hubs))]
    try:
        await asyncio.gather(*(c.subscribed.wait() for c in contexts))
        if not failures:
            await context.send_initial_metadata(())
        while not failures:
            item = await queue.get()
            if item is not None:
                yield item
        raise failures[0]
    finally:
        for task in pumps:
            task.cancel()
