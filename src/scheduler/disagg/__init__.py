"""Prefill/decode disaggregation: two daemons serve one request, the prompt's KV computed
on a prefill daemon and decoded on a decode daemon (``--disaggregation-mode``).

The router sends both legs the same request with a ``bootstrap_room`` pairing them. The
decode scheduler allocates the request's KV blocks (after its own prefix hit) and registers
them for the room with the prefill scheduler's bootstrap socket (``prefill.py``, ``decode.py``); the
prefill scheduler computes the prompt and the first token, writes the blocks decode lacks
into decode's KV pool in one batched transfer (``transfer.py``, Mooncake), and tells decode
the first token (``wire.py``). Decode then continues as if it had computed the prompt.

Everything here runs in the scheduler process, on its step loop: no locks.
"""

from __future__ import annotations


def build_coordinator(settings, scheduler, kv, runner, abort):
    """The prefill or decode side of ``settings`` (a DisaggregationConfig) for one engine:
    its KV pool registered with the transfer engine, its bootstrap socket(s) opened."""
    import zmq

    from .decode import DecodeCoordinator
    from .prefill import PrefillCoordinator
    from .transfer import MemcpyTransfer, MooncakeTransfer
    from .wire import KvLayout

    if settings.mode not in ("prefill", "decode"):
        raise ValueError(f"unknown --disaggregation-mode {settings.mode!r} (null, prefill or decode)")
    mc, rc = runner.layer_config, runner.config  # (the KV heads this rank holds)
    cache = runner.kv_cache
    if not cache.is_contiguous():
        raise ValueError("PD disaggregation needs one contiguous KV cache tensor")
    layout = KvLayout(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=str(rc.dtype).removeprefix("torch."),
        block_size=rc.block_size,
        num_blocks=cache.shape[2],
        itemsize=cache.element_size(),
        base_ptr=cache.data_ptr(),
    )
    if settings.transfer_backend == "mooncake":
        transfer = MooncakeTransfer(settings.host, cache.data_ptr(), runner.kv_cache_bytes)
    elif settings.transfer_backend == "memcpy":
        transfer = MemcpyTransfer()
    else:
        raise ValueError(f"unknown --disaggregation-transfer-backend {settings.transfer_backend!r} (mooncake)")
    ctx = zmq.Context()
    if settings.mode == "prefill":
        return PrefillCoordinator(settings, scheduler, layout, transfer, abort, ctx)
    return DecodeCoordinator(settings, scheduler, kv, layout, transfer, abort, ctx)
