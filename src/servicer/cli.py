"""`python -m servicer`: command line of the inference daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from scheduler.config import EngineConfig, parse_memory_size

from .log_filters import ClientGoneFilter
from .server import ServerConfig, serve


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones whose meaning the help text already gives."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m servicer",
        description="LLM inference daemon: serves a model over gRPC (the SGLang scheduler protocol "
        "of the smg router, grpc.health.v1 and reflection) with its own continuous-batching engine.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", default="smollm2",
                   help="model to serve: 'smollm2' (the bundled SmolLM2-135M-Instruct GGUF), a .gguf file, "
                   "or a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--served-model-name", default=None,
                   help="model id the router shows to clients (default: the --model value as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the gRPC server to")
    p.add_argument("--port", type=int, default=30000, help="gRPC port")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (CUDA, then NPU, else CPU), cpu, cuda, cuda:N, npu, npu:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and KV dtype: auto (float32 on CPU, bfloat16 on accelerators), "
                   "float32, bfloat16 or float16; bfloat16 also suits CPUs with bf16 instructions "
                   "(AVX512-BF16, AMX), where it runs ~1.9x faster than float32")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="most requests decoded together in one step; more wait in the queue")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="most requests waiting beyond the free running slots; more are refused with "
                   "RESOURCE_EXHAUSTED, which the router retries (default: no limit)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (decodes + prefill chunks); longer prompts are chunked "
                   "(default: 512 on CPU, 8192 on accelerators)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the model's own)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="KV cache capacity in tokens (default: from --kv-cache-memory)")
    kv.add_argument("--kv-cache-memory", default=None,
                    help="KV cache size as memory, e.g. 2GiB (default: 2GiB on CPU, "
                    "85%% of free memory after weights on GPUs)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--disable-prefix-caching", action="store_true",
                   help="do not share KV blocks between requests with a common prompt prefix")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention/norm/rope kernels: auto (Triton on CUDA GPUs, torch elsewhere), "
                   "torch (reference path) or triton")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--small-batch-gemv", action="store_true",
                   help="experimental (Triton backend): steps of at most 16 tokens run fused Triton projections "
                   "(RMSNorm and SiLU-mul folded in) instead of cuBLAS; see bench/bench_n256.py")
    p.add_argument("--pdl", action="store_true",
                   help="experimental (with --small-batch-gemv, CUDA sm_90+): those kernels launch as programmatic "
                   "dependents, each pulling its weights into L2 while the kernel before it finishes")
    p.add_argument("--overlap-schedule", choices=["auto", "on", "off"], default="auto",
                   help="launch each step before taking the previous step's tokens, hiding the host's "
                   "bookkeeping behind the device's work: auto = on for accelerators, off on CPU")
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_const", const="off",
                   help="same as --overlap-schedule off (SGLang's spelling)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs per token a request may ask for (top_logprobs_num, token_ids_logprob)")
    p.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                   help="seconds a structured-output grammar (regex, JSON schema, EBNF) may take to compile "
                        "before its request is refused")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler's default generator")
    p.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    p.add_argument("--watchdog-timeout", type=float, default=300.0,
                   help="seconds the scheduler may go without progress (one step, or no heartbeat) before it is "
                        "killed and the daemon exits 1 for its supervisor to restart it; 0 disables")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="logging verbosity of the daemon and its scheduler process")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_cache_memory is not None:
        try:
            parse_memory_size(args.kv_cache_memory)
        except ValueError as e:
            parser.error(str(e))
    if args.max_logprobs < 0:
        parser.error("--max-logprobs must be at least 0")
    if not args.grammar_compile_timeout > 0:
        parser.error("--grammar-compile-timeout must be a positive number of seconds")
    if not args.watchdog_timeout >= 0:  # (NaN too)
        parser.error("--watchdog-timeout must be 0 (off) or a positive number of seconds")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        parser.error("--max-queued-requests must be at least 0")
    for name in ("max_running_requests", "max_num_batched_tokens", "block_size", "max_model_len", "kv_cache_tokens",
                 "num_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory=args.kv_cache_memory,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.disable_prefix_caching,
        num_threads=args.num_threads,
        kernel_backend=args.kernel_backend,
        cuda_graph=not args.disable_cuda_graph,
        small_batch_gemv=args.small_batch_gemv,
        pdl=args.pdl,
        overlap_schedule={"auto": None, "on": True, "off": False}[args.overlap_schedule],
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        served_model_name=args.served_model_name,
    )
    server = ServerConfig(
        host=args.host, port=args.port, log_level=args.log_level, shutdown_grace_s=args.shutdown_grace_period,
        watchdog_timeout_s=args.watchdog_timeout,
    )
    return engine, server


def main(argv: list[str] | None = None) -> int:
    engine, server = parse_args(argv)
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s servicer[%(process)d]: %(message)s"
    )
    logging.getLogger("grpc").setLevel(logging.INFO)  # its debug lines are per event-loop call
    logging.getLogger("grpc._cython.cygrpc").addFilter(ClientGoneFilter())
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency, but the daemon still works without it
        runner = asyncio.run
    return runner(serve(engine, server))


if __name__ == "__main__":
    sys.exit(main())
