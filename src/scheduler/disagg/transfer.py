"""Moving KV bytes between two daemons' pools: Mooncake's transfer engine over TCP.

Each scheduler registers its whole KV pool once; a transfer is one batched write of byte
ranges from this pool into the peer's (``plan.transfer_ranges``), named by the peer's
session id (``host:rpc_port``). Mooncake exchanges the segment descriptors itself on the
first write to a peer (its ``P2PHANDSHAKE`` mode: no metadata server).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import time

logger = logging.getLogger(__name__)

# Before this, Mooncake's TCP transport reported a write complete once it had left the
# sender's socket, not once it had landed (Mooncake PR 2850): decode could read torn KV.
MIN_MOONCAKE_VERSION = (0, 3, 12, 1)
_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")


class TransferError(RuntimeError):
    pass


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.replace(".post", ".").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _installed_mooncake() -> str | None:
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class MooncakeTransfer:
    """Writes from this process's registered KV pool into a peer's, over Mooncake's TCP transport."""

    name = "mooncake"

    def __init__(self, host: str, base_ptr: int, nbytes: int):
        # TCP even where RDMA NICs exist (a loopback pair, or hosts without RDMA between
        # them), no 2 GiB staging buffer of its own, and its sockets on our address only.
        os.environ.setdefault("MC_FORCE_TCP", "1")
        os.environ.setdefault("PASS_ALLOC", "1")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise OSError(
                f"--disaggregation-mode needs the Mooncake transfer engine, which did not import ({e}): "
                "pip install '.[pd]' (mooncake-transfer-engine-non-cuda), and the Debian package libibverbs1"
            ) from e
        version = _installed_mooncake()
        if version is not None and _version_tuple(version) < MIN_MOONCAKE_VERSION:
            raise OSError(
                f"Mooncake {version} is too old: its TCP writes may complete before they land (need 0.3.12.post1+)"
            )
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise OSError(f"the Mooncake transfer engine did not start on {host} (code {rc})")
        rc = self.engine.register_memory(base_ptr, nbytes)
        if rc != 0:
            raise OSError(f"Mooncake could not register the KV pool ({nbytes} bytes) for transfers (code {rc})")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        logger.info("KV transfers: Mooncake %s over TCP, session %s", version or "", self.session_id)

    def write(self, peer_session: str, src: list[int], dst: list[int], lens: list[int]) -> None:
        """Copy each source range into the peer's memory; returns once every byte has landed."""
        rc = self.engine.batch_transfer_sync_write(peer_session, src, dst, lens)
        if rc != 0:
            raise TransferError(f"mooncake returned {rc} writing {sum(lens)} bytes to {peer_session}")


class MemcpyTransfer:
    """Both pools in this process (two engines of one test): the ranges copied with memmove."""

    name = "memcpy"
    session_id = "local"

    def write(self, peer_session: str, src: list[int], dst: list[int], lens: list[int]) -> None:
        for s, d, n in zip(src, dst, lens):
            ctypes.memmove(d, s, n)


def timed_write(transfer, peer_session: str, src: list[int], dst: list[int], lens: list[int]) -> float:
    """Seconds the write took (TransferError on failure)."""
    start = time.perf_counter()
    transfer.write(peer_session, src, dst, lens)
    return time.perf_counter() - start
