"""The daemon's command line: flags map onto EngineConfig / ServerConfig, bad values are refused.

``servicer.cli`` imports the server's generated stubs, which cannot share a process with
smg-grpc-proto's (both register common.proto), so the parser runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from scheduler.config import EngineConfig

_SRC = Path(__file__).resolve().parent.parent / "src"
_PARSE = """
import json, sys
from servicer.cli import parse_args
try:
    engine, server = parse_args(json.loads(sys.argv[1]))
except SystemExit as e:
    print(json.dumps({"exit": e.code}))
else:
    import msgspec
    import dataclasses
    from servicer.server import ServerConfig
    print(json.dumps({"engine": msgspec.to_builtins(engine), "server": dataclasses.asdict(server),
                      "server_defaults": dataclasses.asdict(ServerConfig()), "host": server.host}))
"""


def parse(argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_SRC), os.environ.get("PYTHONPATH")])))
    r = subprocess.run(
        [sys.executable, "-c", _PARSE, json.dumps(argv)], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    out["stderr"] = r.stderr
    return out


def test_defaults_serve_the_embedded_model_on_localhost():
    out = parse([])
    engine = out["engine"]
    assert engine["model"] == "smollm2" and out["host"] == "127.0.0.1"
    assert engine["cuda_graph"] and engine["overlap_schedule"] is None and not engine["small_batch_gemv"]
    assert not engine["pdl"]
    assert engine["kernel_backend"] == "auto" and engine["enable_prefix_caching"]
    assert engine == msgspec.to_builtins(EngineConfig())  # the flags' defaults are the configs'
    assert out["server"] == out["server_defaults"]


def test_kernel_and_schedule_flags():
    engine = parse(
        [
            "--disable-cuda-graph",
            "--small-batch-gemv",
            "--pdl",
            "--overlap-schedule",
            "on",
            "--kernel-backend",
            "triton",
            "--disable-prefix-caching",
        ]
    )["engine"]
    assert not engine["cuda_graph"] and engine["small_batch_gemv"] and engine["overlap_schedule"] is True
    assert engine["pdl"]
    assert engine["kernel_backend"] == "triton" and not engine["enable_prefix_caching"]
    assert parse(["--disable-overlap-schedule"])["engine"]["overlap_schedule"] is False
    assert parse([])["engine"]["max_queued_requests"] is None
    assert parse(["--max-queued-requests", "0"])["engine"]["max_queued_requests"] == 0
    assert parse([])["engine"]["long_prefill_token_threshold"] is None  # half the step budget
    assert parse(["--long-prefill-token-threshold", "0"])["engine"]["long_prefill_token_threshold"] == 0


def test_disaggregation_flags():
    assert parse([])["engine"]["disaggregation"] is None  # mode null
    pd = parse(["--disaggregation-mode", "decode", "--disaggregation-waiting-timeout", "5"])["engine"]["disaggregation"]
    assert pd == dict(
        mode="decode",
        host="127.0.0.1",
        bootstrap_port=8998,
        transfer_backend="mooncake",
        bootstrap_timeout_s=300.0,
        waiting_timeout_s=5.0,
    )


def test_parallelism_flags():
    e = parse(["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:29500"])["engine"]
    assert (e["tp_size"], e["nnodes"], e["node_rank"], e["dist_init_addr"]) == (4, 2, 1, "10.0.0.1:29500")
    assert parse(["--dp-size", "3"])["engine"]["dp_size"] == 3


def test_constrained_json_is_compact_unless_any_whitespace_is_allowed():
    assert not parse([])["engine"]["constrained_json_any_whitespace"]
    assert parse(["--constrained-json-allow-any-whitespace"])["engine"]["constrained_json_any_whitespace"]
    assert not parse(["--constrained-json-disable-any-whitespace"])["engine"]["constrained_json_any_whitespace"]
    both = ["--constrained-json-allow-any-whitespace", "--constrained-json-disable-any-whitespace"]
    assert parse(both)["exit"] == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-cache-memory", "lots"],
        ["--kv-cache-memory", "1e400"],
        ["--kv-cache-memory=-2GiB"],
        ["--kv-cache-memory", "0.5"],
        ["--max-running-requests", "0"],
        ["--kv-cache-tokens", "10", "--kv-cache-memory", "1GiB"],
        ["--overlap-schedule", "maybe"],
        ["--port", "70000"],
        ["--port", "-1"],
        ["--max-model-len", "0"],
        ["--num-threads", "0"],
        ["--kv-cache-tokens", "-100"],
        ["--dtype", "int8"],
        ["--max-logprobs", "-1"],
        ["--max-queued-requests", "-1"],
        ["--long-prefill-token-threshold", "-1"],
        ["--speculative-algorithm", "eagle"],
        ["--speculative-algorithm", "ngram", "--overlap-schedule", "on"],
        ["--speculative-num-draft-tokens", "0"],
        ["--watchdog-timeout", "-1"],
        ["--watchdog-timeout", "nan"],
        ["--grammar-compile-timeout", "0"],
        ["--shutdown-grace-period", "-1"],
        ["--block-size", "x"],
        ["--disaggregation-mode", "both"],
        ["--disaggregation-mode", "prefill", "--port", "9000", "--disaggregation-bootstrap-port", "9000"],
        ["--disaggregation-bootstrap-port", "0"],
        ["--disaggregation-bootstrap-timeout", "0"],
        ["--disaggregation-transfer-backend", "nixl"],
        ["--dp-size", "0"],
        ["--dp-size", "2", "--disaggregation-mode", "decode"],
        ["--nnodes", "2", "--tp-size", "2"],
        ["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "127.0.0.1:29500"],
        ["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "nowhere"],
        ["--nnodes", "2", "--tp-size", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:29500"],
        ["--nnodes", "2", "--tp-size", "2", "--dp-size", "2", "--dist-init-addr", "127.0.0.1:29500"],
    ],
)
def test_bad_values_are_refused(argv):
    out = parse(argv)
    assert out["exit"] == 2 and "error" in out["stderr"]


def test_a_taken_port_is_a_clear_error_and_leaves_nothing_behind(tmp_path):
    """Another listener on the port (even another daemon: SO_REUSEPORT is off) makes the
    daemon exit 1 with a one-line reason, before any model loads, removing its IPC dir."""
    import socket

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a gRPC server binds by default
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(
            os.environ,
            TMPDIR=str(tmp_path),
            PYTHONPATH=os.pathsep.join(filter(None, [str(_SRC), os.environ.get("PYTHONPATH")])),
        )
        r = subprocess.run(
            [sys.executable, "-m", "servicer", "--port", str(port)], env=env, capture_output=True, text=True, timeout=60
        )
    assert r.returncode == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.iterdir()), "the IPC directory was left behind"


def test_a_write_to_a_departed_client_is_not_logged_as_an_error():
    import logging

    from servicer.log_filters import ClientGoneFilter

    def record(msg):
        try:
            raise RuntimeError("Failed execute_batch")
        except RuntimeError:
            import sys

            return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "x", 1, msg, None, sys.exc_info())

    gone = record(
        "ExecuteBatchError raised in core by servicer method [/sglang.grpc.scheduler.SglangScheduler/Generate]"
    )
    ClientGoneFilter().filter(gone)
    assert gone.levelno == logging.DEBUG and gone.exc_info is None
    other = record("Unexpected error in servicer method")
    assert ClientGoneFilter().filter(other) and other.levelno == logging.ERROR
