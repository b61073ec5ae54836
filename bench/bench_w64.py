"""W64 benchmark (shared/benchmarks.md): 64 greedy requests, EOS ignored, all submitted at t0.

Runs, in one process run and side by side:
  (a) our engine offline (Engine.generate),
  (b) the full daemon over gRPC with all 64 requests in flight (streaming Generate),
  (c) HF transformers static batching (batches of 16, left-padded) on the same weights,
and prints output tok/s, TTFT and ITL (mean, p50, p99) for each, with ratios to (c).

--dtypes runs each of (a), (b), (c) once per dtype: float32 (W64's, the CPU default) and,
where the CPU has bf16 instructions, bfloat16 (``--dtype bfloat16``); each bf16 run's ratio
is also given against HF in bf16. In each dtype, W64's first request is also run alone
through (a) and through HF (batch 1): the latency one user sees (``--no-single`` skips it).

--sampling picks the sampling parameters of (a) and (b):
  greedy (default): every request greedy, as W64 specifies;
  mixed: even requests greedy, odd ones sampled with temperature 0.8, top_p 0.9, top_k 40,
         repetition_penalty 1.1, frequency_penalty 0.2, presence_penalty 0.1, seed i (same
         lengths, EOS ignored); (c) HF stays greedy (it is not the baseline for this);
  both:  (a) twice in one process, all-greedy then mixed, and the ratio mixed/greedy
         (issue 5: the sampler may cost at most 10%, i.e. ratio >= 0.90); (b) and (c) greedy.

    python bench/bench_w64.py [--device cpu] [--json out.json] [--skip hf,daemon] [--requests 64]
                              [--sampling greedy|mixed|both] [--dtypes float32,bfloat16]
    python bench/bench_w64.py --sampling both --skip hf,daemon   # sampler cost on the engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from scheduler.config import EngineConfig  # noqa: E402
from scheduler.device import cpu_has_bf16  # noqa: E402
from scheduler.messages import SamplingParams  # noqa: E402

# Run names and keys: fp32 runs (and "auto", the engine's own choice: fp32 on the CPU, bf16 on
# GPUs, as HF's baseline there) keep W64's plain ones.
SHORT = {"float32": "", "bfloat16": "bf16"}


def dtype_label(dtype: str) -> str:
    return f", {SHORT[dtype]}" if SHORT.get(dtype) else ""


def w64_workload(n: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    work = []
    for _ in range(n):
        prompt_len = rng.randint(64, 512)
        out_len = rng.randint(64, 256)
        work.append(([rng.randint(100, 49000) for _ in range(prompt_len)], out_len))
    return work


# Sampled requests of --sampling mixed (odd request i also gets seed=i).
MIXED_SAMPLED = dict(
    temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1
)


def request_params(i: int, n: int, sampling: str) -> dict:
    """Engine SamplingParams kwargs of request i (n output tokens, EOS ignored)."""
    if sampling == "mixed" and i % 2 == 1:
        return dict(MIXED_SAMPLED, seed=i, max_new_tokens=n, ignore_eos=True)
    return dict(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def summarize(name: str, wall: float, per_request: list[tuple[float, float, int]]) -> dict:
    """per_request: (first token time - t0, last token time - t0, output tokens)."""
    ttft = [f for f, _, _ in per_request]
    itl = [(last - first) / (n - 1) for first, last, n in per_request if n > 1]
    total = sum(n for _, _, n in per_request)

    def stats(xs):
        xs = sorted(xs)
        return {
            "mean": statistics.fmean(xs),
            "p50": xs[len(xs) // 2],
            "p99": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))],
        }

    return {
        "name": name,
        "wall_s": wall,
        "output_tokens": total,
        "tok_per_s": total / wall,
        "ttft_s": stats(ttft),
        "itl_s": stats(itl),
    }


# -- (a) offline engine -------------------------------------------------------------------
def single(run, **kw):
    """``run`` on W64's first request alone: one user's latency (key suffix ``_1req``)."""

    def run_one(work, args, dtype: str = "auto") -> dict:
        r = run(work[:1], args, dtype=dtype, **kw)
        r["name"] = r["name"].replace("(offline", "(offline, 1 request").replace("batch 16", "batch 1")
        return r

    return run_one


def run_engine(work, args, sampling: str = "greedy", dtype: str = "auto") -> dict:
    from scheduler.engine import Engine

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=dtype,
        max_running_requests=len(work),
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        speculative_algorithm=args.speculative_algorithm,
        kv_cache_tokens=args.kv_cache_tokens,
        num_threads=args.threads,
    )
    engine = Engine(config)
    engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
    if sampling == "mixed":  # warm the sampled path too (penalties, seeded rows) before timing
        engine.generate(
            [[1, 2, 3, 4], [5, 6, 7, 8]], [SamplingParams(**request_params(i, 4, "mixed")) for i in range(2)]
        )
    params = [SamplingParams(**request_params(i, n, sampling)) for i, (_, n) in enumerate(work)]
    t0 = time.perf_counter()
    results = engine.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t0
    assert all(len(r.output_ids) == n for r, (_, n) in zip(results, work))
    name = f"engine (offline{dtype_label(dtype)})" if sampling == "greedy" else f"engine (offline, {sampling})"
    out = summarize(name, wall, [(r.token_times[0] - t0, r.token_times[-1] - t0, len(r.output_ids)) for r in results])
    out["max_batch_size"] = engine.stats.max_batch_size
    out["sampling"] = sampling
    del engine
    return out


# -- (b) the daemon over gRPC ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _grpc_load(port: int, work, sampling: str = "greedy") -> tuple[float, list]:
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(i, prompt, n, t0):
            kw = request_params(i, n, sampling)
            seed = kw.pop("seed", None)
            sp = pb.SamplingParams(**kw)
            if seed is not None:
                sp.custom_params.update({"seed": seed})
            req = pb.GenerateRequest(
                request_id=f"bench-{i}",
                tokenized=pb.TokenizedInput(input_ids=prompt),
                stream=True,
                sampling_params=sp,
            )
            first = last = None
            count = 0
            async for resp in stub.Generate(req):
                if resp.HasField("chunk") and resp.chunk.token_ids:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    count += len(resp.chunk.token_ids)
            return first - t0, last - t0, count

        await one(-1, [1, 2, 3, 4], 4, time.perf_counter())  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, p, n, t0) for i, (p, n) in enumerate(work)))
        return time.perf_counter() - t0, results


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (all its threads, not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def run_daemon(work, args, sampling: str = "greedy", dtype: str = "auto") -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "servicer",
        "--model",
        args.model,
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        dtype,
        "--max-running-requests",
        str(len(work)),
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        "--log-level",
        "warning",
    ]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.long_prefill_token_threshold is not None:
        cmd += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    if args.speculative_algorithm:
        cmd += ["--speculative-algorithm", args.speculative_algorithm]
    if args.threads:
        cmd += ["--num-threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.time() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {proc.returncode}")
                try:
                    if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == 1:
                        break
                except grpc.RpcError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError("daemon did not become SERVING")
                time.sleep(0.5)
        # Where the CPU goes during the load: on 2 cores every second the servicer or the
        # client spends is taken from the scheduler's torch threads.
        pids = {"servicer": proc.pid, "scheduler": _children(proc.pid)[0]}
        cpu0 = {k: _cpu_seconds(p) for k, p in pids.items()}
        client0 = time.process_time()
        wall, results = asyncio.run(_grpc_load(port, work, sampling))
        cpu = {k: round(_cpu_seconds(p) - cpu0[k], 1) for k, p in pids.items()}
        cpu["client"] = round(time.process_time() - client0, 1)
        assert all(n == want for (_, _, n), (_, want) in zip(results, work))
        name = (
            f"daemon (gRPC, 64 in flight{dtype_label(dtype)})"
            if sampling == "greedy"
            else f"daemon (gRPC, 64 in flight, {sampling})"
        )
        out = summarize(name, wall, results)
        out["cpu_s"] = cpu
        out["sampling"] = sampling
        print(f"  CPU seconds during the load: {cpu}", flush=True)
        return out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


# -- (c) HF transformers static batching ---------------------------------------------------
def run_hf(work, args, batch_size: int = 16, dtype: str = "auto") -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from scheduler.model_source import resolve_model

    path = resolve_model(args.model)
    device = torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16
        )
    if device.type == "cpu" and dtype != "auto":  # (auto: fp32 on the CPU, bf16 on a GPU, as loaded)
        model = model.to(getattr(torch, dtype))
    model = model.to(device).eval()

    class StepClock(LogitsProcessor):
        """Called once per generated position: records when each step's logits are ready."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    pad = 0
    results = []
    t0 = time.perf_counter()
    for start in range(0, len(work), batch_size):
        batch = work[start : start + batch_size]
        longest = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        steps = max(n for _, n in batch)
        clock = StepClock()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                logits_processor=LogitsProcessorList([clock]),
                pad_token_id=pad,
            )
        for _, n in batch:
            results.append((clock.times[0] - t0, clock.times[n - 1] - t0, n))
    wall = time.perf_counter() - t0
    return summarize(f"HF transformers static batch {batch_size}{dtype_label(dtype)}", wall, results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=64, help="first N requests of W64 (for quick runs)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (W64 specifies 2)")
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's own")
    ap.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="default: the engine's own (half the step budget); 0: off",
    )
    ap.add_argument("--speculative-algorithm", choices=["ngram"], default=None, help="default: off")
    ap.add_argument("--skip", default="", help="comma list of engine,daemon,hf to skip (in every dtype)")
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the engine and daemon runs, interleaved; each reports its upper median (HF runs once)",
    )
    ap.add_argument(
        "--sampling",
        choices=("greedy", "mixed", "both"),
        default="greedy",
        help="greedy: all greedy (W64); mixed: alternate greedy and sampled+penalties for (a) and (b); "
        "both: (a) all-greedy and mixed side by side with the ratio (b, c stay greedy)",
    )
    ap.add_argument("--no-single", action="store_true", help="skip the single-request latency runs")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma list of float32,bfloat16 (default: both where the CPU has bf16 instructions)",
    )
    args = ap.parse_args()
    default_dtypes = "float32,bfloat16" if args.device == "cpu" and cpu_has_bf16() else "float32"
    dtypes = list(dict.fromkeys(d.strip() for d in (args.dtypes or default_dtypes).split(",")))
    if not set(dtypes) <= set(SHORT):
        ap.error(f"--dtypes: choose from {', '.join(SHORT)}")
    torch.set_num_threads(args.threads)
    work = w64_workload()[: args.requests]
    print(
        f"W64: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
        f"{sum(n for _, n in work)} output tokens, {args.threads} threads, device {args.device}, "
        f"sampling {args.sampling}, dtypes {','.join(dtypes)}",
        flush=True,
    )
    skip = set(filter(None, args.skip.split(",")))
    served = "greedy" if args.sampling == "both" else args.sampling  # what (b) runs
    plan = []
    if "float32" in dtypes:
        if args.sampling == "both":
            plan += [
                ("engine", lambda w, a: run_engine(w, a, "greedy")),
                ("engine_mixed", lambda w, a: run_engine(w, a, "mixed")),
            ]
        else:
            plan.append(("engine", lambda w, a: run_engine(w, a, args.sampling)))
        plan += [("daemon", lambda w, a: run_daemon(w, a, served)), ("hf", run_hf)]
    for dtype in dtypes:  # the other dtypes: (a), (b), (c) greedy, as W64 specifies
        if SHORT[dtype]:
            plan += [
                (f"{kind}_{SHORT[dtype]}", lambda w, a, fn=fn, dtype=dtype: fn(w, a, dtype=dtype))
                for kind, fn in (("engine", run_engine), ("daemon", run_daemon), ("hf", run_hf))
            ]
    if not args.no_single:
        for dtype in dtypes:
            suffix = f"_1req_{SHORT[dtype]}" if SHORT[dtype] else "_1req"
            run_dtype = dtype if SHORT[dtype] else "auto"  # the plain runs' dtype
            plan += [
                (kind + suffix, lambda w, a, fn=fn, dtype=run_dtype: fn(w, a, dtype=dtype))
                for kind, fn in (("engine", single(run_engine)), ("hf", single(run_hf, batch_size=1)))
            ]
    # --repeat N runs the engine and daemon rounds N times, interleaved (E D E D ...), and keeps
    # each one's median: this machine's speed drifts by +-10% over minutes, so a single pair
    # can show a daemon/engine ratio the code does not cause.
    samples: dict[str, list[dict]] = {}
    for round_ in range(args.repeat):
        for key, fn in plan:
            if key.split("_")[0] in skip or (round_ and key.startswith("hf")):
                continue
            r = fn(work, args)
            samples.setdefault(key, []).append(r)
            print(f"  done: {r['name']}: {r['tok_per_s']:.1f} tok/s in {r['wall_s']:.1f} s", flush=True)
    runs = {}
    for key, rs in samples.items():
        runs[key] = sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2]  # upper median: with 2 rounds the faster
        if len(rs) > 1:
            runs[key]["all_tok_per_s"] = [round(r["tok_per_s"], 1) for r in rs]

    base = runs.get("hf")
    print(
        f"\n{'run':40s} {'tok/s':>8s} {'x HF':>6s} {'x its HF':>9s} {'TTFT mean/p50/p99 (s)':>24s} "
        f"{'ITL mean/p50/p99 (ms)':>24s}"
    )
    for key, r in runs.items():
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}" if base else "-"
        # Its own HF baseline: the HF run of the same dtype and batching ("engine_1req_bf16" ->
        # "hf_1req_bf16"), else (a sampling variant) the plain one.
        same = runs.get("hf" + key[len(key.split("_")[0]) :], base)
        r["x_hf"] = r["tok_per_s"] / base["tok_per_s"] if base else None
        r["x_its_hf"] = r["tok_per_s"] / same["tok_per_s"] if same else None
        same_ratio = f"{r['x_its_hf']:.2f}" if same else "-"
        t, i = r["ttft_s"], r["itl_s"]
        print(
            f"{r['name']:40s} {r['tok_per_s']:8.1f} {ratio:>6s} {same_ratio:>9s} "
            f"{t['mean']:8.2f}/{t['p50']:.2f}/{t['p99']:.2f} "
            f"{i['mean'] * 1e3:9.1f}/{i['p50'] * 1e3:.1f}/{i['p99'] * 1e3:.1f}"
        )
    print("x HF: against HF fp32 static batch 16; x its HF: against the HF run of the same dtype and batch")
    if "engine" in runs and "engine_bf16" in runs:
        print(f"engine bf16 / fp32 throughput: {runs['engine_bf16']['tok_per_s'] / runs['engine']['tok_per_s']:.3f}")
    if "engine" in runs and "daemon" in runs:
        print(f"daemon / engine throughput: {runs['daemon']['tok_per_s'] / runs['engine']['tok_per_s']:.3f}")
        if args.repeat > 1:
            pairs = [d["tok_per_s"] / e["tok_per_s"] for e, d in zip(samples["engine"], samples["daemon"])]
            print(f"  per round: {', '.join(f'{x:.3f}' for x in pairs)}")
    doc = {
        "workload": "W64",
        "device": args.device,
        "threads": args.threads,
        "sampling": args.sampling,
        "dtypes": dtypes,
        "runs": runs,
    }
    if "engine" in runs and "engine_mixed" in runs:
        g, m = runs["engine"]["tok_per_s"], runs["engine_mixed"]["tok_per_s"]
        doc["engine_mixed_over_greedy"] = ratio = m / g
        print(
            f"\nengine greedy {g:.1f} tok/s | mixed {m:.1f} tok/s | mixed / greedy {ratio:.3f} "
            f"(issue 5: >= 0.90 -> {'OK' if ratio >= 0.90 else 'OVER BUDGET'})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
