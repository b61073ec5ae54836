"""The servicer's side of the scheduler: launches and supervises the scheduler process,
sends it requests over ZMQ, and fans its outputs out to one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import socket
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from scheduler.config import EngineConfig
from scheduler.messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineDead,
    EngineReady,
    Heartbeat,
    KvEvents,
    LoadSnapshot,
    MalformedFrames,
    ModelInfo,
    StepOutput,
    from_scheduler_decoder,
    to_scheduler_encoder,
)

logger = logging.getLogger(__name__)


# servicer-<pid of the owning servicer>-<mkdtemp's random part>: a daemon killed by SIGKILL
# leaves its directory behind, and the next one to start removes it.
_IPC_DIR_NAME = re.compile(r"servicer-(\d+)-[a-z0-9_]+")


def _ipc_parents() -> list[str]:
    """Where IPC directories are made (see SchedulerClient.__init__)."""
    return list(dict.fromkeys([tempfile.gettempdir(), "/tmp"]))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _listened_on(directory_fd: int, name: str) -> bool:
    """Whether a process accepts connections on the socket ``name``: its owner is alive even
    where its pid means nothing here (another pid namespace sharing the directory)."""
    path = f"/proc/self/fd/{directory_fd}/{name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _remove_ipc_dir(path: str) -> bool:
    """Unlink a dead daemon's sockets and its directory; False (and nothing removed past what
    was) if it holds anything else, a socket still listened on, or is no longer a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        names = os.listdir(fd)
        for name in names:
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if not stat.S_ISSOCK(mode) or _listened_on(fd, name):
                return False
        for name in names:
            os.unlink(name, dir_fd=fd)
        os.rmdir(path)  # (a symlink swapped in meanwhile: ENOTDIR)
    except FileNotFoundError:  # another servicer starting beside us removed it first
        return False
    except OSError as e:
        logger.warning("could not remove the stale IPC directory %s: %s", path, e)
        return False
    finally:
        os.close(fd)
    return True


def remove_stale_ipc_dirs(parents: Iterable[str] | None = None) -> list[str]:
    """Remove the IPC directories (in ``parents``, by default where ours are made) of
    servicers that died without cleaning up: owned by our user, named for a pid that is gone.
    Symlinks, other users' directories and our own are never touched. Returns the paths removed."""
    removed = []
    for parent in _ipc_parents() if parents is None else parents:
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            match = _IPC_DIR_NAME.fullmatch(entry.name)
            if match is None:
                continue
            pid = int(match.group(1))
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or pid == os.getpid() or _pid_alive(pid):
                continue
            if _remove_ipc_dir(entry.path):
                logger.info("removed the IPC directory %s of a servicer gone (pid %d)", entry.path, pid)
                removed.append(entry.path)
    return removed


class SchedulerUnavailable(Exception):
    """The scheduler process is not running (not started yet, dead, or shutting down)."""


@dataclass
class Liveness:
    last_message: float = 0.0  # monotonic time of the last message from the scheduler
    in_step_s: float = 0.0  # how long its current step had run at the last heartbeat
    load: LoadSnapshot = field(default_factory=LoadSnapshot)


class _Route:
    """Where one request id's outputs go, and how far the request got: OPEN (outputs go
    to ``queue``), FINISHED (its final output went there; the caller may still be reading)
    or CANCELLED (its caller left: outputs are dropped until the final one frees the id)."""

    OPEN, FINISHED, CANCELLED = "open", "finished", "cancelled"
    __slots__ = ("queue", "state")

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue
        self.state = _Route.OPEN


class SchedulerClient:
    def __init__(
        self, config: EngineConfig, log_level: str = "info", name: str = "the scheduler", log_format: str = "text"
    ):
        self.config = config
        self.log_level = log_level
        self.log_format = log_format
        self.name = name  # in log lines (a DP rank's)
        self.ctx = zmq.asyncio.Context()
        # No high-water marks: past one, pyzmq queues un-awaited sends at O(n) each (a burst
        # of n=10k children stalled the loop for seconds) and aborts wait behind them.
        self.ctx.setsockopt(zmq.SNDHWM, 0)
        self.ctx.setsockopt(zmq.RCVHWM, 0)
        remove_stale_ipc_dirs()
        prefix = f"servicer-{os.getpid()}-"  # (_IPC_DIR_NAME)
        ipc_dir = tempfile.mkdtemp(prefix=prefix)
        if len(ipc_dir) > 64:  # ipc:// paths end at 107 bytes: a long TMPDIR cannot hold ours
            os.rmdir(ipc_dir)
            ipc_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        logger.debug("scheduler IPC sockets in %s", ipc_dir)
        tag = uuid.uuid4().hex[:8]
        self.inbox_addr = f"ipc://{ipc_dir}/to-scheduler-{tag}"
        self.outbox_addr = f"ipc://{ipc_dir}/from-scheduler-{tag}"
        self.ipc_dir = ipc_dir
        # (asyncio socket: with no peer, e.g. just after the scheduler died, a send is a
        # pending future rather than a blocked event loop)
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.bind(self.inbox_addr)
        self.from_scheduler = self.ctx.socket(zmq.PULL)
        self.from_scheduler.bind(self.outbox_addr)
        self.process: asyncio.subprocess.Process | None = None
        self.model_info: ModelInfo | None = None  # from EngineReady
        self.liveness = Liveness()
        self.dead_reason: str | None = None
        self.ready = asyncio.Event()
        self.died = asyncio.Event()
        self._routes: dict[str, _Route] = {}  # by request id, until the caller lets go
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self.kv_event_listener = None  # called with every KvEvents batch (see kv_events.py)
        self.malformed = MalformedFrames(logger, "servicer (from the scheduler)")

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Launch the scheduler process; returns once it is loaded (or raises if it died)."""
        cmd = [
            sys.executable,
            "-m",
            "scheduler.process",
            "--config",
            msgspec.json.encode(self.config).decode(),
            "--inbox",
            self.inbox_addr,
            "--outbox",
            self.outbox_addr,
            "--log-level",
            self.log_level,
            "--log-format",
            self.log_format,
        ]
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        self.process = await asyncio.create_subprocess_exec(*cmd, env=env)
        logger.info("started %s process (pid %d)", self.name, self.process.pid)
        self._reader = asyncio.create_task(self._read_loop())
        self._watcher = asyncio.create_task(self._watch_process())
        ready = asyncio.create_task(self.ready.wait())
        died = asyncio.create_task(self.died.wait())
        await asyncio.wait([ready, died], return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        died.cancel()
        if not self.ready.is_set():
            raise SchedulerUnavailable(self.dead_reason or "scheduler exited during start-up")

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop the scheduler process (a shutdown call, then SIGKILL) and close the sockets."""
        proc = self.process
        if proc is not None and proc.returncode is None:
            if self.alive:
                self.to_scheduler.send(to_scheduler_encoder.encode(ControlRequest(0, "shutdown")))
            try:
                await asyncio.wait_for(proc.wait(), timeout)  # (a failed one is already exiting)
            except (TimeoutError, asyncio.TimeoutError):
                proc.kill()
                await proc.wait()
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._mark_dead("the scheduler was stopped")
        self.to_scheduler.close(0)
        self.from_scheduler.close(0)
        self.ctx.term()
        for name in os.listdir(self.ipc_dir):
            os.unlink(os.path.join(self.ipc_dir, name))
        os.rmdir(self.ipc_dir)

    def kill(self, reason: str) -> None:
        """SIGKILL the scheduler process (it works on a stopped one too); its exit marks it dead."""
        logger.error("killing %s process: %s", self.name, reason)
        self.dead_reason = reason
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and not self.died.is_set()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.liveness.last_message

    def _mark_dead(self, reason: str) -> None:
        if self.died.is_set():
            return
        self.dead_reason = reason
        self.died.set()
        # Wake every waiter: their requests cannot finish any more.
        for rid, route in list(self._routes.items()):
            if route.state is _Route.CANCELLED:
                del self._routes[rid]
        for queue in {route.queue for route in self._routes.values()}:  # (n sequences share one)
            queue.put_nowait(SchedulerUnavailable(reason))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(SchedulerUnavailable(reason))

    async def _watch_process(self) -> None:
        code = await self.process.wait()
        self._mark_dead(self.dead_reason or f"the scheduler process exited with code {code}")
        if code != 0:
            logger.error("%s process exited with code %s", self.name, code)

    async def _read_loop(self) -> None:
        try:
            while True:
                raw = await self.from_scheduler.recv(copy=False)
                try:
                    msg = from_scheduler_decoder.decode(raw.buffer)
                except msgspec.DecodeError as e:  # (a ValidationError too: msgpack of another shape)
                    self.malformed.drop(raw.buffer, e)
                    continue
                self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here would leave every request waiting for the watchdog
            logger.exception("reading the scheduler's messages failed")
            self.kill(f"the servicer could not read the scheduler's messages ({type(e).__name__})")
            self._mark_dead(self.dead_reason)

    def _dispatch(self, msg) -> None:
        self.liveness.last_message = time.monotonic()
        if isinstance(msg, StepOutput):
            self.liveness.in_step_s = 0.0  # that step is over
            if msg.load is not None:  # before the outputs: a finished request is no longer counted
                self._take_load(msg.load)
            for out in msg.outputs:
                route = self._routes.get(out.request_id)
                if route is None:
                    continue
                if route.state is _Route.CANCELLED:
                    if out.finish_reason is not None:  # a cancelled request is gone at last
                        del self._routes[out.request_id]
                else:
                    route.queue.put_nowait(out)
                    if out.finish_reason is not None:  # (its caller may still be reading)
                        route.state = _Route.FINISHED
        elif isinstance(msg, Heartbeat):
            # Sent beside the step outputs: one from inside a step can arrive after
            # that step's output, and its in-step time is then stale.
            if self._take_load(msg.load):
                self.liveness.in_step_s = msg.in_step_s
        elif isinstance(msg, ControlReply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EngineReady):
            self.model_info = msg.model_info
            self.ready.set()
        elif isinstance(msg, EngineDead):
            self._mark_dead(msg.reason)
        elif isinstance(msg, KvEvents) and self.kv_event_listener is not None:
            try:
                self.kv_event_listener(msg)
            except Exception:  # never let a listener stop the read loop
                logger.exception("KV event listener failed")

    def _take_load(self, load: LoadSnapshot) -> bool:
        """Keep the newest snapshot: a heartbeat may overtake, or trail, a step's output.
        False for an older one."""
        if load.version < self.liveness.load.version:
            return False
        self.liveness.load = load
        return True

    # -- requests --------------------------------------------------------------------
    def in_flight_ids(self) -> list[str]:
        return list(self._routes)

    @property
    def num_in_flight(self) -> int:
        """Ids still taken: running, finished but not yet released, or cancelled and
        waiting for the scheduler's final output."""
        return len(self._routes)

    @property
    def num_open(self) -> int:
        """Requests still running for a caller that is still there."""
        return sum(route.state is _Route.OPEN for route in self._routes.values())

    def has_request(self, request_id: str) -> bool:
        return request_id in self._routes

    def submit(self, msg: AddRequest, queue: asyncio.Queue) -> None:
        """Send a request; its outputs (RequestOutput, or an exception) arrive on ``queue``,
        which several requests may share (the n sequences of one call)."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "the scheduler is not ready")
        if msg.request_id in self._routes:  # the caller checks; never reroute another's outputs
            raise ValueError(f"request id {msg.request_id!r} is already in flight")
        self._routes[msg.request_id] = _Route(queue)
        self.to_scheduler.send(to_scheduler_encoder.encode(msg))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue (its final output has arrived)."""
        self._routes.pop(request_id, None)

    def cancel(self, request_id: str, reason: str = "") -> None:
        """Abort a request nobody waits for any more. Its id stays taken, its outputs
        dropped, until the scheduler's final output for it arrives: a new request reusing
        the id must never receive the old one's tokens or abort notice."""
        route = self._routes.get(request_id)
        if route is None or route.state is _Route.CANCELLED:
            return
        if route.state is _Route.FINISHED or not self.alive:  # no (further) final output will come
            self.release(request_id)
            return
        logger.debug("request %s: its caller left; aborting it", request_id)
        self.abort(request_id, reason)
        route.state = _Route.CANCELLED

    def abort(self, request_id: str, reason: str = "", error_code: str | None = None) -> bool:
        """Ask the scheduler to drop a request and free its KV; False if unknown here,
        already cancelled, or already finished. With ``error_code`` (a gRPC status name)
        the call ends with that status and ``reason``, not with finish reason "abort"."""
        route = self._routes.get(request_id)
        if route is None or route.state is not _Route.OPEN or not self.alive:
            return False
        self.to_scheduler.send(to_scheduler_encoder.encode(AbortRequest(request_id, reason, error_code)))
        return True

    async def call(self, method: str, timeout: float = 5.0, **args) -> ControlReply:
        """An admin call to the scheduler (e.g. "stats"), answered between steps."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "the scheduler is not ready")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self.to_scheduler.send(to_scheduler_encoder.encode(ControlRequest(call_id, method, args)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)


__all__ = ["SchedulerClient", "SchedulerUnavailable", "remove_stale_ipc_dirs"]
