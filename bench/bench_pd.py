"""W64 through the smg router: one daemon, then a prefill daemon and a decode daemon in the
router's PD mode, one after the other in the same run, with the KV transfers' throughput and
latency as the prefill daemon measured them.

    python bench/bench_pd.py [--requests 64] [--json FILE]

On a machine of few cores both PD daemons share them (each with half the threads): the ratio
then shows what splitting costs here, not what two machines would gain.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import workloads  # noqa: E402
from report import summarize  # noqa: E402

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def daemon(port: int, args, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "servicer", "--model", args.model, "--port", str(port), "--device", "cpu"]
    cmd += ["--max-running-requests", str(args.requests), "--kv-cache-tokens", str(args.kv_cache_tokens)]
    cmd += ["--log-level", "warning"] + extra
    return start(cmd, dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))


def wait_serving(port: int, proc: subprocess.Popen) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.time() + 300
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon on {port} exited with {proc.returncode}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"daemon on {port} did not become SERVING")
            time.sleep(0.5)


def router(workers: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    smg = os.path.join(os.path.dirname(sys.executable), "smg")
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--backend", "sglang"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    proc = start(cmd + workers)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with OPENER.open(url + "/readiness", timeout=5) as r:
                if json.load(r).get("status") == "ready":
                    return proc, url
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("the router did not become ready")
        time.sleep(0.5)


def one_request(url: str, model: str, prompt: list[int], n: int, t0: float) -> tuple[float, float, int]:
    """/generate streamed: (first token time - t0, last - t0, output tokens)."""
    body = {
        "model": model,
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    first = last = None
    tokens = 0
    with OPENER.open(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"request failed: {event}")
            now = time.perf_counter()
            first = first or now
            last = now
            tokens = event.get("meta_info", {}).get("completion_tokens", tokens)
    return first - t0, last - t0, tokens


def run_load(url: str, work, model: str) -> tuple[float, list]:
    one_request(url, model, [1, 2, 3, 4], 4, time.perf_counter())  # warm-up
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(one_request, url, model, p, n, t0) for p, n in work]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    got = [n for _, _, n in results]
    if got != [n for _, n in work]:
        raise RuntimeError(f"output lengths differ from the workload's: {got}")
    return wall, results


def model_id(url: str) -> str:
    with OPENER.open(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def prefill_transfers(port: int) -> dict:
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        stats = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).scheduler_info
        disagg = stub.GetLoads(pb.GetLoadsRequest(include=["disagg"]), timeout=10).loads[0].disaggregation
    n = int(stats["pd_transfers"])
    nbytes = int(stats["pd_transferred_bytes"])
    return {
        "transfers": n,
        "bytes": nbytes,
        "mean_mib_per_request": nbytes / max(n, 1) / 2**20,
        "speed_gb_s_ewma": disagg.kv_transfer_speed_gb_s,
        "latency_ms_ewma": disagg.kv_transfer_latency_ms,
    }


def run_single(work, args) -> dict:
    port = free_port()
    proc = daemon(port, args, [])
    try:
        wait_serving(port, proc)
        rproc, url = router(["--worker-urls", f"grpc://127.0.0.1:{port}"])
        try:
            wall, results = run_load(url, work, model_id(url))
        finally:
            stop(rproc)
    finally:
        stop(proc)
    return summarize("one daemon behind the router", wall, results)


def run_pd(work, args) -> dict:
    pport, dport, bport = free_port(), free_port(), free_port()
    half = ["--num-threads", str(max(1, (os.cpu_count() or 2) // 2))]
    prefill_mode = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport)]
    prefill = daemon(pport, args, half + prefill_mode)
    decode = daemon(dport, args, half + ["--disaggregation-mode", "decode"])
    try:
        wait_serving(pport, prefill)
        wait_serving(dport, decode)
        workers = ["--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{pport}", str(bport)]
        workers += ["--decode", f"grpc://127.0.0.1:{dport}", "--policy", "round_robin"]
        rproc, url = router(workers)
        try:
            wall, results = run_load(url, work, model_id(url))
            transfers = prefill_transfers(pport)
        finally:
            stop(rproc)
    finally:
        stop(prefill)
        stop(decode)
    out = summarize("prefill + decode daemons, router PD mode", wall, results)
    out["kv_transfers"] = transfers
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    work = workloads.w64(args.requests)
    runs = [run_single(work, args), run_pd(work, args)]
    single, pd = runs
    print(f"\nW64 ({args.requests} requests) through the smg router, {os.cpu_count()} cores")
    print(f"{'':44} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>9}")
    for r in runs:
        print(f"{r['name']:44} {r['tok_per_s']:8.1f} {r['ttft_s']['p50']:8.2f}s {r['itl_s']['p50'] * 1e3:7.1f}ms")
    print(f"PD / one daemon: {pd['tok_per_s'] / single['tok_per_s']:.2f}x")
    t = pd["kv_transfers"]
    print(
        f"KV transfers (Mooncake TCP, loopback): {t['transfers']} requests, {t['mean_mib_per_request']:.1f} MiB each, "
        f"{t['speed_gb_s_ewma']:.2f} GB/s, {t['latency_ms_ewma']:.1f} ms per request (moving averages)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "w64", "requests": args.requests, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
