"""The daemon's command line: flags map onto EngineConfig / ServerConfig, bad values are refused."""

from __future__ import annotations

import pytest

from servicer.cli import parse_args


def test_defaults_serve_the_embedded_model_on_localhost():
    engine, server = parse_args([])
    assert engine.model == "smollm2" and server.host == "127.0.0.1"
    assert engine.cuda_graph and engine.overlap_schedule is None and not engine.small_batch_gemv
    assert engine.kernel_backend == "auto" and engine.enable_prefix_caching


def test_kernel_and_schedule_flags():
    engine, _ = parse_args(["--disable-cuda-graph", "--small-batch-gemv", "--overlap-schedule", "on",
                            "--kernel-backend", "triton", "--disable-prefix-caching"])
    assert not engine.cuda_graph and engine.small_batch_gemv and engine.overlap_schedule is True
    assert engine.kernel_backend == "triton" and not engine.enable_prefix_caching
    assert parse_args(["--disable-overlap-schedule"])[0].overlap_schedule is False


@pytest.mark.parametrize(
    "argv",
    [["--kv-cache-memory", "lots"], ["--max-running-requests", "0"], ["--kv-cache-tokens", "10", "--kv-cache-memory", "1GiB"],
     ["--overlap-schedule", "maybe"]],
)
def test_bad_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and "error" in capsys.readouterr().err
