"""The GPU benchmark script still runs against the engine as it is now.

A lent GPU session has minutes, not hours: a script broken by an engine change (a renamed
config field or statistic) would spend them on a traceback. ``--smoke`` runs every part of
``bench/bench_n256.py`` on the CPU with a 2-layer model of the Qwen3 family; its numbers
mean nothing, only that each part ran and wrote its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_n256_benchmark_runs_every_part(tmp_path):
    out = tmp_path / "n256.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_n256.py"),
            "--smoke",
            "--json",
            str(out),
            "--also-batched-tokens",
            "64",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = {k: v for k, v in result.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    n256 = result["n256_engine"]
    assert n256["output_tokens"] > 0
    # Reported for the GPU session to read; on the CPU no Triton kernel runs, so its value
    # says nothing here (tests/test_triton_specialization.py checks the property on the CPU).
    assert isinstance(n256["triton_compiles_after_setup"], int)
    assert {"overlap_over_plain", "tok_per_s_by_batched_tokens"} <= n256.keys()
    for key in ("batch1", "batch1_small_batch_gemv", "batch1_small_batch_gemv_pdl"):
        assert result[key]["engine_step_x_floor"] > 0
    assert result["engine_over_hf"] > 0 and result["n256_hf"]["batches_run"] == 1
