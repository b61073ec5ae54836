"""Shared fixtures. Importing this starts nothing: the daemon (one for the whole session)
starts only when an end-to-end test asks for the `daemon` fixture, so unit tests run alone
without it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_SRC = _TESTS.parent / "src"
# Unit tests import `scheduler`, `kernels`, `servicer` from src/ even without an editable install.
for _p in (str(_SRC), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

E2E_MAX_RUNNING_REQUESTS = 32
E2E_KV_CACHE_TOKENS = 16384

_session_daemon = None  # the running session daemon (for log tails in failure reports)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """One real daemon for all end-to-end tests (SmolLM2 on CPU)."""
    global _session_daemon
    from helpers import Daemon, install_sigterm_cleanup

    install_sigterm_cleanup()
    d = Daemon(
        model=os.environ.get("E2E_MODEL", "smollm2"),
        max_running_requests=E2E_MAX_RUNNING_REQUESTS,
        kv_cache_tokens=E2E_KV_CACHE_TOKENS,
        log_dir=tmp_path_factory.mktemp("daemon"),
    )
    with d:
        _session_daemon = d
        try:
            yield d
        finally:
            _session_daemon = None


@pytest.fixture(scope="session")
def grpc_channel(daemon):
    import grpc

    ch = grpc.insecure_channel(daemon.address)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def grpc_stub(grpc_channel):
    """A SglangScheduler stub (smg-grpc-proto) on the session daemon."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    return pb_grpc.SglangSchedulerStub(grpc_channel)


@pytest.fixture(scope="session")
def health_stub(grpc_channel):
    from grpc_health.v1 import health_pb2_grpc

    return health_pb2_grpc.HealthStub(grpc_channel)


@pytest.fixture(scope="session")
def model_info(grpc_stub):
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    return grpc_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


@pytest.fixture(scope="session")
def tokenizer(model_info):
    """The tokenizer the daemon reports (GetModelInfo.tokenizer_path), loaded locally."""
    from transformers import AutoTokenizer

    path = model_info.tokenizer_path
    assert path, "GetModelInfo.tokenizer_path is empty"
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def router(daemon, tmp_path_factory):
    """`smg launch --backend sglang` in front of the session daemon (one per test module)."""
    from helpers import Router

    with Router(daemon.port, log_dir=tmp_path_factory.mktemp("router")) as r:
        yield r


@pytest.fixture(scope="module")
def model(router, model_info):
    """The model name the router serves: the daemon's served name."""
    assert router.model == (model_info.served_model_name or model_info.model_path)
    return router.model


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    d = _session_daemon
    if report.failed and d is not None and "daemon" in getattr(item, "fixturenames", ()):
        report.sections.append(("daemon log (tail)", f"{d.log_path}\n{d.log_tail(40)}"))
