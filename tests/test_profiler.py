"""StepProfiler in-process: the trace is built on the caller's thread and written by a
background TraceWrite (the scheduler loop keeps serving); sessions are capped in steps."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest
import torch

from scheduler import profiler as profiler_module
from scheduler.messages import ControlReply, ControlRequest
from scheduler.process import SchedulerLoop
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
    prof = StepProfiler(profile_dir=str(tmp_path))
    ok, msg = prof.start(output_dir=str(tmp_path), record_shapes=True)
    assert ok and "at most" in msg, msg
    run_steps(prof, 3)
    write = prof.stop()
    assert isinstance(write, TraceWrite) and not prof.active
    ok, msg = wait_written(prof).result
    assert ok and write.path in msg and "stopped after 3 step(s)" in msg, msg
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(write.path)], "no scratch left"
    assert json.loads(gzip.decompress(open(write.path, "rb").read()))["traceEvents"]
    ok, msg = prof.stop()
    assert not ok and write.path in msg, msg


@pytest.fixture
def held_export(monkeypatch):
    """Trace exports wait until the test sets the returned event."""
    import torch.profiler as tp

    release = threading.Event()
    export = tp.profile.export_chrome_trace

    def held(self, path, *args, **kw):
        assert release.wait(timeout=60)
        return export(self, path, *args, **kw)

    monkeypatch.setattr(tp.profile, "export_chrome_trace", held)
    yield release
    release.set()


def test_no_new_session_while_the_last_trace_is_written(tmp_path, held_export):
    prof = StepProfiler(profile_dir=str(tmp_path))
    assert prof.start(output_dir=str(tmp_path))[0]
    run_steps(prof, 2)
    write = prof.stop()
    assert isinstance(write, TraceWrite) and not write.done()
    ok, msg = prof.start(output_dir=str(tmp_path))
    assert not ok and "still being written" in msg, msg
    assert all(p.name.startswith(".") for p in tmp_path.iterdir()), "only hidden scratch while writing"
    assert not list(tmp_path.glob("*.json*")), "scratch files must not look like traces"
    held_export.set()
    wait_written(prof)
    assert prof.start(output_dir=str(tmp_path))[0]
    prof.stop()
    wait_written(prof)


def test_a_write_cut_short_leaves_nothing(tmp_path, held_export):
    prof = StepProfiler(profile_dir=str(tmp_path))
    assert prof.start(output_dir=str(tmp_path))[0]
    run_steps(prof, 1)
    write = prof.stop()
    assert not write.wait(timeout=0.2)
    write.discard()  # what the scheduler does when it exits before the write ends
    assert list(tmp_path.iterdir()) == []


class RecordingLoop(SchedulerLoop):
    """The scheduler loop's control path alone: replies are recorded, not sent."""

    def __init__(self, profile_dir):
        self.profiler = StepProfiler(profile_dir=str(profile_dir))
        self.replies: list[ControlReply] = []

    def send(self, msg) -> None:
        self.replies.append(msg)


def control(loop, call_id, method, **args):
    reply = loop._control(ControlRequest(call_id, method, args))
    if reply is not None:
        loop.send(reply)


def test_each_deferred_stop_profile_gets_its_own_trace(tmp_path, held_export):
    """StopProfile 1 waits for trace A; A is written; then a StartProfile and StopProfile 2
    arrive in one inbox read (no loop pass between): 1 gets A, 2 gets the new trace B."""
    loop = RecordingLoop(tmp_path)
    control(loop, 0, "start_profile", output_dir=str(tmp_path))
    run_steps(loop.profiler, 1)
    control(loop, 1, "stop_profile")
    control(loop, 2, "stop_profile")  # a second caller of the same stop waits for A too
    first = loop.profiler.writing
    held_export.set()
    assert first.wait(timeout=60)
    control(loop, 3, "start_profile", output_dir=str(tmp_path))
    run_steps(loop.profiler, 1)
    control(loop, 4, "stop_profile")
    second = loop.profiler.writing
    assert second is not first and second.wait(timeout=60)
    loop._answer_written_trace()
    by_call = {r.call_id: r for r in loop.replies}
    assert sorted(by_call) == [0, 1, 2, 3, 4] and len(loop.replies) == 5, loop.replies
    assert all(r.ok for r in loop.replies), loop.replies
    assert first.path in by_call[1].message and first.path in by_call[2].message
    assert second.path in by_call[4].message
    loop._answer_written_trace()
    assert len(loop.replies) == 5, "a reply went out twice"


def test_sessions_are_capped_in_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(profiler_module, "MAX_PROFILE_STEPS", 15)
    prof = StepProfiler(profile_dir=str(tmp_path))
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
    prof = StepProfiler(profile_dir=str(tmp_path))
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
    ok, msg = StepProfiler(profile_dir=str(tmp_path)).start(output_dir=str(tmp_path), num_steps=bad)
    assert not ok and "num_steps" in msg


def test_profiling_is_off_without_a_profile_dir(tmp_path):
    prof = StepProfiler()
    for ok, msg in (prof.start(output_dir=str(tmp_path / "x")), prof.stop()):
        assert not ok and "profiling is off" in msg and "--profile-dir" in msg, msg
    assert list(tmp_path.iterdir()) == []


def test_output_dir_must_resolve_inside_the_profile_dir(tmp_path):
    base = tmp_path / "profiles"
    base.mkdir()
    (base / "out").symlink_to(tmp_path)
    real = os.path.realpath(base)
    assert profiler_module.resolve_output_dir(str(base), None) == real
    assert profiler_module.resolve_output_dir(str(base), "a/b") == os.path.join(real, "a", "b")
    assert profiler_module.resolve_output_dir(str(base), str(base / "a")) == os.path.join(real, "a")
    assert profiler_module.resolve_output_dir(str(base), "a/../b") == os.path.join(real, "b")
    for bad in ["..", "../profiles-x", "a/../../x", str(tmp_path / ".ssh"), "/", "out", "out/x", "a\x00b"]:
        assert profiler_module.resolve_output_dir(str(base), bad) is None, bad


def test_new_directories_are_private(tmp_path):
    prof = StepProfiler(profile_dir=str(tmp_path / "profiles"))
    ok, msg = prof.start(output_dir="a/b", num_steps=1)
    assert ok, msg
    for d in (tmp_path / "profiles", tmp_path / "profiles" / "a", tmp_path / "profiles" / "a" / "b"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    run_steps(prof, 1)
    write = wait_written(prof)
    assert os.stat(write.path).st_mode & 0o777 == 0o600


def test_directories_others_may_write_are_refused(tmp_path):
    """A profile directory (or one found inside it) that another user owns or may write
    could be swapped for a link before the trace lands: refused, generically."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # as /tmp
    ok, msg = StepProfiler(profile_dir=str(shared)).start(num_steps=1)
    assert not ok and "cannot write traces" in msg and "Errno" not in msg
    base = tmp_path / "profiles"
    (base / "open").mkdir(parents=True)
    os.chmod(base / "open", 0o777)
    ok, msg = StepProfiler(profile_dir=str(base)).start(output_dir="open/x", num_steps=1)
    assert not ok and not (base / "open" / "x").exists()


def test_a_file_where_the_directory_should_be_is_a_generic_answer(tmp_path, caplog):
    (tmp_path / "f").write_text("")
    ok, msg = StepProfiler(profile_dir=str(tmp_path)).start(output_dir="f/sub")
    assert not ok and "daemon log" in msg, msg
    assert "Not a directory" not in msg and "exists" not in msg, msg
    assert "cannot use the output directory" in caplog.text and "Errno" in caplog.text, "the reason goes to the log"


def test_only_the_newest_traces_are_kept(tmp_path):
    prof = StepProfiler(profile_dir=str(tmp_path), max_traces=2)
    other = tmp_path / "notes.json.gz"
    other.write_text("not ours")
    paths = []
    for sub in ["", "a", "b"]:  # the cap counts traces in every subdirectory
        assert prof.start(output_dir=sub)[0]
        run_steps(prof, 1)
        prof.stop()
        paths.append(wait_written(prof).path)
    kept = sorted(str(p) for p in tmp_path.rglob("*.trace.json.gz"))
    assert kept == sorted(paths[1:]), kept
    assert other.exists(), "files that are not our traces stay"
