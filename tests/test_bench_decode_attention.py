"""The CPU decode attention benchmark still runs (tiny shapes: its numbers mean nothing here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


def test_decode_attention_benchmark_runs():
    if cpu_kernels.load_library("paged_decode_attention") is None:
        pytest.skip("no C compiler: native kernel unavailable")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_decode_attention.py"),
            "--requests",
            "3",
            "--tokens",
            "40",
            "--layers",
            "2",
            "--repeat",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("native / torch") == 2, r.stdout  # fp32 and bf16
