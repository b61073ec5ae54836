"""Stop strings: incremental detokenisation of one request's output, only for requests
that send ``SamplingParams.stop``.

The text is decoded as vLLM does it incrementally (a few tokens of context, a token whose
bytes do not yet form a character waits for the next), with special tokens skipped (the
router decodes that way). Every output token records where its text ends, so a match is
trimmed at token granularity (as SGLang trims ids): the tokens from the one holding the
stop string's first character on are dropped. While no stop string matched, the tokens
that could still begin one (a text suffix that is a prefix of a stop string, or bytes
not yet decoded) are held back from streaming. A stop string that is exactly a special (or
added) token's text, such as "<|im_end|>", never shows in that text: it is matched by the
token's id instead (as SGLang, which decodes with special tokens, matches it).

The tokenizer is loaded lazily, once per scheduler process, from the model's tokenizer
directory (:func:`model_source.prepare_tokenizer_dir`).
"""

from __future__ import annotations

import bisect
import logging
import threading

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 4  # prompt tokens decoded before the output (leading-space handling)

_tokenizers: dict[str, object] = {}
_lock = threading.Lock()


def load_tokenizer(model_path: str):
    """The HF tokenizer for ``model_path`` (cached per process)."""
    with _lock:
        tok = _tokenizers.get(model_path)
        if tok is None:
            from transformers import AutoTokenizer

            from .model_source import prepare_tokenizer_dir

            logger.info("loading the tokenizer for stop strings")
            tok = AutoTokenizer.from_pretrained(prepare_tokenizer_dir(model_path))
            _tokenizers[model_path] = tok
        return tok


class StopStringChecker:
    def __init__(self, tokenizer, stops: list[str], prompt_ids: list[int], trim: bool = True):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.trim = trim
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])  # context, then the output
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # the output's decoded text
        self.ends: list[int] = []  # per output token: len(text) through that token
        self.num_decoded = 0  # output tokens whose bytes are all in `text`
        # Per stop, a KMP automaton over the text: whole matches, and how long a prefix of
        # the stop the text ends with (held back from streaming). Each new character is fed
        # once, so a request's stops cost O(new text x stops) a token, however long or
        # repetitive they are.
        self.failure = [_failure_function(s) for s in self.stops]
        self.matched = [0] * len(self.stops)
        added = tokenizer.get_added_vocab()  # special and added tokens: text -> id
        self.token_stops = {added[s]: s for s in self.stops if s in added}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def feed(self, token_id: int) -> tuple[str, int] | None:
        """Add one output token; on a match returns (stop string, output tokens to keep)."""
        self.ids.append(token_id)
        self.ends.append(len(self.text))
        stop = self.token_stops.get(token_id)
        if stop is not None:  # a special token's text: a match here, the token itself trimmed
            return stop, len(self.ends) - 1
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if new_text.endswith("\ufffd"):
            return None  # a character's first bytes: its token completes with the next
        if len(new_text) <= len(prefix_text):  # no text (a skipped special token): complete as it is
            if self.num_decoded == len(self.ends) - 1:
                self.num_decoded += 1
            return None
        before = len(self.text)
        added = new_text[len(prefix_text) :]
        self.text += added
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for i in range(self.num_decoded, len(self.ends)):  # pending tokens complete together
            self.ends[i] = len(self.text)
        self.num_decoded = len(self.ends)
        # The earliest match ending in the new text (an older one, ignored under
        # min_new_tokens, is never reported again).
        best = None
        for j, (stop, fail) in enumerate(zip(self.stops, self.failure)):
            k = self.matched[j]
            for i, c in enumerate(added, before):
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):  # a whole match: go on from its longest proper border
                    pos = i + 1 - k
                    if best is None or pos < best[1]:
                        best = (stop, pos)
                    k = fail[k - 1]
            self.matched[j] = k
        if best is None:
            return None
        stop, pos = best
        return stop, bisect.bisect_right(self.ends, pos)

    def num_safe_tokens(self) -> int:
        """Output tokens that can no longer be part of a stop string (all, when not trimming)."""
        if not self.trim:
            return len(self.ends)
        held = max(self.matched, default=0)  # longest text suffix that is a proper prefix of a stop
        return min(bisect.bisect_right(self.ends, len(self.text) - held), self.num_decoded)


def _failure_function(pattern: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of pattern[: i + 1] that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail
