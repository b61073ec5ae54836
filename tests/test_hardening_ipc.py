"""The IPC between the servicer and the scheduler process, hardened: any process of our user
can push a frame into the ZMQ sockets, and a malformed one (not msgpack, or msgpack of another
shape) is dropped with a warning by whichever side reads it, never taking the daemon down; the
IPC directory a servicer killed by SIGKILL leaves behind is removed when the next one starts."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import msgspec
import pytest
import zmq
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from helpers import (
    SCHEDULER_SERVICE,
    SRC_DIR,
    Daemon,
    child_pids,
    install_sigterm_cleanup,
    stop_process_group,
    wait_until,
)
from scheduler.messages import (
    AddRequest,
    ControlRequest,
    EngineDead,
    EngineReady,
    SamplingParams,
    StepOutput,
    from_scheduler_decoder,
    to_scheduler_encoder,
)

MALFORMED_FRAMES = [
    b"\xc1",  # a byte msgpack never uses
    b"not msgpack at all",
    msgspec.msgpack.encode([1, 2, 3]),
    msgspec.msgpack.encode({"type": "NoSuchMessage"}),
    msgspec.msgpack.encode({"type": "AddRequest", "request_id": 5}),
    msgspec.msgpack.encode({"type": "StepOutput", "outputs": "nothing"}),
]


# ------------------------------------------------------------------ through the real daemon


@pytest.fixture(scope="module")
def ipc_daemon(tmp_path_factory):
    """A daemon of this module's own: a regression here would take it down for the tests after."""
    install_sigterm_cleanup()
    with Daemon(log_dir=tmp_path_factory.mktemp("ipc-daemon")) as d:
        yield d


@pytest.fixture(scope="module")
def stub(ipc_daemon):
    with grpc.insecure_channel(ipc_daemon.address) as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


def scheduler_argv(daemon: Daemon) -> list[str]:
    """The command line of the daemon's scheduler process (its IPC addresses and config)."""
    for pid in child_pids(daemon.proc.pid):
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        if "scheduler.process" in argv:
            return argv
    raise AssertionError(f"no scheduler process among the children of {daemon.proc.pid}")


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def generate_completes(stub, max_new_tokens: int = 4) -> bool:
    req = pb.GenerateRequest(
        request_id=f"ipc-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=[123, 456, 789, 234, 567]),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, top_k=-1, top_p=1.0),
        logprob_start_len=-1,
    )
    msgs = list(stub.Generate(req, timeout=120))
    return bool(msgs) and msgs[-1].WhichOneof("response") == "complete"


def test_malformed_frames_pushed_at_the_servicer_leave_the_daemon_serving(ipc_daemon, stub):
    """The servicer binds the socket the scheduler pushes its outputs to: frames pushed there
    beside a running request are dropped, and that request and the next complete."""
    outbox = option(scheduler_argv(ipc_daemon), "--outbox")  # the servicer binds it, the scheduler pushes
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.PUSH)
    intruder.setsockopt(zmq.LINGER, 5000)
    intruder.connect(outbox)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    in_flight = pool.submit(generate_completes, stub, 32)
    try:
        for frame in MALFORMED_FRAMES:
            intruder.send(frame)

        def dropped_or_down():
            dropped = ipc_daemon.log_path.read_text(errors="replace").count("(from the scheduler) dropped a malformed")
            return dropped >= len(MALFORMED_FRAMES) or ipc_daemon.health_status(SCHEDULER_SERVICE) != "SERVING"

        wait_until(dropped_or_down, 60, "the servicer's warnings for the malformed frames")
    finally:
        pool.shutdown(wait=False)
        intruder.close()
        ctx.term()
    assert ipc_daemon.alive(), ipc_daemon.log_tail()
    assert ipc_daemon.health_status("") == "SERVING" and ipc_daemon.health_status(SCHEDULER_SERVICE) == "SERVING"
    assert in_flight.result(timeout=180), ipc_daemon.log_tail()
    assert generate_completes(stub), ipc_daemon.log_tail()


def next_message(socket_: zmq.Socket, kinds: tuple, timeout: float):
    """The next message of one of ``kinds`` from the scheduler (heartbeats and the rest skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and socket_.poll(left_ms), f"no {kinds} from the scheduler within {timeout} s"
        msg = from_scheduler_decoder.decode(socket_.recv())
        if isinstance(msg, kinds):
            return msg


def test_malformed_frames_pushed_into_the_scheduler_inbox_are_dropped(ipc_daemon, tmp_path):
    """The scheduler's inbox connects to the servicer's socket, so nothing outside can reach
    the daemon's own: a real scheduler process (the daemon's config) with this test as its
    servicer takes the frames, then still serves a request."""
    config = option(scheduler_argv(ipc_daemon), "--config")
    ipc_dir = tempfile.mkdtemp(prefix="ipc-test-", dir="/tmp")  # (ipc:// paths end at 107 bytes)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PUSH)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.bind(f"ipc://{ipc_dir}/inbox")
    outbox = ctx.socket(zmq.PULL)
    outbox.setsockopt(zmq.LINGER, 0)
    outbox.bind(f"ipc://{ipc_dir}/outbox")
    log_path = tmp_path / "scheduler.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "scheduler.process", "--config", config]
    cmd += ["--inbox", f"ipc://{ipc_dir}/inbox", "--outbox", f"ipc://{ipc_dir}/outbox"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def send_request(request_id: str, max_new_tokens: int) -> None:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        inbox.send(to_scheduler_encoder.encode(AddRequest(request_id, [123, 456, 789], sampling)))

    try:
        ready = next_message(outbox, (EngineReady, EngineDead), 180)
        assert isinstance(ready, EngineReady), ready
        requests = {"before-garbage": 8, "after-garbage": 3}  # id -> max new tokens
        send_request("before-garbage", requests["before-garbage"])
        for frame in MALFORMED_FRAMES:
            inbox.send(frame)
        send_request("after-garbage", requests["after-garbage"])
        tokens = {rid: [] for rid in requests}
        finished = {}
        while len(finished) < len(requests):
            msg = next_message(outbox, (StepOutput, EngineDead), 120)
            assert isinstance(msg, StepOutput), f"{msg}\n{log_path.read_text(errors='replace')[-3000:]}"
            for out in msg.outputs:
                assert out.error is None, out
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished[out.request_id] = out.finish_reason
        assert finished == {rid: "length" for rid in requests}
        assert {rid: len(ids) for rid, ids in tokens.items()} == requests
        assert proc.poll() is None
        # (the frames came before the request on one connection: their warnings are written)
        assert log_path.read_text(errors="replace").count("scheduler inbox dropped a malformed") == len(
            MALFORMED_FRAMES
        )
        inbox.send(to_scheduler_encoder.encode(ControlRequest(1, "shutdown")))
        proc.wait(timeout=30)
    finally:
        stop_process_group(proc, grace_s=1)
        inbox.close()
        outbox.close()
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)


# ------------------------------------------------------------------ stale IPC directories


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def ipc_dir(parent: Path, pid: int, suffix: str) -> Path:
    """A directory as a servicer makes one, with a socket nobody listens on any more."""
    d = parent / f"servicer-{pid}-{suffix}"
    d.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(d / "to-scheduler-0123abcd"))  # (closed: the file stays, as after a SIGKILL)
    return d


@pytest.fixture
def ipc_parent():
    parent = Path(tempfile.mkdtemp(prefix="stale-", dir="/tmp"))  # (socket paths end at 107 bytes)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def remove_stale_in(parent: Path) -> list[str]:
    from servicer.scheduler_client import remove_stale_ipc_dirs

    return remove_stale_ipc_dirs([str(parent)])


def test_only_the_ipc_directories_of_dead_servicers_are_removed(ipc_parent):
    gone = dead_pid()
    stale = ipc_dir(ipc_parent, gone, "abc123de")
    ours = ipc_dir(ipc_parent, os.getpid(), "ours0000")
    live = ipc_dir(ipc_parent, os.getppid(), "live0000")
    legacy = ipc_parent / "servicer-x1y2z3w4"  # no pid in the name: whose it is cannot be told
    legacy.mkdir()
    elsewhere = ipc_dir(ipc_parent, os.getpid(), "target00")
    link = ipc_parent / f"servicer-{gone}-link0000"
    link.symlink_to(elsewhere)
    held = ipc_dir(ipc_parent, gone, "held0000")  # a dead pid, but someone listens on its socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    (held / "to-scheduler-0123abcd").unlink()
    listener.bind(str(held / "to-scheduler-0123abcd"))
    listener.listen()
    try:
        assert remove_stale_in(ipc_parent) == [str(stale)]
    finally:
        listener.close()
    assert not stale.exists()
    for kept in (ours, live, legacy, elsewhere, held):
        assert kept.is_dir(), kept
    assert link.is_symlink() and (elsewhere / "to-scheduler-0123abcd").exists()


def test_other_users_ipc_directories_are_never_touched(ipc_parent, monkeypatch):
    stale = ipc_dir(ipc_parent, dead_pid(), "abc123de")
    monkeypatch.setattr(os, "getuid", lambda: os.stat(stale).st_uid + 1)
    assert remove_stale_in(ipc_parent) == []
    assert stale.is_dir()


def test_a_directory_holding_anything_but_sockets_is_kept(ipc_parent):
    stale = ipc_dir(ipc_parent, dead_pid(), "abc123de")
    (stale / "notes.txt").write_text("not ours to delete")
    assert remove_stale_in(ipc_parent) == []
    assert (stale / "notes.txt").exists() and (stale / "to-scheduler-0123abcd").exists()


CLOSE_WITH_A_STUCK_HEARTBEAT = """
import sys, zmq
from scheduler import process

class StuckHeartbeat:
    def stop(self):
        return False  # its thread did not end: its socket stays open

ctx = zmq.Context()
stuck = ctx.socket(zmq.PUSH)  # the heartbeat's socket, never closed
outbox = ctx.socket(zmq.PUSH)
outbox.setsockopt(zmq.LINGER, process.OUTBOX_LINGER_MS)
outbox.connect(sys.argv[1])
inbox = ctx.socket(zmq.PULL)
for i in range(int(sys.argv[2])):
    outbox.send(bytes(2**20))
process._close_sockets(ctx, inbox, outbox, StuckHeartbeat())
process._exit_without_teardown(0)
"""


def test_the_last_outputs_leave_even_when_the_heartbeat_thread_is_stuck(tmp_path):
    """A scheduler ending with os._exit after its heartbeat thread failed to stop still
    delivers what its outbox queued."""
    count = 200
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/outbox"
    pull.bind(address)
    try:
        env = dict(os.environ, PYTHONPATH=str(SRC_DIR))
        p = subprocess.run(
            [sys.executable, "-c", CLOSE_WITH_A_STUCK_HEARTBEAT, address, str(count)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        received = 0
        while pull.poll(1000):
            pull.recv()
            received += 1
        assert received == count
    finally:
        pull.close(0)
        ctx.term()
