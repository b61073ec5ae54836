"""N256 GPU benchmark (shared/benchmarks.md) on the Qwen3-0.6B configuration, random bf16 weights.

In one process run, side by side:
  (a) our engine offline (Engine.generate): 256 requests submitted at once, temperature 0.6,
      ignore_eos, after one warm-up request; output tokens / wall time of the whole generate;
      then the same without the overlap schedule (--skip-plain leaves it out), for the ratio;
  (b) batch-1 decode: the step time of one running request (engine ITL, and the model's
      forward + LM head alone) against the HBM floor = weight bytes / measured copy bandwidth
      (a large device-to-device copy, bytes read + written); with cuBLAS projections and with
      the fused small-batch ones (EngineConfig.small_batch_gemv), and those launched as
      programmatic dependents (EngineConfig.pdl; sm_90+);
  (c) HF transformers static batching (left-padded batches of --hf-batch, sampling at
      temperature 0.6 with top-k/top-p off, min_new_tokens = max_new_tokens = the batch's
      longest, counting each request's own tokens) on the same weights and GPU.

    python bench/bench_n256.py [--json out.json] [--skip hf] [--hf-batch 64] [--hf-time-limit 240]

``--smoke`` runs every part on the CPU with a 2-layer model of the same family and a few
short requests: numbers that mean nothing, but a check (tests/test_bench_n256.py) that
the script a lent GPU session depends on still runs against the engine as it is now.

Needs torch, triton, transformers and msgspec (see bench/gpu.sh for a bare machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.messages import SamplingParams  # noqa: E402
from scheduler.model_config import ModelConfig  # noqa: E402
from scheduler.model_runner import LoadedModel, ModelRunner  # noqa: E402
from scheduler.models import build_model  # noqa: E402

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


# --smoke: the same family, small enough for a CPU (vocab still above N256's ids)
SMOKE_CONFIG = dict(
    QWEN3_0_6B,
    vocab_size=10240,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bos_token_id=1,
    eos_token_id=2,
)
SMOKE_REQUESTS, SMOKE_PROMPT, SMOKE_OUTPUT = 6, 40, 12
DEVICE = "cuda"  # "cpu" under --smoke
SMOKE = False


def n256_workload() -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    if SMOKE:
        return [p[:SMOKE_PROMPT] for p in prompts[:SMOKE_REQUESTS]], [
            m % SMOKE_OUTPUT + 1 for m in max_tokens[:SMOKE_REQUESTS]
        ]
    return prompts, max_tokens


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, bytes read + written per second (median of 20)."""
    if SMOKE:
        nbytes = 1 << 20
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        if DEVICE != "cuda":
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[3:])


def triton_variants() -> int:
    """How many variants of our Triton kernels have been compiled so far in this process."""
    from kernels import triton_attention, triton_gemv, triton_ops, triton_sampling

    kernels = [*triton_attention._kernels(), *triton_ops._kernels(), triton_sampling._kernel(), triton_gemv._kernel()]
    return sum(len(caches[0]) for k in kernels for caches in getattr(k, "device_caches", {}).values())


def release_gpu_memory() -> None:
    """Hand a finished engine's KV cache back, so the next one can ask for as much."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def build_models():
    import transformers

    hf_config = transformers.Qwen3Config(**(SMOKE_CONFIG if SMOKE else QWEN3_0_6B))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    ours = build_model(config, dtype=torch.bfloat16)
    ours.load_weights(dict(hf.state_dict()))  # shares the tensors it does not fuse
    return hf, LoadedModel("random-qwen3-0.6b", config, ours.to(DEVICE).eval())


def run_engine(loaded: LoadedModel, args, overlap: bool = True, batched_tokens: int | None = None) -> dict:
    config = EngineConfig(
        model="random-qwen3-0.6b",
        device=DEVICE,
        dtype="bfloat16",
        max_running_requests=args.max_running,
        max_num_batched_tokens=batched_tokens or args.batched_tokens,
        kv_cache_memory=args.kv_memory,
        max_model_len=4096,
        cuda_graph=not args.eager,
        overlap_schedule=overlap,
        small_batch_gemv=args.small_batch_gemv,
    )
    t = time.perf_counter()
    engine = Engine(config, ModelRunner(config, loaded))
    setup_s = time.perf_counter() - t
    compiled_at_setup = triton_variants()  # start-up warm-up and graph capture
    prompts, max_tokens = n256_workload()
    engine.generate([prompts[0][:100]], SamplingParams(max_new_tokens=16, temperature=0.6, ignore_eos=True))
    params = [SamplingParams(max_new_tokens=m, temperature=0.6, ignore_eos=True) for m in max_tokens]
    sync()
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    # Variants compiled after start-up (in the warm-up request or the timed run): each one
    # would have stalled serving for a JIT compile. Should be 0.
    compiles = triton_variants() - compiled_at_setup
    out_tokens = sum(len(c.output_ids) for c in done)
    assert out_tokens == sum(max_tokens), (out_tokens, sum(max_tokens))
    ttft = sorted(c.token_times[0] - t0 for c in done)
    n256 = {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "tok_per_s": out_tokens / wall,
        "ttft_p50_s": ttft[len(ttft) // 2],
        "steps": engine.stats.steps,
        "setup_s": setup_s,
        "max_batch_size": engine.stats.max_batch_size,
        "preemptions": engine.scheduler.num_preemptions,
        "kv_tokens": engine.kv.capacity_tokens,
        "triton_compiles_after_setup": compiles,
    }
    del engine
    return n256


# (result key, small_batch_gemv, pdl): the batch-1 variants timed side by side
BATCH1_VARIANTS = (
    ("batch1", False, False),
    ("batch1_small_batch_gemv", True, False),
    ("batch1_small_batch_gemv_pdl", True, True),
)


def run_batch1(loaded: LoadedModel, args, small_batch_gemv: bool = False, pdl: bool = False) -> dict:
    """(b) batch 1: a 512-token prompt then 256 decode steps, the median gap between tokens;
    and the forward (graph replay) + LM head alone, timed with events. ``small_batch_gemv``:
    the fused small-batch projections (kernels/triton_gemv.py) instead of cuBLAS + norms;
    ``pdl``: their kernels launched as programmatic dependents."""
    config = EngineConfig(
        model="random-qwen3-0.6b",
        device=DEVICE,
        dtype="bfloat16",
        max_running_requests=16,
        kv_cache_memory=args.kv_memory if SMOKE else "2GiB",
        max_model_len=4096,
        cuda_graph=not args.eager,
        small_batch_gemv=small_batch_gemv,
        pdl=pdl,
    )
    engine = Engine(config, ModelRunner(config, loaded))
    prompts, _ = n256_workload()
    engine.generate([prompts[0][:100]], SamplingParams(max_new_tokens=16, temperature=0.6, ignore_eos=True))
    prompt_len, steps = (SMOKE_PROMPT, SMOKE_OUTPUT) if SMOKE else (512, 256)
    one = engine.generate(
        [prompts[1][:prompt_len]], SamplingParams(max_new_tokens=steps + 1, temperature=0.6, ignore_eos=True)
    )[0]
    gaps = [b - a for a, b in zip(one.token_times[1:], one.token_times[2:])]
    batch1 = {"engine_step_ms": 1e3 * statistics.median(gaps)}
    runner = engine.runner
    if runner.graphs is not None:
        runner.graphs.load_inputs([1], [600], [list(range(1, 40))])
        hidden = runner.graphs.outputs[1]
        times = []
        for _ in range(220):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            runner.graphs.graphs[1].replay()
            runner.sampler.lm_head(hidden[:1]).argmax(-1)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        batch1["forward_lm_head_ms"] = statistics.median(times[20:])
    batch1["weight_bytes"] = runner.weight_bytes  # tied: the embedding is read once, as the LM head
    del engine, runner
    release_gpu_memory()
    return batch1


def run_hf(hf, args) -> dict:
    prompts, max_tokens = n256_workload()
    hf.generation_config.pad_token_id = 0
    bsz = args.hf_batch
    # warm-up
    hf.generate(
        torch.tensor([prompts[0][:100]], device=DEVICE),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
    )
    sync()
    t0 = time.perf_counter()
    counted, batches = 0, 0
    for start in range(0, len(prompts), bsz):
        ps, outs = prompts[start : start + bsz], max_tokens[start : start + bsz]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=DEVICE)
        n = max(outs)
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=True,
            temperature=0.6,
            top_k=0,
            top_p=1.0,
        )
        sync()
        counted += sum(outs)
        batches += 1
        if time.perf_counter() - t0 > args.hf_time_limit:
            break
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "output_tokens": counted,
        "tok_per_s": counted / wall,
        "batch": bsz,
        "batches_run": batches,
        "batches_total": -(-len(prompts) // bsz),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list: hf")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument(
        "--hf-time-limit",
        type=float,
        default=240.0,
        help="stop HF after the batch that crosses this many seconds (rate from the batches run)",
    )
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-memory", default="40GiB")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--small-batch-gemv",
        action="store_true",
        help="N256 with the fused small-batch projections (decode batches <= 16)",
    )
    ap.add_argument("--skip-plain", action="store_true", help="do not also run N256 without the overlap schedule")
    ap.add_argument(
        "--also-batched-tokens",
        type=int,
        nargs="*",
        default=[],
        help="also run N256 with these step token budgets (fewer, larger prefill steps)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a quick CPU run of every part with a tiny model (checks the script, measures nothing)",
    )
    args = ap.parse_args()
    if args.smoke:
        global DEVICE, SMOKE
        DEVICE, SMOKE = "cpu", True
        args.kv_memory = "64MiB"

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else f"{DEVICE} (--smoke: not a measurement)"
    bw = copy_bandwidth()
    hf, loaded = build_models()
    n256 = run_engine(loaded, args)
    result = {"gpu": gpu, "torch": torch.__version__, "n256_engine": n256}

    def save() -> None:  # after every part: a later failure must not lose the numbers so far
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    def attempt(key: str, part) -> dict | None:
        """Run one secondary part; its failure is recorded under ``key`` and the run goes on."""
        try:
            return part()
        except Exception as e:  # noqa: BLE001
            result[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
            return None
        finally:
            release_gpu_memory()
            save()

    release_gpu_memory()
    save()
    if not args.skip_plain:  # the same engine without the overlap schedule, for the ratio
        plain = attempt("n256_plain_schedule", lambda: run_engine(loaded, args, overlap=False))
        if plain is not None:
            n256["plain_schedule_tok_per_s"] = plain["tok_per_s"]
            n256["overlap_over_plain"] = n256["tok_per_s"] / plain["tok_per_s"]
    for budget in args.also_batched_tokens:  # prefill steps run eagerly: fewer of them, less host time
        other = attempt(f"n256_batched_tokens_{budget}", lambda: run_engine(loaded, args, batched_tokens=budget))
        if other is not None:
            n256.setdefault("tok_per_s_by_batched_tokens", {args.batched_tokens: n256["tok_per_s"]})[budget] = other[
                "tok_per_s"
            ]
    for key, gemv, pdl in BATCH1_VARIANTS:
        # (an experimental variant must not cost the run's other numbers)
        batch1 = attempt(key, lambda: run_batch1(loaded, args, small_batch_gemv=gemv, pdl=pdl))
        if batch1 is None:
            continue
        floor_ms = 1e3 * batch1["weight_bytes"] / bw
        batch1.update(
            copy_bandwidth_gbs=bw / 1e9, hbm_floor_ms=floor_ms, engine_step_x_floor=batch1["engine_step_ms"] / floor_ms
        )
        if "forward_lm_head_ms" in batch1:
            batch1["forward_x_floor"] = batch1["forward_lm_head_ms"] / floor_ms
        result[key] = batch1
        save()
    if "hf" not in args.skip.split(","):
        hf_result = attempt("n256_hf", lambda: run_hf(hf, args))
        if hf_result is not None:
            result["n256_hf"] = hf_result
            result["engine_over_hf"] = n256["tok_per_s"] / hf_result["tok_per_s"]
            save()

    print(f"GPU: {gpu}, torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(
        f"N256 engine: {n256['output_tokens']} tokens in {n256['wall_s']:.2f} s = {n256['tok_per_s']:.0f} tok/s "
        f"({n256['steps']} steps, max batch {n256['max_batch_size']}, preemptions {n256['preemptions']}, "
        f"Triton compiles after start-up {n256['triton_compiles_after_setup']})"
    )
    for budget, rate in n256.get("tok_per_s_by_batched_tokens", {}).items():
        print(f"N256 with a step budget of {budget} tokens: {rate:.0f} tok/s")
    for key, part in result.items():  # secondary parts that failed (batch 1's are listed below)
        if isinstance(part, dict) and "error" in part and not key.startswith("batch1"):
            print(f"{key}: failed: {part['error']}")
    if "overlap_over_plain" in n256:
        print(
            f"N256 without the overlap schedule: {n256['plain_schedule_tok_per_s']:.0f} tok/s "
            f"(overlap / plain = {n256['overlap_over_plain']:.2f})"
        )
    if "engine_over_hf" in result:
        h = result["n256_hf"]
        print(
            f"N256 HF static batch {h['batch']}: {h['tok_per_s']:.0f} tok/s ({h['batches_run']}/{h['batches_total']} "
            f"batches, {h['wall_s']:.1f} s); engine / HF = {result['engine_over_hf']:.1f}x"
        )
    labels = {
        "batch1": "cuBLAS + norms",
        "batch1_small_batch_gemv": "fused small-batch GEMVs",
        "batch1_small_batch_gemv_pdl": "fused GEMVs, programmatic dependent launch",
    }
    for key, _, _ in BATCH1_VARIANTS:
        label, b1 = labels[key], result[key]
        if "error" in b1:
            print(f"batch 1 ({label}): failed: {b1['error']}")
            continue
        print(
            f"batch 1 ({label}): engine step {b1['engine_step_ms']:.3f} ms, forward+LM head "
            f"{b1.get('forward_lm_head_ms', float('nan')):.3f} ms, HBM floor {b1['hbm_floor_ms']:.3f} ms "
            f"({b1['weight_bytes'] / 1e9:.2f} GB weights): {b1['engine_step_x_floor']:.2f}x / "
            f"{b1.get('forward_x_floor', float('nan')):.2f}x floor"
        )
    save()


if __name__ == "__main__":
    main()
