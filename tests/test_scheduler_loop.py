"""SchedulerLoop and its heartbeat thread, in-process over a stand-in engine: what a
heartbeat reports at each moment of a step."""

from __future__ import annotations

from types import SimpleNamespace

import zmq

from scheduler.messages import LoadSnapshot, StepOutput
from scheduler.process import HeartbeatThread, SchedulerLoop


class OneStepEngine:
    """Publishes its step's final load before the step returns, as Engine.step does, and
    records the heartbeat a beat at that moment would send."""

    def __init__(self):
        self.load = LoadSnapshot(version=1)
        self.runner = SimpleNamespace(device="cpu", check_ranks=lambda: None)
        self.pool = SimpleNamespace(take_events=lambda: [])
        self.steps_left = 1
        self.heartbeat: HeartbeatThread | None = None
        self.beats_in_step = []

    disagg = None

    def has_step_work(self) -> bool:
        return self.steps_left > 0

    def step(self) -> StepOutput:
        self.steps_left -= 1
        self.beats_in_step.append(self.heartbeat.current())
        self.load = LoadSnapshot(version=2)  # the step's final load, published before it returns
        self.beats_in_step.append(self.heartbeat.current())
        self.loop.running = False
        return StepOutput(outputs=[], load=self.load)

    def refresh_load(self) -> None:
        pass


def test_a_heartbeat_never_pairs_a_steps_final_load_with_its_running_time():
    """The servicer keeps a heartbeat whose load version equals the step output's: a beat
    with the step's final load must say the step is over (in_step 0)."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://scheduler-loop-test")
    engine = OneStepEngine()
    engine.loop = loop = SchedulerLoop(engine, inbox, outbox=None)
    loop.send = lambda msg: None
    engine.heartbeat = HeartbeatThread(ctx, "inproc://heartbeat-test", loop)
    try:
        assert engine.heartbeat.current().in_step_s == 0.0
        loop.run()
        for beat in engine.beats_in_step:
            assert beat.load.version == 1 and beat.in_step_s > 0, beat  # the load from before the step
        after = engine.heartbeat.current()
        assert after.load.version == 2 and after.in_step_s == 0.0, after
    finally:
        engine.heartbeat.socket.close()
        inbox.close()
        ctx.term()


class RefusingEngine(OneStepEngine):
    """Refuses every request (as for a prompt past the context) and has no work."""

    def has_work(self) -> bool:
        return False

    def add_request(self, msg):
        from scheduler.scheduler import AdmissionError

        raise AdmissionError("INVALID_ARGUMENT", "too long")

    def finished_outputs(self):
        return []

    def refresh_load(self) -> None:
        self.load = LoadSnapshot(version=self.load.version + 1)


def test_a_refusal_between_steps_sends_the_load_the_heartbeat_reports():
    """Requests handled between steps change the load too: the StepOutput that reports the
    refusal and the next heartbeat carry the same snapshot, with no step running."""
    from scheduler.messages import AddRequest, SamplingParams, to_scheduler_encoder

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://scheduler-loop-refusal")
    sender = ctx.socket(zmq.PUSH)
    sender.connect("inproc://scheduler-loop-refusal")
    engine = RefusingEngine()
    loop = SchedulerLoop(engine, inbox, outbox=None)
    sent = []
    loop.send = sent.append
    heartbeat = HeartbeatThread(ctx, "inproc://heartbeat-refusal", loop)
    try:
        sender.send(to_scheduler_encoder.encode(AddRequest("r", [1, 2, 3], SamplingParams())))
        assert inbox.poll(5000)
        loop._drain_inbox()
        (out,) = sent
        assert out.outputs[0].error_code == "INVALID_ARGUMENT" and out.load.version == 2
        beat = heartbeat.current()
        assert beat.load == out.load and beat.in_step_s == 0.0, beat
    finally:
        for s in (heartbeat.socket, sender, inbox):
            s.close()
        ctx.term()
