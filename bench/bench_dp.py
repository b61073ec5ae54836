"""Data parallelism's cost on this CPU: W64 through the daemon over gRPC with one replica
(all threads) against two replicas behind the same port (the threads shared out), same run.

    python bench/bench_dp.py [--requests 64] [--json FILE]

On a machine of few cores this measures the machinery (two scheduler processes, the
servicer choosing a rank per request, two half-size batches instead of one), not a
speed-up: replicas pay off where each has cores (or a device) of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import workloads  # noqa: E402
from bench_w64 import daemon_defaults, run_daemon  # noqa: E402


def run(work, dp: int, model: str) -> dict:
    cores = os.cpu_count() or 2
    args = daemon_defaults(model, max(1, cores // dp), ["--dp-size", str(dp)])
    result = run_daemon(work, args)
    result["name"] = f"daemon, dp {dp} ({args.threads} thread{'s' if args.threads > 1 else ''} a replica)"
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    work = workloads.w64(args.requests)
    runs = [run(work, 1, args.model), run(work, 2, args.model)]
    print(f"\nW64 ({args.requests} requests) through the daemon over gRPC, {args.model}, {os.cpu_count()} cores")
    print(f"{'':36} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>9}")
    for r in runs:
        print(f"{r['name']:36} {r['tok_per_s']:8.1f} {r['ttft_s']['p50']:8.2f}s {r['itl_s']['p50'] * 1e3:7.1f}ms")
    one, two = runs
    print(f"dp 2 / dp 1: {two['tok_per_s'] / one['tok_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "w64", "requests": args.requests, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
