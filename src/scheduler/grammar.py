"""Structured output with xgrammar: json_schema / regex / ebnf_grammar / structural_tag
constraints compiled per request (with xgrammar's cache), one GrammarMatcher per request.

The sampler fills a token bitmask row for every constrained row of a step and masks
the logits with it; the sampled token is then fed to the matcher. Compilation runs on
the engine's worker threads while the request is held (milliseconds for typical schemas,
seconds for the first constrained request, which builds the vocabulary's tables, or for
huge ones), so other requests keep stepping. A constraint that does not compile refuses
the request with INVALID_ARGUMENT and xgrammar's reason.

JSON schemas compile to compact JSON unless the engine allows any whitespace
(``EngineConfig.constrained_json_any_whitespace``): a small model given that freedom pads
its output with newlines until it runs out of tokens. The router sends ``response_format``
json_object as the json_schema ``{"type": "object"}``, so it follows the same setting.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading

import numpy as np

logger = logging.getLogger(__name__)


class GrammarError(ValueError):
    """The constraint does not compile (the message says why)."""


def _clean(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location: drop them."""
    text = str(e).strip()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text).split("\n")[0].strip() or type(e).__name__


def _check_json(kind: str, spec: str):
    try:
        return json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"invalid {kind}: not JSON: {e}") from e


# Compiled grammars are cached (a repeated schema compiles in microseconds), but every
# tool-calling request may bring its own: unbounded, the cache and the process grow with
# every distinct schema (a soak's numbers: docs/performance.md).
GRAMMAR_CACHE_BYTES = 512 * 2**20  # (as vLLM's default)


class GrammarBackend:
    """The compiler for one model (tokenizer vocabulary), built lazily."""

    _instances: dict[tuple, GrammarBackend] = {}
    _lock = threading.Lock()

    def __init__(
        self, model_path: str, vocab_size: int, stop_token_ids: list[int], cache_limit_bytes: int = GRAMMAR_CACHE_BYTES
    ):
        import xgrammar as xgr

        from .stop_strings import load_tokenizer

        info = xgr.TokenizerInfo.from_huggingface(
            load_tokenizer(model_path), vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=min(os.cpu_count() or 1, 8), cache_limit_bytes=cache_limit_bytes
        )

    @classmethod
    def get(cls, model_path: str, vocab_size: int, stop_token_ids) -> GrammarBackend:
        key = (model_path, vocab_size, tuple(stop_token_ids))
        with cls._lock:
            backend = cls._instances.get(key)
            if backend is None:
                logger.info("building the xgrammar compiler")
                backend = cls._instances[key] = cls(model_path, vocab_size, stop_token_ids)
            return backend

    def compile(self, kind: str, spec: str, json_any_whitespace: bool = False):
        """``json_any_whitespace``: a JSON schema's output may put any run of whitespace
        between its tokens; otherwise it is one line with single spaces after ',' and ':'."""
        c = self.compiler
        try:
            if kind == "json_schema":
                _check_json(kind, spec)  # xgrammar's parse errors read like its internal ones
                return c.compile_json_schema(spec, any_whitespace=json_any_whitespace)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "ebnf_grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                return self._structural_tag(spec)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError and friends)
            reason = _clean(e)
            if reason.startswith("Check failed"):  # an internal limit of xgrammar's, not the spec's fault
                raise GrammarError(f"{kind} not supported by the grammar engine (xgrammar): {reason}") from e
            raise GrammarError(f"invalid {kind}: {reason}") from e
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def _structural_tag(self, spec: str):
        import xgrammar as xgr

        data = _check_json("structural_tag", spec)
        if isinstance(data, dict) and "structures" in data:  # SGLang / OpenAI legacy form
            tags = [
                xgr.StructuralTagItem(
                    begin=s["begin"],
                    schema=json.dumps(s.get("schema", s.get("parameters", {}))),
                    end=s["end"],
                )
                for s in data["structures"]
            ]
            return self.compiler.compile_structural_tag(tags, list(data.get("triggers", [])))
        return self.compiler.compile_structural_tag(spec)

    def matcher(self, kind: str, spec: str, json_any_whitespace: bool = False):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(kind, spec, json_any_whitespace))


def allocate_bitmask(rows: int, vocab_size: int):
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def allows_only(bitmask, row: int, token_ids) -> bool:
    """Whether bitmask row ``row`` allows no token outside ``token_ids``."""
    words = bitmask[row].numpy().view(np.uint32).copy()
    for t in token_ids:
        if t >> 5 < len(words):
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFF_FFFF)
    return not words.any()
