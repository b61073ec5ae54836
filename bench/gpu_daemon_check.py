"""The whole daemon on an accelerator: a smoke check for lent GPU machines (not part of `make test`).

Builds a randomly initialised checkpoint of a real configuration (Qwen3-0.6B shapes, the
bundled tokenizer's vocabulary) on disk, starts `python -m servicer` on it, and checks over
gRPC: SERVING after warm-up, greedy determinism, streamed deltas == non-streamed output,
64 concurrent requests (throughput printed), n=2 sampling, Abort mid-stream, KV all free
afterwards, then SIGTERM exits 0.

    python bench/gpu_daemon_check.py --tokenizer-dir DIR [--device cuda] [--layers 28]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from servicer.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from servicer.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def build_checkpoint(out: str, tokenizer_dir: str, layers: int, device: str) -> None:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), out)


def request(ids, max_new, rid, stream=False, temperature=0.0, n=1, ignore_eos=True):
    sp = pb.SamplingParams(
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        max_new_tokens=max_new,
        n=n,
        temperature=temperature,
        ignore_eos=ignore_eos,
        skip_special_tokens=True,
    )
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=list(ids)),
        sampling_params=sp,
        stream=stream,
        logprob_start_len=-1,
    )


def completes(stub, req, timeout=300):
    return [m.complete for m in stub.Generate(req, timeout=timeout) if m.WhichOneof("response") == "complete"]


async def concurrent(addr: str, n: int) -> tuple[float, int, bool]:
    import random

    rng = random.Random(0)
    work = [([rng.randint(100, 40000) for _ in range(rng.randint(64, 512))], rng.randint(64, 256)) for _ in range(n)]
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)

        async def one(i, ids, out):
            got = 0
            async for m in stub.Generate(request(ids, out, f"c{i}", stream=True), timeout=600):
                if m.WhichOneof("response") == "chunk":
                    got += len(m.chunk.token_ids)
            return got == out, got

        t = time.perf_counter()
        res = await asyncio.gather(*(one(i, ids, out) for i, (ids, out) in enumerate(work)))
        wall = time.perf_counter() - t
    return wall, sum(g for _, g in res), all(ok for ok, _ in res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--model-dir", default="/tmp/servicer-random-qwen3")
    ap.add_argument("--requests", type=int, default=64, help="concurrent streams in the load check")
    args = ap.parse_args()

    t = time.perf_counter()
    build_checkpoint(args.model_dir, args.tokenizer_dir, args.layers, args.device)
    print(f"checkpoint written in {time.perf_counter() - t:.1f} s", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servicer",
            "--model",
            args.model_dir,
            "--device",
            args.device,
            "--port",
            str(port),
            "--max-running-requests",
            "64",
            "--max-model-len",
            "4096",
        ],
        env=env,
        start_new_session=True,
    )
    try:
        channel = grpc.insecure_channel(addr)
        health = health_pb2_grpc.HealthStub(channel)
        t = time.perf_counter()
        status = None
        while time.perf_counter() - t < 400 and daemon.poll() is None:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        check(
            "serving after warm-up",
            status == health_pb2.HealthCheckResponse.SERVING,
            f"{time.perf_counter() - t:.1f} s",
        )
        stub = pb_grpc.SglangSchedulerStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        print("server info:", str(info)[:600].replace("\n", " "), flush=True)

        prompt = list(range(1000, 1100))
        a = completes(stub, request(prompt, 32, "g1"))[0]
        b = completes(stub, request(prompt, 32, "g2"))[0]
        check("greedy deterministic", list(a.output_ids) == list(b.output_ids) and len(a.output_ids) == 32)
        check("prefix cache hit", b.cached_tokens >= 96, f"cached {b.cached_tokens}")
        deltas = []
        for m in stub.Generate(request(prompt, 32, "s1", stream=True), timeout=300):
            if m.WhichOneof("response") == "chunk":
                deltas += list(m.chunk.token_ids)
        check("stream == non-stream", deltas == list(a.output_ids))
        two = completes(stub, request(prompt, 24, "n2", temperature=0.7, n=2))
        check("n=2 sampling", sorted(c.index for c in two) == [0, 1] and all(len(c.output_ids) == 24 for c in two))

        wall, tokens, ok = asyncio.run(concurrent(addr, args.requests))
        check(
            f"{args.requests} concurrent streams complete",
            ok,
            f"{tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s",
        )

        call = stub.Generate(request(prompt, 2000, "ab1", stream=True), timeout=300)
        first = next(call)
        stub.Abort(pb.AbortRequest(request_id="ab1"), timeout=10)
        rest = list(call)
        kinds = [m.WhichOneof("response") for m in [first, *rest]]
        check(
            "abort mid-stream",
            kinds[-1] == "complete" and rest[-1].complete.finish_reason == "abort",
            f"{len(kinds)} messages",
        )
        time.sleep(0.5)
        loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
        print("loads:", str(loads)[:500].replace("\n", " "), flush=True)
        fields = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).scheduler_info.fields
        used = fields["num_used_blocks"].number_value if "num_used_blocks" in fields else -1
        check("KV free when idle", used == 0, f"num_used_blocks {used}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            rc = daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            rc = "killed"
        check("SIGTERM exits 0", rc == 0, f"rc {rc}")
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
