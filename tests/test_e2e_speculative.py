"""The real daemon with n-gram speculation (`--speculative-algorithm ngram`): a text that
repeats its prompt streams the session daemon's greedy tokens, GenerateComplete reports the
drafts verified and kept, and every KV block comes back."""

from __future__ import annotations

import random

import pytest

from helpers import Daemon, scheduler_stub, wait_kv_free
from test_e2e_grpc import chunks_of, completes_of, fresh_salt, generate, make_request, one_complete


@pytest.fixture(scope="module")
def spec_stub(tmp_path_factory):
    with (
        Daemon(
            max_running_requests=8,
            kv_cache_tokens=8192,
            extra_args=["--speculative-algorithm", "ngram"],
            log_dir=tmp_path_factory.mktemp("speculative"),
        ) as d,
        scheduler_stub(d.address) as stub,
    ):
        yield stub


def repeated_prompt(seed=0):
    rng = random.Random(seed)
    return [rng.randint(1000, 30000) for _ in range(24)] * 3


def test_greedy_stream_matches_the_plain_daemon_and_reports_its_drafts(spec_stub, grpc_stub):
    prompt = repeated_prompt()
    msgs = generate(
        spec_stub, make_request(prompt, max_new_tokens=40, ignore_eos=True, stream=True, cache_salt=fresh_salt())
    )
    streamed = [t for c in chunks_of(msgs) for t in c.token_ids]
    (done,) = completes_of(msgs)
    plain = one_complete(grpc_stub, make_request(prompt, max_new_tokens=40, ignore_eos=True, cache_salt=fresh_salt()))
    assert streamed == list(done.output_ids) == list(plain.output_ids)
    assert done.finish_reason == "length" and done.completion_tokens == 40
    assert 0 < done.spec_accepted_tokens <= done.spec_draft_tokens
    assert wait_kv_free(spec_stub) == (0, 0, 0)


def test_n2_and_stop_ids_with_speculation(spec_stub, grpc_stub):
    prompt = repeated_prompt(1)
    free = one_complete(grpc_stub, make_request(prompt, max_new_tokens=30, ignore_eos=True, cache_salt=fresh_salt()))
    stop = free.output_ids[7]
    kw = dict(max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    plain = one_complete(grpc_stub, make_request(prompt, cache_salt=fresh_salt(), **kw))
    msgs = generate(spec_stub, make_request(prompt, n=2, cache_salt=fresh_salt(), **kw))
    completes = sorted(completes_of(msgs), key=lambda c: c.index)
    assert [c.index for c in completes] == [0, 1]
    for c in completes:  # greedy: both sequences as the plain daemon's, ending at the stop id
        assert list(c.output_ids) == list(plain.output_ids) and c.finish_reason == "stop"
        assert c.matched_token_id == stop
    assert wait_kv_free(spec_stub) == (0, 0, 0)
