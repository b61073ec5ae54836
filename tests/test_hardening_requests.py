"""One Generate call's size is bounded before any work (request id, n x prompt, constraint
text), a grammar compiling for long keeps no other client waiting, and grammar errors reach
the client in short words of ours: end to end, on the session daemon."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from conftest import E2E_KV_CACHE_TOKENS
from helpers import child_pids

pytest.importorskip("xgrammar")
TIMEOUT = 600


def request(input_ids, *, rid=None, max_new_tokens=8, n=1, **constraint) -> pb.GenerateRequest:
    sp = pb.SamplingParams(temperature=0.0, n=n, max_new_tokens=max_new_tokens, **constraint)
    return pb.GenerateRequest(
        request_id=rid or f"hardening-{uuid.uuid4().hex[:16]}",
        tokenized=pb.TokenizedInput(original_text="", input_ids=list(input_ids)),
        sampling_params=sp,
        logprob_start_len=-1,
    )


def refusal(stub, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=TIMEOUT))
    return e.value


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def daemon_rss(daemon) -> dict[int, int]:
    """The servicer's resident memory and its children's (the scheduler)."""
    pids = [daemon.proc.pid, *child_pids(daemon.proc.pid)]
    return {pid: rss_bytes(pid) for pid in pids}


PROMPT = [1000 + i for i in range(16)]


def test_a_huge_request_id_is_refused_before_anything_grows(daemon, grpc_stub):
    before = daemon_rss(daemon)
    for _ in range(4):
        e = refusal(grpc_stub, request(PROMPT, rid="x" * 2**20, n=1024))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.details(), e
        assert len(e.details()) < 200
    after = daemon_rss(daemon)
    for pid, size in before.items():  # (unrefused, each sequence would copy the id)
        assert after[pid] - size < 64 * 2**20, (pid, size, after[pid])
    e = refusal(grpc_stub, request(PROMPT, rid="line\nbreak"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "printable" in e.details()
    # an Abort for an id not (yet) running is remembered for a while: its id is bounded too
    reply = grpc_stub.Abort(pb.AbortRequest(request_id="x" * 2**20, reason="test"), timeout=TIMEOUT)
    assert not reply.success and "request_id" in reply.message and len(reply.message) < 200


def test_n_copies_of_a_prompt_beyond_the_kv_capacity_are_refused(grpc_stub):
    prompt = [1000 + i % 4000 for i in range(1000)]
    n = E2E_KV_CACHE_TOKENS // len(prompt) + 1
    e = refusal(grpc_stub, request(prompt, n=n))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV cache's capacity" in e.details(), e


def test_an_oversized_constraint_is_refused_before_it_compiles(grpc_stub):
    properties = {f"field_{i:05d}": {"type": "integer"} for i in range(3000)}  # ~100 KB
    e = refusal(grpc_stub, request(PROMPT, json_schema=json.dumps({"type": "object", "properties": properties})))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "json_schema has" in e.details(), e


def test_grammar_errors_are_short_and_ours(grpc_stub):
    cases = {
        "invalid structural_tag: a structure lacks the string 'end'": dict(
            structural_tag=json.dumps({"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a"]})
        ),
        "invalid json_schema": dict(json_schema=json.dumps({"type": "strin"})),
        "invalid regex": dict(regex="("),
    }
    for message, constraint in cases.items():
        e = refusal(grpc_stub, request(PROMPT, **constraint))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and e.details() == message, (message, e)


def test_a_slow_grammar_keeps_no_other_client_waiting(grpc_stub):
    """A small schema that compiles for long (a long string length bound) holds one compile
    worker; another client's grammar compiles on the other meanwhile, and cancelling the slow
    call stops its compile."""
    good = dict(regex="(yes|no)!")
    list(grpc_stub.Generate(request(PROMPT, **good), timeout=TIMEOUT))  # the workers started
    slow = grpc_stub.Generate(
        request(PROMPT, json_schema=json.dumps({"type": "string", "maxLength": 50000})), timeout=TIMEOUT
    )
    slow_done = threading.Event()

    def drain():
        try:
            list(slow)
        except grpc.RpcError:
            pass
        slow_done.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        for i in range(3):  # fresh specs: each compiles (none cached)
            msgs = list(grpc_stub.Generate(request(PROMPT, regex=f"(yes|no){{{i + 1}}}!"), timeout=TIMEOUT))
            assert msgs[-1].WhichOneof("response") == "complete"
        assert not slow_done.is_set(), "the slow grammar finished first: nothing was shown"
    finally:
        slow.cancel()
    assert slow_done.wait(60)
