"""Messages between a decode scheduler and a prefill scheduler's bootstrap socket
(msgpack over a ZMQ DEALER -> ROUTER pair). Every message names its ``room``.

decode -> prefill: KvRegister (where the room's KV goes), KvAbort (the decode leg ended).
prefill -> decode: KvRegistered (handshake accepted), KvRefused (layout or prompt mismatch),
KvDone (the KV is written; the first token), KvFailed (the prefill leg ended without it),
KvAbortAck (nothing more will be written for the room).
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from ..messages import LogprobRows

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 22  # a registration of a context-long prompt's blocks fits many times over


class KvLayout(msgspec.Struct, frozen=True):
    """One side's KV pool as the other must know it: the tensor ``[layers, 2, blocks,
    block_size, kv_heads, head_dim]`` at ``base_ptr`` in the sender's registered memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int  # the null block included
    itemsize: int
    base_ptr: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def mismatch(self, other: KvLayout) -> str | None:
        """Why KV of ``other``'s pool cannot be copied into this one, or None."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: prefill has {mine}, decode has {theirs}"
        return None


class KvRegister(msgspec.Struct, tag=True):
    room: int
    request_id: str
    prompt_digest: bytes  # sha256 of the prompt and cache salt: both legs must be one request
    decode_session: str  # the transfer engine's address of the decode side
    layout: KvLayout
    dst_blocks: list[int]  # decode's blocks for the prompt's blocks from decode_cached_blocks on
    decode_cached_blocks: int  # leading prompt blocks decode already holds (its prefix hit)
    version: int = PROTOCOL_VERSION


class KvAbort(msgspec.Struct, tag=True):
    room: int


class KvRegistered(msgspec.Struct, tag=True):
    room: int


class KvRefused(msgspec.Struct, tag=True):
    room: int
    message: str


class KvDone(msgspec.Struct, tag=True):
    room: int
    first_token: int | None  # None: the request asked for no output tokens
    logprobs: LogprobRows | None  # the first token's row, when asked for
    num_cached_tokens: int  # prompt tokens prefill took from its prefix cache
    nbytes: int
    seconds: float  # the transfer's time


class KvFailed(msgspec.Struct, tag=True):
    room: int
    message: str
    code: str | None = None  # a gRPC status name; None: the prefill leg was aborted (decode ends "abort")


class KvAbortAck(msgspec.Struct, tag=True):
    room: int


ToPrefill = KvRegister | KvAbort
ToDecode = KvRegistered | KvRefused | KvDone | KvFailed | KvAbortAck

encoder = msgspec.msgpack.Encoder()
to_prefill_decoder = msgspec.msgpack.Decoder(ToPrefill)
to_decode_decoder = msgspec.msgpack.Decoder(ToDecode)


def prompt_digest(token_ids: list[int], cache_salt: str) -> bytes:
    """What both legs of one request agree on: a room paired with another prompt (a
    collision, a guessed room) is refused rather than given someone else's KV."""
    h = hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes())
    h.update(cache_salt.encode())
    return h.digest()
