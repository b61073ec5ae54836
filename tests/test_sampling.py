"""The batched sampler on synthetic logits: every transform against a straightforward
per-row reference, greedy/top-k=1/seed behaviour, logprobs, and the request-side pieces
(BatchSampler.build from requests, stop strings)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels
from kernels.sampling import Penalties, SamplingTensors, argmax_rows, sample, token_logprobs
from scheduler.messages import SamplingParams
from scheduler.request import Request
from scheduler.sampling_batch import BatchSampler
from scheduler.scheduler import ScheduledRequest

V = 512
EOS = 2


def logits_of(n, vocab=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def params(n, temperature=1.0, top_p=1.0, top_k=-1, **kw):
    def col(v):
        return v if isinstance(v, list) else [v] * n

    return SamplingTensors.build(col(temperature), col(top_p), col(top_k), "cpu", **kw)


def make_req(prompt, outputs=(), rid="r", **sp):
    sp.setdefault("max_new_tokens", 64)
    req = Request(rid, list(prompt), SamplingParams(**sp), sp["max_new_tokens"], frozenset({EOS}))
    req.token_ids.extend(outputs)
    return req


def sampler():
    return BatchSampler(
        lm_head=None, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0), vocab_size=V
    )


# -- greedy, top-k 1, seeds -------------------------------------------------------------


def test_greedy_is_argmax():
    logits = logits_of(8)
    out = sample(logits.clone(), params(8, temperature=0.0))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_1_is_greedy_even_hot():
    logits = logits_of(8)
    out = sample(logits.clone(), params(8, temperature=5.0, top_k=1), torch.Generator().manual_seed(1))
    assert torch.equal(out, logits.argmax(-1))


def test_the_request_and_the_kernels_agree_on_what_is_greedy():
    from kernels.sampling import MIN_TEMPERATURE
    from scheduler.messages import GREEDY_TEMPERATURE

    assert GREEDY_TEMPERATURE == MIN_TEMPERATURE
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy and not SamplingParams(temperature=0.01).greedy


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = logits_of(6)
    p = params(6, temperature=[0.0, 1.0, 0.0, 2.0, 0.0, 0.7])
    out = sample(logits.clone(), p, torch.Generator().manual_seed(3))
    greedy = logits.argmax(-1)
    assert out[0] == greedy[0] and out[2] == greedy[2] and out[4] == greedy[4]


def seeded_draws(seed, steps, batch_logits, row, **kw):
    """Tokens drawn for a seeded row `row` over several steps, the rest of the batch unseeded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    n = batch_logits.shape[0]
    for s in range(steps):
        p = params(n, seeded=[(row, g)], **kw)
        out.append(int(sample(batch_logits.clone(), p, torch.Generator().manual_seed(1000 + s))[row]))
    return out


@pytest.mark.parametrize("kw", [{}, {"top_k": 40}, {"top_p": 0.9}, {"top_k": 3000, "top_p": 0.8}])
def test_seeded_rows_reproducible_whatever_the_batch(kw):
    flat = logits_of(1, scale=0.5)  # flat-ish: many tokens are plausible
    alone = seeded_draws(7, 12, flat, 0, **kw)
    # same seed inside a bigger batch whose other rows differ (other top-k: other code path)
    batch = torch.cat([logits_of(3, seed=5), flat, logits_of(2, seed=6)])
    other_k = {"top_k": [kw.get("top_k", -1)] * 3 + [kw.get("top_k", -1)] + [-1, 10]} if kw else {}
    in_batch = seeded_draws(7, 12, batch, 3, **{**kw, **other_k})
    assert alone == in_batch
    assert seeded_draws(8, 12, flat, 0, **kw) != alone
    assert len(set(alone)) > 1  # it does sample


def test_unseeded_sampling_matches_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    out = sample(logits.clone(), params(4000), torch.Generator().manual_seed(0))
    freq = torch.bincount(out, minlength=4).float() / 4000
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.03)


# -- top-k / top-p / min-p / temperature ------------------------------------------------------


def ref_filter(row, temperature, top_k, top_p, min_p):
    """Per-row reference (SGLang's semantics): the set of tokens that may be sampled."""
    probs = torch.softmax(row / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for rank, i in enumerate(order):
        if (top_k <= 0 or rank < top_k) and mass < top_p and probs[i] >= min_p * probs[order[0]]:
            kept.add(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (0.7, -1, 0.5, 0.0),
        (1.3, 50, 0.9, 0.0),
        (1.0, -1, 1.0, 0.2),
        (0.5, 20, 0.95, 0.05),
        (1.0, 2000, 0.7, 0.0),
    ],
)
def test_filters_match_reference(temperature, top_k, top_p, min_p):
    logits = logits_of(4, seed=11, scale=1.5)
    allowed = [ref_filter(logits[i], temperature, top_k, top_p, min_p) for i in range(4)]
    n = 4
    seen = [set() for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        p = params(n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=[min_p] * n)
        out = sample(logits.clone(), p, g)
        for i in range(n):
            seen[i].add(int(out[i]))
    for i in range(n):
        assert seen[i] <= allowed[i], f"row {i}: sampled outside the filter: {seen[i] - allowed[i]}"
        if len(allowed[i]) <= 6:
            assert seen[i] == allowed[i]


def test_filtered_sampling_follows_renormalised_distribution():
    # top-k 3 of 5 tokens, then the draw must follow the renormalised top-3 probabilities
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5]]).repeat(6000, 1)
    out = sample(logits.clone(), params(6000, top_k=3), torch.Generator().manual_seed(0))
    freq = torch.bincount(out, minlength=5).float() / 6000
    want = torch.cat([logits[0, :3].softmax(-1), torch.zeros(2)])
    assert torch.allclose(freq, want, atol=0.03)
    # top-p 0.6: mass before token 2 is > 0.6 -> only tokens 0 and 1 (SGLang: of the whole distribution)
    probs = logits[0].softmax(-1)
    assert probs[0] < 0.6 < probs[0] + probs[1]
    out = sample(logits.clone(), params(6000, top_p=0.6), torch.Generator().manual_seed(1))
    freq = torch.bincount(out, minlength=5).float() / 6000
    want = torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(3)])
    assert torch.allclose(freq, want, atol=0.03)


def test_tokens_tied_with_the_kth_stay():
    # three tokens tie for second place: top_k 2 keeps all three (vLLM's and FlashInfer's
    # threshold semantics), and so does top_p 0.5, whose mass test counts only the more likely
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]]).repeat(4000, 1)
    probs = logits[0].softmax(-1)
    assert probs[0] < 0.5 < probs[0] + probs[1]
    for kw in ({"top_k": 2}, {"top_p": 0.5}):
        out = sample(logits.clone(), params(4000, **kw), torch.Generator().manual_seed(0))
        freq = torch.bincount(out, minlength=5).float() / 4000
        want = torch.cat([probs[:4] / probs[:4].sum(), torch.zeros(1)])
        assert torch.allclose(freq, want, atol=0.03), (kw, freq)


@pytest.mark.parametrize("kw", [{"top_k": 20}, {"top_k": 20, "top_p": 0.9}, {"min_p": [0.9] * 16}])
def test_flat_distribution_needs_few_redraws(monkeypatch, kw):
    # A hot, flat distribution: the first draw lands far below the top 20. Halving redraws
    # alone would take ~log2(vocab / 20) rounds; narrowing to what the filters keep after
    # the first rejection leaves one or two.
    import kernels.sampling as sampling

    draws = []
    real_draw = sampling._draw
    monkeypatch.setattr(sampling, "_draw", lambda w, u: draws.append(w.shape[0]) or real_draw(w, u))
    logits = logits_of(16, seed=3, scale=0.2)
    min_p = kw.get("min_p", [0.0] * 16)
    p = params(16, temperature=2.0, top_k=kw.get("top_k", -1), top_p=kw.get("top_p", 1.0), min_p=min_p)
    out = sample(logits.clone(), p, torch.Generator().manual_seed(0))
    for i in range(16):
        assert int(out[i]) in ref_filter(logits[i], 2.0, kw.get("top_k", -1), kw.get("top_p", 1.0), min_p[i])
    assert len(draws) <= 3, draws


def test_tiny_top_p_is_greedy_and_terminates():
    logits = logits_of(8, scale=0.1)  # flat: the rejection loop needs many rounds
    out = sample(logits.clone(), params(8, top_p=1e-6), torch.Generator().manual_seed(0))
    assert torch.equal(out, logits.argmax(-1))


# -- penalties, bias, min_new_tokens ----------------------------------------------------------


def ref_penalise(row, prompt, outputs, rep, freq, pres):
    row = row.clone()
    seen = set(prompt) | set(outputs)
    for t in seen:
        if rep != 1.0:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(outputs):
        c = outputs.count(t)
        row[t] -= freq * c + pres
    return row


def test_penalties_match_reference_formulas():
    torch.manual_seed(0)
    logits = logits_of(5)
    prompts = [[1, 5, 9, 9], [3, 4], [7], [100, 101, 102], [8]]
    outputs = [[5, 5, 6], [4, 4, 4, 10], [], [100, 200, 200], [9]]
    cfg = [(1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.2, 0.3, 0.7), (1.0, 0.0, 1.5), (1.0, 0.0, 0.0)]
    rows = [i for i, c in enumerate(cfg) if c != (1.0, 0.0, 0.0)]
    pen = Penalties.build(
        rows,
        [cfg[i][0] for i in rows],
        [cfg[i][1] for i in rows],
        [cfg[i][2] for i in rows],
        [torch.tensor(outputs[i], dtype=torch.int64) for i in rows],
        [torch.tensor(prompts[i], dtype=torch.int64) for i in rows],
        V,
        "cpu",
    )
    from kernels.sampling import apply_penalties

    got = logits.clone()
    apply_penalties(got, pen)
    for i in range(5):
        want = ref_penalise(logits[i], prompts[i], outputs[i], *cfg[i])
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_build_from_requests_applies_penalties_bias_and_min_tokens():
    s = sampler()
    reqs = [
        make_req(
            [10, 11, 12],
            [11, 13, 13],
            rid="a",
            temperature=0.0,
            repetition_penalty=1.5,
            frequency_penalty=0.4,
            presence_penalty=0.2,
        ),
        make_req([20], [], rid="b", temperature=0.0, logit_bias={7: 100.0}),
        make_req([30], [31], rid="c", temperature=0.0, min_new_tokens=3, stop_token_ids=[9]),
        make_req([40], [], rid="d", temperature=0.0),
    ]
    logits = logits_of(4, seed=2)
    logits[2, EOS] = 50.0  # EOS would win without the min_new_tokens mask
    logits[2, 9] = 49.0
    p = s.build(reqs)
    assert not p.plain_greedy and p.all_greedy
    got = logits.clone()
    tokens = sample(got, p)
    want_a = ref_penalise(logits[0], [10, 11, 12], [11, 13, 13], 1.5, 0.4, 0.2)
    assert torch.allclose(got[0], want_a, atol=1e-6)
    assert tokens[0] == want_a.argmax()
    assert tokens[1] == 7  # the bias forces it
    assert tokens[2] not in (EOS, 9) and got[2, EOS] == float("-inf")
    assert tokens[3] == logits[3].argmax()
    # once min_new_tokens outputs exist, stop ids are allowed again
    reqs[2].token_ids.extend([31, 31])
    assert s.build(reqs[2:3]).banned is None


def test_a_tiny_repetition_penalty_keeps_logits_finite():
    """r -> 0 divides a seen token's positive logit by r: still a finite number, so the row
    samples a seen token with positive logit (a +inf there made the softmax NaN and the
    row silently took the last vocabulary id)."""
    s = sampler()
    logits = logits_of(1, seed=4)
    logits[0, [10, 11]] = torch.tensor([20.0, 30.0])  # / 1e-38 is past float32's 3.4e38
    req = make_req([10, 11, 12], [], rid="tiny", temperature=0.7, repetition_penalty=1e-38)
    got = logits.clone()
    tokens = sample(got, s.build([req]))
    assert not torch.isnan(got).any()
    assert int(tokens[0]) in (10, 11), tokens


def test_plain_greedy_fast_path_detected():
    s = sampler()
    reqs = [make_req([1, 2], [3], rid=str(i), temperature=0.0) for i in range(4)] + [make_req([1], rid="k", top_k=1)]
    assert s.build(reqs).plain_greedy
    assert s.build([make_req([1], rid="cold", temperature=5e-6)]).plain_greedy  # below the kernels' threshold


def test_seeded_request_reproducible_through_build():
    logits = logits_of(1, scale=0.5)

    def run(seed):
        s = sampler()
        req = make_req([1, 2, 3], rid="s", temperature=1.0, seed=seed)
        out = []
        for _ in range(10):
            tok = int(sample(logits.clone(), s.build([req]), s.generator)[0])
            req.token_ids.append(tok)
            out.append(tok)
        return out

    assert run(42) == run(42)
    assert run(42) != run(43)


# -- logprobs -----------------------------------------------------------------------------------


def test_token_logprobs():
    logits = logits_of(3)
    lp = logits.log_softmax(-1)
    tokens = torch.tensor([5, 6, 7])
    ids = torch.tensor([[1, 2], [3, 0], [4, 4]])
    chosen, top_v, top_i, ids_v = token_logprobs(lp, tokens, 4, ids)
    assert torch.allclose(chosen, lp[torch.arange(3), tokens])
    ref_v, ref_i = lp.topk(4)
    assert torch.equal(top_i, ref_i) and torch.allclose(top_v, ref_v)
    assert torch.allclose(ids_v, lp.gather(1, ids))


class FakeModel:
    """hidden states are the logits themselves."""

    def compute_logits(self, hidden):
        return hidden.clone()


def sched_like_record(logprobs, sampling):
    """What Scheduler.advance and complete do with a step's logprobs."""
    for req, row in logprobs.prompt:
        req.input_logprobs.append(*row)
    for req, row in zip(sampling, logprobs.output or [None] * len(sampling)):
        if row is not None:
            req.output_logprobs.append(*row)


def test_batch_sampler_records_output_and_input_logprobs():
    s = BatchSampler(FakeModel().compute_logits, torch.device("cpu"), torch.Generator().manual_seed(0), V)
    prompt = [5, 6, 7, 8]
    req = make_req(
        prompt,
        rid="lp",
        temperature=0.0,
        return_logprob=True,
        top_logprobs_num=3,
        token_ids_logprob=[1, 2],
        logprob_start_len=0,
    )
    other = make_req([9, 9, 9], rid="o", temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    hidden = logits_of(7, seed=9)  # rows 0..3: req's prompt, 4..6: other's prompt
    step = [ScheduledRequest(req, 4, samples=True), ScheduledRequest(other, 3, samples=True)]
    tokens, logprobs = s.run(step, hidden, [3, 6], [req, other])
    tokens = tokens.tolist()
    assert len(tokens) == 2 and tokens[0] == int(hidden[3].argmax())
    # the rows go to the scheduler, which records them with the tokens
    assert logprobs.output[1] is None and not req.output_logprobs.values and len(req.input_logprobs.values) == 1
    sched_like_record(logprobs, [req, other])
    req.input_logprob_next = 3  # (Scheduler.advance)
    lp = hidden.log_softmax(-1)
    il = req.input_logprobs
    assert il.token_ids == prompt and il.values[0] is None
    for t in range(1, 4):
        assert il.values[t] == pytest.approx(float(lp[t - 1, prompt[t]]), abs=1e-5)
        assert il.top_ids[t] == lp[t - 1].topk(3).indices.tolist()
    ol = req.output_logprobs
    assert ol.values[0] == pytest.approx(float(lp[3, tokens[0]]), abs=1e-5)
    assert ol.top_ids[0] == lp[3].topk(3).indices.tolist()
    assert ol.ids_values[0] == pytest.approx(lp[3, [1, 2]].tolist(), abs=1e-5)
    assert other.output_logprobs is None and other.input_logprobs is None
    assert not req.needs_input_logprobs


def test_input_logprobs_across_chunks_and_start_len():
    s = BatchSampler(FakeModel().compute_logits, torch.device("cpu"), torch.Generator().manual_seed(0), V)
    prompt = list(range(20, 30))
    req = make_req(prompt, rid="c", temperature=0.0, return_logprob=True, logprob_start_len=4)
    hidden = logits_of(10, seed=3)
    assert req.prefix_cache_limit == 3
    _, logprobs = s.run([ScheduledRequest(req, 6)], hidden[:6], [], [])  # chunk 1: positions 0..5
    sched_like_record(logprobs, [])
    req.input_logprob_next, req.num_computed_tokens = 6, 6  # (Scheduler.advance)
    assert req.prefix_cache_limit == 6
    # chunk 2: positions 6..9, samples
    _, logprobs = s.run([ScheduledRequest(req, 4, samples=True)], hidden[6:], [3], [req])
    sched_like_record(logprobs, [req])
    req.input_logprob_next = 9
    lp = hidden.log_softmax(-1)
    il = req.input_logprobs
    assert il.token_ids == prompt[4:]
    assert il.values == pytest.approx([float(lp[t - 1, prompt[t]]) for t in range(4, 10)], abs=1e-5)
    assert req.prefix_cache_limit is None


# -- stop strings ---------------------------------------------------------------------------------


class CharTokenizer:
    """token id = a character (ids < 256); 0 decodes to nothing (a special token)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids if i)

    def get_added_vocab(self):
        return {}


def feed_all(text, stops, trim=True, min_new=0):
    from scheduler.stop_strings import StopStringChecker

    req = make_req(
        [ord("x")],
        rid="st",
        temperature=0.0,
        stop=stops,
        no_stop_trim=not trim,
        min_new_tokens=min_new,
        max_new_tokens=len(text) + 5,
    )
    req.stop_checker = StopStringChecker(CharTokenizer(), stops, [ord("x")], trim=trim)
    safe = []
    for ch in text:
        req.append_token(ord(ch))
        safe.append(req.num_sendable_tokens)
        if req.is_finished:
            break
    return req, safe


def test_stop_string_automata_equal_brute_force():
    """The incremental (KMP) matches and held-back characters equal a search from scratch:
    the earliest match starting in the last len(stop) - 1 characters or later (it ends in the
    new text), and the longest text suffix that is a proper prefix of a stop, on random small
    alphabets (repetitive stops, overlapping and ignored matches included)."""
    import random

    from scheduler.stop_strings import StopStringChecker

    def held_back(text, stops):
        return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)

    def new_match(text, before, stops):
        found = [(text.find(s, max(0, before - len(s) + 1)), s) for s in stops]
        return min(((pos, s) for pos, s in found if pos != -1), default=None)

    rng = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        checker = StopStringChecker(CharTokenizer(), stops, [ord("x")])
        for _ in range(rng.randint(1, 14)):
            before = len(checker.text)
            match = checker.feed(ord(rng.choice(alphabet)))
            want = new_match(checker.text, before, stops)
            if want is None:
                assert match is None, (checker.text, stops)
            else:  # one character a token: the tokens to keep are the match's position
                stop, keep = match
                assert keep == want[0] and checker.text.startswith(stop, keep), (checker.text, stops, match)
            assert max(checker.matched) == held_back(checker.text, stops), (checker.text, stops)


def test_stop_string_trimmed_and_held_back():
    req, safe = feed_all("hello STOP world", ["STOP"])
    assert req.finish_reason == "stop" and req.matched_stop_str == "STOP"
    assert "".join(map(chr, req.visible_output_ids)) == "hello "
    # while "S", "ST", "STO" could begin the stop string, they were held back
    assert safe[6:9] == [6, 6, 6]


def test_stop_string_kept_with_no_stop_trim():
    req, safe = feed_all("hello STOP world", ["STOP"], trim=False)
    assert "".join(map(chr, req.visible_output_ids)) == "hello STOP"
    assert safe[-2] == 9  # nothing held back when not trimming


def test_stop_string_false_start_released_and_earliest_match_wins():
    req, safe = feed_all("aSTb xy ab", ["STOP", "xy"])
    assert req.matched_stop_str == "xy"
    assert "".join(map(chr, req.visible_output_ids)) == "aSTb "
    assert safe[3] == 4  # "aSTb": the false start is released once "b" arrives


def test_stop_string_respects_min_new_tokens():
    req, _ = feed_all("ab ab ab", ["ab"], min_new=4)
    assert "".join(map(chr, req.visible_output_ids)) == "ab "


def test_stop_match_ignored_under_min_new_tokens_is_never_found_again():
    # "ab" completes at token 2, under min_new_tokens, and is streamed; a longer stop string
    # must not widen the search back onto it (that would trim tokens already sent).
    req, safe = feed_all("abqrs", ["ab", "wxyz"], min_new=3)
    assert not req.is_finished
    assert safe == sorted(safe) and "".join(map(chr, req.visible_output_ids)) == "abqrs"


# -- a full-size mixed batch --------------------------------------------------------------------


def test_a_mixed_64_row_batch_at_full_vocabulary():
    """64 rows at SmolLM2's vocabulary mixing greedy, top-k/top-p, min-p, penalties, bias and
    seeds: the build takes the general path (not the greedy fast path), every row samples an
    in-vocabulary token, greedy rows are the argmax of their (biased) logits and top-k rows
    draw from the top k of their penalised logits."""
    vocab, n = 49152, 64
    s = BatchSampler(None, torch.device("cpu"), torch.Generator().manual_seed(0), vocab)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (300,), generator=g).tolist()
    out = torch.randint(0, vocab, (100,), generator=g).tolist()
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.05),
        dict(temperature=1.0, top_p=0.95),
        dict(temperature=0.8, min_p=0.05, frequency_penalty=0.3, presence_penalty=0.2, seed=5),
    ]
    mixed = []
    for i in range(n):
        mixed.append(make_req(prompt, out, rid=f"m{i}", **kinds[i % 4]))
        if i % 8 == 0:  # (greedy rows)
            mixed[-1].sampling.logit_bias = {11: 10.0}
    greedy = [make_req(prompt, out, rid=f"g{i}", temperature=0.0) for i in range(n)]
    logits = torch.randn(n, vocab, generator=g)

    assert s.build(greedy).plain_greedy
    p = s.build(mixed)
    assert not p.plain_greedy and not p.all_greedy
    assert p.penalties is not None and p.bias is not None and p.min_p is not None and p.any_top_k
    assert p.num_rows == 48 and len(p.seeded) == 16  # 16 greedy rows; the min-p rows are seeded
    tokens = sample(logits.clone(), p, s.generator).tolist()
    assert len(tokens) == n and all(0 <= t < vocab for t in tokens)
    seen = torch.tensor(sorted(set(prompt + out)))
    for i in range(0, n, 4):
        row = logits[i].clone()
        if i % 8 == 0:
            row[11] += 10.0
        assert tokens[i] == int(row.argmax()), i
    for i in range(1, n, 4):
        row = logits[i].clone()
        v = row[seen]
        row[seen] = torch.where(v > 0, v / 1.05, v * 1.05)
        assert tokens[i] in set(row.topk(20).indices.tolist()), i


# -- grammar bitmask ---------------------------------------------------------------------------


def test_bitmask_torch_path_matches_xgrammar():
    from kernels.sampling import _apply_bitmask_torch, apply_bitmask

    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    logits = logits_of(3)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask, [0, 2])
    _apply_bitmask_torch(b, bitmask, [0, 2])
    assert torch.equal(a, b) and torch.equal(a[1], logits[1])
    bit = lambda row, t: (int(bitmask[row, t // 32]) >> (t % 32)) & 1  # noqa: E731
    assert all((a[0, t] == float("-inf")) == (bit(0, t) == 0) for t in range(V))


class OnlyAllows:
    """A grammar stand-in whose next token must be one of ``ids``."""

    def __init__(self, *ids):
        self.ids = ids

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self.ids:
            bitmask[row, t // 32] |= 1 << (t % 32)


def test_min_new_tokens_yields_to_a_grammar_that_can_only_end():
    pytest.importorskip("xgrammar")
    ended, open_ = (make_req([5, 6], rid=r, temperature=0.0, min_new_tokens=4) for r in "ab")
    ended.grammar, open_.grammar = OnlyAllows(EOS), OnlyAllows(EOS, 7)
    params = sampler().build([ended, open_])
    rows, cols = params.banned
    assert rows.tolist() == [1] and cols.tolist() == [EOS]  # only the row that has a choice
    logits = logits_of(2)
    logits[:, EOS] = -5.0  # EOS is not the argmax
    assert sample(logits, params).tolist() == [EOS, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(64, 49152), (3, 1003), (2, 5)])  # whole 8-lane chunks; a tail; only a tail
def test_argmax_rows_takes_the_first_maximum_of_each_row_as_torch_does(dtype, shape):
    """The native argmax (csrc/row_argmax.c) greedy sampling takes on the CPU, ties included."""
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g).to(dtype)
    x[0, 1] = x[0, -1] = x[0].max() + 1  # a tie across lanes and the tail: the first wins
    x[-1] = float("-inf")  # a row masked whole: index 0, as torch
    wide = torch.zeros(shape[0], shape[1] + 3, dtype=dtype)
    wide[:, : shape[1]] = x
    for rows in (x, wide[:, : shape[1]]):  # contiguous, and rows a stride apart
        native = cpu_kernels.row_argmax(rows)
        assert native is not None and native.dtype == torch.int64
        assert torch.equal(native, rows.max(dim=-1).indices)
        assert torch.equal(argmax_rows(rows), native)
    assert cpu_kernels.row_argmax(x.t()) is None  # columns a stride apart: torch's path
