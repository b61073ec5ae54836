"""A request as the scheduler tracks it.

There is no prefill/decode flag: each step computes ``num_tokens - num_computed_tokens``
tokens of it (capped by the step's budget), so chunked prefill, prefix hits and
resumption after preemption all fall out of the same rule.
"""

from __future__ import annotations

import enum

from .messages import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float = 0.0,
        hash_extra: bytes = b"",
    ):
        self.request_id = request_id
        self.token_ids = list(prompt_ids)  # prompt, then outputs
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else eos_token_ids
        )
        self.arrival_time = arrival_time
        self.hash_extra = hash_extra  # extra prefix-cache keys (cache salt, adapter)
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.block_ids: list[int] = []
        self.block_digests: list[bytes] = []  # chained hashes of the full blocks so far
        self.num_committed_blocks = 0  # leading blocks already indexed in the prefix cache
        self.num_sent_tokens = 0  # output tokens already reported to the servicer
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.matched_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and decide whether the request is done."""
        self.token_ids.append(token_id)
        n = self.num_output_tokens
        if token_id in self.stop_ids and n >= self.sampling.min_new_tokens:
            self.finish("stop", matched_token_id=token_id)
        elif n >= self.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str, matched_token_id: int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.matched_token_id = matched_token_id
