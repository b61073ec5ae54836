"""A request as the scheduler tracks it.

There is no prefill/decode flag: each step computes ``num_tokens_with_pending -
num_computed_tokens`` tokens of it (capped by the step's budget), so chunked prefill,
prefix hits and resumption after preemption all fall out of the same rule.

With the overlap schedule a step is launched before the previous step's sampled tokens
reach the host: such a token is *pending* (counted in ``num_pending``, its value still on
the device, in row ``pending_row`` of the launched step's sampled tokens) until the engine
completes that step and appends it. ``token_ids`` only ever holds known tokens.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from .messages import CONSTRAINT_FAILED, LogprobLists, LogprobRows, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from .pooling import PoolingSpec


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        hash_extra: bytes = b"",
        stop_checker=None,
        pooling: PoolingSpec | None = None,
    ):
        self.request_id = request_id
        self.token_ids = list(prompt_ids)  # prompt, then outputs
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else eos_token_ids)
        self.hash_extra = hash_extra  # extra prefix-cache key (the cache salt)
        self.status = Status.WAITING
        self.arrived_at = time.monotonic()
        self.queue_time_s: float | None = None  # from arrival to its first step, until sent (metrics, traces)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.num_queued_cached_tokens = 0  # the prefix hit it had when last queued (a load estimate)
        self.block_ids: list[int] = []
        self.block_digests: list[bytes] = []  # chained hashes of the full blocks so far
        self.num_committed_blocks = 0  # leading blocks already indexed in the prefix cache
        self.num_sent_tokens = 0  # output tokens already reported to the servicer
        self.num_pending = 0  # sampled tokens of launched steps not yet appended (overlap)
        self.pending_row = -1  # row of the newest pending token in its step's sampled tokens
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: tuple[str, str] | None = None  # (gRPC status name, message) when it ends in error
        self.matched_token_id: int | None = None
        self.matched_stop_str: str | None = None
        self.num_visible_outputs: int | None = None  # set when a matched stop string is trimmed
        self.stop_checker = stop_checker  # StopStringChecker, when stop strings are sent
        # An embedding model's request: prefill only, then its pooled vector (pooling.py)
        self.pooling = pooling
        self.pool_state = None  # owned by the pooler (what it accumulated over the prompt's chunks)
        self.embedding: list[float] | None = None
        self.sampler_state = None  # owned by the sampler (seeded generator, token-id buffer)
        self.grammar = None  # xgrammar GrammarMatcher (structured output), set on release from hold
        self.holds: set[str] = set()  # what a held request still waits for (Scheduler.release_held)
        # N-gram speculation (ngram.py): this step's draft tokens (computed after the last
        # token, one decode row each), the drafter's state, and counts for the response.
        self.draft_ids: list[int] = []
        self.draft_state = None
        self.num_draft_tokens = 0  # drafted over the request's life
        self.num_accepted_drafts = 0  # of them, kept
        # Logprobs (sampling.return_logprob): output rows in step with the output tokens.
        self.output_logprobs = LogprobLists() if sampling.return_logprob else None
        # A prompt-only request's (max_new_tokens 0) token_ids_logprob row at the next
        # position: the proto's prefill-only scoring answer, sent with its final output.
        self.next_token_ids_logprobs: list[float] | None = None
        self.input_logprobs: LogprobLists | None = None
        self.input_logprob_next = -1  # next prompt position whose logits are still needed; -1: none
        self.input_logprobs_sent = False
        if sampling.wants_input_logprobs:
            start = min(sampling.logprob_start_len, self.num_prompt_tokens - 1)
            self.input_logprobs = LogprobLists(token_ids=list(prompt_ids[start:]))
            if start == 0:  # the first prompt token has no context, hence no logprob
                self.input_logprobs.append(None, [], [], [])
            # token t's logprob comes from the logits at position t - 1
            self.input_logprob_next = max(start, 1) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus the pending ones: what steps compute up to."""
        return len(self.token_ids) + self.num_pending

    @property
    def will_finish_by_length(self) -> bool:
        """The pending tokens already reach max_new_tokens: nothing more to schedule."""
        return self.num_output_tokens + self.num_pending >= self.max_new_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def visible_output_ids(self) -> list[int]:
        """The output as reported: without a trimmed stop string's tokens."""
        end = (
            len(self.token_ids)
            if self.num_visible_outputs is None
            else self.num_prompt_tokens + self.num_visible_outputs
        )
        return self.token_ids[self.num_prompt_tokens : end]

    @property
    def num_sendable_tokens(self) -> int:
        """Output tokens that may go to the client now. A request with stop strings (and
        trimming) holds back tokens that could still turn out to start a stop string."""
        if self.num_visible_outputs is not None:
            return self.num_visible_outputs
        if self.stop_checker is not None and not self.is_finished:
            return self.stop_checker.num_safe_tokens()
        return self.num_output_tokens

    @property
    def needs_input_logprobs(self) -> bool:
        """Prompt positions whose logits the next steps must compute (and not skip via the
        prefix cache)."""
        return 0 <= self.input_logprob_next < self.num_prompt_tokens - 1

    def input_logprob_span(self, num_new_tokens: int) -> range:
        """Prompt positions whose logits (for prompt logprobs) a step computing the next
        ``num_new_tokens`` tokens yields and still are needed."""
        if not self.needs_input_logprobs:
            return range(0)
        start = self.num_computed_tokens
        return range(max(start, self.input_logprob_next), min(start + num_new_tokens, self.num_prompt_tokens - 1))

    @property
    def prefix_cache_limit(self) -> int | None:
        """At most this many leading tokens may come from the prefix cache (None: no limit)."""
        if self.pooling is not None and self.pooling.reads_every_row:
            return 0
        return self.input_logprob_next if self.needs_input_logprobs else None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and decide whether the request is done: a grammar dead
        end, a stop token (or a complete grammar), a stop string, or the length limit."""
        if self.max_new_tokens == 0:  # a prompt-only request: its last prefill step's sample is no output
            self.finish("length")
            return
        self.token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            # The sampler keeps to the grammar's bitmask: it left a token outside only
            # because the grammar allowed none (e.g. ``root ::= root``), a dead end.
            self.error = (
                CONSTRAINT_FAILED,
                f"the structured-output grammar allows no token after "
                f"{self.num_output_tokens - 1} output token(s): it admits no complete output from "
                "here (or the penalties ruled out every token it allows)",
            )
            self.finish("abort")
        elif self._is_stop_token(token_id):
            self.finish("stop", matched_token_id=token_id)
        elif self._matches_stop_string(token_id):
            self.finish("stop")
        elif self.num_output_tokens >= self.max_new_tokens:
            self.finish("length")

    def _is_stop_token(self, token_id: int) -> bool:
        """A stop id ends the request from output token min_new_tokens + 1 on (the sampler
        masks stop ids before that); a complete grammar ends it on the stop token it took
        (e.g. EOS under ignore_eos)."""
        if token_id in self.stop_ids and self.num_output_tokens > self.sampling.min_new_tokens:
            return True
        return self.grammar is not None and self.grammar.is_terminated()

    def _matches_stop_string(self, token_id: int) -> bool:
        """Feed the token to the stop-string checker; on a match (once min_new_tokens
        exist) record it and, unless no_stop_trim, how much output stays visible."""
        if self.stop_checker is None:
            return False
        match = self.stop_checker.feed(token_id)
        if match is None or self.num_output_tokens < self.sampling.min_new_tokens:
            return False
        stop, keep = match
        self.matched_stop_str = stop
        if not self.sampling.no_stop_trim:
            self.num_visible_outputs = keep
        return True

    def take_output(self, final: bool = False) -> RequestOutput | None:
        """The output tokens (and logprob rows) not yet sent that may go now, marked sent;
        None when there are none, unless ``final`` (the finished request's last output)."""
        start, end = self.num_sent_tokens, self.num_sendable_tokens
        if end <= start and not final:
            return None
        p = self.num_prompt_tokens
        new = self.token_ids[p + start : p + end]  # (end never passes the visible outputs)
        self.num_sent_tokens = max(start, end)
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=new,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,  # generated: a trimmed stop string's tokens too
            finish_reason=self.finish_reason,
            matched_token_id=self.matched_token_id,
            matched_stop_str=self.matched_stop_str,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_drafts=self.num_accepted_drafts,
        )
        if self.error is not None:
            out.error_code, out.error = self.error
        out.embedding = self.embedding
        out.queue_time_s, self.queue_time_s = self.queue_time_s, None  # (once)
        if self.output_logprobs is not None and new:
            out.output_logprobs = self.output_logprobs.rows(start, start + len(new), new)
        elif self.next_token_ids_logprobs is not None and final:
            out.output_logprobs = LogprobRows(values=[], token_ids=[], ids_values=[self.next_token_ids_logprobs])
        if self.input_logprobs is not None and not self.input_logprobs_sent and not self.needs_input_logprobs:
            if new or self.is_finished:
                self.input_logprobs_sent = True
                out.input_logprobs = self.input_logprobs.rows(0, len(self.input_logprobs.values))
        return out

    def finish(self, reason: str, matched_token_id: int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.matched_token_id = matched_token_id
