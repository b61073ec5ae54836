"""The decode side: a request's KV blocks are allocated here (after this daemon's own
prefix hit) and registered with the prefill daemon the request names; once the prefill
side has written them and sent the first token, the request decodes as if it had computed
its prompt here.

Blocks the prefill side might still write (a registration or transfer given up on: a
timeout, a lost connection, an abort) are quarantined until it confirms nothing more will
come, or for ``QUARANTINE_S``: reusing them earlier could let stale KV land in another
request's blocks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from ..messages import DisaggLoad, DisaggParams
from ..request import Request
from ..scheduler import AdmissionError
from .common import HANDSHAKE_S, QUARANTINE_S
from .wire import (
    MAX_FRAME_BYTES,
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
    to_decode_decoder,
)

logger = logging.getLogger(__name__)

# Where a request's registration stands.
PREALLOC = "prealloc"  # waiting for KV blocks
UNSENT = "unsent"  # blocks allocated; the prefill side not reached yet
SENT = "sent"  # registered; no answer yet
ACKED = "acked"  # the prefill side took the registration: waiting for the KV


class _Peer:
    """One prefill daemon's bootstrap server: a DEALER that queues nothing while it is not
    connected (a registration must never arrive after we gave up on it), and a monitor that
    reports a lost connection."""

    def __init__(self, ctx: zmq.Context, host: str, port: int):
        self.name = f"{host}:{port}"
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(f"tcp://{host}:{port}")

    def send(self, msg) -> bool:
        try:
            self.socket.send(encoder.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected (yet)
            return False

    def disconnected(self) -> bool:
        """Whether the connection dropped since the last call."""
        dropped = False
        while True:
            try:
                zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            dropped = True

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)


@dataclass
class _Leg:
    request: Request
    cache_salt: str
    peer: _Peer
    state: str = PREALLOC
    deadline: float = 0.0  # monotonic: the current state's time limit (from UNSENT on)
    register: KvRegister | None = None


class DecodeCoordinator:
    mode = "decode"

    def __init__(self, settings, scheduler, kv, layout: KvLayout, transfer, abort, ctx: zmq.Context):
        """``abort(request_id, (code, message) | None)`` ends a request (the engine's abort);
        ``transfer``: the engine the prefill side writes into our pool through (its session)."""
        self.settings = settings
        self.scheduler = scheduler
        self.kv = kv
        self.layout = layout
        self.transfer = transfer  # (kept: it owns the registration of our pool)
        self.session_id = transfer.session_id
        self.abort = abort
        self.ctx = ctx
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.legs: dict[int, _Leg] = {}  # room -> its leg, until the KV came or it ended
        self.room_of: dict[str, int] = {}
        self.prealloc: deque[int] = deque()  # rooms waiting for blocks, in arrival order
        self.quarantine: dict[int, tuple[float, list[int]]] = {}  # room -> (since, blocks)
        self.outputs = []  # first tokens received, for the next StepOutput
        self.received_requests = 0
        self.received_prompt_tokens = 0
        self.decode_cached_blocks = 0
        self.transfer_speed_gb_s = 0.0
        self.transfer_latency_ms = 0.0

    # -- the engine's side -------------------------------------------------------------
    @property
    def sockets(self) -> list[zmq.Socket]:
        return [s for p in self.peers.values() for s in (p.socket, p.monitor)]

    def check(self, params: DisaggParams) -> None:
        """Before admission (AdmissionError): a leg this decode daemon cannot serve."""
        if params.bootstrap_room in self.legs:
            raise AdmissionError("ALREADY_EXISTS", f"bootstrap_room {params.bootstrap_room} is already in use")

    def add(self, req: Request, params: DisaggParams, cache_salt: str) -> None:
        """A held request's decode leg (after :meth:`check`): it registers once blocks are free."""
        room = params.bootstrap_room
        key = (params.bootstrap_host, params.bootstrap_port)
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = _Peer(self.ctx, *key)
        self.legs[room] = _Leg(req, cache_salt, peer)
        self.room_of[req.request_id] = room
        self.prealloc.append(room)

    def on_retire(self, req: Request) -> None:
        """A leg ended before its KV came (aborted by the client or the router): free its
        blocks now if the prefill side never had them, else quarantine them."""
        room = self.room_of.pop(req.request_id, None)
        if room is None:
            return
        leg = self.legs.pop(room)
        if leg.state == PREALLOC:
            self.prealloc.remove(room)
        elif leg.state in (SENT, ACKED):
            self._quarantine(room, leg)

    def poll(self, now: float) -> None:
        for peer in list(self.peers.values()):
            while True:
                try:
                    frame = peer.socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = to_decode_decoder.decode(frame)
                except msgspec.DecodeError as e:
                    logger.warning("dropped a malformed message from the prefill at %s: %s", peer.name, e)
                    continue
                self._on_message(msg, now)
            if peer.disconnected():
                self._lost(peer)
        self._preallocate(now)
        self._expire(now)

    def take_outputs(self) -> list:
        outputs, self.outputs = self.outputs, []
        return outputs

    def has_work(self) -> bool:
        return bool(self.legs or self.quarantine)

    def load(self) -> DisaggLoad:
        return DisaggLoad(
            mode=self.mode,
            decode_prealloc=len(self.prealloc),
            decode_receiving=len(self.legs) - len(self.prealloc),
            quarantined_blocks=sum(len(b) for _, b in self.quarantine.values()),
            kv_transfer_speed_gb_s=self.transfer_speed_gb_s,
            kv_transfer_latency_ms=self.transfer_latency_ms,
        )

    def stats_dict(self) -> dict:
        return {
            "pd_received_requests": self.received_requests,
            "pd_received_prompt_tokens": self.received_prompt_tokens,
            "pd_decode_cached_blocks": self.decode_cached_blocks,
            "pd_waiting_kv": len(self.legs),
            "pd_quarantined_blocks": self.load().quarantined_blocks,
        }

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.ctx.term()

    # -- registration ------------------------------------------------------------------
    def _preallocate(self, now: float) -> None:
        """Give the oldest waiting legs their blocks and register them, while blocks and
        running slots last (each keeps a block of headroom per running request, so
        receiving cannot starve the requests decoding now)."""
        bs = self.kv.block_size
        while self.prealloc:
            receiving = len(self.legs) - len(self.prealloc)
            if len(self.scheduler.running) + receiving >= self.scheduler.config.max_running_requests:
                return
            room = self.prealloc[0]
            leg = self.legs[room]
            req = leg.request
            cached = self.kv.find_cached_prefix(req)
            n = req.num_prompt_tokens
            headroom = len(self.scheduler.running) * bs
            if not self.kv.can_admit(req, cached, n - len(cached) * bs + headroom):
                return
            self.prealloc.popleft()
            self.kv.admit(req, cached)
            self.kv.allocate(req, n - len(cached) * bs)
            self.decode_cached_blocks += len(cached)
            leg.register = KvRegister(
                room=room,
                request_id=req.request_id,
                prompt_digest=prompt_digest(req.token_ids[:n], leg.cache_salt),
                decode_session=self.session_id,
                layout=self.layout,
                dst_blocks=req.block_ids[len(cached) :],
                decode_cached_blocks=len(cached),
            )
            leg.state = UNSENT
            leg.deadline = now + min(HANDSHAKE_S, self.settings.bootstrap_timeout_s)
            self._try_send(leg)

    def _try_send(self, leg: _Leg) -> None:
        if leg.peer.send(leg.register):
            leg.state = SENT

    # -- answers -----------------------------------------------------------------------
    def _on_message(self, msg, now: float) -> None:
        if isinstance(msg, KvAbortAck):
            self._release_quarantine(msg.room)
            return
        leg = self.legs.get(msg.room)
        if leg is None or leg.state not in (SENT, ACKED):
            return  # a leg that ended meanwhile
        where = f"the prefill at {leg.peer.name}"
        if isinstance(msg, KvRegistered):
            leg.state = ACKED
            leg.deadline = now + self.settings.waiting_timeout_s
        elif isinstance(msg, KvDone):
            self._received(msg.room, leg, msg)
        elif isinstance(msg, KvRefused):
            self._end(msg.room, leg, ("UNAVAILABLE", f"PD handshake refused by {where}: {msg.message}"), safe=True)
        elif isinstance(msg, KvFailed):
            error = (msg.code, f"{msg.message} (reported by {where})") if msg.code else None
            self._end(msg.room, leg, error, safe=True)

    def _received(self, room: int, leg: _Leg, msg: KvDone) -> None:
        """The KV is in our blocks: the request continues from the first token."""
        del self.legs[room]
        del self.room_of[leg.request.request_id]
        req = leg.request
        n = req.num_prompt_tokens
        req.num_computed_tokens = n
        self.kv.commit(req)  # its full prompt blocks join this daemon's prefix cache
        req.num_cached_tokens = msg.num_cached_tokens
        self.received_requests += 1
        self.received_prompt_tokens += n
        self.transfer_speed_gb_s = msg.nbytes / max(msg.seconds, 1e-9) / 1e9
        self.transfer_latency_ms = msg.seconds * 1e3
        if msg.first_token is None:
            req.finish("length")
        else:
            if msg.logprobs is not None and req.output_logprobs is not None:
                req.output_logprobs.extend(msg.logprobs)
            req.append_token(msg.first_token)
        self.scheduler.release_held(req, "kv")
        if not req.is_finished:
            out = req.take_output()
            if out is not None:
                self.outputs.append(out)

    def _end(self, room: int, leg: _Leg, error: tuple[str, str] | None, safe: bool) -> None:
        """End a leg without its KV. ``safe``: the prefill side will write nothing more, so
        its blocks are freed at once; otherwise they are quarantined."""
        if error is not None:
            logger.warning("request %s (room %d): %s", leg.request.request_id, room, error[1])
        if safe:
            leg.state = UNSENT  # (on_retire then frees the blocks)
        self.abort(leg.request.request_id, error)

    def _lost(self, peer: _Peer) -> None:
        for room, leg in list(self.legs.items()):
            if leg.peer is peer and leg.state in (SENT, ACKED):
                why = f"KV transfer failed: lost the connection to the prefill at {peer.name}"
                self._end(room, leg, ("UNAVAILABLE", why), safe=False)

    def _expire(self, now: float) -> None:
        for room, leg in list(self.legs.items()):
            if leg.state == UNSENT and now < leg.deadline:
                self._try_send(leg)
            if leg.state == PREALLOC or now < leg.deadline:
                continue
            if leg.state == UNSENT:
                why = f"PD bootstrap failed: the prefill bootstrap server at {leg.peer.name} is unreachable"
            elif leg.state == SENT:
                why = f"PD bootstrap failed: the prefill at {leg.peer.name} did not answer the handshake"
            else:
                timeout = self.settings.waiting_timeout_s
                why = (
                    f"KV transfer failed: no KV for room {room} from the prefill at {leg.peer.name} "
                    f"within {timeout:g} s"
                )
            self._end(room, leg, ("UNAVAILABLE", why), safe=leg.state == UNSENT)
        for room, (since, _) in list(self.quarantine.items()):
            if now - since >= QUARANTINE_S:
                self._release_quarantine(room)

    # -- quarantine --------------------------------------------------------------------
    def _quarantine(self, room: int, leg: _Leg) -> None:
        req = leg.request
        blocks, req.block_ids = req.block_ids, []
        req.num_committed_blocks = 0
        self.quarantine[room] = (time.monotonic(), blocks)
        leg.peer.send(KvAbort(room))

    def _release_quarantine(self, room: int) -> None:
        entry = self.quarantine.pop(room, None)
        if entry is not None:
            self.kv.pool.free(list(reversed(entry[1])))
