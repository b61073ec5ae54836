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
        self.runner = SimpleNamespace(device="cpu")
        self.pool = SimpleNamespace(take_events=lambda: [])
        self.steps_left = 1
        self.heartbeat: HeartbeatThread | None = None
        self.beats_in_step = []

    def has_work(self) -> bool:
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
