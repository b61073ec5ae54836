"""Structured output with xgrammar: json_schema / regex / ebnf_grammar / structural_tag
constraints compiled per request (with xgrammar's cache), one GrammarMatcher per request.

The sampler fills a token bitmask row for every constrained row of a step and masks
the logits with it; the sampled token is then fed to the matcher. Compilation runs on
worker processes while the request is held (grammar_compiles.py; milliseconds for typical
schemas, seconds for the first constrained request, which builds the vocabulary's tables, or
for huge ones), so other requests keep stepping. A constraint that does not compile refuses
the request with a short message of ours; xgrammar's own text (C++ checks, source
locations) goes to the log only.

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
import signal
import sys
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
        raise GrammarError(f"invalid {kind}: not JSON") from e


def _legacy_structures(data: dict) -> list[tuple[str, str, str]]:
    """(begin, schema, end) of each entry of the SGLang / OpenAI legacy form's "structures"."""
    structures, triggers = data["structures"], data.get("triggers", [])
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise GrammarError("invalid structural_tag: 'structures' and 'triggers' must be lists")
    tags = []
    for s in structures:
        if not isinstance(s, dict):
            raise GrammarError("invalid structural_tag: each structure must be an object")
        for key in ("begin", "end"):
            if not isinstance(s.get(key), str):
                raise GrammarError(f"invalid structural_tag: a structure lacks the string {key!r}")
        tags.append((s["begin"], json.dumps(s.get("schema", s.get("parameters", {}))), s["end"]))
    if not all(isinstance(t, str) for t in triggers):
        raise GrammarError("invalid structural_tag: 'triggers' must be strings")
    return tags


# Compiled grammars are cached (a repeated schema compiles in microseconds), but every
# tool-calling request may bring its own: unbounded, the cache and the process grow with
# every distinct schema (a soak's numbers: docs/performance.md).
GRAMMAR_CACHE_BYTES = 512 * 2**20  # (as vLLM's default)


class GrammarBackend:
    """The compiler for one model (tokenizer vocabulary), built lazily."""

    _instances: dict[tuple, GrammarBackend] = {}
    _lock = threading.Lock()

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_limit_bytes: int = GRAMMAR_CACHE_BYTES,
        max_threads: int | None = None,
        cache_enabled: bool = True,
    ):
        import xgrammar as xgr

        from .stop_strings import load_tokenizer

        self.info = xgr.TokenizerInfo.from_huggingface(
            load_tokenizer(model_path), vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(
            self.info,
            max_threads=max_threads or min(os.cpu_count() or 1, 8),
            cache_enabled=cache_enabled,
            cache_limit_bytes=cache_limit_bytes,
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
            # xgrammar's text names C++ checks and sources: the log gets it, the client ours
            reason = _clean(e)
            logger.info("a %s constraint does not compile: %s", kind, reason[:2000])
            if reason.startswith("Check failed"):  # an internal limit of xgrammar's, not the spec's fault
                raise GrammarError(f"{kind} not supported by the grammar engine (xgrammar)") from e
            raise GrammarError(f"invalid {kind}") from e
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def _structural_tag(self, spec: str):
        import xgrammar as xgr

        data = _check_json("structural_tag", spec)
        if isinstance(data, dict) and "structures" in data:  # SGLang / OpenAI legacy form
            tags = [xgr.StructuralTagItem(begin=b, schema=schema, end=e) for b, schema, e in _legacy_structures(data)]
            return self.compiler.compile_structural_tag(tags, list(data.get("triggers", [])))
        return self.compiler.compile_structural_tag(spec)

    def matcher(self, kind: str, spec: str, json_any_whitespace: bool = False):
        return self.matcher_for(self.compile(kind, spec, json_any_whitespace))

    @staticmethod
    def matcher_for(compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


def serve_compiles(model_path: str, vocab_size: int, stop_token_ids: list[int], conn) -> None:
    """A compile worker's loop (grammar_compiles.py starts it in its own process, to kill it
    when a compile overruns): answers each (kind, spec, json_any_whitespace) on ``conn`` with
    ("ok", the CompiledGrammar as JSON) or ("error", message). Ends when the engine goes."""
    try:
        # One thread: the workers beside each other are the parallelism. No cache here: the
        # engine keeps the compiled grammars, and a killed worker would lose its cache anyway.
        backend = GrammarBackend(model_path, vocab_size, stop_token_ids, max_threads=1, cache_enabled=False)
    except Exception as e:  # noqa: BLE001  (no xgrammar / tokenizer)
        logger.error("the grammar compile worker cannot start: %s", e)
        conn.send(("unavailable", "structured output is unavailable (the daemon's log says why)"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            kind, spec, json_any_whitespace = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", backend.compile(kind, spec, json_any_whitespace).serialize_json()))
        except GrammarError as e:
            conn.send(("error", str(e)))


def worker_main() -> None:
    """Entry point of a compile worker process: ``python -c ... '[model_path, vocab_size,
    stop_token_ids, pipe fd, parent pid]'``."""
    from multiprocessing.connection import Connection

    model_path, vocab_size, stop_token_ids, fd, parent_pid = json.loads(sys.argv[1])
    _end_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s grammar-worker %(levelname)s %(message)s")
    serve_compiles(model_path, vocab_size, stop_token_ids, Connection(fd))


def _end_with_parent(parent_pid: int) -> None:
    """Killed with the engine's process, even one killed without a chance to clean up."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's end ends it, once idle
        pass
    if os.getppid() != parent_pid:  # it died before the prctl
        os._exit(0)


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
