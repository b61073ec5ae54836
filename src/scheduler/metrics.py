"""The engine's counters, and the generation throughput its load reports carry."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

THROUGHPUT_WINDOW_S = 5.0


@dataclass
class EngineStats:
    steps: int = 0
    max_batch_size: int = 0
    max_step_tokens: int = 0
    num_generated_tokens: int = 0
    num_pooled_requests: int = 0  # an embedding model's requests answered
    batch_size_histogram: dict[int, int] = field(default_factory=dict)

    def record_step(self, batch_size: int, num_tokens: int) -> None:
        self.steps += 1
        self.max_batch_size = max(self.max_batch_size, batch_size)
        self.max_step_tokens = max(self.max_step_tokens, num_tokens)
        self.batch_size_histogram[batch_size] = self.batch_size_histogram.get(batch_size, 0) + 1


class ThroughputWindow:
    """Output tokens per second of the steps done in the last ``window_s`` seconds, over
    the time they ran from the first one's launch: a step longer than the window still
    gives a rate, and idle time before the first one does not count (idle long enough,
    the window empties and the rate is 0)."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S):
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int]] = deque()  # (launched, done, tokens)
        self.num_tokens = 0  # kept with the deque: summing it every step costs O(steps/s)

    def add(self, launched_at: float, done_at: float, num_tokens: int) -> None:
        self._steps.append((launched_at, done_at, num_tokens))
        self.num_tokens += num_tokens

    def rate(self, now: float) -> float:
        steps, horizon = self._steps, now - self.window_s
        while steps and steps[0][1] < horizon:
            self.num_tokens -= steps.popleft()[2]
        span = (steps[-1][1] - steps[0][0]) if steps else 0.0
        return self.num_tokens / span if span > 0 else 0.0
