"""StartProfile / StopProfile on the session daemon (router contract §6): a torch.profiler
session inside the scheduler process, written as a Chrome trace on stop."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
from smg_grpc_proto.generated import common_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb


def generate(stub, max_new_tokens=4):
    req = pb.GenerateRequest(
        request_id=f"prof-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=[123, 456, 789, 234, 567, 890, 345]),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, top_k=-1, top_p=1.0),
        logprob_start_len=-1,
    )
    msgs = list(stub.Generate(req, timeout=120))
    assert msgs and msgs[-1].WhichOneof("response") == "complete"


def stop(stub):
    return stub.StopProfile(spb.StopProfileRequest(), timeout=120)


def read_trace(path: Path) -> dict:
    assert path.exists() and path.stat().st_size > 0, path
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data)


@pytest.fixture
def no_profile(grpc_stub):
    """Make sure no session is left running by (or before) the test."""
    stop(grpc_stub)
    yield
    stop(grpc_stub)


def test_profile_writes_a_chrome_trace(grpc_stub, tmp_path, no_profile):
    r = grpc_stub.StartProfile(spb.StartProfileRequest(output_dir=str(tmp_path), activities=["CPU", "GPU"]), timeout=60)
    assert r.success, r.message
    generate(grpc_stub)
    r = stop(grpc_stub)
    assert r.success, r.message
    traces = list(tmp_path.glob("*.trace.json.gz"))
    assert len(traces) == 1, traces
    assert str(traces[0]) in r.message, "the reply should name the trace file"
    trace = read_trace(traces[0])
    assert trace.get("traceEvents"), "an empty trace"


def test_profile_errors_are_answers(grpc_stub, tmp_path, no_profile):
    r = stop(grpc_stub)
    assert not r.success and "no profile is running" in r.message
    assert grpc_stub.StartProfile(spb.StartProfileRequest(output_dir=str(tmp_path)), timeout=60).success
    again = grpc_stub.StartProfile(spb.StartProfileRequest(output_dir=str(tmp_path)), timeout=60)
    assert not again.success and "already" in again.message
    bad = stop(grpc_stub)
    assert bad.success, bad.message
    r = grpc_stub.StartProfile(spb.StartProfileRequest(output_dir=str(tmp_path), activities=["TPU"]), timeout=60)
    assert not r.success and "TPU" in r.message
    r = grpc_stub.StartProfile(spb.StartProfileRequest(output_dir=str(tmp_path), profile_by_stage=True), timeout=60)
    assert not r.success and "profile_by_stage" in r.message, r.message  # refused, not ignored
    r = grpc_stub.StartProfile(spb.StartProfileRequest(output_dir=f"{tmp_path}/a\x00b"), timeout=60)
    assert not r.success and "cannot create output_dir" in r.message, r.message


def test_profile_start_step_and_num_steps(grpc_stub, tmp_path, no_profile):
    """start_step 1, num_steps 2: begins one step later, stops by itself two steps after."""
    req = spb.StartProfileRequest(output_dir=str(tmp_path), start_step=1, num_steps=2, record_shapes=True)
    r = grpc_stub.StartProfile(req, timeout=60)
    assert r.success and "in 1 step" in r.message and "for 2 step" in r.message, r.message
    generate(grpc_stub, max_new_tokens=6)  # prefill + 5 decode steps
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*.trace.json.gz")) and time.monotonic() < deadline:
        time.sleep(0.1)
    traces = list(tmp_path.glob("*.trace.json.gz"))
    assert len(traces) == 1, "the profile should stop and write its trace by itself"
    # The file appears whole (written aside, then renamed); a StopProfile now names it,
    # with the write's own answer or as the last trace once nothing is running.
    r = stop(grpc_stub)
    assert str(traces[0]) in r.message, r.message
    assert read_trace(traces[0]).get("traceEvents")
