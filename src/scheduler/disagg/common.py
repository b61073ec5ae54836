"""What both sides share: time limits and transfer statistics."""

from __future__ import annotations

# A registration or transfer a side gave up on (a timeout, a lost connection) may still be
# in flight: its blocks are held this long (Mooncake's own transfer timeout and a margin)
# unless the prefill side confirms first that nothing more will be written.
QUARANTINE_S = 35.0
# Decode's first message must reach the prefill side within this (or the bootstrap timeout, if shorter).
HANDSHAKE_S = 30.0
EWMA_WEIGHT = 0.2  # of the newest transfer in the reported speed and latency


class TransferStats:
    """Counts and a moving average of the transfers' speed and latency."""

    def __init__(self):
        self.transfers = 0
        self.failures = 0
        self.blocks = 0
        self.bytes = 0
        self.speed_gb_s = 0.0
        self.latency_ms = 0.0

    def record(self, nbytes: int, seconds: float, blocks: int) -> None:
        self.transfers += 1
        self.blocks += blocks
        self.bytes += nbytes
        speed = nbytes / max(seconds, 1e-9) / 1e9
        first = self.transfers == 1
        self.speed_gb_s = speed if first else (1 - EWMA_WEIGHT) * self.speed_gb_s + EWMA_WEIGHT * speed
        ms = seconds * 1e3
        self.latency_ms = ms if first else (1 - EWMA_WEIGHT) * self.latency_ms + EWMA_WEIGHT * ms

    def as_dict(self) -> dict:
        return {
            "pd_transfers": self.transfers,
            "pd_transfer_failures": self.failures,
            "pd_transferred_blocks": self.blocks,
            "pd_transferred_bytes": self.bytes,
        }
