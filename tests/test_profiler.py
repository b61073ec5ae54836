"""StepProfiler in-process: the trace is built on the caller's thread and written by a
background TraceWrite (the scheduler loop keeps serving); sessions are capped in steps."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from scheduler import profiler as profiler_module
from scheduler.profiler import StepProfiler, TraceWrite


def run_steps(prof: StepProfiler, n: int) -> None:
    x = torch.randn(8, 8)
    for _ in range(n):
        (x @ x).relu_()
        prof.on_step()


def wait_written(prof: StepProfiler) -> TraceWrite:
    assert prof.writing is not None and prof.writing.wait(timeout=60)
    write = prof.take_finished_write()
    assert write is not None and prof.writing is None
    return write


def test_stop_hands_back_a_trace_write_that_lands_whole(tmp_path):
    prof = StepProfiler()
    ok, msg = prof.start(output_dir=str(tmp_path), record_shapes=True)
    assert ok and "at most" in msg, msg
    run_steps(prof, 3)
    write = prof.stop()
    assert isinstance(write, TraceWrite) and not prof.active
    ok, msg = wait_written(prof).result
    assert ok and write.path in msg and "stopped after 3 step(s)" in msg, msg
    assert [p.name for p in tmp_path.iterdir()] == [write.path.rsplit("/", 1)[1]], "no .part or .tmp left"
    assert json.loads(gzip.decompress(open(write.path, "rb").read()))["traceEvents"]
    ok, msg = prof.stop()
    assert not ok and write.path in msg, msg


def test_no_new_session_while_the_last_trace_is_written(tmp_path):
    prof = StepProfiler()
    assert prof.start(output_dir=str(tmp_path))[0]
    run_steps(prof, 2)
    write = prof.stop()
    assert isinstance(write, TraceWrite)
    if not write.done():  # (a fast machine may already be done)
        ok, msg = prof.start(output_dir=str(tmp_path))
        assert not ok and "still being written" in msg, msg
    wait_written(prof)
    assert prof.start(output_dir=str(tmp_path))[0]
    prof.stop()
    wait_written(prof)


def test_sessions_are_capped_in_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(profiler_module, "MAX_PROFILE_STEPS", 15)
    prof = StepProfiler()
    ok, msg = prof.start(output_dir=str(tmp_path), num_steps=16)
    assert not ok and "num_steps must be in [1, 15]" in msg, msg
    ok, msg = prof.start(output_dir=str(tmp_path), num_steps=4, with_stack=True)
    assert not ok and "num_steps must be in [1, 3]" in msg and "stacks" in msg, msg  # detailed: a fifth
    ok, msg = prof.start(output_dir=str(tmp_path), activities=["CPU", "MEM"])
    assert ok and "at most 3 steps" in msg, msg
    run_steps(prof, 5)
    assert not prof.active, "the session should stop by itself after 3 steps"
    assert prof.stop() is prof.writing, "a StopProfile now is answered with that trace"
    ok, msg = wait_written(prof).result
    assert ok and "stopped by itself after 3 step(s)" in msg, msg


def test_a_failed_write_is_an_answer_and_leaves_nothing(tmp_path):
    prof = StepProfiler()
    out = tmp_path / "out"
    assert prof.start(output_dir=str(out))[0]
    run_steps(prof, 1)
    out.rmdir()  # the directory vanishes before the trace is written
    write = prof.stop()
    assert isinstance(write, TraceWrite)
    ok, msg = wait_written(prof).result
    assert not ok and "writing the trace failed" in msg, msg
    assert not out.exists()


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_num_steps_refused(tmp_path, bad):
    ok, msg = StepProfiler().start(output_dir=str(tmp_path), num_steps=bad)
    assert not ok and "num_steps" in msg
