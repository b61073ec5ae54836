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

from .request import Request

MAX_NGRAM = 4  # the longest suffix looked up (a longer match is the more specific guess)
MIN_NGRAM = 2  # a single repeated token is too weak a hint: its drafts would mostly be wasted rows


class NgramDrafter:
    def __init__(self, num_draft_tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @staticmethod
    def eligible(req: Request) -> bool:
        """Requests whose rows a step may sample independently of each other: no per-token
        state in the sampler (penalties, grammar, logprobs, a seeded generator, a pending
        min_new_tokens ban on stop ids), and no token in flight."""
        sp = req.sampling
        return not (
            req.num_pending
            or sp.has_penalties
            or req.grammar is not None
            or req.output_logprobs is not None
            or req.needs_input_logprobs
            or (sp.seed is not None and not sp.greedy)
            or req.num_output_tokens < sp.min_new_tokens
        )

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``min(num_draft_tokens, limit)`` tokens that followed the latest earlier
        occurrence of the longest suffix (``max_ngram`` down to ``min_ngram`` tokens) of
        the request's sequence; [] when none occurred."""
        limit = min(limit, self.num_draft_tokens)
        if limit <= 0:
            return []
        tokens = req.token_ids
        index = self._index(req)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            start = index.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + limit]
        return []

    def _index(self, req: Request) -> dict[tuple[int, ...], int]:
        """The request's n-grams that end before its last token, each mapped to the position
        right after its latest occurrence; extended by the tokens added since the last call
        (kept on the request, which owns nothing else of the drafter's)."""
        state = req.ngram_index
        if state is None:
            state = req.ngram_index = ({}, 0)
        index, done = state
        tokens = req.token_ids
        end = len(tokens) - 1  # n-grams ending at positions < end: the suffix itself is not its own match
        for e in range(done, end):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if e + 1 >= n:
                    index[tuple(tokens[e + 1 - n : e + 1])] = e + 1
        req.ngram_index = (index, max(done, end))
        return index
