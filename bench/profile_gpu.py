"""GPU tuning probes (not the benchmark): decode attention configs and an N256 step breakdown.

    python bench/profile_gpu.py [--skip attn,steps]

(1) Decode attention alone (unified Triton kernel, Qwen3-0.6B heads, bf16, scattered blocks),
    in CUDA graphs: time and KV bytes/s for key-tile sizes, warps and split-KV factors, per
    batch size.
(2) N256 through the engine with host timers around each phase of a step (schedule, model,
    sampling, update), the GPU synchronised at each boundary.
(3) The small-batch projections (kernels/triton_gemv.py) against what they replace (Triton
    RMSNorm + cuBLAS linear (+ Triton SiLU-mul)), per Qwen3-0.6B projection, in CUDA graphs;
    the best blocks also launched as programmatic dependents (sm_90+).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from kernels.triton_attention import decode_splits, unified_attention  # noqa: E402


def attention_probe() -> None:
    import triton

    H, KVH, D, BS = 16, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_blocks = 256 * 1100 // BS + 8
    k = torch.randn(num_blocks, BS, KVH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # In CUDA graphs, as the decode steps run: without them a batch-1 launch is host-bound.
    bench = getattr(triton.testing, "do_bench_cudagraph", None)
    bench = bench or (
        lambda fn, rep, return_mode: triton.testing.do_bench(fn, warmup=20, rep=rep, return_mode=return_mode)
    )
    print(f"{'B':>4} {'ctx':>5} {'tile':>4} {'warps':>5} {'splits':>6} {'us':>8} {'GB/s':>6}")
    for B, ctx in ((1, 600), (1, 2000), (8, 1000), (64, 1000), (256, 1000)):
        per = -(-ctx // BS)
        # Graph replays do not clear the 50 MB L2: small batches cycle through `sets` disjoint
        # block sets (one per layer, up to 28) so their keys come from HBM, as in a forward.
        sets = max(1, min(28, (num_blocks - 1) // (B * per)))
        perm = torch.randperm(num_blocks - 1, device="cuda")[: sets * B * per] + 1
        tables = perm.view(sets, B, per).to(torch.int64)
        qsl = torch.arange(B + 1, device="cuda", dtype=torch.int64)
        seq = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        kv_bytes = B * ctx * KVH * D * 2 * 2
        best = None
        auto = decode_splits(B, KVH, sms)
        for tile in (32, 64, 128):
            for warps in (2, 4, 8):
                for splits in sorted({1, auto}):

                    def fn(tile=tile, warps=warps, splits=splits):
                        for table in tables:
                            unified_attention(
                                q,
                                k,
                                v,
                                table,
                                qsl,
                                seq,
                                D**-0.5,
                                max_query_len=1,
                                tile_n=tile,
                                num_warps=warps,
                                num_splits=splits,
                            )

                    try:
                        ms = bench(fn, rep=100, return_mode="median") / sets
                    except Exception as e:  # noqa: BLE001
                        print(f"{B:>4} {ctx:>5} {tile:>4} {warps:>5} {splits:>6} failed: {str(e)[:80]}")
                        continue
                    gbs = kv_bytes / ms / 1e6
                    print(f"{B:>4} {ctx:>5} {tile:>4} {warps:>5} {splits:>6} {ms * 1e3:>8.1f} {gbs:>6.0f}")
                    if best is None or ms < best[0]:
                        best = (ms, tile, warps, splits)
        if best is None:
            continue
        print(f"best B={B} ctx={ctx}: tile {best[1]} warps {best[2]} splits {best[3]}: {best[0] * 1e3:.1f} us")


def gemv_probe() -> None:
    """Each projection as in a decode step: 28 layers' weights (distinct tensors, ~0.1-0.35 GB:
    streamed from HBM, not L2-resident), timed per layer."""
    import triton.testing

    from kernels import triton_ops
    from kernels.triton_gemv import small_batch_linear

    bench = getattr(triton.testing, "do_bench_cudagraph", None) or triton.testing.do_bench
    layers, hidden, inter, qkv_out = 28, 1024, 3072, (16 + 2 * 8) * 128
    dev, bf = "cuda", torch.bfloat16
    # (name, weight [out, in], fused norm?, gate_up?)
    shapes = [
        ("norm+qkv", (qkv_out, hidden), True, False),
        ("o_proj", (hidden, 16 * 128), False, False),
        ("norm+gate_up+silu", (2 * inter, hidden), True, True),
        ("down", (hidden, inter), False, False),
    ]
    print(
        f"{'proj':<18} {'M':>3} {'torch us':>9} {'best us':>8} {'GB/s':>6} {'block_n':>7} {'block_k':>7} {'pdl us':>7}"
        "  (per layer)"
    )
    for name, (n_out, k_in), norm, gate_up in shapes:
        ws = [torch.randn(n_out, k_in, device=dev, dtype=bf) / k_in**0.5 for _ in range(layers)]
        nw = torch.ones(k_in, device=dev, dtype=bf)
        for m in (1, 4, 16):
            x = torch.randn(m, k_in, device=dev, dtype=bf)
            r = torch.randn(m, k_in, device=dev, dtype=bf)

            def reference():
                for w in ws:
                    h = triton_ops.rms_norm(x, nw, 1e-6, r)[0] if norm else x
                    y = torch.nn.functional.linear(h, w)
                    if gate_up:
                        triton_ops.silu_and_mul(y)

            ref_ms = bench(reference) / layers
            best = None
            for bn in (16, 32, 64):
                for bk in (64, 128, 256):

                    def fused(bn=bn, bk=bk):
                        for w in ws:
                            small_batch_linear(
                                x,
                                w,
                                None,
                                nw if norm else None,
                                r if norm else None,
                                1e-6,
                                gate_up,
                                block_n=bn,
                                block_k=bk,
                            )

                    try:
                        ms = bench(fused) / layers
                    except Exception as e:  # noqa: BLE001
                        print(f"{name:<18} {m:>3} block_n {bn} block_k {bk} failed: {str(e)[:80]}")
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, bn, bk)
            if best is None:
                continue
            pdl_ms = float("nan")
            if torch.cuda.get_device_capability()[0] >= 9:  # the best blocks, launched as programmatic dependents

                def chained(bn=best[1], bk=best[2]):
                    for w in ws:
                        small_batch_linear(
                            x,
                            w,
                            None,
                            nw if norm else None,
                            r if norm else None,
                            1e-6,
                            gate_up,
                            block_n=bn,
                            block_k=bk,
                            pdl=True,
                        )

                try:
                    pdl_ms = bench(chained) / layers
                except Exception as e:  # noqa: BLE001
                    print(f"{name:<18} {m:>3} pdl failed: {str(e)[:120]}")
            gbs = ws[0].numel() * 2 / best[0] / 1e6
            print(
                f"{name:<18} {m:>3} {ref_ms * 1e3:>9.1f} {best[0] * 1e3:>8.1f} {gbs:>6.0f} {best[1]:>7} {best[2]:>7}"
                f" {pdl_ms * 1e3:>7.1f}"
            )
        del ws


def step_probe() -> None:
    from bench_n256 import build_models, n256_workload
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.messages import SamplingParams
    from scheduler.model_runner import ModelRunner

    _, loaded = build_models()
    # The timers synchronise at every boundary, which defeats the overlap schedule: off here.
    config = EngineConfig(
        model="x",
        device="cuda",
        dtype="bfloat16",
        max_running_requests=256,
        max_num_batched_tokens=8192,
        kv_cache_memory="40GiB",
        max_model_len=4096,
        overlap_schedule=False,
    )
    engine = Engine(config, ModelRunner(config, loaded))
    engine.generate([[5] * 100], SamplingParams(max_new_tokens=4, temperature=0.6, ignore_eos=True))
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def timed(name, fn):
        def wrapper(*a, **kw):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = fn(*a, **kw)
            torch.cuda.synchronize()
            totals[name] += time.perf_counter() - t
            counts[name] += 1
            return r

        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.advance = timed("advance", engine.scheduler.advance)
    engine.scheduler.complete = timed("complete", engine.scheduler.complete)
    engine.runner.model.forward = timed("model (eager)", engine.runner.model.forward)
    if engine.runner.graphs is not None:
        engine.runner.graphs.run = timed("model (graph)", engine.runner.graphs.run)
    engine.runner.sampler.run = timed("sampler", engine.runner.sampler.run)
    engine.runner.launch = timed("launch", engine.runner.launch)
    engine._complete = timed("take tokens + outputs", engine._complete)
    engine.step = timed("step", engine.step)
    prompts, max_tokens = n256_workload()
    params = [SamplingParams(max_new_tokens=m, temperature=0.6, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    print(f"N256 with timers: {wall:.2f} s, {engine.stats.steps} steps")
    for name in sorted(totals, key=totals.get, reverse=True):
        print(
            f"  {name:<14} {totals[name]:7.2f} s  {counts[name]:5d} calls  "
            f"{1e3 * totals[name] / counts[name]:7.3f} ms/call"
        )


def torch_profile() -> None:
    """torch.profiler over N256's first steps (prefill-heavy, eager) and then decode steps (graphs)."""
    from torch.profiler import ProfilerActivity, profile

    from bench_n256 import build_models, n256_workload
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.messages import AddRequest, SamplingParams
    from scheduler.model_runner import ModelRunner

    _, loaded = build_models()
    config = EngineConfig(
        model="x",
        device="cuda",
        dtype="bfloat16",
        max_running_requests=256,
        max_num_batched_tokens=8192,
        kv_cache_memory="40GiB",
        max_model_len=4096,
    )
    engine = Engine(config, ModelRunner(config, loaded))
    engine.generate([[5] * 100], SamplingParams(max_new_tokens=4, temperature=0.6, ignore_eos=True))
    prompts, max_tokens = n256_workload()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(AddRequest(f"r{i}", p, SamplingParams(max_new_tokens=m, temperature=0.6, ignore_eos=True)))
    for phase, steps in (("prefill (eager) steps", 3), ("decode (graph) steps", 0)):
        if phase.startswith("decode"):
            while (
                any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
                or engine.scheduler.waiting
            ):
                engine.step()
            steps = 10
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        print(
            f"== {phase}: {steps} steps, {1e3 * wall / steps:.2f} ms/step (profiled), "
            f"batch {len(engine.scheduler.running)}"
        )
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default="")
    skip = ap.parse_args().skip.split(",")
    for name, probe in (
        ("attn", attention_probe),
        ("gemv", gemv_probe),
        ("steps", step_probe),
        ("prof", torch_profile),
    ):
        if name not in skip:
            probe()
            gc.collect()  # (step_probe's timers hold its 40 GiB engine in a reference cycle)
            torch.cuda.empty_cache()
