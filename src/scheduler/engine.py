"""The engine: scheduler + model runner, stepped by the scheduler process or used
offline (tests, benchmarks) through :meth:`Engine.generate`."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import msgspec

from .block_pool import BlockPool
from .config import EngineConfig
from .grammar_compiles import GrammarCompiles
from .kv_manager import KVCacheManager
from .messages import AddRequest, LoadSnapshot, RequestOutput, SamplingParams, StepOutput, out_of_vocabulary
from .metrics import EngineStats, ThroughputWindow
from .model_runner import LaunchedStep, ModelRunner
from .request import Request
from .sampling_batch import BatchSampler
from .scheduler import AdmissionError, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    token_times: list[float]  # time.perf_counter() at which each output token became available


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        """``config``: what the user asked for; the runner resolves it (``self.config`` is the
        resolved config, resolve.py)."""
        self.runner = runner or ModelRunner(config)
        self.config = rc = self.runner.config
        mc = self.runner.model_config
        self.pool = BlockPool(rc.num_kv_blocks, rc.block_size, rc.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        eos = frozenset(mc.eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running_requests=rc.max_running_requests,
                max_queued_requests=rc.max_queued_requests,
                max_num_batched_tokens=rc.max_num_batched_tokens,
                max_model_len=rc.max_model_len,
                long_prefill_token_threshold=rc.long_prefill_token_threshold,
                max_draft_tokens=rc.speculative_num_draft_tokens,
                max_speculative_rows=rc.max_speculative_rows or None,
                speculative_doubling_rows=rc.speculative_doubling_rows or None,
                pooling=rc.pooling,
            ),
            self.kv,
            eos,
        )
        self.stats = EngineStats()
        self.throughput = ThroughputWindow()
        # Overlap schedule (resolve.py): the previous step's tokens are taken after the next
        # step is launched, so the host's bookkeeping hides behind the device's work.
        self.overlap = rc.overlap_schedule
        self.inflight: LaunchedStep | None = None  # launched, tokens not yet taken
        self._offline_ids = itertools.count()  # generate()'s request ids
        self.grammars = GrammarCompiles(
            self.runner.model_path,
            mc.vocab_size,
            sorted(eos),
            rc.grammar_compile_timeout_s,
            rc.constrained_json_any_whitespace,
        )  # for requests held meanwhile
        logger.info("overlap schedule: %s", "on" if self.overlap else "off")
        self.disagg = None  # the prefill or decode side of PD disaggregation (disagg/)
        if rc.disaggregation is not None:
            from .disagg import build_coordinator

            self.disagg = build_coordinator(rc.disaggregation, self.scheduler, self.kv, self.runner, self.abort)
            self.scheduler.on_retire = self.disagg.on_retire
        self.load = LoadSnapshot(max_total_num_tokens=self.kv.capacity_tokens)

    # -- requests ----------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> Request:
        """Queue a request; raises AdmissionError for one that can never run."""
        self.scheduler.check_queue_room()  # first: under overload, refuse before any setup
        if msg.embed != (self.config.pooling is not None):
            raise AdmissionError(
                "INVALID_ARGUMENT",
                "this daemon serves a generation model: start it with --is-embedding (or an embedding "
                "checkpoint) to answer Embed"
                if msg.embed
                else "this daemon serves an embedding model: it answers Embed (/v1/embeddings, /v1/classify), "
                "not Generate",
            )
        vocab = self.runner.model_config.vocab_size
        bad = out_of_vocabulary(msg.input_ids, vocab)  # (as the servicer: no path may reach the embedding with one)
        if bad is not None:
            raise AdmissionError("INVALID_ARGUMENT", f"token id {bad} is outside the vocabulary (size {vocab})")
        holds = set()
        if msg.disagg is not None:
            if self.disagg is None:
                raise AdmissionError(
                    "INVALID_ARGUMENT", "disaggregated_params sent to a daemon running --disaggregation-mode null"
                )
            self.disagg.check(msg.disagg)
            holds.add("bootstrap" if self.disagg.mode == "prefill" else "kv")
            if self.disagg.mode == "decode" and msg.sampling.wants_input_logprobs:
                # the prompt's logprobs come with the prefill leg (the router merges them)
                msg = msgspec.structs.replace(msg, sampling=msgspec.structs.replace(msg.sampling, logprob_start_len=-1))
        sp = msg.sampling
        if sp.constraint_kind:
            holds.add("grammar")
        checker = self._stop_checker(msg) if sp.stop else None
        req = self.scheduler.add_request(msg, holds=frozenset(holds), stop_checker=checker)
        if sp.constraint_kind:
            self.grammars.submit(req, sp.constraint_kind, sp.constraint)
        if msg.disagg is not None:
            self.disagg.add(req, msg.disagg, msg.cache_salt)
        return req

    def _stop_checker(self, msg: AddRequest):
        from .stop_strings import StopStringChecker, load_tokenizer

        try:
            tokenizer = load_tokenizer(self.runner.model_path)
        except Exception as e:  # noqa: BLE001  (no tokenizer: refuse rather than ignore the stops)
            logger.warning("stop strings refused: no tokenizer for %s: %s", self.runner.model_path, e)
            raise AdmissionError(
                "FAILED_PRECONDITION", "stop strings need the model's tokenizer, which did not load"
            ) from e
        return StopStringChecker(tokenizer, msg.sampling.stop, msg.input_ids, trim=not msg.sampling.no_stop_trim)

    def _admit_compiled(self) -> None:
        """Queue the held requests whose grammar is ready; refuse those it failed for or
        that overran the compile time limit."""
        done = self.grammars.poll(wait_briefly=not self.scheduler.has_work() and self.inflight is None)
        for req, matcher in done.ready:
            self.scheduler.release_held(req, "grammar", matcher)
        for req, code, message in done.refused:
            self.scheduler.reject(req, code, message)

    def abort(self, request_id: str, error: tuple[str, str] | None = None) -> bool:
        """``error``: (gRPC status name, message) to end the request with instead of a plain abort."""
        self.grammars.cancel(request_id)
        return self.scheduler.abort(request_id, error)

    def has_work(self) -> bool:
        """Anything in flight: a step to run, or a PD leg waiting for its partner."""
        return self.has_step_work() or (self.disagg is not None and self.disagg.has_work())

    def has_step_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None or bool(self.grammars)

    def poll_disagg(self) -> list[RequestOutput]:
        """PD: take the partner's messages, send finished prefills' KV, enforce the time
        limits; the outputs that made (first tokens received, legs ended)."""
        self.disagg.poll(time.monotonic())
        outputs = self.disagg.take_outputs() + self.finished_outputs()
        if outputs:
            self.refresh_load()
        return outputs

    # -- stepping ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Schedule and launch one step. With the overlap schedule the previous step's
        tokens are taken (and its outputs made) only after this one is launched, so the
        host's bookkeeping runs while the device computes; a step whose requests need
        their tokens on the host first (grammar, penalties, logprobs) waits for them."""
        if self.grammars:
            self._admit_compiled()
        batch = self.scheduler.schedule()
        if not len(batch) and self.inflight is None:  # nothing runs (grammars compiling)
            self.refresh_load()
            return StepOutput(outputs=self.finished_outputs(), load=self.load)
        prev, self.inflight = self.inflight, None
        overlap = self.overlap and not any(BatchSampler.needs_host_tokens(e.request) for e in batch)
        outputs: list[RequestOutput] = []
        if prev is not None and not overlap:
            outputs += self._complete(prev)
            prev = None
            batch = batch.unfinished()  # the tokens just taken may have finished some
        launched = None
        if len(batch):
            launched = self.runner.launch(batch, prev)
            self.scheduler.advance(batch)
        if prev is not None:
            outputs += self._complete(prev)
        if launched is not None:
            if overlap:
                self.inflight = launched
            else:
                outputs += self._complete(launched)
            self.stats.record_step(len(batch), batch.num_tokens)  # (not a step that only took tokens)
        self.refresh_load()
        outputs += self.finished_outputs()
        return StepOutput(outputs=outputs, load=self.load)

    def _complete(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Take a launched step's tokens, advance its requests, and make their outputs."""
        tokens = launched.result()
        appended = self.scheduler.complete(launched.batch, tokens, launched.logprobs, launched.pooled)
        self.stats.num_pooled_requests += len(launched.pooled)
        self.stats.num_generated_tokens += appended  # not the tokens of requests already done
        self.throughput.add(launched.launched_at, time.monotonic(), appended)
        outputs = [e.request.take_output() for e in launched.batch if not e.request.is_finished]
        return [o for o in outputs if o is not None]

    def finished_outputs(self) -> list[RequestOutput]:
        """Final outputs of every request finished since the last call (aborts included)."""
        return [req.take_output(final=True) for req in self.scheduler.take_finished()]

    def refresh_load(self) -> None:
        """Publish a new load snapshot (replaced whole, so other threads read it safely)."""
        sched = self.scheduler
        self.load = LoadSnapshot(
            version=self.load.version + 1,
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            num_waiting_uncached_tokens=sched.num_waiting_uncached_tokens(),
            num_used_tokens=self.pool.num_used_blocks * self.pool.block_size,
            max_total_num_tokens=self.kv.capacity_tokens,
            gen_throughput=self.throughput.rate(time.monotonic()),
            cache_hit_rate=sched.num_cached_prompt_tokens / max(sched.num_admitted_prompt_tokens, 1),
            num_draft_tokens=sched.num_draft_tokens,
            num_accepted_drafts=sched.num_accepted_drafts,
            disagg=self.disagg.load() if self.disagg is not None else None,
        )

    def flush_cache(self) -> tuple[bool, str]:
        """Drop every cached prefix block; refused while requests hold KV."""
        if self.has_work():
            n = len(self.scheduler.running) + self.scheduler.num_waiting
            return False, f"cannot flush the prefix cache: {n} request(s) in flight"
        if not self.pool.reset_prefix_cache():
            return False, "cannot flush the prefix cache: KV blocks are still in use"
        return True, "prefix cache flushed"

    def stats_dict(self) -> dict:
        s = self.stats
        return {
            "steps": s.steps,
            "max_batch_size": s.max_batch_size,
            "max_step_tokens": s.max_step_tokens,
            "batch_size_histogram": {str(k): v for k, v in sorted(s.batch_size_histogram.items())},
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_generated_tokens": s.num_generated_tokens,
            "num_pooled_requests": s.num_pooled_requests,
            "num_draft_tokens": self.scheduler.num_draft_tokens,
            "num_accepted_drafts": self.scheduler.num_accepted_drafts,
            "gen_throughput": self.load.gen_throughput,
            "cache_hit_rate": self.load.cache_hit_rate,
            "num_used_blocks": self.pool.num_used_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_total_blocks": self.pool.num_blocks,
            "num_used_tokens": self.pool.num_used_blocks * self.pool.block_size,
            "max_total_num_tokens": self.kv.capacity_tokens,
            "block_size": self.pool.block_size,
            # prompt tokens computed by this engine's own steps (those not from the prefix cache
            # at first admission; a PD decode daemon computes none)
            "num_computed_prompt_tokens": self.scheduler.num_admitted_prompt_tokens
            - self.scheduler.num_cached_prompt_tokens,
        } | (self.disagg.stats_dict() if self.disagg is not None else {})

    # -- offline API -------------------------------------------------------------------
    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """An embedding model's vectors for prompts, batched as the daemon batches them; in
        prompt order. All or none, as :meth:`generate`."""
        ids = [f"offline-{next(self._offline_ids)}" for _ in prompts]
        vectors: dict[str, list[float] | None] = {rid: None for rid in ids}
        self._add_all(
            [AddRequest(rid, list(p), SamplingParams(max_new_tokens=0), embed=True) for rid, p in zip(ids, prompts)]
        )
        while self.has_work():
            for o in self.step().outputs:
                if o.request_id in vectors and o.embedding is not None:
                    vectors[o.request_id] = o.embedding
        return [vectors[rid] for rid in ids]

    def _add_all(self, messages: list[AddRequest]) -> None:
        """Queue every message, or (AdmissionError) none."""
        added = []
        try:
            for msg in messages:
                self.add_request(msg)
                added.append(msg.request_id)
        except AdmissionError:
            for rid in added:  # (their final outputs go with the next step's, unread)
                self.abort(rid)
            raise

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order.
        All or none: if one prompt is refused (AdmissionError), none stays queued."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"offline-{next(self._offline_ids)}" for _ in prompts]
        results = {rid: Completion(rid, list(p), [], None, 0, []) for rid, p in zip(ids, prompts)}
        self._add_all([AddRequest(rid, list(prompt), sp) for rid, prompt, sp in zip(ids, prompts, params)])
        while self.has_work():
            out = self.step()
            now = time.perf_counter()
            for o in out.outputs:
                c = results.get(o.request_id)
                if c is None:  # not this call's (e.g. aborted by an earlier refused call)
                    continue
                c.output_ids.extend(o.new_token_ids)
                c.token_times.extend([now] * len(o.new_token_ids))
                c.num_cached_tokens = o.num_cached_tokens
                if o.finish_reason:
                    c.finish_reason = o.finish_reason
        return [results[rid] for rid in ids]


__all__ = ["Engine", "Completion", "AdmissionError"]
