"""StartProfile / StopProfile through the real daemon (router contract §6): a torch.profiler
session inside the scheduler process, written as a Chrome trace on stop, only inside the
operator's --profile-dir. The session daemon has none (profiling off); this module starts
one with --profile-dir and a cap of two kept traces."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from helpers import Daemon

MAX_TRACES = 2
ERRNO_TEXTS = ["Errno", "File exists", "Not a directory", "No such file", "Permission denied", "Is a directory"]


def generate(stub, max_new_tokens=4):
    req = pb.GenerateRequest(
        request_id=f"prof-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=[123, 456, 789, 234, 567, 890, 345]),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, top_k=-1, top_p=1.0),
        logprob_start_len=-1,
    )
    msgs = list(stub.Generate(req, timeout=120))
    assert msgs and msgs[-1].WhichOneof("response") == "complete"


def start(stub, **fields):
    return stub.StartProfile(spb.StartProfileRequest(**fields), timeout=60)


def stop(stub):
    return stub.StopProfile(spb.StopProfileRequest(), timeout=120)


def read_trace(path: Path) -> dict:
    assert path.exists() and path.stat().st_size > 0, path
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data)


def all_traces(profile_dir: Path) -> list[Path]:
    return sorted(profile_dir.rglob("*.trace.json.gz"))


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def stub(profile_dir, tmp_path_factory):
    """A SglangScheduler stub on a daemon started with --profile-dir."""
    extra = ["--profile-dir", str(profile_dir), "--profile-max-traces", str(MAX_TRACES)]
    log_dir = tmp_path_factory.mktemp("daemon")
    with Daemon(max_running_requests=4, kv_cache_tokens=2048, extra_args=extra, log_dir=log_dir) as d:
        with grpc.insecure_channel(d.address) as ch:
            yield pb_grpc.SglangSchedulerStub(ch)


@pytest.fixture
def no_profile(stub):
    """Make sure no session is left running by (or before) the test."""
    stop(stub)
    yield
    stop(stub)


def test_profiling_is_off_without_a_profile_dir(grpc_stub, tmp_path):
    """The session daemon has no --profile-dir: StartProfile is refused, nothing is created."""
    if os.environ.get("SGLANG_TORCH_PROFILER_DIR"):
        pytest.skip("SGLANG_TORCH_PROFILER_DIR is set: the session daemon profiles into it")
    target = tmp_path / "out"
    r = start(grpc_stub, output_dir=str(target))
    assert not r.success and "profiling is off" in r.message and "--profile-dir" in r.message, r.message
    assert not target.exists()
    r = stop(grpc_stub)
    assert not r.success and "profiling is off" in r.message, r.message


def test_profile_writes_a_chrome_trace(stub, profile_dir, no_profile):
    out = profile_dir / "chrome"
    r = start(stub, output_dir=str(out), activities=["CPU", "GPU"])
    assert r.success, r.message
    generate(stub)
    r = stop(stub)
    assert r.success, r.message
    traces = list(out.glob("*.trace.json.gz"))
    assert len(traces) == 1, traces
    assert str(traces[0]) in r.message, "the reply should name the trace file"
    assert read_trace(traces[0]).get("traceEvents"), "an empty trace"
    assert out.stat().st_mode & 0o777 == 0o700 and traces[0].stat().st_mode & 0o777 == 0o600


def test_relative_output_dir_is_taken_from_the_profile_dir(stub, profile_dir, no_profile):
    r = start(stub, output_dir="rel/run1")
    assert r.success and str(profile_dir / "rel" / "run1") in r.message, r.message
    generate(stub)
    r = stop(stub)
    assert r.success and str(profile_dir / "rel" / "run1") in r.message, r.message


def test_output_dir_outside_the_profile_dir_is_refused(stub, profile_dir, tmp_path, no_profile):
    """Outside by path, by '..', or through a symlink inside it: the same answer, nothing made."""
    (profile_dir / "escape").symlink_to(tmp_path, target_is_directory=True)
    existing_file = tmp_path / "file"
    existing_file.write_text("")
    outside = [
        tmp_path / ".ssh",  # does not exist
        tmp_path,  # exists
        existing_file,  # a file
        existing_file / "sub",  # below a file
        profile_dir / ".." / "sibling",
        "../" + tmp_path.name,
        "escape",
        "escape/.ssh",
        f"{profile_dir}/a\x00b",
    ]
    before = sorted(tmp_path.rglob("*"))
    for path in outside:
        r = start(stub, output_dir=str(path))
        assert not r.success and r.message == "output_dir must be inside the profile directory", (path, r.message)
    assert sorted(tmp_path.rglob("*")) == before, "a refused StartProfile created something"
    assert not (profile_dir.parent / "sibling").exists()
    (profile_dir / "escape").unlink()


def test_filesystem_errors_reveal_nothing(stub, profile_dir, no_profile):
    (profile_dir / "plain-file").write_text("")
    for name in ["plain-file", "plain-file/sub", "x" * 300]:
        r = start(stub, output_dir=name)
        assert not r.success and "daemon log" in r.message, r.message
        assert not any(text in r.message for text in ERRNO_TEXTS), r.message


def test_errors_are_answers(stub, profile_dir, no_profile):
    r = stop(stub)
    assert not r.success and "no profile is running" in r.message
    assert start(stub).success
    again = start(stub, output_dir="other")
    assert not again.success and "already" in again.message
    assert not (profile_dir / "other").exists()
    assert stop(stub).success
    r = start(stub, activities=["TPU"])
    assert not r.success and "TPU" in r.message
    r = start(stub, profile_by_stage=True)
    assert not r.success and "profile_by_stage" in r.message, r.message  # refused, not ignored


def test_profile_start_step_and_num_steps(stub, profile_dir, no_profile):
    """start_step 1, num_steps 2: begins one step later, stops by itself two steps after."""
    out = profile_dir / "steps"
    r = start(stub, output_dir=str(out), start_step=1, num_steps=2, record_shapes=True)
    assert r.success and "in 1 step" in r.message and "for 2 step" in r.message, r.message
    generate(stub, max_new_tokens=6)  # prefill + 5 decode steps
    deadline = time.monotonic() + 60
    while not list(out.glob("*.trace.json.gz")) and time.monotonic() < deadline:
        time.sleep(0.1)
    traces = list(out.glob("*.trace.json.gz"))
    assert len(traces) == 1, "the profile should stop and write its trace by itself"
    # The file appears whole (written aside, then renamed); a StopProfile now names it,
    # with the write's own answer or as the last trace once nothing is running.
    r = stop(stub)
    assert str(traces[0]) in r.message, r.message
    assert read_trace(traces[0]).get("traceEvents")


def test_only_the_newest_traces_are_kept(stub, profile_dir, no_profile):
    written = []
    for i in range(MAX_TRACES + 2):
        assert start(stub, output_dir=f"cap/{i}").success
        generate(stub, max_new_tokens=2)
        r = stop(stub)
        assert r.success, r.message
        written += list((profile_dir / "cap" / str(i)).glob("*.trace.json.gz"))
        assert len(all_traces(profile_dir)) <= MAX_TRACES, all_traces(profile_dir)
    assert all_traces(profile_dir) == sorted(written[-MAX_TRACES:])
