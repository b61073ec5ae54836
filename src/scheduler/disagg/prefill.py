"""The prefill side: a bootstrap server where decode schedulers register, per room, the
blocks that will receive a request's KV; each request computes its prompt and first token
as usual, and when it ends its KV goes to the blocks registered for its room.

A request waits (held, "bootstrap") until its room is registered; a registration may
arrive before the request does. A request that ends without its KV sent (aborted, timed
out, refused) tells the registered decode side why, so it frees its blocks at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import zmq

from kernels.util import cdiv

from ..messages import DisaggLoad, DisaggParams
from ..request import Request
from ..scheduler import AdmissionError
from .common import TransferStats
from .plan import transfer_ranges
from .transfer import TransferError, timed_write
from .wire import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    KvAbort,
    KvAbortAck,
    KvDone,
    KvFailed,
    KvLayout,
    KvRefused,
    KvRegister,
    KvRegistered,
    encoder,
    prompt_digest,
    to_prefill_decoder,
)

logger = logging.getLogger(__name__)
BIND_RETRY_S = 1.0


@dataclass
class _Room:
    since: float  # monotonic: when its request or its registration came, whichever first
    request: Request | None = None
    cache_salt: str = ""
    registration: KvRegister | None = None
    peer: bytes = b""  # the registering decode's identity on the bootstrap socket


@dataclass
class _BootstrapServer:
    """The ROUTER socket decode schedulers connect to; bound, or retried until it can be."""

    ctx: zmq.Context
    host: str
    port: int
    socket: zmq.Socket | None = None
    problem: str | None = "not bound yet"
    next_try: float = 0.0

    def try_bind(self, now: float) -> None:
        if self.socket is not None or now < self.next_try:
            return
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            sock.bind(f"tcp://{self.host}:{self.port}")
        except zmq.ZMQError as e:
            sock.close(0)
            was = self.problem
            self.problem = f"bootstrap server cannot listen on {self.host}:{self.port}: {e}"
            if was != self.problem:
                logger.warning("%s; retrying every %.0f s", self.problem, BIND_RETRY_S)
            self.next_try = now + BIND_RETRY_S
            return
        self.socket, self.problem = sock, None
        logger.info("PD bootstrap server listening on %s:%d", self.host, self.port)


class PrefillCoordinator:
    mode = "prefill"

    def __init__(self, settings, scheduler, layout: KvLayout, transfer, abort, ctx: zmq.Context):
        """``abort(request_id, (code, message))`` ends a request (the engine's abort)."""
        self.settings = settings
        self.scheduler = scheduler
        self.layout = layout
        self.transfer = transfer
        self.abort = abort
        self.rooms: dict[int, _Room] = {}
        self.room_of: dict[str, int] = {}  # request id -> room
        # Rooms whose request ended before a decode side registered: a late registration is
        # told why at once instead of waiting for the bootstrap timeout.
        self.ended: dict[int, tuple[float, KvFailed]] = {}
        self.stats = TransferStats()
        self.server = _BootstrapServer(ctx, settings.host, settings.bootstrap_port)
        self.server.try_bind(time.monotonic())

    # -- the engine's side -------------------------------------------------------------
    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.server.socket] if self.server.socket is not None else []

    def check(self, params: DisaggParams) -> None:
        """Before admission (AdmissionError): a leg this prefill daemon cannot serve."""
        if params.bootstrap_port != self.settings.bootstrap_port:
            raise AdmissionError(
                "FAILED_PRECONDITION",
                f"PD bootstrap misconfigured: the request names bootstrap port {params.bootstrap_port}, this "
                f"prefill daemon listens on {self.settings.bootstrap_port} (the router's --prefill URL PORT)",
            )
        room = self.rooms.get(params.bootstrap_room)
        if room is not None and room.request is not None:
            raise AdmissionError("ALREADY_EXISTS", f"bootstrap_room {params.bootstrap_room} is already in use")

    def add(self, req: Request, params: DisaggParams, cache_salt: str) -> None:
        """A held request's prefill leg (after :meth:`check`): it runs once its room is registered."""
        room = self._room(params.bootstrap_room, time.monotonic())
        room.request, room.cache_salt = req, cache_salt
        self.room_of[req.request_id] = params.bootstrap_room
        # The first token is this leg's only output (none if none was asked for).
        req.max_new_tokens = min(req.max_new_tokens, 1)
        if room.registration is not None:
            self._pair(params.bootstrap_room, room)

    def on_retire(self, req: Request) -> None:
        """A request ends (before its blocks are freed): send its KV, or tell decode why not."""
        room_id = self.room_of.pop(req.request_id, None)
        if room_id is None:
            return
        room = self.rooms.pop(room_id)
        if req.error is not None or req.finish_reason == "abort":
            code, message = req.error or (None, "the prefill leg was aborted")
            failed = KvFailed(room_id, message, code)
            if room.registration is None:
                self.ended[room_id] = (time.monotonic(), failed)
            else:
                self._send(room.peer, failed)
            return
        self._send_kv(room_id, room, req)

    def poll(self, now: float) -> None:
        """Take decode's messages and enforce the bootstrap timeout."""
        self.server.try_bind(now)
        sock = self.server.socket
        while sock is not None:
            try:
                peer, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:  # not two frames: not one of ours
                continue
            try:
                msg = to_prefill_decoder.decode(frame)
            except msgspec.DecodeError as e:
                logger.warning("bootstrap server dropped a malformed message of %d bytes: %s", len(frame), e)
                continue
            if isinstance(msg, KvRegister):
                self._on_register(peer, msg, now)
            else:
                self._on_abort(peer, msg)
        self._expire(now)

    def has_work(self) -> bool:
        return bool(self.rooms)

    def take_outputs(self) -> list:
        return []  # (a prefill leg's only output is its final one, made when it ends)

    def load(self) -> DisaggLoad:
        waiting = sum(1 for r in self.rooms.values() if r.request is not None and r.registration is None)
        return DisaggLoad(
            mode=self.mode,
            bootstrap_problem=self.server.problem,
            prefill_bootstrapping=waiting,
            kv_transfer_speed_gb_s=self.stats.speed_gb_s,
            kv_transfer_latency_ms=self.stats.latency_ms,
        )

    def stats_dict(self) -> dict:
        return self.stats.as_dict() | {"pd_pending_registrations": sum(r.request is None for r in self.rooms.values())}

    def close(self) -> None:
        if self.server.socket is not None:
            self.server.socket.close(0)
        self.server.ctx.term()

    # -- internals ---------------------------------------------------------------------
    def _room(self, room_id: int, now: float) -> _Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = _Room(since=now)
        return room

    def _send(self, peer: bytes, msg) -> None:
        if self.server.socket is not None:
            self.server.socket.send_multipart([peer, encoder.encode(msg)])

    def _on_register(self, peer: bytes, msg: KvRegister, now: float) -> None:
        room_id = msg.room
        problem = None
        if msg.version != PROTOCOL_VERSION:
            problem = f"protocol version {msg.version}, this prefill speaks {PROTOCOL_VERSION}"
        else:
            problem = self.layout.mismatch(msg.layout)
        ended = self.ended.pop(room_id, None)
        if problem is None and ended is not None:
            self._send(peer, KvRegistered(room_id))
            self._send(peer, ended[1])
            return
        room = self.rooms.get(room_id)
        if problem is None and room is not None and room.registration is not None:
            problem = f"room {room_id} is already registered by another decode request"
        if problem is not None:
            self._send(peer, KvRefused(room_id, problem))
            return
        self._send(peer, KvRegistered(room_id))
        room = self._room(room_id, now)
        room.registration, room.peer = msg, peer
        if room.request is not None:
            self._pair(room_id, room)

    def _pair(self, room_id: int, room: _Room) -> None:
        """The request and its registration met: check they are one request, then run it."""
        req, reg = room.request, room.registration
        n = req.num_prompt_tokens
        bs = self.layout.block_size
        problem = None
        if reg.prompt_digest != prompt_digest(req.token_ids[:n], room.cache_salt):
            problem = "the decode leg's prompt (or cache salt) differs from the prefill leg's"
        elif not 0 <= (c := reg.decode_cached_blocks) <= (n - 1) // bs or len(reg.dst_blocks) != cdiv(n, bs) - c:
            problem = f"the decode leg registered {len(reg.dst_blocks)} blocks after {c} cached ones for {n} tokens"
        if problem is None:
            self.scheduler.release_held(req, "bootstrap")
            return
        self._send(room.peer, KvRefused(room_id, problem))
        room.registration = None  # (told already)
        self.abort(req.request_id, ("UNAVAILABLE", f"PD handshake refused for room {room_id}: {problem}"))

    def _on_abort(self, peer: bytes, msg: KvAbort) -> None:
        """The decode leg ended first: nothing will be written for the room after the ack
        (transfers run on this loop, so none is under way now)."""
        room = self.rooms.get(msg.room)
        if room is not None and room.peer == peer:
            room.registration = None
            if room.request is None:
                del self.rooms[msg.room]
            else:
                self.abort(room.request.request_id, ("UNAVAILABLE", f"the decode leg of room {msg.room} ended first"))
        self._send(peer, KvAbortAck(msg.room))

    def _send_kv(self, room_id: int, room: _Room, req: Request) -> None:
        reg = room.registration
        n = req.num_prompt_tokens
        src_blocks = req.block_ids[reg.decode_cached_blocks : cdiv(n, self.layout.block_size)]
        src, dst, lens = transfer_ranges(self.layout, src_blocks, reg.layout, reg.dst_blocks)
        try:
            seconds = timed_write(self.transfer, reg.decode_session, src, dst, lens)
        except TransferError as e:
            self.stats.failures += 1
            message = f"KV transfer failed for room {room_id} to {reg.decode_session}: {e}"
            logger.warning("%s", message)
            req.error = ("UNAVAILABLE", message)
            self._send(room.peer, KvFailed(room_id, message, "UNAVAILABLE"))
            return
        nbytes = sum(lens)
        self.stats.record(nbytes, seconds, len(src_blocks))
        first = req.output_ids[0] if req.output_ids else None
        logprobs = None
        if first is not None and req.output_logprobs is not None:
            logprobs = req.output_logprobs.rows(0, 1, [first])
        self._send(room.peer, KvDone(room_id, first, logprobs, req.num_cached_tokens, nbytes, seconds))

    def _expire(self, now: float) -> None:
        timeout = self.settings.bootstrap_timeout_s
        for room_id, room in list(self.rooms.items()):
            if now - room.since < timeout or room.registration is not None and room.request is not None:
                continue
            if room.request is not None:  # no decode side came
                self.abort(
                    room.request.request_id,
                    (
                        "UNAVAILABLE",
                        f"PD bootstrap timed out: no decode worker registered room {room_id} within {timeout:g} s",
                    ),
                )
            else:  # no prefill leg came
                del self.rooms[room_id]
                message = f"PD bootstrap timed out: no prefill request for room {room_id} arrived within {timeout:g} s"
                self._send(room.peer, KvFailed(room_id, message, "UNAVAILABLE"))
        for room_id, (at, _) in list(self.ended.items()):
            if now - at >= timeout:
                del self.ended[room_id]
