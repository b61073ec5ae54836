"""Structured-output grammars compiling beside the step loop.

A compile can take seconds (the first one also builds the vocabulary's tables), so the
request waits held in the scheduler while its grammar compiles on a worker thread, and
the engine collects the finished ones between steps. Compiles cannot be interrupted: one
past its time limit, or of a cancelled request, is *abandoned* (left to finish unheeded)
and the compiles queued behind it restart on fresh threads.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from .messages import CONSTRAINT_FAILED
from .request import Request
from .scheduler import AdmissionError

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # an engine with nothing but compiling grammars waits this long per poll
# Abandoned compiles keep a core busy: past this many still running, structured output is
# refused until some end.
MAX_ABANDONED_COMPILES = 2
NUM_THREADS = 2


def _compile_grammar(
    model_path: str, vocab_size: int, eos_ids: list[int], kind: str, spec: str, json_any_whitespace: bool = False
):
    """On a worker thread (xgrammar compiles without the GIL): the request's matcher."""
    from .grammar import GrammarBackend, GrammarError

    try:
        return GrammarBackend.get(model_path, vocab_size, eos_ids).matcher(kind, spec, json_any_whitespace)
    except GrammarError as e:
        raise AdmissionError(CONSTRAINT_FAILED, str(e)) from e
    except Exception as e:  # noqa: BLE001  (no xgrammar / tokenizer)
        raise AdmissionError("FAILED_PRECONDITION", f"structured output is unavailable: {e}") from e


@dataclass
class _Compile:
    request: Request
    kind: str  # json_schema | regex | ebnf_grammar | structural_tag
    spec: str
    future: Future
    started: float | None = None  # monotonic time it was first seen compiling (not queued)


@dataclass
class Compiled:
    """A poll's result: grammars ready for their requests, and requests refused (their
    grammar failed, or overran the time limit) with a gRPC status name and a message."""

    ready: list[tuple[Request, object]]  # (request, xgrammar GrammarMatcher)
    refused: list[tuple[Request, str, str]]


class GrammarCompiles:
    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        eos_ids: list[int],
        timeout_s: float,
        json_any_whitespace: bool = False,  # EngineConfig.constrained_json_any_whitespace
    ):
        self._target = (model_path, vocab_size, eos_ids)
        self.json_any_whitespace = json_any_whitespace
        self.timeout_s = timeout_s
        self.jobs: dict[str, _Compile] = {}  # by request id
        self._threads: ThreadPoolExecutor | None = None
        self.abandoned: set[Future] = set()  # abandoned and still running (each removes itself)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def check_room(self) -> None:
        """Raises AdmissionError while too many abandoned compiles still run."""
        if len(self.abandoned) >= MAX_ABANDONED_COMPILES:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"{len(self.abandoned)} abandoned grammar compiles "
                "(past --grammar-compile-timeout, or of cancelled requests) still run; structured "
                "output is refused until they end",
            )

    def submit(self, request: Request, kind: str, spec: str) -> None:
        self.jobs[request.request_id] = _Compile(request, kind, spec, self._start(kind, spec))

    def cancel(self, request_id: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is not None and not job.future.done() and not job.future.cancel():
            # Already compiling: it would keep a grammar thread as long as it runs, outside
            # the time limit (that counts for held requests only) and the overrun cap.
            self._disown(job.future)
            self._renew_threads("a cancelled request's grammar was still compiling")

    def poll(self, wait_briefly: bool = False) -> Compiled:
        """Take the finished compiles and refuse those that compiled for longer than the
        time limit. ``wait_briefly``: nothing else to do, so wait a moment for one."""
        if wait_briefly:
            wait([job.future for job in self.jobs.values()], timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        result = Compiled([], [])
        now, timed_out = time.monotonic(), False
        for rid, job in list(self.jobs.items()):
            if job.future.done():
                del self.jobs[rid]
                try:
                    result.ready.append((job.request, job.future.result()))
                except AdmissionError as e:
                    result.refused.append((job.request, e.code, str(e)))
            elif job.started is None:
                if job.future.running():  # the limit counts from here, not from the queue
                    job.started = now
            elif now - job.started > self.timeout_s:
                del self.jobs[rid]
                result.refused.append(
                    (
                        job.request,
                        CONSTRAINT_FAILED,
                        f"the {job.kind} constraint did not "
                        f"compile within {self.timeout_s:g} s (--grammar-compile-timeout); simplify it",
                    )
                )
                self._disown(job.future)
                timed_out = True
        if timed_out:
            self._renew_threads("a grammar compile overran its time limit")
        return result

    def _start(self, kind: str, spec: str) -> Future:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=NUM_THREADS, thread_name_prefix="grammar")
        return self._threads.submit(_compile_grammar, *self._target, kind, spec, self.json_any_whitespace)

    def _disown(self, future: Future) -> None:
        """A compile nobody waits for any more, still running: counted until it ends."""
        self.abandoned.add(future)
        future.add_done_callback(self.abandoned.discard)  # (on its thread: set ops are atomic)

    def _renew_threads(self, why: str) -> None:
        """Leave the disowned compiles to finish on the old threads, and restart the ones
        queued behind them on new threads, so one pathological grammar delays the others
        by at most the time limit."""
        old, self._threads = self._threads, None
        if old is not None:
            old.shutdown(wait=False)
        logger.warning("%s; its thread is left to finish unheeded", why)
        for job in self.jobs.values():
            if job.future.cancel():  # not started yet
                job.future, job.started = self._start(job.kind, job.spec), None
