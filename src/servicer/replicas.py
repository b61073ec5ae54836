"""The daemon's engine replicas (``--dp-size N``): one scheduler process each (a TP group of
its own when ``--tp-size`` > 1), behind the one gRPC port.

:class:`Replicas` speaks for them as one scheduler does. A request goes to the rank it names
(``data_parallel_rank``), else to the one whose prefix cache holds most of its prompt (the
ranks' KV events say which blocks each holds) unless that rank is much busier, else to the
one with the fewest open requests; every later word about it (abort, cancel, its outputs)
goes to that rank. Admin calls go to every rank. The set is ready when every rank is, and
dead when any rank is (the others are stopped: a daemon with a missing replica exits for
its supervisor to restart, as it does when its one scheduler dies).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Container

import msgspec

from scheduler.block_pool import hash_block, public_hash
from scheduler.config import EngineConfig
from scheduler.messages import AddRequest, ControlReply, KvEvents, LoadSnapshot

from .scheduler_client import Liveness, SchedulerClient, SchedulerUnavailable

logger = logging.getLogger(__name__)

# Open requests a rank holding a prompt's prefix may have beyond twice the least busy
# rank's and still get it: a hit saves its prefill, a queue costs every request in it.
AFFINITY_SLACK = 4


class Replicas:
    def __init__(self, config: EngineConfig, log_level: str = "info", log_format: str = "text"):
        self.size = config.dp_size
        self.ranks = [
            SchedulerClient(msgspec.structs.replace(config, dp_rank=r), log_level, self._name(r), log_format)
            for r in range(self.size)
        ]
        self.ready = asyncio.Event()
        self.died = asyncio.Event()
        self.dead_reason: str | None = None
        self.kv_event_listener = None  # called with (KvEvents, its rank) for every rank's batches
        # Per rank: the blocks it caches, as the service's KV event hubs follow them (fed by
        # the listener); none until it says.
        self.cached: list[Container[int]] = [() for _ in range(self.size)]
        self._owner: dict[str, int] = {}  # request id -> its rank, while a rank holds it
        self._turn = itertools.count()  # ties between equally loaded ranks go round
        self._watcher: asyncio.Task | None = None
        for r, client in enumerate(self.ranks):
            client.kv_event_listener = lambda msg, r=r: self._on_kv_events(r, msg)

    def _name(self, rank: int) -> str:
        return "the scheduler" if self.size == 1 else f"DP rank {rank}'s scheduler"

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Launch every rank; returns once all are loaded (or raises, the others stopped)."""
        self._watcher = asyncio.create_task(self._watch())
        starts = [asyncio.create_task(client.start()) for client in self.ranks]
        try:
            await asyncio.gather(*starts)
        except BaseException as e:
            for task in starts:
                task.cancel()
            for client in self.ranks:
                if client.process is not None and client.process.returncode is None:
                    client.kill("another DP rank failed to start")
            if isinstance(e, asyncio.CancelledError):
                raise
            raise SchedulerUnavailable(self.dead_reason or self._first_dead_reason()) from None
        self.ready.set()

    async def _watch(self) -> None:
        """The first rank to die ends the set: the others are killed (their requests then end
        UNAVAILABLE like the dead rank's)."""
        waits = [asyncio.create_task(client.died.wait()) for client in self.ranks]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        self.dead_reason = self._first_dead_reason()
        self.died.set()
        for client in self.ranks:
            if not client.died.is_set():
                client.kill(f"another replica is gone ({self.dead_reason})")

    def _first_dead_reason(self) -> str:
        for r, client in enumerate(self.ranks):
            if client.died.is_set() and client.dead_reason:
                return client.dead_reason if self.size == 1 else f"DP rank {r}: {client.dead_reason}"
        return "a scheduler exited during start-up"

    async def stop(self, timeout: float = 5.0) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await asyncio.gather(*(client.stop(timeout) for client in self.ranks))
        if not self.died.is_set():
            self.dead_reason = self.dead_reason or "the scheduler was stopped"
            self.died.set()

    def kill(self, reason: str) -> None:
        for client in self.ranks:
            client.kill(reason)

    @property
    def failed(self) -> bool:
        """Whether a rank has died: its own event is set at once, ``died`` only once the
        watcher task runs, so a caller checking right after the death (a drain that ended
        because the death ended its requests) must ask the ranks too."""
        return self.died.is_set() or any(client.died.is_set() for client in self.ranks)

    @property
    def failure_reason(self) -> str:
        return self.dead_reason or self._first_dead_reason()

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and not self.failed

    @property
    def model_info(self):
        return self.ranks[0].model_info

    def heartbeat_age(self) -> float:
        return max(client.heartbeat_age() for client in self.ranks)

    @property
    def liveness(self) -> Liveness:
        """One rank's liveness, or for several: the oldest message, the longest step, and
        the loads summed."""
        if self.size == 1:
            return self.ranks[0].liveness
        lives = [client.liveness for client in self.ranks]
        return Liveness(
            last_message=min(x.last_message for x in lives),
            in_step_s=max(x.in_step_s for x in lives),
            load=sum_loads([x.load for x in lives]),
        )

    # -- requests --------------------------------------------------------------------
    def in_flight_ids(self) -> list[str]:
        return [rid for client in self.ranks for rid in client.in_flight_ids()]

    @property
    def num_in_flight(self) -> int:
        return sum(client.num_in_flight for client in self.ranks)

    @property
    def num_open(self) -> int:
        return sum(client.num_open for client in self.ranks)

    def has_request(self, request_id: str) -> bool:
        return any(client.has_request(request_id) for client in self.ranks)

    def pick_rank(self, wanted: int | None = None, prompt: list[int] | None = None, salt: str = "") -> int:
        """``wanted`` (checked by the caller), or the rank holding the longest cached prefix of
        ``prompt``, then the one with the fewest open requests: counted here as they are sent,
        so a burst spreads before any load report comes back."""
        if wanted is not None or self.size == 1:
            return wanted or 0
        turn = next(self._turn)
        open_ = [client.num_open for client in self.ranks]
        least = min(range(self.size), key=lambda r: (open_[r], (r - turn) % self.size))
        hits = self._cached_blocks(prompt or [], salt)
        cached = max(range(self.size), key=lambda r: (hits[r], -open_[r]))
        # A shared system prompt alone (under half the prompt) must not pull every chat to one
        # rank; nor may a cache hit pile work onto a rank while another idles.
        worth_it = 2 * hits[cached] * self.model_info.block_size > len(prompt or [])
        balanced = open_[cached] <= 2 * open_[least] + AFFINITY_SLACK
        return cached if worth_it and balanced else least

    def _cached_blocks(self, prompt: list[int], salt: str) -> list[int]:
        """How many of the prompt's leading full blocks each rank holds (hashed as the
        schedulers hash them)."""
        hits = [0] * self.size
        info = self.model_info
        if info is None or not any(self.cached):
            return hits
        bs, parent, extra = info.block_size, None, salt.encode()
        for i in range(len(prompt) // bs):
            parent = hash_block(parent, prompt[i * bs : (i + 1) * bs], extra)
            key = public_hash(parent)
            matched = False
            for r, cached in enumerate(self.cached):
                if hits[r] == i and key in cached:
                    hits[r] += 1
                    matched = True
            if not matched:
                break
        return hits

    def submit(self, msg: AddRequest, queue: asyncio.Queue, rank: int | None = None) -> None:
        rank = self.pick_rank() if rank is None else rank
        self.ranks[rank].submit(msg, queue)
        self._owner[msg.request_id] = rank
        if len(self._owner) > 2 * self.num_in_flight + 64:  # (cancelled ids the ranks let go of since)
            self._owner = {rid: r for rid, r in self._owner.items() if self.ranks[r].has_request(rid)}

    def _client(self, request_id: str) -> SchedulerClient | None:
        rank = self._owner.get(request_id)
        if rank is None:
            return None
        client = self.ranks[rank]
        if not client.has_request(request_id):  # it let go meanwhile (its final output came)
            del self._owner[request_id]
            return None
        return client

    def release(self, request_id: str) -> None:
        client = self._client(request_id)
        if client is not None:
            client.release(request_id)
            self._owner.pop(request_id, None)

    def cancel(self, request_id: str, reason: str = "") -> None:
        client = self._client(request_id)
        if client is not None:
            client.cancel(request_id, reason)
            if not client.has_request(request_id):
                self._owner.pop(request_id, None)

    def abort(self, request_id: str, reason: str = "", error_code: str | None = None) -> bool:
        client = self._client(request_id)
        return client is not None and client.abort(request_id, reason, error_code)

    async def call(self, method: str, timeout: float = 5.0, **args) -> ControlReply:
        """An admin call answered by every rank: ok when all are; with several ranks the
        message names each, and the results come as ``{"dp_ranks": [...]}`` beside rank 0's."""
        if self.size == 1:
            return await self.ranks[0].call(method, timeout, **args)
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "the scheduler is not ready")
        replies = await asyncio.gather(*(client.call(method, timeout, **args) for client in self.ranks))
        result = dict(replies[0].result or {})
        result["dp_ranks"] = [reply.result for reply in replies]
        return ControlReply(
            call_id=0,
            ok=all(reply.ok for reply in replies),
            message="; ".join(f"DP rank {r}: {reply.message}" for r, reply in enumerate(replies)),
            result=result,
        )

    def _on_kv_events(self, rank: int, msg: KvEvents) -> None:
        if self.kv_event_listener is not None:
            self.kv_event_listener(msg, rank)


def sum_loads(loads: list[LoadSnapshot]) -> LoadSnapshot:
    """Several ranks' loads as one engine's (the cache hit rate: their mean)."""
    return LoadSnapshot(
        version=sum(s.version for s in loads),
        num_running=sum(s.num_running for s in loads),
        num_waiting=sum(s.num_waiting for s in loads),
        num_waiting_uncached_tokens=sum(s.num_waiting_uncached_tokens for s in loads),
        num_used_tokens=sum(s.num_used_tokens for s in loads),
        max_total_num_tokens=sum(s.max_total_num_tokens for s in loads),
        gen_throughput=sum(s.gen_throughput for s in loads),
        cache_hit_rate=sum(s.cache_hit_rate for s in loads) / len(loads),
    )


__all__ = ["Replicas", "sum_loads"]
