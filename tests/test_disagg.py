"""Prefill/decode disaggregation without daemons: two engines of one process on the bundled
model, paired through real bootstrap sockets on loopback, the KV copied in memory. The PD
pair must give the tokens one engine gives, move only the blocks decode lacks, and end every
failure on both sides with its blocks freed."""

import random
import time

import pytest

from helpers import free_port
from scheduler.config import DisaggregationConfig, EngineConfig
from scheduler.disagg.plan import block_runs, transfer_ranges
from scheduler.disagg.transfer import TransferError
from scheduler.disagg.wire import KvLayout
from scheduler.engine import Engine
from scheduler.messages import AddRequest, DisaggParams, SamplingParams
from scheduler.model_runner import ModelRunner, load_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(EngineConfig(device="cpu"))


def make_engine(loaded, mode=None, port=0, block_size=16, timeout=30.0, waiting=None):
    pd = None
    if mode is not None:
        pd = DisaggregationConfig(
            mode=mode,
            host="127.0.0.1",
            bootstrap_port=port,
            transfer_backend="memcpy",
            bootstrap_timeout_s=timeout,
            waiting_timeout_s=timeout if waiting is None else waiting,
        )
    config = EngineConfig(device="cpu", kv_cache_tokens=4096, block_size=block_size, disaggregation=pd)
    return Engine(config, ModelRunner(config, loaded))


@pytest.fixture(scope="module")
def pair(loaded):
    port = free_port()
    prefill, decode = make_engine(loaded, "prefill", port), make_engine(loaded, "decode", port)
    yield prefill, decode
    prefill.disagg.close()
    decode.disagg.close()


def add(engine, rid, prompt, room, port, sampling=GREEDY):
    engine.add_request(AddRequest(rid, list(prompt), sampling, disagg=DisaggParams("127.0.0.1", port, room)))


def drive(*engines, timeout=60.0, until=None):
    """Step and poll the engines until none has work (or ``until(outputs)``); every output
    by request id, per engine."""
    outputs = {id(e): {} for e in engines}
    deadline = time.monotonic() + timeout
    while any(e.has_work() for e in engines) and not (until and until([outputs[id(e)] for e in engines])):
        assert time.monotonic() < deadline, "the PD pair did not finish"
        for e in engines:
            outs = e.poll_disagg()
            if e.has_step_work():
                outs += e.step().outputs
            for o in outs:
                outputs[id(e)].setdefault(o.request_id, []).append(o)
        time.sleep(0.001)
    return [outputs[id(e)] for e in engines]


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def final(outs):
    return outs[-1]


def assert_no_leak(*engines):
    for e in engines:
        assert e.pool.num_free_blocks == e.pool.num_blocks, f"{e.pool.num_used_blocks} KV blocks still held"
        assert not e.has_work()


def test_block_runs_merge_blocks_consecutive_on_both_sides():
    assert block_runs([3, 4, 5, 9, 10], [7, 8, 9, 20, 22]) == [(3, 7, 3), (9, 20, 1), (10, 22, 1)]
    assert block_runs([], []) == []


def test_transfer_ranges_cover_every_layer_and_half():
    src = KvLayout(2, 3, 4, "float32", 16, 10, 4, base_ptr=1000)
    dst = KvLayout(2, 3, 4, "float32", 16, 20, 4, base_ptr=50_000)
    bb = 16 * 3 * 4 * 4
    s, d, n = transfer_ranges(src, [1, 2], dst, [5, 6])
    assert n == [2 * bb] * 4  # one run, for K and V of both layers
    assert s == [1000 + (p * 10 + 1) * bb for p in range(4)]
    assert d == [50_000 + (p * 20 + 5) * bb for p in range(4)]
    other = KvLayout(2, 3, 4, "float32", 32, 20, 4)
    assert "block_size differs" in src.mismatch(other)
    with pytest.raises(ValueError):
        transfer_ranges(src, [1], other, [1])


def test_pd_pair_gives_the_tokens_of_one_engine(loaded, pair):
    """Short, block-sized, long and chunked (over the step budget) prompts; decode computes
    none of their prompt tokens."""
    prefill, decode = pair
    port = prefill.config.disaggregation.bootstrap_port
    rng = random.Random(1)
    prompts = [[rng.randint(100, 49000) for _ in range(n)] for n in (5, 16, 100, 700)]
    expected = [c.output_ids for c in make_engine(loaded).generate(prompts, GREEDY)]
    for i, p in enumerate(prompts):
        add(prefill, f"r{i}", p, room=i, port=port)
        add(decode, f"r{i}", p, room=i, port=port)
    computed_before = decode.stats_dict()["num_computed_prompt_tokens"]
    pre, dec = drive(prefill, decode)
    for i, want in enumerate(expected):
        assert tokens(dec[f"r{i}"]) == want
        assert final(dec[f"r{i}"]).finish_reason == "length" and final(dec[f"r{i}"]).error is None
        assert tokens(pre[f"r{i}"]) == want[:1]  # the prefill leg's only output: the first token
    stats = decode.stats_dict()
    assert stats["num_computed_prompt_tokens"] == computed_before
    assert stats["pd_received_prompt_tokens"] >= sum(map(len, prompts))
    assert prefill.stats_dict()["pd_transfers"] >= len(prompts)
    assert prefill.load.disagg.kv_transfer_speed_gb_s > 0
    assert_no_leak(prefill, decode)


def test_decode_prefix_hit_moves_only_the_missing_blocks(pair):
    prefill, decode = pair
    port = prefill.config.disaggregation.bootstrap_port
    prompt = list(range(2000, 2000 + 200))
    moved = []
    for room in (100, 101):
        before = prefill.stats_dict()["pd_transferred_blocks"]
        add(prefill, f"hit{room}", prompt, room, port)
        add(decode, f"hit{room}", prompt, room, port)
        _, dec = drive(prefill, decode)
        assert final(dec[f"hit{room}"]).error is None
        moved.append(prefill.stats_dict()["pd_transferred_blocks"] - before)
    assert moved[0] == 13 and moved[1] == 1  # 200 tokens: 13 blocks; a hit keeps 12 of them
    assert_no_leak(prefill, decode)


def test_a_failed_transfer_fails_both_legs(pair, monkeypatch):
    prefill, decode = pair
    port = prefill.config.disaggregation.bootstrap_port

    def broken(*args):
        raise TransferError("the link is down")

    monkeypatch.setattr(prefill.disagg.transfer, "write", broken)
    add(prefill, "broken", range(3000, 3040), 200, port)
    add(decode, "broken", range(3000, 3040), 200, port)
    pre, dec = drive(prefill, decode)
    for outs in (pre["broken"], dec["broken"]):
        assert final(outs).error_code == "UNAVAILABLE" and "KV transfer failed" in final(outs).error
    assert_no_leak(prefill, decode)


def test_an_aborted_prefill_leg_ends_the_decode_leg(pair):
    prefill, decode = pair
    port = prefill.config.disaggregation.bootstrap_port
    add(prefill, "gone", range(4000, 4050), 300, port)
    add(decode, "gone", range(4000, 4050), 300, port)
    prefill.abort("gone")
    _, dec = drive(prefill, decode)
    assert final(dec["gone"]).finish_reason == "abort" and final(dec["gone"]).error is None
    assert_no_leak(prefill, decode)


def test_an_aborted_decode_leg_holds_its_blocks_until_prefill_confirms(pair):
    """Registered blocks may still be written: they stay out of the pool until the prefill
    side says nothing more comes for the room."""
    prefill, decode = pair
    port = prefill.config.disaggregation.bootstrap_port
    add(decode, "waiting", range(5000, 5100), 400, port)
    deadline = time.monotonic() + 10
    while decode.load.disagg is None or decode.load.disagg.decode_receiving == 0 or not prefill.disagg.rooms:
        assert time.monotonic() < deadline
        decode.poll_disagg()
        prefill.poll_disagg()
        decode.refresh_load()
    decode.abort("waiting")
    decode.poll_disagg()
    assert decode.disagg.load().quarantined_blocks == 7
    drive(prefill, decode)
    assert decode.disagg.load().quarantined_blocks == 0
    assert_no_leak(prefill, decode)


def test_a_leg_without_its_partner_times_out(loaded):
    port = free_port()
    prefill = make_engine(loaded, "prefill", port, timeout=0.3)
    # The decode leg waits longer than the prefill's bootstrap timeout, so the prefill's
    # verdict reaches it first even on a loaded machine.
    decode = make_engine(loaded, "decode", port, timeout=0.3, waiting=30.0)
    try:
        add(prefill, "alone", range(100, 140), 1, port)
        add(decode, "alone-too", range(100, 140), 2, port)
        pre, dec = drive(prefill, decode)
        for outs in (pre["alone"], dec["alone-too"]):
            assert final(outs).error_code == "UNAVAILABLE" and "bootstrap timed out" in final(outs).error
        assert_no_leak(prefill, decode)
    finally:
        prefill.disagg.close()
        decode.disagg.close()


def test_mismatched_legs_are_refused(loaded, pair):
    """Another prompt in the same room, or a decode pool with another block size."""
    prefill, decode = pair
    port = prefill.config.disaggregation.bootstrap_port
    add(prefill, "a", range(6000, 6030), 500, port)
    add(decode, "a", range(7000, 7030), 500, port)
    pre, dec = drive(prefill, decode)
    for outs in (pre["a"], dec["a"]):
        assert final(outs).error_code == "UNAVAILABLE" and "handshake refused" in final(outs).error
    other = make_engine(loaded, "decode", port, block_size=32)
    try:
        add(prefill, "b", range(6000, 6030), 501, port)
        add(other, "b", range(6000, 6030), 501, port)
        _, dec = drive(prefill, other, until=lambda outs: "b" in outs[1])
        assert "block_size differs" in final(dec["b"]).error
        prefill.abort("b")
        drive(prefill)
        assert_no_leak(prefill, decode, other)
    finally:
        other.disagg.close()


def test_mooncake_writes_scattered_ranges_into_a_peer_pool():
    """The real transfer engine (TCP on loopback) between two registered pools of this process:
    every range lands where the plan says, the rest of the pool untouched."""
    pytest.importorskip("mooncake.engine", reason="Mooncake is not installed (pip install '.[pd]'; libibverbs1)")
    import torch

    from scheduler.disagg.transfer import MooncakeTransfer

    src = torch.randn(4 << 20)
    dst = torch.zeros(4 << 20)
    sender = MooncakeTransfer("127.0.0.1", src.data_ptr(), src.numel() * 4)
    receiver = MooncakeTransfer("127.0.0.1", dst.data_ptr(), dst.numel() * 4)
    n, size = 240, 4096  # floats per range
    sender.write(
        receiver.session_id,
        [src.data_ptr() + i * 2 * size * 4 for i in range(n)],
        [dst.data_ptr() + i * 3 * size * 4 for i in range(n)],
        [size * 4] * n,
    )
    got = dst[: 3 * size * n].view(n, 3, size)
    assert torch.equal(got[:, 0], src[: 2 * size * n].view(n, 2, size)[:, 0])
    assert not got[:, 1:].any()
