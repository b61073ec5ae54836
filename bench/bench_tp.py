"""Tensor parallelism's cost on this CPU: W64 through the offline engine with one rank (all
threads) against two ranks (the threads shared out), same run, and what one all-reduce of a
decode step's and a prefill chunk's activations costs over gloo.

    python bench/bench_tp.py [--requests 64] [--json FILE]

SmolLM2's 9 heads do not split in two, so the model is a random-weight Llama of its size
with 8 heads (4 KV heads) of 64: 30 layers, hidden 512, MLP 1536, vocabulary 49152. On a
machine of few cores this measures the machinery (collectives, the step sent to each rank),
not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import workloads  # noqa: E402
from report import summarize  # noqa: E402

SHAPE = dict(
    vocab_size=49152,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def write_model(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def run_engine(path: str, tp: int, work) -> dict:
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.messages import SamplingParams

    threads = max(1, (os.cpu_count() or 2) // tp)
    config = EngineConfig(model=path, device="cpu", tp_size=tp, num_threads=threads, max_running_requests=len(work))
    engine = Engine(config)
    try:
        engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
        params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for _, n in work]
        t0 = time.perf_counter()
        done = engine.generate([p for p, _ in work], params)
        wall = time.perf_counter() - t0
        steps = engine.stats.steps
    finally:
        engine.runner.close()
    result = summarize(f"engine, tp {tp} ({threads} thread{'s' if threads > 1 else ''} a rank)", wall, _times(done, t0))
    result["steps"] = steps
    return result


def _times(done, t0):
    return [(c.token_times[0] - t0, c.token_times[-1] - t0, len(c.output_ids)) for c in done]


def _all_reduce_rank(rank: int, port: int, rows: list[int], hidden: int, out) -> None:
    import torch.distributed as dist

    from scheduler.tensor_parallel import init_process_group

    torch.set_num_threads(1)
    group = init_process_group(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    group.use_shared_memory(max(rows) * hidden)
    times = {}
    for how, reduce in (("gloo", dist.all_reduce), ("shared memory", group.shared.all_reduce)):
        for n in rows:
            x = torch.randn(n, hidden)
            for _ in range(20):
                reduce(x)
            t0 = time.perf_counter()
            for _ in range(200):
                reduce(x)
            times[f"{how}, [{n}, {hidden}]"] = (time.perf_counter() - t0) / 200
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def all_reduce_cost(rows: list[int], hidden: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, rows, hidden, out)) for r in range(2)]
    for p in procs:
        p.start()
    times = out.get()
    for p in procs:
        p.join()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    work = workloads.w64(args.requests)
    with tempfile.TemporaryDirectory() as path:
        write_model(path)
        runs = [run_engine(path, 1, work), run_engine(path, 2, work)]
    collectives = 2 * SHAPE["num_hidden_layers"] + 1  # o and down per layer, the embedding
    cost = all_reduce_cost([64, 512], SHAPE["hidden_size"])
    one, two = runs
    print(f"\nW64 ({args.requests} requests), random Llama of SmolLM2's size with 8 heads, {os.cpu_count()} cores")
    print(f"{'':36} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>9} {'steps':>6}")
    for r in runs:
        print(
            f"{r['name']:36} {r['tok_per_s']:8.1f} {r['ttft_s']['p50']:8.2f}s "
            f"{r['itl_s']['p50'] * 1e3:7.1f}ms {r['steps']:6d}"
        )
    print(f"tp 2 / tp 1: {two['tok_per_s'] / one['tok_per_s']:.2f}x")
    for what, seconds in cost.items():
        print(
            f"all-reduce by {what} fp32 between 2 ranks: {seconds * 1e6:.0f} us; "
            f"x{collectives} a step = {collectives * seconds * 1e3:.1f} ms"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "w64", "requests": args.requests, "runs": runs, "all_reduce_s": cost}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
