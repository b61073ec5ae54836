"""Scheduler invariants over random workloads (fixed seeds, no model: a fake token source).

Each seed makes one workload: requests arriving over the steps with random prompt lengths
(some sharing a prefix, some whole prompts repeated), stop tokens, aborts at random steps,
and a random scheduler: block size, a KV pool barely big enough for the largest request
(so preemption happens), step budget, running-request limit, long-prefill threshold (0 or
not), and a lag of 0 or 1 step between launching a step and completing it (1 is what the
overlap schedule does: the next step is scheduled and launched while the previous one's
tokens are still in flight).

Every step must: stay within the token budget, schedule a request at most once, give each
one a chunk of 1 to its tokens left, put single-token chunks first, set ``samples`` exactly
for the chunks that reach the end, have the KV blocks for what it schedules, and keep the
pool's reference counts equal to the blocks the requests hold. A step may be empty only
while a step is in flight (otherwise the scheduler is stuck). At the end no block is
used and no request is left.

The fake model's next token depends only on the sequence so far, so scheduling must not
change any output: every request that was not aborted produces what generating it alone
gives (and, with a threshold, the same as the same workload with the threshold off); an
aborted one produces a prefix of it. A last test checks that the seeds exercise what this
is about (preemptions, prefix hits, cut chunks, aborts, stops).

A failure names its seed: rerun it with ``pytest tests/test_scheduler_properties.py -k seed17``.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from scheduler.block_pool import BlockPool
from scheduler.kv_manager import KVCacheManager
from scheduler.messages import AddRequest, SamplingParams
from scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

SEEDS = range(60)
VOCAB = range(100, 124)  # small, so stop tokens come up
EOS = 100


def next_token(token_ids: list[int], periodic: bool = False) -> int:
    """The fake model: a hash of the sequence so far (its last tokens and its length); when
    ``periodic``, of its last token only, so its outputs soon cycle and repeat what a prompt
    made of them already holds: n-gram drafts then hit."""
    h = 0 if periodic else len(token_ids)
    for t in token_ids[-1:] if periodic else token_ids[-6:]:
        h = (h * 1_000_003 + t) & 0xFFFFFFFF
    return VOCAB[(h * 2_654_435_761 >> 7) % len(VOCAB)]


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    max_new: int
    stop_ids: list[int]
    arrival: int  # the step it is added before
    abort_at: int | None  # the step it is aborted before (if still in flight)


@dataclass
class Case:
    seed: int
    block_size: int
    num_blocks: int  # usable blocks (the null block excluded)
    budget: int
    threshold: int
    max_running: int
    prefix_caching: bool
    lag: int  # steps launched but not completed
    drafts: int  # n-gram speculation's most draft tokens per step (0: off)
    periodic: bool  # the fake model's outputs repeat (see next_token)
    specs: list[Spec]


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    token = lambda: rng.choice(VOCAB)  # noqa: E731
    prefixes = [[token() for _ in range(rng.randint(1, 30))] for _ in range(2)]
    specs: list[Spec] = []
    for i in range(rng.randint(2, 10)):
        if specs and rng.random() < 0.15:  # the same prompt again (n > 1 siblings)
            prompt = list(rng.choice(specs).prompt)
        else:
            head = rng.choice(prefixes) if rng.random() < 0.5 else []
            prompt = head + [token() for _ in range(rng.randint(1, 60))]
        arrival = rng.choice([0, 0, rng.randint(0, 25)])
        abort_at = arrival + rng.randint(0, 30) if rng.random() < 0.15 else None
        specs.append(
            Spec(
                f"r{i}",
                prompt,
                rng.choice([0, 1, 3, 8, 16]),
                [token()] if rng.random() < 0.3 else [],
                arrival,
                abort_at,
            )
        )
    # Speculation (drawn apart, so the draws above stay as they were): with a periodic model,
    # most prompts quote its own continuation of their first token, as a text quoting its
    # context does.
    spec_rng = random.Random(-1 - seed)
    drafts = spec_rng.choice([0, 1, 3, 3])
    periodic = drafts > 0 and spec_rng.random() < 0.6
    for s in specs if periodic else ():
        if spec_rng.random() < 0.6:
            s.prompt = s.prompt[:1]
            while len(s.prompt) < spec_rng.randint(8, 40):
                s.prompt.append(next_token(s.prompt, periodic=True))
            for _ in range(spec_rng.choice([0, 1, 3])):  # misquoted: drafts from there are rejected
                s.prompt[spec_rng.randrange(len(s.prompt))] = spec_rng.choice(VOCAB)
    block_size = rng.choice([1, 2, 4, 8])
    largest = max(-(-(len(s.prompt) + s.max_new) // block_size) for s in specs)
    budget = rng.choice([1, 2, 3, 5, 8, 16, 32])
    threshold = rng.choice([0, 1, max(budget // 2, 1), rng.randint(1, budget + 4)])
    return Case(
        seed,
        block_size,
        largest + rng.randint(0, 8),
        budget,
        threshold,
        rng.randint(1, 6),
        rng.random() < 0.8,
        rng.choice([0, 1]),
        drafts,
        periodic,
        specs,
    )


def generate_alone(spec: Spec, periodic: bool) -> tuple[str, list[int]]:
    """What the fake model gives the request on its own: (finish reason, output ids)."""
    ids = list(spec.prompt)
    for _ in range(spec.max_new):
        ids.append(next_token(ids, periodic))
        if ids[-1] == EOS or ids[-1] in spec.stop_ids:
            return "stop", ids[len(spec.prompt) :]
    return "length", ids[len(spec.prompt) :]


def check_step(case: Case, sched: Scheduler, pool: BlockPool, batch: ScheduledBatch, where: str) -> None:
    """The invariants of a freshly scheduled step (before it is launched)."""
    ids = [r.request_id for r in batch.requests]
    assert len(sched.running) <= case.max_running, f"{where}: {len(sched.running)} running > {case.max_running}"
    assert batch.num_tokens <= case.budget, f"{where}: {batch.num_tokens} tokens > budget {case.budget}"
    assert len(set(ids)) == len(ids), f"{where}: a request twice in one step: {ids}"
    ones = [e.num_new_tokens == 1 or bool(e.request.draft_ids) for e in batch]  # a decode row each
    assert ones == sorted(ones, reverse=True), f"{where}: single-token chunks not first: {batch.entries}"
    for e in batch:
        req, n, samples = e.request, e.num_new_tokens, e.samples
        left = req.num_tokens_with_pending - req.num_computed_tokens
        drafts = len(req.draft_ids)
        assert req in sched.running, f"{where}: {req.request_id} scheduled but not running"
        assert 1 <= n <= left + drafts, f"{where}: {req.request_id} gets {n} tokens with {left} left"
        assert samples == (n - drafts == left), f"{where}: {req.request_id} samples={samples}, {n} of {left} tokens"
        assert not drafts or (n == 1 + drafts and left == 1 and not req.num_pending), (
            f"{where}: {req.request_id} drafts {req.draft_ids} on a {n}-token chunk, {left} left"
        )
        assert req.num_output_tokens + drafts < max(req.max_new_tokens, 1), (
            f"{where}: {req.request_id} drafts past max_new_tokens {req.max_new_tokens}"
        )
        assert not samples or req.num_output_tokens + req.num_pending < max(req.max_new_tokens, 1), (
            f"{where}: {req.request_id} samples past max_new_tokens {req.max_new_tokens}"
        )
        have = len(req.block_ids) * case.block_size
        assert have >= req.num_computed_tokens + n, (
            f"{where}: {req.request_id} has blocks for {have} tokens, needs {req.num_computed_tokens + n}"
        )
    held = Counter(b for r in [*sched.running, *sched.waiting] for b in r.block_ids)
    assert all(not r.block_ids for r in sched.waiting), f"{where}: a waiting request holds blocks"
    wrong = [b.block_id for b in pool.blocks[1:] if b.ref_cnt != held[b.block_id]]
    assert not wrong, f"{where}: {len(wrong)} blocks (e.g. {wrong[:3]}) counted other than their holders"


def simulate(case: Case, threshold: int, drafts: int) -> tuple[dict[str, tuple[str, list[int]]], Counter]:
    """Run the workload to the end, checking every step. Returns each request's (finish
    reason, output ids) and counts of what happened."""
    pool = BlockPool(case.num_blocks + 1, case.block_size, case.prefix_caching)
    config = SchedulerConfig(
        case.max_running, case.budget, 4096, long_prefill_token_threshold=threshold, max_draft_tokens=drafts
    )
    sched = Scheduler(config, KVCacheManager(pool), frozenset({EOS}))
    cache_block = pool.cache_block

    def cache_whole_block(block_id, digest, parent, token_ids):  # (what KvStored sends the router)
        assert len(token_ids) == case.block_size, f"seed {case.seed}: block {block_id} cached with {token_ids}"
        return cache_block(block_id, digest, parent, token_ids)

    pool.cache_block = cache_whole_block
    results: dict[str, tuple[str, list[int]]] = {}
    seen = Counter()
    # launched: (step, per sampling request: the tokens its row 0 follows, and its drafts)
    inflight: list[tuple[ScheduledBatch, list[tuple[int, list[int]]]]] = []
    step = 0
    while len(results) < len(case.specs) or inflight:
        where = f"seed {case.seed} (threshold {threshold}, drafts {drafts}, lag {case.lag}), step {step}"
        assert step < 20_000, f"{where}: no end in sight"
        for spec in case.specs:
            if spec.arrival == step:
                sched.add_request(
                    AddRequest(
                        spec.rid,
                        spec.prompt,
                        SamplingParams(temperature=0.0, max_new_tokens=spec.max_new, stop_token_ids=spec.stop_ids),
                    )
                )
            if spec.abort_at == step and sched.abort(spec.rid):
                seen["aborts"] += 1
        batch = sched.schedule()
        check_step(case, sched, pool, batch, where)
        seen["chunks cut at the threshold"] += sum(
            e.num_new_tokens == threshold < e.request.num_tokens_with_pending - e.request.num_computed_tokens
            for e in batch
        )
        speculating = any(r.draft_ids for r in batch.requests)
        if len(batch):
            drafted = {r.request_id: (r.num_tokens, list(r.draft_ids)) for r in batch.requests if r.draft_ids}
            sched.advance(batch)  # (a speculating request's row 0 follows its known tokens, not its drafts)
            inflight.append(
                (batch, [drafted.get(r.request_id, (r.num_computed_tokens, [])) for r in batch.sampling_requests])
            )
        else:
            assert inflight or not sched.has_work(), (
                f"{where}: an empty step with nothing in flight while requests wait: "
                f"{[r.request_id for r in sched.waiting]}, run: {[r.request_id for r in sched.running]}, "
                f"{pool.num_free_blocks} free blocks"
            )
        # (a speculating step completes before the next is scheduled, as the engine does)
        while inflight and (len(inflight) > case.lag or not len(batch) or speculating):
            done, rows = inflight.pop(0)  # the model samples what follows the tokens the step computed
            sched.complete(
                done,
                [
                    next_token(r.token_ids[:end] + drafted[:i], case.periodic)
                    for r, (end, drafted) in zip(done.sampling_requests, rows)
                    for i in range(len(drafted) + 1)
                ],
            )
        for req in sched.take_finished():
            results[req.request_id] = (req.finish_reason, req.output_ids)
            assert req.num_accepted_drafts <= req.num_output_tokens, (
                f"{where}: {req.request_id} kept {req.num_accepted_drafts} drafts of {req.num_output_tokens} outputs"
            )
        step += 1
    where = f"seed {case.seed} (threshold {threshold}, drafts {drafts}, lag {case.lag})"
    assert not inflight and not sched.requests and not sched.has_work(), f"{where}: requests left at the end"
    assert pool.num_free_blocks == pool.num_blocks, f"{where}: {pool.num_used_blocks} KV blocks leaked"
    seen["preemptions"] += sched.num_preemptions
    seen["accepted drafts"] += sched.num_accepted_drafts
    seen["rejected drafts"] += sched.num_draft_tokens - sched.num_accepted_drafts
    seen["prefix hits"] += sched.num_cached_prompt_tokens > 0
    return results, seen


@functools.cache
def run_case(seed: int) -> Counter:
    """Simulate the seed's workload with its threshold (and with 0), check every output.
    Returns what happened, for the coverage test."""
    case = make_case(seed)
    results, seen = simulate(case, case.threshold, case.drafts)
    plain = simulate(case, 0, 0)[0] if case.threshold or case.drafts else results
    for spec in case.specs:
        where = f"seed {seed}: {spec.rid} (threshold {case.threshold}, drafts {case.drafts}, lag {case.lag})"
        reason, out = results[spec.rid]
        alone = generate_alone(spec, case.periodic)
        if reason == "abort":
            assert out == alone[1][: len(out)], f"{where}: aborted with {out}, not a prefix of {alone[1]}"
            continue
        assert (reason, out) == alone, f"{where}: {reason} with {out}; alone it gives {alone}"
        if spec.abort_at is None:
            assert (reason, out) == plain[spec.rid], f"{where}: {reason} with {out}; threshold 0: {plain[spec.rid]}"
        seen[reason] += 1
    seen["preemptions with a threshold and lag 1"] = seen["preemptions"] * (case.threshold > 0 and case.lag == 1)
    return seen


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_random_workload_keeps_the_scheduler_invariants(seed):
    run_case(seed)


def test_the_seeds_cover_what_matters():
    """The random workloads preempt, hit the prefix cache, cut chunks, abort and stop (a
    generator change that loses one of these would leave it untested)."""
    seeds_with = Counter(what for s in SEEDS for what, n in run_case(s).items() if n)
    for what in (
        "preemptions",
        "prefix hits",
        "chunks cut at the threshold",
        "aborts",
        "stop",
        "length",
        "preemptions with a threshold and lag 1",
        "accepted drafts",
        "rejected drafts",
    ):
        assert seeds_with[what] >= 5, f"only {seeds_with[what]} of the seeds have {what}: {dict(seeds_with)}"
