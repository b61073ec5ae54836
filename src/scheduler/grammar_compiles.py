"""Structured-output grammars compiling beside the step loop, in processes of their own.

A compile can take seconds (the first one also builds the vocabulary's tables, and some
small specs, long repetition counts, compile for minutes), and xgrammar cannot interrupt
one. So the request waits held in the scheduler while its grammar compiles in one of
NUM_WORKERS worker processes, and the engine collects the finished ones between steps. A
compile past its time limit, or of a cancelled request, is stopped by killing its worker; a
fresh worker takes its place, so no compile outlives its request or its limit, and none
keeps other clients' grammars waiting for longer than the limit.

Workers hand back the compiled grammar serialised; the engine keeps the compiled grammars
(bounded in bytes), so a repeated spec compiles once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import wait

from .messages import CONSTRAINT_FAILED
from .request import Request

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # an engine with nothing but compiling grammars waits this long per poll
NUM_WORKERS = 2  # compiles at once (each worker compiles on one thread)
_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the scheduler package
_UNAVAILABLE = "structured output is unavailable (the daemon's log says why)"


class _Worker:
    """One compile process (scheduler.grammar.serve_compiles) and its end of their pipe."""

    def __init__(self, model_path: str, vocab_size: int, eos_ids: list[int]):
        self.conn, child = Pipe()
        args = json.dumps([model_path, vocab_size, eos_ids, child.fileno(), os.getpid()])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from scheduler.grammar import worker_main; worker_main()", args],
            pass_fds=(child.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.ready = False  # it has loaded the tokenizer and waits for compiles
        self.job: _Compile | None = None

    def reply(self):
        """Its next message if one waits, else None; ("died", "") once the process is gone."""
        try:
            return self.conn.recv() if self.conn.poll() else None
        except (EOFError, OSError):
            return ("died", "")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


@dataclass
class _Compile:
    request: Request
    kind: str  # json_schema | regex | ebnf_grammar | structural_tag
    spec: str
    worker: _Worker | None = None  # the worker compiling it; None while queued
    started: float | None = None  # monotonic time it was handed to its worker


@dataclass
class Compiled:
    """A poll's result: grammars ready for their requests, and requests refused (their
    grammar failed, or overran the time limit) with a gRPC status name and a message."""

    ready: list[tuple[Request, object]]  # (request, xgrammar GrammarMatcher)
    refused: list[tuple[Request, str, str]]


class _CompiledGrammars:
    """Compiled grammars by (kind, spec, json_any_whitespace), least recently used dropped
    first past ``limit_bytes``: every tool-calling request may bring its own schema."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[tuple, object] = OrderedDict()

    def get(self, key: tuple):
        compiled = self._entries.get(key)
        if compiled is not None:
            self._entries.move_to_end(key)
        return compiled

    def put(self, key: tuple, compiled) -> None:
        if key in self._entries:
            return
        self._entries[key] = compiled
        self.size_bytes += compiled.memory_size_bytes
        while self.size_bytes > self.limit_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.size_bytes -= old.memory_size_bytes


class GrammarCompiles:
    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        eos_ids: list[int],
        timeout_s: float,
        json_any_whitespace: bool = False,  # EngineConfig.constrained_json_any_whitespace
        cache_limit_bytes: int | None = None,
    ):
        from .grammar import GRAMMAR_CACHE_BYTES

        self._target = (model_path, vocab_size, list(eos_ids))
        self.json_any_whitespace = json_any_whitespace
        self.timeout_s = timeout_s
        self.jobs: dict[str, _Compile] = {}  # by request id, in arrival order
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)
        self.cache = _CompiledGrammars(GRAMMAR_CACHE_BYTES if cache_limit_bytes is None else cache_limit_bytes)
        self._backend: Future | None = None  # this process's GrammarBackend (its tokenizer info)
        self._cached: list[tuple[Request, object]] = []  # cache hits for the next poll

    def __bool__(self) -> bool:
        return bool(self.jobs or self._cached)

    def submit(self, request: Request, kind: str, spec: str) -> None:
        backend = self._start_backend()
        if backend.done() and backend.exception() is None:
            compiled = self.cache.get(self._key(kind, spec))
            if compiled is not None:
                self._cached.append((request, backend.result().matcher_for(compiled)))
                return
        self.jobs[request.request_id] = _Compile(request, kind, spec)
        self._dispatch()

    def cancel(self, request_id: str) -> None:
        self._cached = [(r, m) for r, m in self._cached if r.request_id != request_id]
        job = self.jobs.pop(request_id, None)
        if job is None or job.worker is None:
            return
        w, job.worker.job = job.worker, None
        message = w.reply()
        if message is not None and message[0] in ("ok", "error"):  # it had finished: the worker stays
            self._keep(job, message)
            self._dispatch()
            return
        self._stop(w, "a cancelled request's grammar was still compiling")

    def close(self) -> None:
        self._finalizer()

    def poll(self, wait_briefly: bool = False) -> Compiled:
        """Take the finished compiles and refuse those that compiled for longer than the
        time limit. ``wait_briefly``: nothing else to do, so wait a moment for one."""
        result, self._cached = Compiled(self._cached, []), []
        if not self.jobs:
            self._receive(result)  # (workers starting say when they are ready)
            return result
        if wait_briefly and not result.ready:
            wait([w.conn for w in self.workers], timeout=GRAMMAR_WAIT_S)
        backend = self._start_backend()
        if backend.done() and backend.exception() is not None:
            logger.error("structured output is unavailable: %s", backend.exception())
            self._backend = None  # the next constrained request tries again
            result.refused += [(job.request, "FAILED_PRECONDITION", _UNAVAILABLE) for job in self.jobs.values()]
            self.jobs.clear()
            return result
        self._receive(result)
        now = time.monotonic()
        for rid, job in list(self.jobs.items()):
            if job.started is not None and now - job.started > self.timeout_s:
                del self.jobs[rid]
                result.refused.append(
                    (
                        job.request,
                        CONSTRAINT_FAILED,
                        f"the {job.kind} constraint did not compile within {self.timeout_s:g} s "
                        "(--grammar-compile-timeout); simplify it",
                    )
                )
                self._stop(job.worker, "a grammar compile overran its time limit")
        self._dispatch()
        return result

    # -- workers -----------------------------------------------------------------------
    def _start_backend(self) -> Future:
        """This process builds the vocabulary's tables too (to rebuild the compiled grammars
        the workers send), on a thread: it takes seconds."""
        if self._backend is None:
            from .grammar import GrammarBackend

            pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            self._backend = pool.submit(GrammarBackend.get, *self._target)
            pool.shutdown(wait=False)
        return self._backend

    def _key(self, kind: str, spec: str) -> tuple:
        return (kind, spec, self.json_any_whitespace and kind == "json_schema")

    def _receive(self, result: Compiled) -> None:
        for w in list(self.workers):
            message = w.reply()
            if message is None:
                continue
            status, payload = message
            if status == "ready":
                w.ready = True
            elif status in ("ok", "error"):
                job, w.job = w.job, None
                if job is not None and self.jobs.get(job.request.request_id) is job:
                    del self.jobs[job.request.request_id]
                    self._keep(job, message, result)
            else:  # "unavailable" (it could not start), or "died" (crashed or killed)
                job = w.job
                self._stop(w, f"a grammar compile worker ended ({status})")
                if job is not None and self.jobs.pop(job.request.request_id, None) is not None:
                    result.refused.append(
                        (job.request, CONSTRAINT_FAILED, f"the {job.kind} constraint failed to compile")
                    )
                elif not w.ready:  # none can start: refuse rather than hold requests for ever
                    queued = [job for job in self.jobs.values() if job.worker is None]
                    result.refused += [(job.request, "FAILED_PRECONDITION", _UNAVAILABLE) for job in queued]
                    for job in queued:
                        del self.jobs[job.request.request_id]

    def _keep(self, job: _Compile, message: tuple, result: Compiled | None = None) -> None:
        """A worker's answer: cache a compiled grammar, hand it (or the refusal) to ``result``."""
        import xgrammar as xgr

        status, payload = message
        if status == "error":
            if result is not None:
                result.refused.append((job.request, CONSTRAINT_FAILED, payload))
            return
        backend = self._backend.result()
        compiled = xgr.CompiledGrammar.deserialize_json(payload, backend.info)
        self.cache.put(self._key(job.kind, job.spec), compiled)
        if result is not None:
            result.ready.append((job.request, backend.matcher_for(compiled)))

    def _dispatch(self) -> None:
        """Start the missing workers, and hand queued compiles to the idle ready ones."""
        while len(self.workers) < NUM_WORKERS:
            try:
                self.workers.append(_Worker(*self._target))
            except OSError as e:  # (out of processes or descriptors) queued compiles wait, then time out
                logger.error("cannot start a grammar compile worker: %s", e)
                break
        backend = self._backend
        if backend is None or not backend.done() or backend.exception() is not None:  # (to take the answers)
            return
        idle = [w for w in self.workers if w.ready and w.job is None]
        for job in self.jobs.values():
            if not idle:
                break
            if job.worker is None:
                w = idle.pop(0)
                try:
                    w.conn.send((job.kind, job.spec, self.json_any_whitespace))
                except OSError:  # it died while idle (nothing reads an idle worker's pipe)
                    self._stop(w, "an idle grammar compile worker had ended")
                    return  # (_stop dispatched the queue again)
                job.worker, w.job, job.started = w, job, time.monotonic()

    def _stop(self, w: _Worker, why: str) -> None:
        w.kill()
        self.workers.remove(w)
        logger.warning("%s; its worker (pid %d) is stopped and a new one started", why, w.process.pid)
        self._dispatch()
