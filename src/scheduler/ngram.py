"""N-gram speculation (prompt lookup): draft tokens for a decoding request from its own text.

If the sequence's last n tokens occurred earlier (in the prompt or the output so far), the
tokens that followed that occurrence are a cheap guess at what comes next: code edits,
summaries and answers that quote their context repeat long runs of it. The step then
computes the request's last token and the drafts together, one decode row each (the rows
see the KV cache up to their own position), samples every row, and keeps each draft while
it equals what the model sampled in the row before it; the first row that disagrees
gives the correction. Every kept token is the model's own sample, so the output is what
decoding one token at a time gives, greedy or sampled: the drafts only decide how many
tokens a step yields (1 to drafts + 1), at the price of the extra rows. On a CPU a decode
row costs the same pass over the weights, so a few rows cost little more than one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request import Request
from .sampling_batch import BatchSampler

if TYPE_CHECKING:
    from .kv_manager import KVCacheManager
    from .scheduler import ScheduledRequest

MAX_NGRAM = 4  # the longest suffix looked up (a longer match is the more specific guess)
MIN_NGRAM = 2  # a single repeated token is too weak a hint: its drafts would mostly be wasted rows
# Only the n-grams of the last this-many tokens (of a long prompt) are indexed: indexing a
# whole long prompt would stall its first decode step (docs/performance.md).
WINDOW = 4096
# Each verify's share of drafts kept moves a request's average this far (the last few
# verifies weigh most: a request can start or stop quoting its context).
KEPT_SHARE_WEIGHT = 0.3


@dataclass
class DraftState:
    """What the drafter keeps per request (on the request, which owns nothing else of it)."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after it
    indexed: int = 0  # the n-grams ending before this position are in the index
    kept_share: float = 1.0  # moving average of the share of drafts kept per verify


class NgramDrafter:
    def __init__(self, max_draft_tokens: int, doubling_rows: int | None = None, max_rows: int | None = None):
        self.max_draft_tokens = max_draft_tokens
        # decode rows at which a step's per-row cost equals its fixed cost (None: rows are free)
        self.doubling_rows = doubling_rows
        # most decode rows (one per decode, one per draft) a step may have with drafts; None: no limit
        self.max_rows = max_rows
        self.num_draft_tokens = 0  # drafts verified, and of them kept (speculation's acceptance)
        self.num_accepted_drafts = 0

    def add_drafts(self, scheduled: list[ScheduledRequest], budget: int, kv: KVCacheManager, num_running: int) -> None:
        """Give the step's decoding requests draft tokens to verify in it, out of the
        ``budget`` its other work left (drafts never delay a prefill), each as far as a
        match goes, while the decode rows stay within ``max_rows`` and the pool keeps a
        block for each of the ``num_running`` requests' next token (a draft must not cost a
        preemption)."""
        rows = decodes = sum(1 for e in scheduled if e.num_new_tokens == 1)
        row_cap = self.max_rows
        bs = kv.block_size
        for e in scheduled:
            req = e.request
            room = min(budget, row_cap - rows if row_cap else budget)
            if room < 1:
                return
            if e.num_new_tokens != 1 or req.num_computed_tokens != req.num_tokens - 1 or not self.eligible(req):
                continue
            if not self.pays(req, decodes):
                continue
            spare_blocks = len(req.block_ids) + kv.pool.num_free_blocks - num_running
            limit = min(
                room, req.max_new_tokens - req.num_output_tokens - 1, spare_blocks * bs - req.num_computed_tokens - 1
            )
            drafts = self.propose(req, limit)
            if drafts and kv.allocate(req, 1 + len(drafts)):
                req.draft_ids = drafts
                e.num_new_tokens = 1 + len(drafts)
                budget -= len(drafts)
                rows += len(drafts)

    def accept(self, req: Request, tokens: list[int]) -> int:
        """A speculating request's rows: row i sampled the token after draft i - 1 (row 0:
        after its last token). Drafts are kept while each equals the sample of the row
        before it; the first sample that differs (or the one after the last draft) ends
        the run. Appends them (up to a stop) and returns how many; the KV of the drafts not
        kept leaves the computed tokens, to be written over."""
        drafts = req.draft_ids
        kept = 0
        while kept < len(drafts) and tokens[kept] == drafts[kept]:
            kept += 1
        req.num_computed_tokens -= len(drafts) - kept
        req.draft_ids = []
        appended = 0
        for token in tokens[: kept + 1]:
            req.append_token(token)
            appended += 1
            if req.is_finished:  # a stop inside the kept drafts: what follows it never was
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                kept = appended - 1
                break
        self.record(req, len(drafts), kept)
        req.num_draft_tokens += len(drafts)
        req.num_accepted_drafts += kept
        self.num_draft_tokens += len(drafts)
        self.num_accepted_drafts += kept
        return appended

    def pays(self, req: Request, rows: int) -> bool:
        """Whether the request's drafts are worth their rows in a step of ``rows`` decode
        rows. With a step costing fixed + rows x per-row, a draft is worth its row when it
        is kept at least rows / (rows + doubling_rows) of the time: nearly always at a few
        rows (memory-bound steps), half the time where the rows cost as much as the rest."""
        if self.doubling_rows is None or req.draft_state is None:
            return True
        return req.draft_state.kept_share >= rows / (rows + self.doubling_rows)

    @staticmethod
    def eligible(req: Request) -> bool:
        """Requests whose rows a step may sample independently of each other: nothing the
        sampler reads from the tokens so far (penalties, grammar, logprobs), no seeded
        generator, no pending min_new_tokens ban on stop ids."""
        sp = req.sampling
        return not (
            BatchSampler.needs_host_tokens(req)
            or (sp.seed is not None and not sp.greedy)
            or req.num_output_tokens < sp.min_new_tokens
        )

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``min(max_draft_tokens, limit)`` tokens that followed the latest earlier
        occurrence of the longest suffix (MAX_NGRAM down to MIN_NGRAM tokens) of the
        request's sequence; [] when none occurred."""
        limit = min(limit, self.max_draft_tokens)
        if limit <= 0:
            return []
        state = req.draft_state = req.draft_state or DraftState()
        tokens = req.token_ids
        index = self._index(state, tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) <= n:
                continue
            start = index.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + limit]
        return []

    def record(self, req: Request, drafted: int, kept: int) -> None:
        """A verify of the request's ``drafted`` drafts kept ``kept`` of them (for :meth:`pays`)."""
        state = req.draft_state
        state.kept_share += KEPT_SHARE_WEIGHT * (kept / drafted - state.kept_share)

    @staticmethod
    def _index(state: DraftState, tokens: list[int]) -> dict[tuple[int, ...], int]:
        """The n-grams of ``tokens`` that end before its last token (within WINDOW of it),
        each mapped to the position right after its latest occurrence; extended by the
        tokens added since the last call."""
        index = state.index
        end = len(tokens) - 1  # n-grams ending at positions < end: the suffix itself is not its own match
        for e in range(max(state.indexed, end - WINDOW), end):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if e + 1 >= n:
                    index[tuple(tokens[e + 1 - n : e + 1])] = e + 1
        state.indexed = max(state.indexed, end)
        return index
