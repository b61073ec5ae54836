"""Process and port utilities for the end-to-end tests.

`Daemon` runs the real inference daemon (`python -m servicer`) and `Router` the real
`smg launch` router as subprocesses, each in its own process group, and always stop the
whole group on exit (SIGTERM, then SIGKILL after a grace period) so no process outlives a
test session, whether it passed, failed or was interrupted. HTTP goes through the stdlib
(urllib) only.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SRC_DIR = REPO_ROOT / "src"
VENV_BIN = Path(sys.executable).parent  # not resolved: a venv python is a symlink out of the venv

SCHEDULER_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
DAEMON_START_TIMEOUT_S = 180.0
ROUTER_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 15.0

# Every process group we started and have not stopped yet: killed at interpreter exit as a
# last resort (e.g. when a fixture's finaliser never ran).
_LIVE_GROUPS: set[int] = set()


def _kill_leftovers() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _LIVE_GROUPS.discard(pgid)


atexit.register(_kill_leftovers)


def install_sigterm_cleanup() -> None:
    """Turn SIGTERM (e.g. from a CI `timeout`) into KeyboardInterrupt so context managers
    and pytest finalisers still stop the daemon and router. Only where SIGTERM is unhandled."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills for real
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, _on_term)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports that were free a moment ago (each socket stays bound until
    all are chosen, so two calls in a row cannot hand out the same port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def find_executable(name: str) -> str:
    """`name` from the virtualenv of the running interpreter, else from PATH."""
    cand = VENV_BIN / name
    if cand.exists() and os.access(cand, os.X_OK):
        return str(cand)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found in {VENV_BIN} or on PATH")
    return found


def tail(path: Path, lines: int = 60) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the /proc/<pid>/stat fields after "(comm)": state ppid pgrp ...) of every process."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        yield int(d.name), stat[stat.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses


def _group_members(pgid: int) -> list[int] | None:
    """Live (non-zombie) pids of process group `pgid`, from /proc; None without /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    return [pid for pid, f in proc_stats() if len(f) >= 3 and int(f[2]) == pgid and f[0] not in ("Z", "X")]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children or, without it, a /proc scan."""
    kids: list[int] = []
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    for f in tasks:
        try:
            kids += [int(x) for x in f.read_text().split()]
        except OSError:
            pass
    if tasks:
        return kids
    return [child for child, f in proc_stats() if int(f[1]) == pid]


def _group_alive(pgid: int) -> bool:
    members = _group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group of `proc` (a session leader), wait up to `grace_s` for the
    leader and the rest of the group, then SIGKILL whatever is left."""
    pgid = proc.pid
    try:
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Children (e.g. a scheduler process) may still be on their way out.
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        _LIVE_GROUPS.discard(pgid)


class _ManagedProcess:
    """Base: a subprocess in a new session with its output in a log file."""

    name = "process"

    def __init__(self, log_dir: os.PathLike | None = None):
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix=f"e2e-{self.name}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.cmd: list[str] = []

    def _spawn(self, cmd: list[str], env: dict) -> None:
        self.cmd = cmd
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO_ROOT),
                start_new_session=True,
            )
        _LIVE_GROUPS.add(self.proc.pid)

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    def _fail(self, why: str) -> None:
        msg = f"{self.name} {why}\ncommand: {' '.join(self.cmd)}\nlog {self.log_path} (tail):\n{self.log_tail()}"
        self.stop()
        raise RuntimeError(msg)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)

    def __exit__(self, *exc) -> None:
        self.stop()


def _base_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("NO_COLOR", "1")
    # No network on the test machines: never let anything try the model hub.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.pop("http_proxy", None)
    env.pop("https_proxy", None)
    env.pop("HTTP_PROXY", None)
    env.pop("HTTPS_PROXY", None)
    return env


class Daemon(_ManagedProcess):
    """`python -m servicer ...` on 127.0.0.1:<port>, ready once grpc.health.v1 says SERVING.

    With ``wait_serving=False`` entering only starts the process: several daemons then load
    at once, and a test can watch one that is not SERVING yet; `wait_until_serving` waits."""

    name = "daemon"

    def __init__(
        self,
        model: str = "smollm2",
        port: int | None = None,
        max_running_requests: int = 32,
        kv_cache_tokens: int = 16384,
        extra_args: list[str] | None = None,
        log_dir: os.PathLike | None = None,
        start_timeout_s: float = DAEMON_START_TIMEOUT_S,
        log_level: str = "info",
        wait_serving: bool = True,
        env: dict[str, str] | None = None,
    ):
        super().__init__(log_dir)
        self.env = dict(env or {})  # added to the test environment
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.wait_serving = wait_serving
        self.address = f"{self.host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.args = [
            "--model",
            model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--max-running-requests",
            str(max_running_requests),
            "--kv-cache-tokens",
            str(kv_cache_tokens),
            "--log-level",
            log_level,
        ] + list(extra_args or [])
        self.startup_s: float | None = None
        self._t0: float | None = None  # when the process was started

    def __enter__(self) -> Daemon:
        env = _base_env() | self.env
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SRC_DIR), env.get("PYTHONPATH", "")] if p)
        self._t0 = time.monotonic()
        self._spawn([sys.executable, "-m", "servicer"] + self.args, env)
        if self.wait_serving:
            self.wait_until_serving()
        return self

    def wait_until_serving(self) -> Daemon:
        """Wait until both health services say SERVING (stopping the daemon and failing with
        its log tail if it exits first or takes over `start_timeout_s` from its start)."""
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._t0
        return self

    def channel(self):
        """A new gRPC channel to the daemon."""
        import grpc

        return grpc.insecure_channel(self.address)

    def health_status(self, service: str = "", timeout: float = 2.0) -> str | None:
        """The grpc.health.v1 status name, or None when the call fails."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with self.channel() as ch:
            try:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
            except grpc.RpcError:
                return None
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def _wait_serving(self) -> None:
        deadline = (self._t0 if self._t0 is not None else time.monotonic()) + self.start_timeout_s
        while True:
            if not self.alive():
                self._fail(f"exited with code {self.proc.returncode} before it was SERVING")
            if self.health_status("") == "SERVING" and self.health_status(SCHEDULER_SERVICE) == "SERVING":
                return
            if time.monotonic() > deadline:
                self._fail(f"was not SERVING after {self.start_timeout_s:.0f} s")
            time.sleep(0.5)


# ---------------------------------------------------------------- waiting for a state


def wait_until(predicate, timeout: float, what, interval: float = 0.05):
    """Poll `predicate()` until it returns something truthy, and return that; past `timeout`
    seconds, fail naming `what` (a string, or a callable giving one then) and the last value.
    Tests wait for a state this way, never for a fixed time: a loaded machine only makes the
    wait longer, so make `timeout` generous."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            name = what() if callable(what) else what
            raise AssertionError(f"{name}: not reached within {timeout:g} s (last: {value!r})")
        time.sleep(interval)


# ---------------------------------------------------------------- daemon state (gRPC)


def watch_health(channel, timeout: float = 60.0) -> tuple[list, threading.Thread]:
    """A grpc.health.v1 Watch on ``channel`` in a thread: (the statuses heard so far, the thread),
    which ends when the stream does (the daemon gone, or ``timeout``)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    statuses: list = []

    def watch() -> None:
        import grpc

        try:
            for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=timeout):
                statuses.append(reply.status)
        except grpc.RpcError:
            pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return statuses, thread


def kv_state(stub) -> tuple[int, int, int]:
    """(requests in flight, KV tokens held now, KV tokens in the last heartbeat's load) of a
    daemon, from a SglangScheduler `stub` (smg-grpc-proto). In flight: the servicer's open
    calls plus the scheduler's running and waiting requests (a cancelled request leaves the
    servicer at once, the scheduler a step later). Scheduler stats that did not answer in
    time (GetServerInfo gives {"error": ...} then) count as -1: unknown is never free."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    fields = info.scheduler_info.fields
    keys = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")
    if not all(k in fields for k in keys):
        return -1, -1, -1
    running, waiting, live = (int(fields[k].number_value) for k in keys)
    load = stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
    return info.active_requests + running + waiting, live, load.num_used_tokens


def wait_kv_free(stub, timeout: float = 60.0) -> tuple[int, int, int]:
    """Poll `kv_state` until nothing is in flight and no KV block is held, (0, 0, 0), or
    `timeout` passes; returns the last state. Only meaningful where no other request can be
    running (the session daemon serves one test at a time)."""
    deadline = time.monotonic() + timeout
    while True:
        state = kv_state(stub)
        if state == (0, 0, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.25)


# ---------------------------------------------------------------- HTTP (stdlib only)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HttpResult:
    def __init__(self, status: int, body: bytes, headers):
        self.status = status
        self.body = body
        self.headers = headers

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"HttpResult({self.status}, {self.text[:500]!r})"


def http_request(method: str, url: str, body=None, timeout: float = 60.0) -> HttpResult:
    """One HTTP request; `body` (if not None) is sent as JSON. HTTP errors are returned, not raised."""
    data = None
    headers = {}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return HttpResult(resp.status, resp.read(), resp.headers)
    except urllib.error.HTTPError as e:
        return HttpResult(e.code, e.read(), e.headers)


def http_get(url: str, timeout: float = 60.0) -> HttpResult:
    return http_request("GET", url, None, timeout)


def http_post(url: str, body, timeout: float = 120.0) -> HttpResult:
    return http_request("POST", url, body, timeout)


def sse_post(url: str, body, timeout: float = 120.0) -> Iterator[str]:
    """POST `body` as JSON and yield the `data:` payloads of the SSE response one by one
    (including the final "[DONE]"). Raises urllib.error.HTTPError on a non-2xx status."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        method="POST",
    )
    with _OPENER.open(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if line.startswith("data:"):
                yield line[len("data:") :].strip()


class Router(_ManagedProcess):
    """`smg launch` in front of one gRPC worker; ready once /readiness reports ready and
    /v1/tokenize works (the tokenizer is loaded).

    `worker_args`, when given, replace `--worker-urls grpc://127.0.0.1:<worker_port>` (then
    `worker_port` may be None): e.g. `--pd-disaggregation --prefill URL PORT --decode URL`."""

    name = "router"

    def __init__(
        self,
        worker_port: int | None,
        policy: str | None = None,
        port: int | None = None,
        prometheus_port: int | None = None,
        extra_args: list[str] | None = None,
        log_dir: os.PathLike | None = None,
        start_timeout_s: float = ROUTER_START_TIMEOUT_S,
        log_level: str = "warn",
        shutdown_grace_s: int = 1,
        worker_args: list[str] | None = None,
    ):
        super().__init__(log_dir)
        self.host = "127.0.0.1"
        spare = iter(free_ports(2))
        self.port = port or next(spare)
        self.prometheus_port = prometheus_port or next(spare)
        self.base_url = f"http://{self.host}:{self.port}"
        if worker_args is None and worker_port is None:
            raise ValueError("Router needs worker_port or worker_args")
        self.worker_url = f"grpc://127.0.0.1:{worker_port}" if worker_port is not None else None
        workers = list(worker_args) if worker_args is not None else ["--worker-urls", self.worker_url]
        self.start_timeout_s = start_timeout_s
        self.args = [
            "launch",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.prometheus_port),
            *workers,
            "--backend",
            "sglang",
            "--log-level",
            log_level,
            # Tests need no in-flight drain on stop (the default grace makes each stop ~5 s).
            "--shutdown-grace-period-secs",
            str(shutdown_grace_s),
        ]
        if policy:
            self.args += ["--policy", policy]
        self.args += list(extra_args or [])
        self.model: str | None = None
        self.startup_s: float | None = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str, timeout: float = 60.0) -> HttpResult:
        return http_get(self.url(path), timeout)

    def post(self, path: str, body, timeout: float = 120.0) -> HttpResult:
        return http_post(self.url(path), body, timeout)

    def sse(self, path: str, body, timeout: float = 120.0) -> Iterator[str]:
        return sse_post(self.url(path), body, timeout)

    def __enter__(self) -> Router:
        t0 = time.monotonic()
        self._spawn([find_executable("smg")] + self.args, _base_env())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _try(self, fn):
        try:
            return fn()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last = None
        while True:
            if not self.alive():
                self._fail(f"exited with code {self.proc.returncode} before it was ready (last: {last!r})")
            if time.monotonic() > deadline:
                self._fail(f"was not ready after {self.start_timeout_s:.0f} s (last: {last!r})")
            r = self._try(lambda: self.get("/readiness", timeout=5))
            last = r
            ready = False
            if r is not None and r.status == 200:
                try:
                    ready = r.json().get("status") == "ready"
                except ValueError:
                    ready = False
            if ready:
                if self.model is None:
                    m = self._try(lambda: self.get("/v1/models", timeout=5))
                    last = m
                    if m is not None and m.status == 200:
                        try:
                            data = m.json().get("data") or []
                            if data:
                                self.model = data[0]["id"]
                        except (ValueError, KeyError, TypeError):
                            pass
                if self.model is not None:
                    t = self._try(lambda: self.post("/v1/tokenize", {"model": self.model, "prompt": "hi"}, timeout=5))
                    last = t
                    if t is not None and t.status == 200:
                        return
            time.sleep(0.5)


@contextlib.contextmanager
def scheduler_stub(address: str, timeout: float = 30.0):
    """A SglangScheduler stub (smg-grpc-proto) on the daemon at `address`, its channel
    closed on exit."""
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        yield pb_grpc.SglangSchedulerStub(channel)
    finally:
        channel.close()


def sample_model_info(**fields):
    """A complete scheduler.messages.ModelInfo of a small model for unit tests, ``fields`` changed."""
    from scheduler.messages import ModelInfo

    small = dict(
        model_path="model",
        tokenizer_path="model",
        served_model_name="model",
        max_context_length=64,
        vocab_size=1000,
        eos_token_ids=[2],
        bos_token_id=1,
        pad_token_id=0,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        max_total_num_tokens=1024,
        max_running_requests=4,
        max_queued_requests=16,
        max_logprobs=20,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=256,
        block_size=16,
        enable_prefix_caching=True,
        device="cpu",
        dtype="float32",
        weight_gb=0.1,
        kv_cache_gb=0.2,
    )
    return ModelInfo(**{**small, **fields})
