"""Messages between the gRPC servicer and the scheduler process (msgspec over ZMQ).

servicer -> scheduler: AddRequest, AbortRequest, ControlRequest.
scheduler -> servicer: EngineReady (once, after load), StepOutput (one per step that
produced anything, and for refusals and aborts between steps), ControlReply, Heartbeat
(every 0.25 s, from a thread), EngineDead, KvEvents (the prefix cache's changes after a
step or a flush).

Kept free of torch imports: the servicer process imports this module too.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

GREEDY_TEMPERATURE = 1e-5  # kernels.sampling.MIN_TEMPERATURE (this module stays torch-free)
# RequestOutput.error_code of a structured-output failure (a grammar that does not compile,
# or admits no complete output): FAILED_PRECONDITION with the trailer
# `smg-constraint-failed: engine`, which the router answers with HTTP 422, as SGLang's servicer does.
CONSTRAINT_FAILED = "CONSTRAINT_FAILED"


def out_of_vocabulary(token_ids: list[int], vocab_size: int) -> int | None:
    """The first token id outside [0, vocab_size), or None (one pass when all are inside)."""
    if not token_ids or 0 <= min(token_ids) <= max(token_ids) < vocab_size:
        return None
    return next(t for t in token_ids if not 0 <= t < vocab_size)


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Normalised sampling parameters (proto3 zeros already mapped to their meaning)."""

    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int | None = None  # None = up to the context limit
    min_new_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None  # custom_params "seed": reproducible sampling for this request
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling
    stop: list[str] = []  # stop strings (matched on the detokenised output)
    no_stop_trim: bool = False  # keep the matched stop string's tokens in the output
    # Logprobs (GenerateRequest.return_logprob & co.): of the raw logits, before any
    # sampling transform. logprob_start_len >= 0 also asks for prompt logprobs from there.
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] = []
    logprob_start_len: int = -1
    # Structured output: "json_schema" | "regex" | "ebnf_grammar" | "structural_tag" ("" = none)
    constraint_kind: str = ""
    constraint: str = ""

    @property
    def greedy(self) -> bool:
        """Takes the argmax (the sampling kernels treat a temperature this low as 0)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


class DisaggParams(msgspec.Struct):
    """A prefill/decode disaggregated request's leg (GenerateRequest.disaggregated_params):
    where the prefill daemon's bootstrap server is, and the room pairing the two legs."""

    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    cache_salt: str = ""  # requests share cached KV only when their salts are equal
    disagg: DisaggParams | None = None  # a PD leg (the daemon's --disaggregation-mode says which)
    embed: bool = False  # an Embed: prefill only, answered with the pooled vector (embedding models)


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str
    reason: str = ""
    # None: the request ends normally with finish reason "abort" (a client's Abort, a client
    # gone); a gRPC status name: it ends with that error, ``reason`` its message (shutdown)
    error_code: str | None = None


class ControlRequest(msgspec.Struct, tag=True):
    """An admin call that wants a reply (stats, flush cache, profiling)."""

    call_id: int
    method: str
    args: dict[str, Any] = {}


class LogprobRows(msgspec.Struct, omit_defaults=True):
    """Logprobs of consecutive positions: one entry per token of ``token_ids``.

    ``values[i]`` is the logprob of ``token_ids[i]`` (None only for the first prompt
    token, which has no context); ``top_values``/``top_ids`` the ``top_logprobs_num`` best
    alternatives per position; ``ids_values`` the logprobs of the request's
    ``token_ids_logprob`` per position (output only).
    """

    values: list[float | None]
    token_ids: list[int]
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    ids_values: list[list[float]] = []


class LogprobLists:
    """Accumulated logprob rows (host lists), one entry per position."""

    __slots__ = ("values", "token_ids", "top_values", "top_ids", "ids_values")

    def __init__(self, token_ids: list[int] | None = None):
        self.values: list[float | None] = []
        self.token_ids: list[int] = token_ids if token_ids is not None else []  # input: preset
        self.top_values: list[list[float]] = []
        self.top_ids: list[list[int]] = []
        self.ids_values: list[list[float]] = []

    def append(self, value, top_values, top_ids, ids_values) -> None:
        self.values.append(value)
        self.top_values.append(top_values)
        self.top_ids.append(top_ids)
        self.ids_values.append(ids_values)

    def rows(self, start: int, end: int, token_ids: list[int] | None = None) -> LogprobRows:
        """Positions [start, end) as a message (empty top/ids columns left out)."""
        return LogprobRows(
            values=self.values[start:end],
            token_ids=token_ids if token_ids is not None else self.token_ids[start:end],
            top_values=self.top_values[start:end] if any(self.top_values[start:end]) else [],
            top_ids=self.top_ids[start:end] if any(self.top_ids[start:end]) else [],
            ids_values=self.ids_values[start:end] if any(self.ids_values[start:end]) else [],
        )

    def extend(self, rows: LogprobRows) -> None:
        """Append a message's rows (its empty top/ids columns stand for empty entries)."""
        n = len(rows.values)
        self.values.extend(rows.values)
        self.token_ids.extend(rows.token_ids)
        self.top_values.extend(rows.top_values or [[]] * n)
        self.top_ids.extend(rows.top_ids or [[]] * n)
        self.ids_values.extend(rows.ids_values or [[]] * n)


class RequestOutput(msgspec.Struct, omit_defaults=True):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_token_id: int | None = None
    matched_stop_str: str | None = None
    output_logprobs: LogprobRows | None = None  # rows for new_token_ids (return_logprob)
    input_logprobs: LogprobRows | None = None  # the prompt's, once, with the first tokens
    error: str | None = None  # why the request ended in error: refused, a grammar dead end, a shutdown
    error_code: str | None = None  # gRPC status name for `error`
    num_draft_tokens: int = 0  # speculative drafts verified so far, and of them kept
    num_accepted_drafts: int = 0
    embedding: list[float] | None = None  # an embedding model's answer (a classifier's: its logits)
    queue_time_s: float | None = None  # from arrival to its first step; once, with its first output

    @classmethod
    def refused(cls, msg: AddRequest, code: str, message: str) -> RequestOutput:
        """The only output of a request refused at admission (``code``: a gRPC status name)."""
        return cls(msg.request_id, [], len(msg.input_ids), 0, 0, "abort", error=message, error_code=code)


class DisaggLoad(msgspec.Struct, omit_defaults=True):
    """The PD part of the scheduler's load (GetLoads ``disaggregation``, health)."""

    mode: str  # "prefill" | "decode"
    bootstrap_problem: str | None = None  # prefill: why its bootstrap server is not listening
    prefill_bootstrapping: int = 0  # prefill: requests waiting for their decode side to register
    decode_prealloc: int = 0  # decode: requests waiting for KV blocks to register
    decode_receiving: int = 0  # decode: registered, waiting for the KV
    quarantined_blocks: int = 0  # decode: blocks of abandoned transfers, held until safe
    kv_transfer_speed_gb_s: float = 0.0
    kv_transfer_latency_ms: float = 0.0


class LoadSnapshot(msgspec.Struct):
    """The scheduler's load, refreshed after every step (read by GetLoads and health)."""

    # Counts refreshes. Heartbeats travel on their own socket, so one carrying an older
    # snapshot can arrive after a step's output: the reader keeps the highest version.
    version: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_uncached_tokens: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0
    gen_throughput: float = 0.0  # output tokens/s over the last few seconds
    cache_hit_rate: float = 0.0  # cached / all prompt tokens admitted so far
    num_draft_tokens: int = 0  # speculative drafts verified so far, and of them kept
    num_accepted_drafts: int = 0
    disagg: DisaggLoad | None = None  # PD mode's queues and transfers; None in mode null

    @property
    def token_usage(self) -> float:
        """The share of the KV cache's tokens in use."""
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0


class StepOutput(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    # The load after this step, so the servicer's GetLoads never shows a request running
    # after its final output was delivered (heartbeats alone lag by up to HEARTBEAT_S).
    load: LoadSnapshot | None = None


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every HEARTBEAT_S by a thread of the scheduler process, also mid-step."""

    load: LoadSnapshot
    in_step_s: float  # how long the current step has run; 0 between steps


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the loaded engine serves (sent once, in EngineReady): GetModelInfo and
    GetServerInfo answer from it, and requests are validated against its limits."""

    model_path: str
    tokenizer_path: str  # a directory AutoTokenizer loads (a GGUF's tokenizer converted)
    served_model_name: str
    max_context_length: int  # tokens: --max-model-len, else the model's own
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int  # 0 when the model has none
    pad_token_id: int  # 0 when the model has none
    model_type: str  # e.g. "llama"
    architectures: list[str]  # e.g. ["LlamaForCausalLM"]
    max_total_num_tokens: int  # KV cache capacity
    max_running_requests: int
    max_queued_requests: int  # requests that may wait beyond the free running slots
    max_logprobs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # 0: off
    block_size: int
    enable_prefix_caching: bool
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # e.g. "float32", "bfloat16"
    weight_gb: float  # GiB
    kv_cache_gb: float  # GiB
    tp_size: int = 1  # tensor-parallel ranks
    disaggregation_mode: str = "null"  # "null" | "prefill" | "decode"
    disaggregation_bootstrap_port: int = 0  # where a prefill daemon's bootstrap server listens
    disaggregation_transfer_backend: str = ""  # "mooncake" in PD mode
    is_generation: bool = True  # False: an embedding model, answering Embed only
    labels: list[str] = []  # a classifier's, in logit order


class EngineReady(msgspec.Struct, tag=True):
    model_info: ModelInfo


class ControlReply(msgspec.Struct, tag=True):
    call_id: int
    ok: bool
    result: dict[str, Any] = {}
    message: str = ""


class EngineDead(msgspec.Struct, tag=True):
    reason: str


# -- KV cache events (prefix-cache changes, published to SubscribeKvEvents) ---------------


class KvStored(msgspec.Struct, tag=True):
    """One full block entered the prefix cache."""

    block_hash: int  # int64 identity (first 8 sha256 bytes, big-endian, signed)
    parent_hash: int | None  # the previous block of the same sequence; None at the root
    token_ids: list[int]
    block_size: int


class KvRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]


class KvCleared(msgspec.Struct, tag=True):
    pass


KvEvent = KvStored | KvRemoved | KvCleared


class KvEvents(msgspec.Struct, tag=True):
    """The block pool's events drained after one step (or a flush), in order."""

    events: list[KvEvent]
    timestamp: float  # wall clock (time.time()) when drained


ToScheduler = AddRequest | AbortRequest | ControlRequest
FromScheduler = EngineReady | StepOutput | Heartbeat | ControlReply | EngineDead | KvEvents

to_scheduler_encoder = msgspec.msgpack.Encoder()
to_scheduler_decoder = msgspec.msgpack.Decoder(ToScheduler)
from_scheduler_encoder = msgspec.msgpack.Encoder()
from_scheduler_decoder = msgspec.msgpack.Decoder(FromScheduler)


class MalformedFrames:
    """Drops the frames a decoder refused (not msgpack, or not one of the expected messages):
    any process of our user can push one into the IPC sockets, and it must not take down the
    process that reads it. One warning per frame, up to a burst of ``burst`` lines refilled at
    ``per_s`` lines a second: a flood of garbage cannot flood the log, and the next warning
    counts the frames dropped without one."""

    def __init__(self, logger: logging.Logger, reader: str, burst: int = 10, per_s: float = 1.0):
        self.logger = logger
        self.reader = reader
        self.burst = burst
        self.per_s = per_s
        self.tokens = float(burst)
        self.refilled = time.monotonic()
        self.dropped = 0  # in all
        self.unlogged = 0  # dropped without a warning since the last one

    def drop(self, frame: bytes | memoryview, error: Exception) -> None:
        self.dropped += 1
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.refilled) * self.per_s)
        self.refilled = now
        if self.tokens < 1:
            self.unlogged += 1
            return
        self.tokens -= 1
        also = f" (and {self.unlogged} more without a warning)" if self.unlogged else ""
        self.logger.warning(
            "%s dropped a malformed frame of %d bytes%s, %d in all: %s",
            self.reader,
            len(frame),
            also,
            self.dropped,
            error,
        )
        self.unlogged = 0
