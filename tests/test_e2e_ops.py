"""End-to-end tests of the operations plane (issue 6): real daemon subprocesses, the real
`smg` router and the real `grpcurl`; no fakes.

* kill -9 of the scheduler process: health drops, in-flight calls end UNAVAILABLE, the
  daemon exits non-zero and leaves no child behind (issue 6 §7);
* FlushCache and grpc.health.v1 Watch through grpcurl and server reflection (§2, §6);
* a router that cannot read the tokenizer path the worker reports fetches it with
  GetTokenizer and serves chat (§4, router contract §3);
* two daemons behind one cache_aware router: requests sharing a long prefix land on the
  daemon that holds it, shown from the daemons' own cached_tokens and counters (§5).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from helpers import (
    SCHEDULER_SERVICE,
    Daemon,
    Router,
    _group_members,
    child_pids,
    find_executable,
    http_get,
    wait_until,
)
from test_e2e_grpc import RPC_TIMEOUT, fresh_salt, make_request, one_complete, sched_stat, wait_idle

STORY = [6403, 1980, 253, 655]  # "Once upon a time"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ------------------------------------------------------------------ small helpers


def complete(stub, input_ids, max_new_tokens=2, **kw):
    """The Complete of one non-streaming request (EOS ignored: always max_new_tokens)."""
    return one_complete(stub, make_request(input_ids, max_new_tokens=max_new_tokens, ignore_eos=True, **kw))


def idle(stub) -> None:
    assert wait_idle(stub) == 0, "the daemon did not go idle"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def scheduler_pid(daemon_pid: int) -> int:
    found = [p for p in child_pids(daemon_pid) if "scheduler.process" in cmdline(p)]
    assert len(found) == 1, (
        f"expected one scheduler child of {daemon_pid}, found {found}: {[cmdline(p) for p in child_pids(daemon_pid)]}"
    )
    return found[0]


def pid_gone(pid: int) -> bool:
    """No such process, or only a zombie left for its (dead) parent to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].split()[0] in ("Z", "X")


def router_log(router: Router) -> str:
    return ANSI.sub("", router.log_path.read_text(errors="replace"))


def router_stored_blocks(router: Router, daemon: Daemon) -> int:
    """KV blocks of `daemon` the router has applied to its index (its Prometheus counter)."""
    text = http_get(f"http://{router.host}:{router.prometheus_port}/metrics", timeout=10).text
    label = f'worker="grpc://127.0.0.1:{daemon.port}",op="stored"'
    found = [line for line in text.splitlines() if line.startswith("smg_kv_event_blocks_total{") and label in line]
    return int(float(found[0].rsplit(" ", 1)[1])) if found else 0


def wait_router_stored(router: Router, daemon: Daemon, at_least: int, timeout: float = 60.0) -> None:
    """Wait until the router has indexed `at_least` stored blocks of `daemon`: the events
    follow the request's output, so a routing check right after it would race them."""
    deadline = time.monotonic() + timeout
    while (n := router_stored_blocks(router, daemon)) < at_least:
        assert time.monotonic() < deadline, f"the router applied {n} of {at_least} stored blocks of {daemon.address}"
        time.sleep(0.05)


# ------------------------------------------------------------------ 1. kill -9 of the scheduler


def test_a_scheduler_that_stops_making_progress_is_killed_by_the_watchdog(tmp_path):
    """SIGSTOP of the scheduler mid-stream: health goes NOT_SERVING once its heartbeats stop
    (2 s), before the watchdog acts; after --watchdog-timeout the daemon kills it, the stream
    ends UNAVAILABLE naming the watchdog, and the daemon exits 1 for its supervisor, leaving
    no process behind. Only the watchdog's lower bound is timed (a loaded machine can only
    make it later); its upper bound is the stream's end naming the watchdog."""
    with Daemon(
        max_running_requests=4, kv_cache_tokens=2048, log_dir=tmp_path, extra_args=["--watchdog-timeout", "4"]
    ) as d:
        sched = scheduler_pid(d.proc.pid)
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            call = stub.Generate(
                make_request(STORY, max_new_tokens=1500, stream=True, ignore_eos=True), timeout=RPC_TIMEOUT
            )
            assert next(call).WhichOneof("response") == "chunk"
            t_stop = time.monotonic()  # (before the signal: a late reading would shrink `waited`)
            os.kill(sched, signal.SIGSTOP)
            # NOT_SERVING from 2 s without a heartbeat until the daemon, past the watchdog, exits
            deadline = time.monotonic() + 60
            while True:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=5).status
                except grpc.RpcError as e:
                    pytest.fail(f"the daemon stopped answering health before it said NOT_SERVING: {e.code()}")
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                assert time.monotonic() < deadline, "still SERVING 60 s after the scheduler stopped"
                time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as ei:
                for _ in call:
                    pass
            waited = time.monotonic() - t_stop
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "watchdog-timeout 4" in ei.value.details(), (
            ei.value.code(),
            ei.value.details(),
        )
        # The watchdog counts from the scheduler's last message (up to a heartbeat, 0.25 s,
        # before the SIGSTOP; more on a loaded machine) and looks once a second: it may fire
        # a little under 4 s after t_stop, but never at once.
        print(f"the stream ended {waited:.1f} s after the scheduler stopped")
        assert waited >= 2.5, f"the stream ended {waited:.1f} s after the scheduler stopped: before the watchdog"
        try:
            code = d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the daemon was still running 60 s after the watchdog fired\n{d.log_tail()}")
        assert code == 1, d.log_tail()
        assert pid_gone(sched)


def test_scheduler_kill9_fails_fast_and_exits_nonzero(tmp_path):
    """SIGKILL of the scheduler process mid-stream: health says NOT_SERVING (or the daemon
    has exited), the in-flight stream ends UNAVAILABLE, the daemon exits non-zero, and no
    process of the daemon's is left (issue 6 §7). Fast is checked as state, not time: the
    stream's status names the scheduler's exit (noticed at once), not a heartbeat timeout
    or the watchdog; the deadlines only stop a hang."""
    with Daemon(max_running_requests=4, kv_cache_tokens=2048, log_dir=tmp_path) as d:
        sched = scheduler_pid(d.proc.pid)
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            call = stub.Generate(
                make_request(STORY, max_new_tokens=1500, stream=True, ignore_eos=True), timeout=RPC_TIMEOUT
            )
            first = next(call)
            assert first.WhichOneof("response") == "chunk"

            outcome: dict = {"msgs": [first]}

            def drain():
                try:
                    for m in call:
                        outcome["msgs"].append(m)
                    outcome["ended"] = "ok"
                except grpc.RpcError as e:
                    outcome["ended"] = e

            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
            # a few more chunks: the request is really decoding
            wait_until(lambda: len(outcome["msgs"]) >= 3 or "ended" in outcome, 60, "two more chunks")
            assert "ended" not in outcome, f"the stream ended before the kill: {outcome}"

            os.kill(sched, signal.SIGKILL)
            t_kill = time.monotonic()
            seen = {}  # service -> (seconds after the kill, what said it)

            def not_serving_or_gone() -> bool:
                for service in ("", SCHEDULER_SERVICE):
                    if service in seen:
                        continue
                    try:
                        st = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                    except grpc.RpcError:
                        # No answer is no verdict (a timeout proves nothing); only the daemon's
                        # exit makes the server's absence one.
                        if d.proc.poll() is not None:
                            seen[service] = (time.monotonic() - t_kill, f"daemon exited {d.proc.returncode}")
                        continue
                    if st == health_pb2.HealthCheckResponse.NOT_SERVING:
                        seen[service] = (time.monotonic() - t_kill, "NOT_SERVING")
                    else:
                        assert st == health_pb2.HealthCheckResponse.SERVING, st
                return len(seen) == 2

            wait_until(not_serving_or_gone, 60, lambda: f"health NOT_SERVING after kill -9 of the scheduler ({seen})")
            print(f"health after kill -9: {seen}")

            reader.join(60)
            assert not reader.is_alive(), "the in-flight stream did not end within 60 s of the kill"
            ended = outcome["ended"]
            assert isinstance(ended, grpc.RpcError), f"the stream ended without an error: {outcome['msgs'][-1]}"
            assert ended.code() == grpc.StatusCode.UNAVAILABLE, (ended.code(), ended.details())
            assert "exited with code -9" in ended.details(), f"not noticed from the exit: {ended.details()}"
            assert all(m.WhichOneof("response") == "chunk" for m in outcome["msgs"]), "a Complete after the kill"

        try:
            code = d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the daemon was still running 60 s after its scheduler died\n{d.log_tail()}")
        assert code != 0, f"the daemon exited 0 after its scheduler was killed\n{d.log_tail()}"
        wait_until(
            lambda: not _group_members(d.proc.pid),
            60,
            lambda: f"no process outliving the daemon (left: {[(p, cmdline(p)) for p in _group_members(d.proc.pid)]})",
        )
        assert pid_gone(sched)


# ------------------------------------------------------------------ 2. grpcurl: FlushCache, health Watch


@pytest.fixture(scope="module")
def grpcurl(daemon):
    """Run grpcurl (reflection only) against the session daemon; returns the CompletedProcess."""
    exe = find_executable("grpcurl")

    def run(*args, data=None, max_time=60.0, check=True):
        cmd = [exe, "-plaintext", "-max-time", str(max_time)]
        if data is not None:
            cmd += ["-d", data if isinstance(data, str) else json.dumps(data)]
        cmd += [daemon.address, *args]
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=max_time + 15)
        if check:
            assert p.returncode == 0, f"{' '.join(cmd)} -> rc {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
        return p

    return run


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


def json_messages(text: str) -> list[dict]:
    """The JSON objects grpcurl printed one after the other (pretty-printed)."""
    dec, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def flush_via_grpcurl(grpcurl, timeout_s) -> dict:
    out = grpcurl(f"{SCHEDULER_SERVICE}/FlushCache", data={"timeout_s": timeout_s}).stdout
    return json.loads(out)  # proto3 JSON leaves out success=false


def test_grpcurl_flush_cache_drops_the_prefix_cache(grpcurl, stub):
    prompt = [1000 + (i * 7919) % 40000 for i in range(64)]  # 4 full blocks
    salt = fresh_salt()  # kept apart from any other test's blocks
    assert complete(stub, prompt, cache_salt=salt).cached_tokens == 0
    assert complete(stub, prompt, cache_salt=salt).cached_tokens > 0, "the repeated prompt should hit the prefix cache"
    idle(stub)
    r = flush_via_grpcurl(grpcurl, 0)
    assert r.get("success") is True, r
    assert r.get("message"), r
    assert complete(stub, prompt, cache_salt=salt).cached_tokens == 0, "the prefix cache survived FlushCache"


def test_grpcurl_flush_cache_busy_and_waiting(grpcurl, stub, daemon):
    """timeout_s 0 while a request runs: success false with the reason; timeout_s > 0: waits
    while the request goes on generating (the flush does not cut it short), and flushes
    once the daemon is idle. The request runs until this test aborts it, so each step is
    ordered by state, not by how fast the machine is."""
    idle(stub)
    req = make_request(STORY, max_new_tokens=4000, stream=True, ignore_eos=True)
    call = stub.Generate(req, timeout=600)
    assert next(call).WhichOneof("response") == "chunk"  # running
    busy = flush_via_grpcurl(grpcurl, 0)
    assert busy.get("success", False) is False, busy
    assert "in flight" in busy.get("message", ""), f"a refused flush must say why: {busy}"

    # grpcurl -v prints "Request metadata to send" just before it sends the call
    cmd = [
        find_executable("grpcurl"),
        "-plaintext",
        "-v",
        "-max-time",
        "600",
        "-d",
        json.dumps({"timeout_s": 600}),
        daemon.address,
        f"{SCHEDULER_SERVICE}/FlushCache",
    ]
    flush = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("Request metadata to send" in line for line in lines):
            line = flush.stdout.readline()
            assert line, f"grpcurl ended before sending FlushCache:\n{''.join(lines)}"
            lines.append(line)
        for _ in range(5):  # the request keeps generating while the flush waits
            assert next(call).WhichOneof("response") == "chunk"
        assert flush.poll() is None, f"FlushCache answered while a request was running:\n{''.join(lines)}"
        assert stub.Abort(pb.AbortRequest(request_id=req.request_id, reason="test done"), timeout=10).success
        rest = list(call)
        assert rest[-1].WhichOneof("response") == "complete" and rest[-1].complete.finish_reason == "abort", rest[-1:]
        out, _ = flush.communicate(timeout=600)
    finally:
        if flush.poll() is None:
            flush.kill()
            flush.wait()
    text = "".join(lines) + out
    assert flush.returncode == 0, text
    body = text.split("Response contents:", 1)[1].split("Response trailers received:", 1)[0]
    r = json.loads(body)
    assert r.get("success") is True, text


@pytest.mark.parametrize("service", ["", SCHEDULER_SERVICE])
def test_grpcurl_health_watch_streams_until_the_client_leaves(grpcurl, service):
    """Watch sends the current status (SERVING) and keeps the stream open until the client
    goes away (grpcurl's -max-time), instead of ending after one message."""
    t0 = time.monotonic()
    p = grpcurl("grpc.health.v1.Health/Watch", data={"service": service}, max_time=2, check=False)
    took = time.monotonic() - t0
    msgs = json_messages(p.stdout)
    assert msgs and msgs[0].get("status") == "SERVING", (p.stdout, p.stderr)
    assert all(m.get("status") == "SERVING" for m in msgs), msgs
    assert p.returncode != 0 and "DeadlineExceeded" in p.stderr, (
        f"the Watch stream ended by itself (rc {p.returncode}) after {took:.1f} s\n{p.stdout}\n{p.stderr}"
    )
    assert took >= 1.5


def test_grpcurl_health_watch_unknown_service(grpcurl):
    p = grpcurl("grpc.health.v1.Health/Watch", data={"service": "no.such.Service"}, max_time=2, check=False)
    msgs = json_messages(p.stdout)
    assert msgs and msgs[0].get("status") == "SERVICE_UNKNOWN", (p.returncode, p.stdout, p.stderr)


# ------------------------------------------------------------------ 3. tokenizer via GetTokenizer


def _hide_prefix() -> list[str] | None:
    """A command prefix that runs `sh -c SCRIPT sh DIR CMD...` in a private mount namespace,
    or None where this machine cannot make one."""
    cands = [["unshare", "--mount", "--propagation", "private"]]
    cands.append(["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"])
    if not shutil.which("unshare"):
        return None
    probe = tempfile.mkdtemp(prefix="ops-hide-")
    try:
        Path(probe, "marker").write_text("x")
        for c in cands:
            r = subprocess.run(
                c + ["sh", "-c", 'mount -t tmpfs tmpfs "$1" && test ! -e "$1/marker"', "sh", probe],
                check=False,
                capture_output=True,
                timeout=20,
            )
            if r.returncode == 0:
                return c
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


class HiddenPathRouter(Router):
    """`smg launch` in its own mount namespace where `hide` is an empty tmpfs: the router
    cannot read what the worker has there, as if it ran on another host."""

    def __init__(self, *a, hide: str, ns_prefix: list[str], **kw):
        super().__init__(*a, **kw)
        self.hide = hide
        self.ns_prefix = ns_prefix

    def _spawn(self, cmd, env):
        script = 'mount -t tmpfs tmpfs "$1" || exit 97; shift; exec "$@"'
        super()._spawn(self.ns_prefix + ["sh", "-c", script, "sh", self.hide] + cmd, env)


def test_router_without_the_tokenizer_path_fetches_it_and_serves_chat(daemon, tmp_path):
    with grpc.insecure_channel(daemon.address) as ch:
        info = pb_grpc.SglangSchedulerStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    tok_dir = info.tokenizer_path
    assert tok_dir and os.path.isfile(os.path.join(tok_dir, "tokenizer.json")), tok_dir
    prefix = _hide_prefix()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare/mount not permitted): cannot hide the tokenizer path")

    with HiddenPathRouter(daemon.port, hide=tok_dir, ns_prefix=prefix, log_level="info", log_dir=tmp_path) as r:
        body = {
            "model": r.model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 24,
        }
        resp = r.post("/v1/chat/completions", body)
        assert resp.status == 200, resp
        content = resp.json()["choices"][0]["message"]["content"]
        assert "Paris" in content, content
        log = router_log(r)
    assert "Fetching tokenizer from worker" in log, "the router did not use GetTokenizer:\n" + log[-3000:]
    assert "Successfully registered tokenizer" in log, log[-3000:]


# ------------------------------------------------------------------ 4. cache_aware over two daemons


@pytest.fixture(scope="module")
def second_daemon(tmp_path_factory):
    # No queue beyond the free running slots: test_a_full_queue_is_resource_exhausted fills it.
    with Daemon(
        max_running_requests=8,
        kv_cache_tokens=8192,
        extra_args=["--max-queued-requests", "0"],
        log_dir=tmp_path_factory.mktemp("daemon-b"),
    ) as d:
        yield d


def long_prefix(tokenizer, tag: str, min_tokens: int = 640) -> str:
    """Plain text of at least `min_tokens` tokens, unlike any other test's prompts."""
    words = []
    i = 0
    while True:
        words.append(f"{tag}{i} river stone {i * 37 % 101}.")
        i += 1
        if i % 20 == 0 and len(tokenizer.encode(" ".join(words), add_special_tokens=False)) >= min_tokens:
            return " ".join(words)


def test_cache_aware_routes_shared_prefix_to_the_daemon_holding_it(daemon, second_daemon, tokenizer, tmp_path):
    """Two daemons behind `--policy cache_aware`: after one request with a long prompt, the
    requests that share its prefix all land on the daemon that served it, which reports
    cached_tokens ~ the prefix length; the other daemon serves none of them."""
    workers = {"A": daemon, "B": second_daemon}
    channels = {k: grpc.insecure_channel(d.address) for k, d in workers.items()}
    stubs = {k: pb_grpc.SglangSchedulerStub(ch) for k, ch in channels.items()}
    router = Router(daemon.port, policy="cache_aware", log_level="info", log_dir=tmp_path)
    i = router.args.index("--worker-urls")
    router.args.insert(i + 2, f"grpc://127.0.0.1:{second_daemon.port}")
    try:
        with router as r:
            # Both workers registered and both KV event streams open.
            deadline = time.monotonic() + 60
            while True:
                log = router_log(r)
                streams = {
                    k: f"KV event stream connected worker_url=grpc://127.0.0.1:{d.port}" in log
                    for k, d in workers.items()
                }
                ready = r.get("/readiness", timeout=5)
                healthy = ready.json().get("healthy_workers") if ready.status == 200 else None
                if all(streams.values()) and healthy == 2:
                    break
                assert time.monotonic() < deadline, f"router not ready on both workers: {streams}, {ready}"
                time.sleep(0.5)

            prefix = long_prefix(tokenizer, "zq" + uuid.uuid4().hex[:4])
            n_prefix = len(tokenizer.encode(prefix, add_special_tokens=False))

            def send(prompt, n=4):
                """One completion through the router; returns (usage, which daemon generated it)."""
                for s in stubs.values():
                    idle(s)
                before = {k: sched_stat(s, "num_generated_tokens") for k, s in stubs.items()}
                resp = r.post(
                    "/v1/completions",
                    {"model": r.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
                )
                assert resp.status == 200, resp
                for s in stubs.values():
                    idle(s)
                after = {k: sched_stat(s, "num_generated_tokens") for k, s in stubs.items()}
                served = [k for k in workers if after[k] - before[k] >= n]
                assert len(served) == 1, (before, after)
                return resp.json()["usage"], served[0]

            stored_before = {k: router_stored_blocks(r, d) for k, d in workers.items()}
            usage0, holder = send(prefix)
            other = "B" if holder == "A" else "A"
            cached0 = (usage0.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            assert usage0["prompt_tokens"] == n_prefix, (usage0, n_prefix)
            assert cached0 < 64, f"the first long prompt was already cached: {usage0}"
            hit_other = sched_stat(stubs[other], "cache_hit_rate")
            gen_other = sched_stat(stubs[other], "num_generated_tokens")
            new_blocks = n_prefix // 16 - cached0 // 16  # the prompt's full blocks not cached before
            wait_router_stored(r, workers[holder], stored_before[holder] + new_blocks)

            results = []
            for j, q in enumerate(["What happened next?", "Name the river.", "Count the stones.", "Summarise it."]):
                usage, served = send(f"{prefix} Question {j}: {q}")
                results.append(
                    (served, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
                )
            print(f"prefix {n_prefix} tokens on daemon {holder}; follow-ups (daemon, prompt, cached): {results}")
            assert all(served == holder for served, _, _ in results), (
                f"a prefix-sharing request left {holder}: {results}"
            )
            for _, prompt_tokens, cached in results:
                assert prompt_tokens > n_prefix
                # Whole blocks of the prefix (16 tokens each); the block where the suffix starts may differ.
                assert cached is not None and n_prefix - 32 <= cached <= n_prefix, results
            assert sched_stat(stubs[other], "num_generated_tokens") == gen_other
            assert sched_stat(stubs[other], "cache_hit_rate") == hit_other
            loads = {k: s.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads[0] for k, s in stubs.items()}
            assert loads[holder].cache_hit_rate > 0

            # Not merely "always the same worker": a second long prefix put straight into the
            # other daemon (the router learns of it only from that daemon's KV events) draws
            # its requests there, while the first prefix's requests keep going to the holder.
            prefix2 = long_prefix(tokenizer, "vx" + uuid.uuid4().hex[:4])
            ids2 = tokenizer.encode(prefix2, add_special_tokens=False)
            stored_before = router_stored_blocks(r, workers[other])
            complete(stubs[other], ids2)
            wait_router_stored(r, workers[other], stored_before + len(ids2) // 16)
            mixed = []
            for j in range(2):
                for p, want in ((prefix2, other), (prefix, holder)):
                    usage, served = send(f"{p} Again {j}: what now?")
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    mixed.append((served, want, usage["prompt_tokens"], cached))
            print(f"interleaved (served, expected, prompt, cached): {mixed}")
            assert all(served == want for served, want, _, _ in mixed), mixed
            for _, want, _, cached in mixed:
                n = len(ids2) if want == other else n_prefix
                assert cached is not None and n - 32 <= cached <= n, mixed
    finally:
        for ch in channels.values():
            ch.close()


def test_a_full_queue_is_resource_exhausted(second_daemon):
    """--max-queued-requests 0 with 8 running slots: of 20 concurrent long requests, those
    arriving while all slots are taken get RESOURCE_EXHAUSTED (the router retries it) at
    once, the others finish, and the daemon ends idle with every KV block free."""
    with grpc.insecure_channel(second_daemon.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        idle(stub)
        outcomes: dict[int, object] = {}

        def one(i):
            req = make_request(STORY, max_new_tokens=48, ignore_eos=True)
            try:
                outcomes[i] = one_complete(stub, req).finish_reason
            except grpc.RpcError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=RPC_TIMEOUT)
        refused = [e for e in outcomes.values() if isinstance(e, grpc.RpcError)]
        finished = [r for r in outcomes.values() if r == "length"]
        assert len(outcomes) == 20 and len(refused) + len(finished) == 20, outcomes
        assert refused and len(finished) >= 8, outcomes
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in e.details(), e
        idle(stub)
        assert sched_stat(stub, "num_used_blocks") == 0
