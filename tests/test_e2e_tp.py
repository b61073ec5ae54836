"""End-to-end: the daemon with the bundled model split across three tensor-parallel ranks
(9 heads, 3 KV heads), behind the real router; then one rank killed with SIGKILL takes the
whole daemon down cleanly, as the scheduler's own death does."""

from __future__ import annotations

import os
import signal

import pytest
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from helpers import Daemon, Router, child_pids, install_sigterm_cleanup, wait_until, watch_health

TP = 3


@pytest.fixture(scope="module")
def tp_daemon(tmp_path_factory):
    install_sigterm_cleanup()
    daemon = Daemon(
        max_running_requests=8,
        kv_cache_tokens=4096,
        extra_args=["--tp-size", str(TP)],
        log_dir=tmp_path_factory.mktemp("tp-daemon"),
    )
    with daemon:
        yield daemon


def ranks_of(daemon: Daemon) -> list[int]:
    """The pids of ranks 1..N-1: the scheduler process's children (but multiprocessing's
    resource tracker)."""
    (scheduler,) = child_pids(daemon.proc.pid)
    return [pid for pid in child_pids(scheduler) if b"resource_tracker" not in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def test_split_daemon_answers_through_the_router(tp_daemon, tmp_path):
    with tp_daemon.channel() as ch:
        info = pb_grpc.SglangSchedulerStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.server_args["tp_size"] == TP
    assert len(ranks_of(tp_daemon)) == TP - 1
    with Router(tp_daemon.port, log_dir=tmp_path) as router:
        body = {
            "model": router.model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 16,
        }
        resp = router.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]


def test_a_killed_rank_takes_the_daemon_down(tp_daemon):
    """(Last: this ends the module's daemon.) Health watchers hear NOT_SERVING."""
    scheduler = child_pids(tp_daemon.proc.pid)[0]
    ranks = ranks_of(tp_daemon)
    with tp_daemon.channel() as ch:
        statuses, watcher = watch_health(ch)
        wait_until(lambda: statuses, 10, "the first health status")
        os.kill(ranks[0], signal.SIGKILL)
        wait_until(lambda: tp_daemon.proc.poll() is not None, 60, "the daemon exiting")
        watcher.join(30)
    assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert tp_daemon.proc.returncode != 0
    for pid in [scheduler, *ranks]:  # (the resource tracker ends once its parent has)
        wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 10, f"process {pid} gone")
    assert "tensor-parallel rank(s) gone" in tp_daemon.log_tail(200)
