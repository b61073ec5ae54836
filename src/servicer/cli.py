"""`python -m servicer`: command line of the inference daemon."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import socket
import sys

from scheduler.config import DisaggregationConfig, EngineConfig, describe_default, parse_memory_size
from scheduler.logs import LOG_FORMATS, configure_logging

from .log_filters import ClientGoneFilter
from .server import ServerConfig, serve


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except those of on/off flags and the empty ones whose meaning the
    help text already gives."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _number(kind, low: float, high: float = math.inf, what: str = ""):
    """An argparse type: a ``kind`` number in [low, high] (NaN refused)."""

    def parse(text: str):
        value = kind(text)  # a ValueError reads "invalid int value: 'x'"
        if not low <= value <= high:
            bound = f"in {low}..{high}" if high < math.inf else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {what or bound}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _memory_size(text: str) -> str:
    try:
        parse_memory_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_COUNT = _number(int, 1)
_ENGINE = EngineConfig()
_SERVER = ServerConfig()
_PD = DisaggregationConfig(mode="null", host="")  # (its defaults)


def build_parser() -> argparse.ArgumentParser:
    """Each flag's dest is its EngineConfig / ServerConfig field, and its default that
    field's default."""
    e, srv = _ENGINE, _SERVER
    p = argparse.ArgumentParser(
        prog="python -m servicer",
        description="LLM inference daemon: serves a model over gRPC (the SGLang scheduler protocol "
        "of the smg router, grpc.health.v1 and reflection) with its own continuous-batching engine.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model",
        default=e.model,
        help="model to serve: 'smollm2' (the bundled SmolLM2-135M-Instruct GGUF), a .gguf file, "
        "or a Hugging Face model directory (config.json + safetensors)",
    )
    p.add_argument(
        "--served-model-name",
        default=e.served_model_name,
        help="model id the router shows to clients (default: the --model value as given)",
    )
    p.add_argument(
        "--is-embedding",
        action="store_true",
        default=e.is_embedding,
        help="serve the model's embeddings (the Embed RPC; /v1/embeddings behind the router), its last token's "
        "hidden state L2-normalised; classifiers (*ForSequenceClassification), sentence-transformers layouts "
        "and base models (*Model) are served this way without it, pooled as their checkpoint says",
    )
    p.add_argument("--host", default=srv.host, help="address to bind the gRPC server to")
    p.add_argument("--port", type=_number(int, 0, 65535), default=srv.port, help="gRPC port")
    p.add_argument(
        "--ssl-certfile",
        default=srv.ssl_certfile,
        metavar="PEM",
        help="serve TLS on the whole port with this certificate chain (with --ssl-keyfile); without TLS a "
        "host other than loopback gets a warning: the admin RPCs are open to the network",
    )
    p.add_argument("--ssl-keyfile", default=srv.ssl_keyfile, metavar="PEM", help="private key of --ssl-certfile")
    p.add_argument(
        "--ssl-ca-certs",
        default=srv.ssl_ca_certs,
        metavar="PEM",
        help="CA certificates (with --ssl-certfile): every client must present a certificate they signed (mTLS)",
    )
    p.add_argument(
        "--device",
        default=e.device,
        help="where the model runs: auto (CUDA, then NPU, else CPU), cpu, cuda, cuda:N, npu, npu:N",
    )
    p.add_argument(
        "--dtype",
        default=e.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"weight and KV dtype: auto ({describe_default('dtype')}), "
        "float32, bfloat16 or float16; bfloat16 also suits CPUs with bf16 instructions "
        "(AVX512-BF16, AMX), where it runs faster than float32 (docs/performance.md)",
    )
    p.add_argument(
        "--max-running-requests",
        type=_COUNT,
        default=e.max_running_requests,
        help="most requests decoded together in one step; more wait in the queue "
        f"(default: {describe_default('max_running_requests')})",
    )
    p.add_argument(
        "--max-queued-requests",
        type=_number(int, 0),
        default=e.max_queued_requests,
        help="most requests waiting beyond the free running slots; more are refused with "
        "RESOURCE_EXHAUSTED, which the router retries (default: 4 x --max-running-requests: a few "
        "batches' worth, which bounds the memory queued requests take and still admits one call of n=1024 "
        "at 256 running slots)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_COUNT,
        default=e.max_num_batched_tokens,
        help="token budget of one step (decodes + prefill chunks); longer prompts are chunked "
        f"(default: {describe_default('max_num_batched_tokens')})",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=_number(int, 0),
        default=e.long_prefill_token_threshold,
        help="a prompt with more tokens left to compute prefills in chunks of at most this many, "
        "one such prompt at a time, so that shorter prompts arriving meanwhile start in the next step "
        "instead of queueing behind it (the step budget they leave goes back to it); 0 disables "
        "(default: half of --max-num-batched-tokens)",
    )
    p.add_argument(
        "--max-model-len",
        type=_COUNT,
        default=e.max_model_len,
        help="context limit in tokens (default: the model's own)",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-tokens",
        type=_COUNT,
        default=e.kv_cache_tokens,
        help="KV cache capacity in tokens (default: from --kv-cache-memory)",
    )
    kv.add_argument(
        "--kv-cache-memory",
        type=_memory_size,
        default=e.kv_cache_memory,
        help="KV cache size as memory, e.g. 2GiB (default: "
        + describe_default("kv_cache_memory", lambda v: v.replace("%", "%% of the memory free after the weights"))
        + ")",
    )
    p.add_argument("--block-size", type=_COUNT, default=e.block_size, help="tokens per KV block")
    p.add_argument(
        "--disable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not share KV blocks between requests with a common prompt prefix",
    )
    p.add_argument(
        "--kernel-backend",
        default=e.kernel_backend,
        metavar="BACKEND",
        help="the kernels every layer runs, a backend of src/kernels/backend.py: "
        f"auto ({describe_default('kernel_backend')}), "
        "torch (the reference paths), cpu (torch with the native CPU kernels and packed weights) or "
        "triton (GPUs)",
    )
    p.add_argument(
        "--disable-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    p.add_argument(
        "--small-batch-gemv",
        action="store_true",
        help="experimental (Triton backend): steps of at most 16 tokens run fused Triton projections "
        "(RMSNorm and SiLU-mul folded in) instead of cuBLAS; see bench/bench_n256.py",
    )
    p.add_argument(
        "--pdl",
        action="store_true",
        help="experimental (with --small-batch-gemv, CUDA sm_90+): those kernels launch as programmatic "
        "dependents, each pulling its weights into L2 while the kernel before it finishes",
    )
    p.add_argument(
        "--overlap-schedule",
        choices=["auto", "on", "off"],
        default="auto",
        help="launch each step before taking the previous step's tokens, hiding the host's "
        "bookkeeping behind the device's work: auto = "
        + describe_default("overlap_schedule", lambda on: "on" if on else "off")
        + ", and off with --speculative-algorithm",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_const",
        const="off",
        help="same as --overlap-schedule off (SGLang's spelling)",
    )
    p.add_argument(
        "--speculative-algorithm",
        type=str.lower,
        choices=["ngram"],
        default=e.speculative_algorithm,
        help="speculative decoding: ngram (prompt lookup: a decoding request's next tokens guessed "
        "from what followed the latest earlier occurrence of its last tokens, then verified in the "
        "same step; the output is unchanged, greedy or sampled, and repetitive text (code edits, "
        "quoting the context) takes fewer steps) (default: off)",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=_COUNT,
        default=e.speculative_num_draft_tokens,
        help="most draft tokens a request verifies per step with --speculative-algorithm (on a CPU, "
        "up to 3 keep one request's step on the few-row projections)",
    )
    p.add_argument(
        "--max-logprobs",
        type=_number(int, 0),
        default=e.max_logprobs,
        help="most logprobs per token a request may ask for (top_logprobs_num, token_ids_logprob)",
    )
    p.add_argument(
        "--grammar-compile-timeout",
        dest="grammar_compile_timeout_s",
        default=e.grammar_compile_timeout_s,
        type=_number(float, math.ulp(0.0), what="a positive number of seconds"),
        metavar="SECONDS",
        help="seconds a structured-output grammar (regex, JSON schema, EBNF) may take to compile "
        "before its request is refused",
    )
    json_ws = p.add_mutually_exclusive_group()
    json_ws.add_argument(
        "--constrained-json-allow-any-whitespace",
        dest="constrained_json_any_whitespace",
        action="store_true",
        default=e.constrained_json_any_whitespace,
        help="let JSON-schema constrained output (response_format json_schema and json_object) put any run "
        "of whitespace between tokens, as SGLang and vLLM do by default; off by default because small "
        "models then pad with newlines until max_tokens and return JSON that does not parse, while "
        "the default compact form (one line, ', ' and ': ') always parses when the grammar finishes",
    )
    json_ws.add_argument(
        "--constrained-json-disable-any-whitespace",
        dest="constrained_json_any_whitespace",
        action="store_false",
        default=e.constrained_json_any_whitespace,
        help="compact JSON for JSON-schema constraints: the default here (SGLang's spelling, accepted)",
    )
    p.add_argument(
        "--num-threads",
        type=_COUNT,
        default=e.num_threads,
        help="CPU threads for torch (default: all cores); on a host shared with other CPU-heavy "
        "processes give fewer than the free cores: the threads wait on each other every step, "
        "so one that is descheduled stalls them all",
    )
    p.add_argument(
        "--seed", type=_number(int, -(2**63), 2**64 - 1), default=e.seed, help="seed of the sampler's default generator"
    )
    p.add_argument(
        "--shutdown-grace-period",
        dest="shutdown_grace_s",
        type=_number(float, 0.0),
        metavar="SECONDS",
        default=srv.shutdown_grace_s,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    p.add_argument(
        "--watchdog-timeout",
        dest="watchdog_timeout_s",
        default=srv.watchdog_timeout_s,
        type=_number(float, 0.0, what="0 (off) or a positive number of seconds"),
        metavar="SECONDS",
        help="seconds the scheduler may go without progress (one step, or no heartbeat) before it is "
        "killed and the daemon exits 1 for its supervisor to restart it; 0 disables",
    )
    p.add_argument(
        "--log-level",
        default=srv.log_level,
        choices=["debug", "info", "warning", "error"],
        help="logging verbosity of the daemon and its scheduler process",
    )
    p.add_argument(
        "--enable-metrics",
        action="store_true",
        default=srv.enable_metrics,
        help="serve Prometheus metrics (SGLang's sglang:* names) over HTTP at --metrics-host:--metrics-port/metrics",
    )
    p.add_argument("--metrics-host", default=srv.metrics_host, help="address of the metrics endpoint")
    p.add_argument(
        "--metrics-port", type=_number(int, 0, 65535), default=srv.metrics_port, help="port of the metrics endpoint"
    )
    p.add_argument(
        "--enable-trace",
        action="store_true",
        default=srv.enable_trace,
        help="OpenTelemetry tracing: a span per request (and admin call), the child of the caller's W3C "
        "traceparent (the smg router's with --enable-trace), exported over OTLP/gRPC (the trace extra)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=srv.otlp_traces_endpoint,
        metavar="HOST:PORT",
        help="the OTLP/gRPC collector spans go to (plaintext; an https:// URL for TLS)",
    )
    p.add_argument(
        "--log-format",
        default=srv.log_format,
        choices=LOG_FORMATS,
        help="text for people; json for log pipelines: one object per line with time, level, process, logger, "
        "message and the request id where there is one",
    )
    p.add_argument(
        "--profile-dir",
        default=e.profile_dir,
        metavar="DIR",
        help="directory StartProfile writes torch.profiler traces into: a request's output_dir, absolute "
        "or relative to it, must lie inside it, and new directories are private to the daemon's user "
        "(default: $SGLANG_TORCH_PROFILER_DIR if set, else profiling is off)",
    )
    p.add_argument(
        "--tp-size",
        type=_COUNT,
        default=e.tp_size,
        metavar="N",
        help="tensor parallelism: the model split across N ranks, one process each (the heads, the MLP "
        "columns and the vocabulary divided among them; their threads share --num-threads' cores)",
    )
    p.add_argument(
        "--nnodes",
        type=_COUNT,
        default=e.nnodes,
        metavar="N",
        help="hosts the --tp-size ranks span, --tp-size / N on each: node 0 runs the gRPC server and the "
        "scheduler, the others (the same command with their --node-rank) run ranks only",
    )
    p.add_argument(
        "--node-rank",
        type=_number(int, 0),
        default=e.node_rank,
        metavar="R",
        help="this host's place among --nnodes (0: the one serving)",
    )
    p.add_argument(
        "--dist-init-addr",
        default=e.dist_init_addr,
        metavar="HOST:PORT",
        help="where the ranks of several hosts meet (node 0's address; the next port carries node 0's "
        "commands to the other hosts' ranks); needed with --nnodes > 1",
    )
    p.add_argument(
        "--dp-size",
        type=_COUNT,
        default=e.dp_size,
        metavar="N",
        help="data parallelism: N engine replicas behind this one port, a scheduler process (and TP group) "
        "each; a request goes to the rank its data_parallel_rank names, else to the one caching most of "
        "its prompt unless it is much busier, else to the least busy one; "
        "the router's --dp-aware sees every rank as a worker (on accelerators each rank takes the next device)",
    )
    pd = p.add_argument_group(
        "prefill/decode disaggregation",
        "two daemons serve each request behind `smg launch --pd-disaggregation`: the prefill daemon "
        "computes the prompt's KV and first token and writes the KV into the decode daemon's cache "
        "(Mooncake over TCP: pip install '.[pd]')",
    )
    pd.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default="null",
        help="this daemon's part: null serves requests whole; prefill and decode serve only PD legs",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-port",
        type=_number(int, 1, 65535),
        default=_PD.bootstrap_port,
        metavar="PORT",
        help="prefill: where decode daemons register the blocks a request's KV goes to (on --host); "
        "the router's --prefill URL PORT",
    )
    pd.add_argument(
        "--disaggregation-transfer-backend",
        choices=["mooncake"],
        default=_PD.transfer_backend,
        help="what moves the KV between the daemons",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-timeout",
        type=_number(float, 0.001, what="a positive number of seconds"),
        default=_PD.bootstrap_timeout_s,
        metavar="SECONDS",
        help="a leg whose partner has not shown up within this fails with UNAVAILABLE",
    )
    pd.add_argument(
        "--disaggregation-waiting-timeout",
        type=_number(float, 0.001, what="a positive number of seconds"),
        default=_PD.waiting_timeout_s,
        metavar="SECONDS",
        help="decode: KV registered but not written within this fails with UNAVAILABLE",
    )
    p.add_argument(
        "--profile-max-traces",
        type=_COUNT,
        default=e.profile_max_traces,
        metavar="N",
        help="traces kept under --profile-dir: writing one deletes the oldest beyond the newest N",
    )
    return p


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args["speculative_algorithm"] and args["overlap_schedule"] == "on":
        parser.error(
            "--speculative-algorithm cannot run with --overlap-schedule on (a step's drafts come from "
            "the tokens the previous step kept)"
        )
    args["overlap_schedule"] = {"auto": None, "on": True, "off": False}[args["overlap_schedule"]]
    args["disaggregation"] = _disaggregation(parser, args)
    _check_nodes(parser, args)
    if args["disaggregation"] is not None and args["dp_size"] > 1:
        parser.error("--dp-size > 1 cannot serve PD legs yet: run one daemon per replica with --disaggregation-mode")
    engine_fields = set(EngineConfig.__struct_fields__)
    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(args) <= engine_fields | server_fields, set(args) - engine_fields - server_fields  # a dest typo
    engine = EngineConfig(**{f: args[f] for f in engine_fields & set(args)})
    server = ServerConfig(**{f: args[f] for f in server_fields & set(args)})
    return engine, server


def _check_nodes(parser: argparse.ArgumentParser, args: dict) -> None:
    nnodes, rank, addr = args["nnodes"], args["node_rank"], args["dist_init_addr"]
    if rank >= nnodes:
        parser.error(f"--node-rank {rank} is not below --nnodes {nnodes}")
    if nnodes == 1:
        return
    if args["tp_size"] % nnodes:
        parser.error(f"--tp-size {args['tp_size']} does not divide among --nnodes {nnodes}")
    if args["dp_size"] > 1:
        parser.error("--dp-size > 1 cannot span several hosts yet (--nnodes > 1)")
    host, _, port = (addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        parser.error("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, PORT below 65535)")


def _disaggregation(parser: argparse.ArgumentParser, args: dict) -> DisaggregationConfig | None:
    """The --disaggregation-* flags (taken out of ``args``) as the engine's setting."""
    mode = args.pop("disaggregation_mode")
    port = args.pop("disaggregation_bootstrap_port")
    backend = args.pop("disaggregation_transfer_backend")
    bootstrap_timeout = args.pop("disaggregation_bootstrap_timeout")
    waiting_timeout = args.pop("disaggregation_waiting_timeout")
    if mode == "null":
        return None
    if mode == "prefill" and port == args["port"]:
        parser.error(f"--disaggregation-bootstrap-port {port} is the gRPC --port as well")
    host = args["host"]
    if host in ("", "0.0.0.0", "::", "[::]"):  # the peer needs an address that reaches us
        host = socket.gethostbyname(socket.gethostname())
    return DisaggregationConfig(
        mode=mode,
        host=host,
        bootstrap_port=port,
        transfer_backend=backend,
        bootstrap_timeout_s=bootstrap_timeout,
        waiting_timeout_s=waiting_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    engine, server = parse_args(argv)
    name = "servicer" if engine.node_rank == 0 else f"node-{engine.node_rank}"
    configure_logging(server.log_level, server.log_format, name)
    if engine.node_rank > 0:  # ranks only: node 0 serves
        from scheduler.tp_worker import run_node

        return run_node(engine)
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
