"""Continuous-batching scheduler: one flattened batch per step under a token budget.

Each step: running requests first (decodes and unfinished prefill chunks), then
waiting requests in arrival order with prefix lookup, the last one possibly chunked; a
waiting request whose next prompt block another request is computing is passed over
for the step and takes that block from the cache on the next. When the pool runs dry
the newest running request is preempted by recompute: its blocks are freed and it goes
back to the head of the queue with its tokens so far (a running request short of blocks
while its token is in flight waits for that token instead of preempting: it may finish
and free its blocks).

A long prompt (more than ``long_prefill_token_threshold`` tokens left) prefills in chunks
of at most that many tokens, one long prompt at a time, so shorter prompts that arrive
meanwhile start at once instead of queueing behind it; the budget they leave goes back to
it, and then to the next in line, so steps stay as full as without the threshold.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kv_manager import KVCacheManager
from .messages import AddRequest
from .ngram import NgramDrafter
from .request import Request, Status

if TYPE_CHECKING:
    from .pooling import PoolingSpec
    from .sampling_batch import StepLogprobs


class AdmissionError(Exception):
    """A request that can never run; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step: its next ``num_new_tokens`` tokens (speculating: its
    last token and each draft), and whether the step reaches the end of its known and
    pending tokens (and so samples)."""

    request: Request
    num_new_tokens: int
    samples: bool = False


@dataclass(slots=True)
class ScheduledBatch:
    entries: list[ScheduledRequest] = field(default_factory=list)  # 1-token chunks (decodes) first

    @property
    def requests(self) -> list[Request]:
        return [e.request for e in self.entries]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def sampling_requests(self) -> list[Request]:
        """The requests that sample, in batch order; each owns the next 1 + len(draft_ids)
        rows of the step's sampled tokens (one row but for a speculating request)."""
        return [e.request for e in self.entries if e.samples]

    @property
    def sampling_rows(self) -> list[Request]:
        """The request of each row of the step's sampled tokens."""
        return [r for r in self.sampling_requests for _ in range(1 + len(r.draft_ids))]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(self.entries)

    def unfinished(self) -> ScheduledBatch:
        """The batch without the requests that finished since it was scheduled."""
        keep = [e for e in self.entries if not e.request.is_finished]
        return self if len(keep) == len(self.entries) else ScheduledBatch(keep)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's part of the resolved config (the engine fills it from resolve.py); the
    limits have no defaults of their own, the optional features default to off."""

    max_running_requests: int
    max_num_batched_tokens: int
    max_model_len: int
    # most requests waiting beyond the free running slots; more get RESOURCE_EXHAUSTED
    # (the router retries those elsewhere or later). None: no limit, as SGLang's default.
    max_queued_requests: int | None = None
    # a prefill chunk with more tokens left is cut to this many, and only one such long
    # prompt is admitted at a time (vLLM's long-prefill threshold); 0: no limit
    long_prefill_token_threshold: int = 0
    # n-gram speculation (ngram.py): most draft tokens a decoding request verifies per step; 0: off
    max_draft_tokens: int = 0
    # most decode rows (one per decode, one per draft) a step may have with drafts: the
    # largest CUDA graph, beyond which a step would run eagerly; None: no limit
    max_speculative_rows: int | None = None
    # decode rows at which a step's per-row cost equals its fixed cost: past a few rows, a
    # request drafts only while it keeps enough of its drafts (NgramDrafter.pays); None: always
    speculative_doubling_rows: int | None = None
    # an embedding model's: every request is prefill only, then pooled
    pooling: PoolingSpec | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: frozenset[int]):
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # admitted, not schedulable yet (grammar compiling)
        self.requests: dict[str, Request] = {}
        self.drafter = (
            NgramDrafter(
                config.max_draft_tokens,
                doubling_rows=config.speculative_doubling_rows,
                max_rows=config.max_speculative_rows,
            )
            if config.max_draft_tokens
            else None
        )
        self.finished: list[Request] = []  # finished since the last drain (aborts included)
        # called with each request that ends, before its blocks are freed (PD sends its KV then)
        self.on_retire: Callable[[Request], None] | None = None
        self.num_preemptions = 0
        # prompt tokens of first admissions, and those of them served from the prefix cache
        self.num_admitted_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    # -- admission -------------------------------------------------------------------
    def add_request(self, msg: AddRequest, holds: frozenset[str] = frozenset(), stop_checker=None) -> Request:
        """Admit a request (AdmissionError if it can never run); queue it, or with ``holds``
        (what it waits for: "grammar" compiling, PD's "bootstrap" or "kv") keep it aside until
        :meth:`release_held` has cleared each. ``stop_checker``: its StopStringChecker."""
        if msg.request_id in self.requests:
            raise AdmissionError("ALREADY_EXISTS", f"request id {msg.request_id!r} is already in flight")
        n = len(msg.input_ids)
        limit = self.config.max_model_len
        if n == 0:
            raise AdmissionError("INVALID_ARGUMENT", "the prompt is empty")
        if msg.embed and n > limit:  # (an embedding's input may fill the context: nothing follows it)
            raise AdmissionError("INVALID_ARGUMENT", f"the input has {n} tokens; the context limit is {limit}")
        if n >= limit and not msg.embed:
            raise AdmissionError(
                "INVALID_ARGUMENT", f"the prompt has {n} tokens; the context limit is {limit} (prompt must be shorter)"
            )
        max_new = msg.sampling.max_new_tokens
        if max_new is not None and n + max_new > limit:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context limit of {limit} tokens",
            )
        capacity = self.kv.capacity_tokens
        if max_new is None:
            max_new = min(limit, capacity) - n  # up to the context (and what the KV can ever hold)
            if max_new < 1:
                raise AdmissionError(
                    "INVALID_ARGUMENT", f"the prompt has {n} tokens; the KV cache holds {capacity} tokens in all"
                )
        elif n + max_new > capacity:
            # INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: the router retries the latter, and
            # this request can never fit however long it waits.
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the whole KV cache ({capacity} tokens)",
            )
        self.check_queue_room()
        extra = msg.cache_salt.encode()
        pooling = self.config.pooling if msg.embed else None
        req = Request(
            msg.request_id, msg.input_ids, msg.sampling, max_new, self.eos_token_ids, extra, stop_checker, pooling
        )
        self.requests[req.request_id] = req
        if holds:
            req.holds = set(holds)
            self.held[req.request_id] = req
        else:
            self._enqueue(req)
        return req

    def release_held(self, req: Request, reason: str, grammar=None) -> None:
        """What a held request waited for is there (its compiled grammar's matcher, or PD's
        registration or KV); once nothing is left it becomes schedulable. A request whose
        prompt KV came from a prefill daemon (computed tokens already) decodes from there."""
        req.holds.discard(reason)
        if grammar is not None:
            req.grammar = grammar
            for token in req.output_ids:  # (a first token sampled on the prefill daemon)
                grammar.accept_token(token)
        if req.holds:
            return
        del self.held[req.request_id]
        if req.is_finished:  # its first token ended it
            self._retire(req)
        elif req.num_computed_tokens:
            req.status = Status.RUNNING
            self.running.append(req)
        else:
            self._enqueue(req)

    def reject(self, req: Request, code: str, message: str) -> None:
        """A held request cannot run after all: it finishes with an error."""
        del self.held[req.request_id]
        req.error = (code, message)
        req.finish("abort")
        self._retire(req)

    def abort(self, request_id: str, error: tuple[str, str] | None = None) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        if self.held.pop(request_id, None) is None:
            (self.running if req.status is Status.RUNNING else self.waiting).remove(req)
        req.error = error
        req.finish("abort")
        self._retire(req)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_queue_room(self) -> None:
        """RESOURCE_EXHAUSTED (AdmissionError) when --max-queued-requests is reached."""
        limit = self.config.max_queued_requests
        if limit is None:
            return
        # A burst that the next step starts at once is not a queue: free slots don't count.
        free_slots = max(self.config.max_running_requests - len(self.running), 0)
        if self.num_waiting >= limit + free_slots:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"the request queue is full: {self.num_waiting} requests wait for {free_slots} free running slots "
                f"+ {limit} queued (--max-queued-requests); retry later",
            )

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified (the drafter counts them, and of them :attr:`num_accepted_drafts` kept)."""
        return self.drafter.num_draft_tokens if self.drafter is not None else 0

    @property
    def num_accepted_drafts(self) -> int:
        return self.drafter.num_accepted_drafts if self.drafter is not None else 0

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or held while their grammar compiles."""
        return len(self.waiting) + len(self.held)

    def num_waiting_uncached_tokens(self) -> int:
        """Prefill work queued: the waiting requests' tokens past the prefix hit they had
        when queued (the router's least-load policy weighs workers by it)."""
        queued = sum(r.num_tokens - r.num_queued_cached_tokens for r in self.waiting)
        return queued + sum(r.num_tokens for r in self.held.values())

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        scheduled: list[ScheduledRequest] = []
        budget = self.config.max_num_batched_tokens
        cap = self.config.long_prefill_token_threshold or budget
        budget, pool_short = self._schedule_running(scheduled, budget, cap)
        passed_over = False  # a long prompt waits for the one prefilling now
        if not pool_short:  # a running request lacked KV blocks: admit nobody new
            budget, passed_over = self._admit_waiting(scheduled, budget, cap)
        if budget and cap < self.config.max_num_batched_tokens:
            budget = self._extend_cut_chunks(scheduled, budget)
            if budget and passed_over:  # still some left: the next in line, long or not
                budget, _ = self._admit_waiting(scheduled, budget, budget)
        if budget > 1 and self.drafter is not None and not pool_short:  # what prefill left over
            self.drafter.add_drafts(scheduled, budget, self.kv, len(self.running))
        # Single-token chunks (decodes, and prefills cut to one token) and speculating
        # decodes (one row per token) first: the attention path batches them as decodes.
        scheduled.sort(key=lambda e: e.num_new_tokens != 1 and not e.request.draft_ids)
        for e in scheduled:  # (an embedding's last chunk pools instead: pooling.py)
            r = e.request
            e.samples = (
                r.num_computed_tokens + e.num_new_tokens - len(r.draft_ids) == r.num_tokens_with_pending
                and r.pooling is None
            )
        return ScheduledBatch(scheduled)

    def _schedule_running(self, scheduled: list[ScheduledRequest], budget: int, cap: int) -> tuple[int, bool]:
        """Give running requests their next chunk (a decode: one token; a prefill chunk at
        most ``cap``), preempting the newest ones when the pool runs dry. Returns (budget
        left, whether the pool ran short)."""
        pool_short = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and req.will_finish_by_length:  # its last token is in flight
                i += 1
                continue
            n = min(req.num_tokens_with_pending - req.num_computed_tokens, budget, cap)
            if req.num_pending and not self.kv.allocate(req, n):
                # Its token in flight may end it and free its blocks: wait for that token
                # rather than preempt a request for a step that may be wasted.
                pool_short = True
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                pool_short = True
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
        return budget, pool_short

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int, cap: int) -> tuple[int, bool]:
        """Admit waiting requests in order while the budget, the running slots and the pool
        allow, each with its cached prefix and a first chunk of at most ``cap``; a long one
        (more than ``cap`` tokens to compute) is passed over while another long prompt
        prefills. Returns (budget left, whether a long one was passed over)."""
        # Blocks being computed (made when a waiting request is first looked at): a waiting
        # request whose next uncached block is one of them waits a step and takes it from the
        # cache instead of computing it again (n > 1 siblings, a burst with one system prompt).
        in_progress: set[bytes] | None = None
        long_prefilling = any(_is_cut(e.request, e.num_new_tokens) for e in scheduled)
        passed_over = False
        j = 0  # waiting[:j]: passed over until then
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[j]
            if req.num_pending:  # preempted while its last token was in flight: wait for it
                break
            cached = self.kv.find_cached_prefix(req)
            if in_progress is None:
                in_progress = {d for r in self.running for d in self.kv.uncached_digests(r)}
            if in_progress and self.kv.next_block_in_progress(req, cached, in_progress):
                j += 1
                continue
            num_cached = len(cached) * self.kv.block_size
            to_compute = req.num_tokens - num_cached
            if to_compute > cap and long_prefilling:
                passed_over = True
                j += 1
                continue
            n = min(to_compute, budget, cap)
            if not self.kv.can_admit(req, cached, n):
                break
            del self.waiting[j]
            self.kv.admit(req, cached)
            in_progress.update(self.kv.uncached_digests(req))
            if req.num_preemptions == 0:
                req.queue_time_s = time.monotonic() - req.arrived_at
                req.num_cached_tokens = num_cached
                self.num_cached_prompt_tokens += num_cached
                self.num_admitted_prompt_tokens += req.num_prompt_tokens
            self.kv.allocate(req, n)
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
            long_prefilling |= to_compute > cap
        return budget, passed_over

    def _extend_cut_chunks(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Give the budget nobody else took back to the prefill chunks cut short, oldest
        first. A chunk whose whole extension the free blocks cannot hold stays as cut:
        squeezing the pool dry would preempt decodes on the next step. Returns the budget left."""
        for e in scheduled:
            req, n = e.request, e.num_new_tokens
            if budget and _is_cut(req, n):
                extra = min(req.num_tokens_with_pending - req.num_computed_tokens - n, budget)
                if self.kv.allocate(req, n + extra):
                    e.num_new_tokens = n + extra
                    budget -= extra
        return budget

    def advance(self, batch: ScheduledBatch) -> None:
        """Right after a step is launched: count its tokens as computed. Each request that
        samples in it has one more pending token, in its row of the step's sampled tokens."""
        row = 0
        for e in batch:
            req, n = e.request, e.num_new_tokens
            if req.input_logprobs is not None:  # (a per-request check on the hot path: cheap first)
                span = req.input_logprob_span(n)
                if span:  # those positions' prompt logprobs come with this step
                    req.input_logprob_next = span.stop
            req.num_computed_tokens += n
            if e.samples:
                req.pending_row = row
                req.num_pending += 1
                row += 1 + len(req.draft_ids)

    def complete(
        self,
        batch: ScheduledBatch,
        sampled: list[int],
        logprobs: StepLogprobs | None = None,
        pooled: list[tuple[Request, list[float]]] = (),
    ) -> int:
        """When a launched step's tokens reach the host: append them (one per sampling
        request, in order, with the logprobs of those that asked), index the newly full KV
        blocks and retire finished requests. Requests that finished meanwhile (aborted, or
        stopped by the previous step's token while this step was in flight) drop their
        token. ``pooled``: the embeddings whose prompts the step finished, which end with
        their vectors. Returns how many tokens were appended."""
        if logprobs is not None:
            for req, row in logprobs.prompt:
                req.input_logprobs.append(*row)
        logprob_rows = logprobs.output if logprobs is not None else None
        appended = 0
        j = 0  # the request's first row of the sampled tokens
        for req in batch.sampling_requests:
            tokens = sampled[j : j + 1 + len(req.draft_ids)]
            row = logprob_rows[j] if logprob_rows is not None else None
            j += len(tokens)
            req.num_pending -= 1
            if req.is_finished:
                req.draft_ids = []
                continue
            was_running = req.status is Status.RUNNING
            if req.draft_ids:
                appended += self.drafter.accept(req, tokens)
            else:
                before = req.num_output_tokens
                req.append_token(tokens[0])
                if req.num_output_tokens > before:  # (not for a prompt-only request)
                    appended += 1
                    if row is not None:
                        req.output_logprobs.append(*row)
                elif row is not None and req.sampling.token_ids_logprob:
                    req.next_token_ids_logprobs = row.ids_values  # prefill-only scoring: no token, one row
            if req.is_finished:
                self.kv.commit(req)  # its full blocks stay cached for later prompts
                # a request preempted while this step ran sits in the queue
                (self.running if was_running else self.waiting).remove(req)
                self._retire(req)
        for e in batch:
            if not e.request.is_finished:
                self.kv.commit(e.request)
        for req, vector in pooled:
            if not req.is_finished:  # (its full blocks were just committed: a later prompt may hit them)
                req.embedding = vector
                req.finish("stop")
                self.running.remove(req)
                self._retire(req)
        return appended

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done

    # -- internals -------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.kv.free(req)  # (its full blocks stay cached: it will likely find them again)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        req.num_queued_cached_tokens = len(self.kv.find_cached_prefix(req)) * self.kv.block_size
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _retire(self, req: Request) -> None:
        if self.on_retire is not None:
            self.on_retire(req)
        self.kv.free(req)
        del self.requests[req.request_id]
        self.finished.append(req)


def _is_cut(req: Request, n: int) -> bool:
    """Whether a scheduled chunk of ``n`` tokens leaves part of the request's prompt (or
    recomputed tokens) for later steps."""
    return req.num_computed_tokens + n < req.num_tokens_with_pending
