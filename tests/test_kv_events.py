"""SubscribeKvEvents (router contract §8).

Unit tests run the real service in an in-process grpc.aio server over a stand-in
scheduler client (no model): numbering, replay and cursor rules, fan-out, slow
subscribers, load records. The server's own generated stubs and smg-grpc-proto's cannot
share a process (both register common.proto), so each unit scenario runs this file as a
script in a fresh interpreter (``python tests/test_kv_events.py SCENARIO``).
End-to-end tests use the session daemon (real model, smg-grpc-proto stubs): prompt
blocks arrive as chained stored events, replay after a reconnect, FlushCache's cleared
event, idle heartbeats.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from scheduler.block_pool import hash_block, public_hash
from scheduler.messages import KvCleared, KvEvents, KvRemoved, KvStored, LoadSnapshot

if __name__ != "__main__":  # the isolated scenarios use the server's own stubs instead
    from smg_grpc_proto.generated import common_pb2 as spb
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

BS = 16
_TESTS = Path(__file__).resolve().parent


def isolated(scenario: str, timeout: float = 180.0) -> None:
    """Run one unit scenario in a fresh interpreter (see the module docstring)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_TESTS.parent / "src"), str(_TESTS), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"scenario {scenario} failed:\n{r.stdout}\n{r.stderr}"


# ------------------------------------------------------------------ unit scenarios (own process)


class FakeClient:
    """What the service and the hub read from a SchedulerClient."""

    def __init__(self):
        from helpers import sample_model_info
        from servicer.scheduler_client import Liveness

        self.liveness = Liveness(last_message=time.monotonic(), load=LoadSnapshot(max_total_num_tokens=1024))
        self.model_info = sample_model_info(max_running_requests=8, weight_gb=0.1, kv_cache_gb=0.2)
        self.died = asyncio.Event()
        self.dead_reason = None
        self.alive = True
        self.size = 1  # DP ranks
        self.kv_event_listener = None


def stored(h, parent, tokens=None, bs=BS):
    return KvStored(h, parent, tokens if tokens is not None else list(range(h, h + bs)), bs)


def one_block_batch(h):
    return KvEvents([stored(h, None)], time.time())


def run_with_server(test, hub=None):
    """Run ``test(client, hub, stub, spb)`` against a fresh in-process server."""
    from types import SimpleNamespace

    from servicer.generated import common_pb2
    from servicer.generated import sglang_scheduler_pb2_grpc as pb_grpc
    from servicer.scheduler_service import SglangSchedulerService

    async def main():
        client = FakeClient()
        service = SglangSchedulerService(client, SimpleNamespace(shutting_down=False))
        if hub is not None:
            service.kv_events = hub
            client.kv_event_listener = hub.publish
        server = grpc.aio.server()
        pb_grpc.add_SglangSchedulerServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.SglangSchedulerStub(ch)
                await asyncio.wait_for(test(client, service.kv_events, stub, common_pb2), 120)
        finally:
            await server.stop(0)

    asyncio.run(main())


async def subscribe(stub, hub, spb, start=0, before_first=False):
    """Open a stream and wait until the hub has registered it."""
    before = set(hub.subscribers)
    call = stub.SubscribeKvEvents(
        spb.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=before_first)
    )
    await call.initial_metadata()
    assert hub.subscribers - before, "initial metadata came before the subscription was registered"
    return call


async def next_real(call):
    """The next batch that carries events (skipping load_only ones)."""
    while True:
        b = await call.read()
        assert b is not grpc.aio.EOF
        if not b.load.load_only:
            return b


def block_hashes(batch):
    return [blk.block_hash for ev in batch.events if ev.WhichOneof("data") == "stored" for blk in ev.stored.blocks]


# ------------------------------------------------------------------ unit tests (isolated)


def scenario_proto_events():
    from servicer.kv_events import to_proto_events

    events = to_proto_events(
        [
            KvRemoved([7, 8]),
            stored(1, None),
            stored(2, 1),
            stored(3, 2),
            stored(9, 99, tokens=[1, 2, 3]),  # partial block: never published
            stored(4, 3),  # its parent is published, but in the previous run: a new event
            stored(5, 42),  # a different chain
            KvCleared(),
        ],
        iter(range(1, 100)),
    )
    kinds = [e.WhichOneof("data") for e in events]
    assert kinds == ["removed", "stored", "stored", "stored", "cleared"], kinds
    assert list(events[0].removed.block_hashes) == [7, 8]
    first = events[1].stored
    assert [b.block_hash for b in first.blocks] == [1, 2, 3] and not first.HasField("parent_block_hash")
    assert all(len(b.token_ids) == b.block_size == BS for e in events[1:4] for b in e.stored.blocks)
    assert events[2].stored.parent_block_hash == 3 and [b.block_hash for b in events[2].stored.blocks] == [4]
    assert events[3].stored.parent_block_hash == 42
    assert [e.event_id for e in events] == [1, 2, 3, 4, 5]


def scenario_fan_out():
    from servicer.kv_events import KvEventHub

    async def main():
        hub = KvEventHub(queue_size=2)
        fast, _ = hub.subscribe(0)
        slow, _ = hub.subscribe(0)
        got = []
        for h in (1, 2, 3):
            hub.publish(one_block_batch(h))
            while not fast.queue.empty():
                got.append(fast.queue.get_nowait()[0].sequence_number)
        assert got == [1, 2, 3], got
        assert slow.overflowed and slow not in hub.subscribers
        assert not fast.overflowed and fast in hub.subscribers

    asyncio.run(main())


def chain_batch(first_hash, blocks):
    """One step that stored ``blocks`` chained blocks."""
    hashes = range(first_hash, first_hash + blocks)
    return KvEvents([stored(h, h - 1 if h > first_hash else None) for h in hashes], time.time())


def scenario_block_budget():
    from servicer.kv_events import KvEventHub

    async def main():
        hub = KvEventHub(history_blocks=10)
        reader, _ = hub.subscribe(0)  # drains as it goes
        lagging, _ = hub.subscribe(0)  # never reads
        for i, size in enumerate((4, 4, 4, 1)):  # 13 blocks: the first batch no longer fits
            hub.publish(chain_batch(1000 * (i + 1), size))
            assert (await reader.next(1)).sequence_number == i + 1
        assert [b.sequence_number for b, _ in hub.history] == [2, 3, 4]
        # The lagging subscriber held 4 + 4 queued blocks; the third batch of 4 overflowed it.
        assert lagging.overflowed and lagging not in hub.subscribers
        assert not reader.overflowed and reader in hub.subscribers and reader.queued_blocks == 0
        # A batch larger than the whole budget is still kept (alone) and still delivered.
        hub.publish(chain_batch(9000, 25))
        assert [b.sequence_number for b, _ in hub.history] == [5]
        assert len((await reader.next(1)).events[0].stored.blocks) == 25

    asyncio.run(main())


def scenario_replay():
    async def test(client, hub, stub, spb):
        live = await subscribe(stub, hub, spb)
        for h in range(1, 6):
            client.kv_event_listener(one_block_batch(h * 100))
        seen = [(await next_real(live)) for _ in range(5)]
        assert [b.sequence_number for b in seen] == [1, 2, 3, 4, 5]
        samples = [b.load.sample for b in seen]
        assert samples == sorted(set(samples)) and samples[0] >= 1, samples

        # A cursor inside the history: exactly the missing batches, then live.
        again = await subscribe(stub, hub, spb, start=2)
        replayed = [await next_real(again) for _ in range(3)]
        assert [b.sequence_number for b in replayed] == [3, 4, 5]
        assert [block_hashes(b) for b in replayed] == [block_hashes(b) for b in seen[2:]]
        client.kv_event_listener(one_block_batch(600))
        assert (await next_real(again)).sequence_number == 6
        assert (await next_real(live)).sequence_number == 6  # every subscriber gets every batch

        # Caught up (cursor = last): nothing replayed, live continues.
        caught_up = await subscribe(stub, hub, spb, start=6)
        client.kv_event_listener(one_block_batch(700))
        assert (await next_real(caught_up)).sequence_number == 7

        # From 0: the blocks cached now (numbered like the last batch), then live.
        client.kv_event_listener(KvEvents([KvRemoved([100])], time.time()))  # (batch 8)
        fresh = await subscribe(stub, hub, spb, start=0)
        state = await next_real(fresh)
        assert state.sequence_number == 8 and sorted(block_hashes(state)) == [200, 300, 400, 500, 600, 700]
        client.kv_event_listener(one_block_batch(800))
        assert (await next_real(fresh)).sequence_number == 9

        # A cursor from the future (e.g. before a restart): OUT_OF_RANGE.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubscribeKvEvents(spb.SubscribeKvEventsRequest(start_sequence_number=10)).read()
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE

        # Events with nothing publishable do not take a sequence number.
        client.kv_event_listener(KvEvents([stored(5, None, tokens=[1])], time.time()))
        client.kv_event_listener(one_block_batch(900))
        assert (await next_real(fresh)).sequence_number == 10
        for call in (live, again, caught_up, fresh):
            call.cancel()

    run_with_server(test)


def scenario_expired_cursor():
    from servicer.kv_events import KvEventHub

    async def test(client, hub, stub, spb):
        live = await subscribe(stub, hub, spb)
        for h in range(1, 11):
            client.kv_event_listener(one_block_batch(h * 100))
        assert [(await next_real(live)).sequence_number for _ in range(10)] == list(range(1, 11))
        assert [b.sequence_number for b, _ in hub.history] == [7, 8, 9, 10]
        call = await subscribe(stub, hub, spb, start=6)  # oldest kept is 7: still complete
        assert [(await next_real(call)).sequence_number for _ in range(4)] == [7, 8, 9, 10]
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubscribeKvEvents(spb.SubscribeKvEventsRequest(start_sequence_number=5)).read()
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "resubscribe from 0" in e.value.details()
        live.cancel()

    run_with_server(test, KvEventHub(history=4))


def scenario_cursor_from_before_a_restart():
    async def test(client, hub, stub, spb):
        # A restarted daemon numbers from 1 again and publishes before the router reconnects:
        # the router's old cursor 7 is within the new numbers but was never sent by this run.
        for h in range(1, 11):
            client.kv_event_listener(one_block_batch(h * 100))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubscribeKvEvents(spb.SubscribeKvEventsRequest(start_sequence_number=7)).read()
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "restarted" in e.value.details()
        fresh = await subscribe(stub, hub, spb, start=0)  # what the router does next
        assert (await next_real(fresh)).sequence_number == 10  # (what is cached now)
        client.kv_event_listener(one_block_batch(1100))
        assert (await next_real(fresh)).sequence_number == 11
        again = await subscribe(stub, hub, spb, start=11)  # a cursor this run sent: accepted
        client.kv_event_listener(one_block_batch(1200))
        assert (await next_real(again)).sequence_number == 12
        fresh.cancel()
        again.cancel()

    run_with_server(test)


def scenario_data_loss():
    from servicer.kv_events import KvEventHub

    async def test(client, hub, stub, spb):
        call = await subscribe(stub, hub, spb)
        for h in range(1, 5):  # all at once: the stream cannot drain its queue of 2
            client.kv_event_listener(one_block_batch(h * 100))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await next_real(call)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS
        assert not hub.subscribers

    run_with_server(test, KvEventHub(queue_size=2))


def scenario_load_records():
    from servicer import kv_events

    async def test(client, hub, stub, spb):
        # No heartbeat at first (this scenario has its own interpreter): the first two records
        # can only come from the 100 ms load checks, however slow the machine.
        kv_events.HEARTBEAT_S = kv_events.SLOW_HEARTBEAT_S = 3600.0
        call = await subscribe(stub, hub, spb, before_first=True)
        first = await call.read()
        assert first.load.load_only and first.sequence_number == 0 and not first.events, first
        assert first.load.HasField("max_total_num_tokens") and first.load.max_total_num_tokens == 1024
        assert first.load.max_running_requests == 8 and first.load.memory.kv_cache_gb == 0.2

        # A load change goes out at the next check, without telemetry.
        client.liveness.load = LoadSnapshot(
            num_running=2, num_waiting=3, num_used_tokens=256, max_total_num_tokens=1024
        )
        changed = await call.read()
        assert changed.load.load_only and changed.sequence_number == 0
        assert (changed.load.running_requests, changed.load.waiting_requests) == (2, 3)
        assert abs(changed.load.token_usage - 0.25) < 1e-9
        assert not changed.load.HasField("max_total_num_tokens")
        assert changed.load.sample > first.load.sample

        # A real batch carries a (non load_only) record; heartbeats then repeat its number.
        # (A slow heartbeat far longer than a heartbeat, so telling them apart leaves room for
        # a loaded machine; no await since: the stream saw no check.)
        kv_events.HEARTBEAT_S, kv_events.SLOW_HEARTBEAT_S = 1.0, 60.0
        client.kv_event_listener(one_block_batch(100))
        real = await call.read()
        assert real.sequence_number == 1 and real.events and not real.load.load_only
        beat = await call.read()
        assert beat.load.load_only and beat.sequence_number == 1 and not beat.events
        # Due 1 s after `real` left the server, by the server's timestamps (reading late here
        # cannot shrink it); far below the 60 s of a slow heartbeat.
        gap = beat.timestamp - real.timestamp
        assert 0.95 <= gap < 30, gap
        assert beat.load.HasField("max_total_num_tokens"), "heartbeats carry telemetry"
        assert beat.load.sample > real.load.sample > changed.load.sample
        call.cancel()

        # Without the opt-in, nothing before the first real batch (here the snapshot of
        # block 100, then the next one).
        quiet = await subscribe(stub, hub, spb)
        state = await quiet.read()
        assert state.sequence_number == 1 and block_hashes(state) == [100] and not state.load.load_only
        await asyncio.sleep(1.3)
        client.kv_event_listener(one_block_batch(200))
        b = await next_real(quiet)
        assert b.sequence_number == 2
        quiet.cancel()

    run_with_server(test)


def test_proto_events_chain_blocks_and_drop_partial_ones():
    isolated("proto_events")


def test_hub_fans_out_and_drops_only_the_slow_subscriber():
    isolated("fan_out")


def test_sequence_numbers_replay_and_cursor_rules():
    isolated("replay")


def test_history_and_subscriber_lag_are_bounded_in_blocks():
    isolated("block_budget")


def test_expired_cursor_is_out_of_range():
    isolated("expired_cursor")


def test_a_cursor_from_before_a_restart_is_out_of_range():
    isolated("cursor_from_before_a_restart")


def test_overflowing_subscriber_gets_data_loss():
    isolated("data_loss")


def test_load_only_records():
    isolated("load_records")


# ------------------------------------------------------------------ end-to-end (session daemon)


class Stream:
    """A SubscribeKvEvents call on the session daemon, read by a thread into a queue."""

    def __init__(self, stub, start=0, before_first=False):
        req = spb.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=before_first)
        self.call = stub.SubscribeKvEvents(req, timeout=120)
        self.items: queue.Queue = queue.Queue()
        self.call.initial_metadata()  # once we have it, the server has registered us
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for b in self.call:
                self.items.put(b)
        except grpc.RpcError as e:
            self.items.put(e)

    def get(self, timeout=60.0):
        item = self.items.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def real_batches(self, until, timeout=60.0):
        """Event-carrying batches until ``until(batches)`` holds."""
        got = []
        deadline = time.monotonic() + timeout
        while not until(got):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {[b.sequence_number for b in got]}"
            b = self.get(left)
            if not b.load.load_only:
                got.append(b)
        return got

    def drain_after(self, stub):
        """The real batches still on their way once the daemon is idle, until none can be left.
        A step's KvEvents follow its output, so an idle daemon may still be sending some: a
        scheduler stats reply (GetServerInfo) comes after them on the same socket, and a load
        record the stream makes after that reply comes after them on the stream."""
        wait_idle(stub)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert "steps" in info.scheduler_info.fields, f"no scheduler stats: {info.scheduler_info}"
        barrier = time.time()
        got = []
        while True:
            b = self.get()
            if not b.load.load_only:
                got.append(b)
            elif b.timestamp > barrier:
                return got

    def close(self):
        self.call.cancel()
        self.thread.join(5)


def stored_blocks(batches):
    return [blk for b in batches for ev in b.events if ev.WhichOneof("data") == "stored" for blk in ev.stored.blocks]


def random_prompt(n):
    rng = random.Random(time.time_ns())
    return [rng.randrange(1000, 40000) for _ in range(n)]


def generate(stub, prompt, max_new_tokens=2):
    req = pb.GenerateRequest(
        request_id=f"kv-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, top_k=-1, top_p=1.0),
        logprob_start_len=-1,
    )
    return [m for m in stub.Generate(req, timeout=120)]


def wait_idle(stub, timeout=60.0):
    deadline = time.monotonic() + timeout
    while stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).active_requests:
        assert time.monotonic() < deadline, "the daemon did not go idle"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def prompt_run(grpc_stub):
    """Subscribe from 0, generate over fresh prompts (the first spans 5 full blocks), one
    after the other so they land in separate batches; keep every real batch."""
    wait_idle(grpc_stub)
    prompts = [random_prompt(5 * BS + 3), random_prompt(2 * BS + 1), random_prompt(2 * BS + 5)]
    stream = Stream(grpc_stub)
    try:
        for p in prompts:
            generate(grpc_stub, p)
        want = {public_hash(d) for p in prompts for d in chain_digests(p)}
        batches = stream.real_batches(lambda got: want <= {blk.block_hash for blk in stored_blocks(got)})
        batches += stream.drain_after(grpc_stub)  # whatever else these requests caused (e.g. a decode-time block)
    finally:
        stream.close()
    assert len(batches) >= 3, [b.sequence_number for b in batches]
    return prompts[0], batches


def chain_digests(prompt):
    digests, parent = [], None
    for i in range(len(prompt) // BS):
        parent = hash_block(parent, prompt[i * BS : (i + 1) * BS])
        digests.append(parent)
    return digests


def test_e2e_prompt_blocks_arrive_as_chained_stored_events(prompt_run):
    prompt, batches = prompt_run
    seqs = [b.sequence_number for b in batches]
    assert seqs[0] >= 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    blocks = stored_blocks(batches)
    by_hash = {blk.block_hash: blk for blk in blocks}
    expected = [public_hash(d) for d in chain_digests(prompt)]
    for i, h in enumerate(expected):
        blk = by_hash[h]
        assert blk.block_size == BS and list(blk.token_ids) == prompt[i * BS : (i + 1) * BS]
    # Parent links follow the prompt: the root has none, every other block names its predecessor.
    parent_of, prev = {}, None
    for b in batches:
        for ev in b.events:
            if ev.WhichOneof("data") != "stored":
                continue
            prev = ev.stored.parent_block_hash if ev.stored.HasField("parent_block_hash") else None
            for blk in ev.stored.blocks:
                parent_of[blk.block_hash] = prev
                prev = blk.block_hash
    assert parent_of[expected[0]] is None
    assert [parent_of[h] for h in expected[1:]] == expected[:-1]
    assert all(len(blk.token_ids) == blk.block_size for blk in blocks), "only full blocks"
    assert all(b.HasField("load") and not b.load.load_only for b in batches)


def test_e2e_resubscribe_replays_exactly_the_missing_batches(grpc_stub, prompt_run):
    _, batches = prompt_run
    cursor, last = batches[0].sequence_number, batches[-1].sequence_number
    stream = Stream(grpc_stub, start=cursor)
    try:
        replayed = stream.real_batches(lambda got: got and got[-1].sequence_number >= last)
    finally:
        stream.close()
    assert [b.sequence_number for b in replayed] == list(range(cursor + 1, last + 1))
    assert [list(b.events) for b in replayed] == [list(b.events) for b in batches[1:]]


def test_e2e_far_cursor_is_out_of_range(grpc_stub):
    req = spb.SubscribeKvEventsRequest(start_sequence_number=10**12)
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stub.SubscribeKvEvents(req, timeout=10))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_e2e_flush_cache_streams_cleared(grpc_stub):
    wait_idle(grpc_stub)
    stream = Stream(grpc_stub)
    try:
        r = grpc_stub.FlushCache(spb.FlushCacheRequest(timeout_s=5), timeout=60)
        assert r.success, r.message
        got = stream.real_batches(lambda got: any(ev.WhichOneof("data") == "cleared" for b in got for ev in b.events))
    finally:
        stream.close()
    assert got


def test_e2e_idle_stream_heartbeats_load(grpc_stub):
    wait_idle(grpc_stub)
    stream = Stream(grpc_stub, before_first=True)
    try:
        records = [stream.get(timeout=30) for _ in range(3)]
    finally:
        stream.close()
    assert all(b.load.load_only and b.sequence_number == 0 and not b.events for b in records)
    assert [b.load.sample for b in records] == sorted({b.load.sample for b in records})
    assert records[0].load.max_total_num_tokens > 0 and records[0].load.max_running_requests > 0
    assert all(b.load.running_requests == 0 and b.load.waiting_requests == 0 for b in records)
    # First at once, then a heartbeat a second (the daemon is idle: no load change), by the
    # server's timestamps: ~2 s; slow heartbeats, 5 s apart, would take 10 s (the margin is
    # for a loaded machine).
    span = records[-1].timestamp - records[0].timestamp
    assert 1.0 < span < 9.0, span


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()


def test_e2e_router_cache_aware_subscribes(daemon, tmp_path_factory):
    """The real router under cache_aware opens the stream (no UNIMPLEMENTED), learns the
    block size from our stored events, and still answers."""
    from helpers import Router, wait_until

    question = [{"role": "user", "content": "Name three colours of the rainbow, please, in a short list."}]
    with Router(daemon.port, policy="cache_aware", log_level="info", log_dir=tmp_path_factory.mktemp("router-kv")) as r:
        body = {"model": r.model, "messages": question, "temperature": 0, "max_tokens": 8}
        resp = r.post("/v1/chat/completions", body)
        assert resp.status == 200, resp
        assert resp.json()["choices"][0]["message"]["content"]
        wait_until(
            lambda: "Learned block_size" in r.log_tail(400),
            60,
            lambda: f"the router learning the block size:\n{r.log_tail(400)}",
        )
        log = r.log_tail(400)
    assert "UNIMPLEMENTED" not in log and "Unimplemented" not in log, log
