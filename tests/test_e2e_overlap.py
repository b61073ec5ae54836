"""The real daemon with the overlap schedule forced on (`--overlap-schedule on`; on the CPU
it is off by default): concurrent streams give the session daemon's greedy tokens, stop
tokens and cancellations mid-stream still end cleanly, and every KV block comes back."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import Daemon, scheduler_stub
from test_e2e_grpc import (
    RPC_TIMEOUT,
    chunks_of,
    completes_of,
    fresh_salt,
    generate,
    make_request,
    one_complete,
    wait_idle,
)


@pytest.fixture(scope="module")
def overlap_stub(tmp_path_factory):
    with (
        Daemon(
            max_running_requests=16,
            kv_cache_tokens=8192,
            extra_args=["--overlap-schedule", "on"],
            log_dir=tmp_path_factory.mktemp("overlap"),
        ) as d,
        scheduler_stub(d.address) as stub,
    ):
        yield stub


def work(n=12, seed=11):
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(rng.randint(10, 60))] for _ in range(n)]


def used_tokens(stub, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:  # the load snapshot trails the last step by at most one heartbeat
        n = stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads[0].num_used_tokens
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.3)


def test_concurrent_streams_match_the_plain_daemon(overlap_stub, grpc_stub):
    prompts = work()

    def stream(stub, ids, cache_salt=None):
        msgs = generate(stub, make_request(ids, max_new_tokens=10, ignore_eos=True, stream=True, cache_salt=cache_salt))
        tokens = [t for c in chunks_of(msgs) for t in c.token_ids]
        (done,) = completes_of(msgs)
        assert done.finish_reason == "length"
        return tokens

    with ThreadPoolExecutor(len(prompts)) as ex:
        batched = list(ex.map(lambda p: stream(overlap_stub, p), prompts))
    assert all(len(t) == 10 for t in batched)  # (12 streams batched round differently from one
    assert wait_idle(overlap_stub) == 0 and used_tokens(overlap_stub) == 0  # alone: no token check)
    # One at a time on both daemons, each prompt computed afresh (a fresh salt: no cached KV
    # from the batched run), the batches are equal: every token must match.
    ours = [stream(overlap_stub, p, fresh_salt()) for p in prompts]
    plain = [stream(grpc_stub, p, fresh_salt()) for p in prompts]  # the session daemon: plain schedule
    assert ours == plain


def test_stop_token_and_cancel_mid_stream(overlap_stub):
    prompts = work(8, seed=5)
    ref = one_complete(overlap_stub, make_request(prompts[0], max_new_tokens=12, ignore_eos=True))
    stop_at = list(ref.output_ids)[3]
    stopped = one_complete(
        overlap_stub, make_request(prompts[0], max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    )
    assert stopped.finish_reason == "stop" and list(stopped.output_ids) == list(ref.output_ids)[:4]

    def cancel_after_two_chunks(ids):
        call = overlap_stub.Generate(
            make_request(ids, max_new_tokens=400, ignore_eos=True, stream=True), timeout=RPC_TIMEOUT
        )
        for i, _ in enumerate(call):
            if i == 1:
                call.cancel()
                return True
        return False

    with ThreadPoolExecutor(len(prompts)) as ex:
        assert all(ex.map(cancel_after_two_chunks, prompts))
    assert wait_idle(overlap_stub) == 0 and used_tokens(overlap_stub) == 0
