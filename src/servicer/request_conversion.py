"""GenerateRequest (proto) -> scheduler AddRequest, with validation at the edge.

Proto3 zero values arrive for every field the router left unset; they are mapped to
their meaning here (temperature 0 = greedy, top_p 0 = 1, top_k 0 = off, ...).
"""

from __future__ import annotations

import math

from scheduler.messages import AddRequest, DisaggParams, ModelInfo, SamplingParams, out_of_vocabulary

MAX_N = 1024  # sequences per Generate call (OpenAI allows 128)
MAX_SEED = 2**64  # seeds are 64-bit; negative ones wrap
# Stop strings are matched against every new token of the request, inside the scheduler's
# step loop: bound the work one request can add to everyone's steps (OpenAI allows 4).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
# Each of a call's n sequences carries its own copy of these to the scheduler (and its own
# sampler state there): bound them so n x entries stays modest (OpenAI allows 300 biases).
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Every sequence of a call carries the request id (and the scheduler keeps it per sequence):
# the router sends UUIDs, so a few hundred characters leave room for any prefix.
MAX_REQUEST_ID_CHARS = 256
# A constraint compiles in a worker process and its grammar is cached: the biggest tool
# schemas are a few KiB, so this bounds the compile's input without refusing real ones.
MAX_CONSTRAINT_CHARS = 64 * 2**10


class InvalidRequest(ValueError):
    """The request can never be served as sent: INVALID_ARGUMENT (or ``code``) with this message."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code


def normalize_sampling(sp, vocab_size: int | None = None) -> SamplingParams:
    """Map proto SamplingParams onto ours, rejecting values that make no sense."""
    temperature = sp.temperature
    top_p = sp.top_p if sp.top_p != 0 else 1.0
    top_k = sp.top_k if sp.top_k > 0 else -1
    repetition_penalty = sp.repetition_penalty if sp.repetition_penalty != 0 else 1.0
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", sp.min_p),
        ("repetition_penalty", repetition_penalty),
    ):
        if math.isnan(value) or math.isinf(value):
            raise InvalidRequest(f"sampling_params.{name} must be a finite number, got {value}")
    if temperature < 0:
        raise InvalidRequest(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if sp.top_k < -1:
        raise InvalidRequest(f"sampling_params.top_k must be -1 (off) or positive, got {sp.top_k}")
    if not 0.0 <= sp.min_p <= 1.0:
        raise InvalidRequest(f"sampling_params.min_p must be in [0, 1], got {sp.min_p}")
    if repetition_penalty <= 0:
        raise InvalidRequest(f"sampling_params.repetition_penalty must be > 0, got {repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(sp, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"sampling_params.{name} must be in [-2, 2], got {value}")
    # 0 is allowed, as in SGLang: the prompt is prefilled (cached; prompt logprobs) and nothing sampled
    max_new_tokens = sp.max_new_tokens if sp.HasField("max_new_tokens") else None
    if max_new_tokens is not None and sp.min_new_tokens > max_new_tokens:
        raise InvalidRequest(
            f"sampling_params.min_new_tokens ({sp.min_new_tokens}) must be at most max_new_tokens ({max_new_tokens})"
        )
    seed = None
    if sp.HasField("custom_params") and "seed" in sp.custom_params.fields:
        value = sp.custom_params.fields["seed"]
        number = value.number_value
        kind = value.WhichOneof("kind")
        if kind != "number_value" or not math.isfinite(number) or number != int(number):
            shown = number if kind == "number_value" else f"a {kind.removesuffix('_value')}"
            raise InvalidRequest(f"custom_params.seed must be an integer, got {shown}")
        if not -MAX_SEED // 2 <= number < MAX_SEED:
            raise InvalidRequest(f"custom_params.seed must fit in 64 bits, got {number:.6g}")
        seed = int(number) % MAX_SEED
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"sampling_params.logit_bias has {len(sp.logit_bias)} entries; the most is {MAX_LOGIT_BIAS}"
        )
    logit_bias = {}
    for key, value in sp.logit_bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):  # int() also takes "1_0", " 5", "٣"
            raise InvalidRequest(f"sampling_params.logit_bias keys must be token ids, got {key[:24]!r}")
        token = int(key)
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidRequest(f"sampling_params.logit_bias token id {token} is outside the vocabulary")
        if math.isnan(value):
            raise InvalidRequest(f"sampling_params.logit_bias[{key}] is NaN")
        logit_bias[token] = min(max(float(value), -100.0), 100.0)  # OpenAI's range, as vLLM clamps
    constraint_kind = sp.WhichOneof("constraint") or ""
    constraint = getattr(sp, constraint_kind) if constraint_kind else ""
    if len(constraint) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(
            f"sampling_params.{constraint_kind} has {len(constraint)} characters; the most is {MAX_CONSTRAINT_CHARS}"
        )
    if constraint_kind and not constraint.strip():
        raise InvalidRequest(f"sampling_params.{constraint_kind} is empty")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=sp.min_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        max_new_tokens=max_new_tokens,
        min_new_tokens=sp.min_new_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        seed=seed,
        logit_bias=logit_bias,
        stop=[x for x in sp.stop if x],
        no_stop_trim=sp.no_stop_trim,
        constraint_kind=constraint_kind,
        constraint=constraint,
    )


def reject_unsupported(request) -> None:
    """Fields this server cannot honour: an error rather than a silently different answer."""
    if request.lora_id:
        raise InvalidRequest(
            f"LoRA adapter {request.lora_id[:64]!r} is not loaded (this server serves the base model only)", "NOT_FOUND"
        )
    unsupported = {
        "mm_inputs": request.HasField("mm_inputs"),
        "input_embeds": len(request.input_embeds) > 0,
        "return_hidden_states": request.return_hidden_states,
        "custom_logit_processor": bool(request.custom_logit_processor),
    }
    for name, present in unsupported.items():
        if present:
            raise InvalidRequest(f"{name} is not supported by this server (text-only, one engine)")


def disaggregation_leg(request, model_info: ModelInfo) -> DisaggParams | None:
    """The request's PD leg: required in prefill and decode mode, refused in mode null."""
    mode = model_info.disaggregation_mode
    present = request.HasField("disaggregated_params")
    if mode == "null":
        if present:
            raise InvalidRequest(
                "disaggregated_params sent to a daemon without prefill/decode disaggregation "
                "(it runs --disaggregation-mode null)"
            )
        return None
    if not present:
        raise InvalidRequest(
            f"this daemon runs --disaggregation-mode {mode}: requests must carry disaggregated_params "
            "(send them through a router in PD mode, smg launch --pd-disaggregation)"
        )
    if request.sampling_params.n > 1:
        raise InvalidRequest("sampling_params.n > 1 is not supported with prefill/decode disaggregation")
    p = request.disaggregated_params
    host = p.bootstrap_host
    if not host or len(host) > 255 or not host.isprintable():
        raise InvalidRequest("disaggregated_params.bootstrap_host must be 1 to 255 printable characters")
    if not 1 <= p.bootstrap_port <= 65535:
        raise InvalidRequest(f"disaggregated_params.bootstrap_port must be 1..65535, got {p.bootstrap_port}")
    if p.bootstrap_room < 0:
        raise InvalidRequest(f"disaggregated_params.bootstrap_room must be >= 0, got {p.bootstrap_room}")
    return DisaggParams(host, p.bootstrap_port, p.bootstrap_room)


def check_request_id(rid: str) -> None:
    """InvalidRequest unless ``rid`` is a usable id (checked first: the message never echoes it)."""
    if not rid:
        raise InvalidRequest("request_id is empty")
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters")


def to_add_request(request, model_info: ModelInfo) -> AddRequest:
    """Validate a GenerateRequest against the model and build the scheduler message."""
    check_request_id(request.request_id)
    reject_unsupported(request)
    disagg = disaggregation_leg(request, model_info)
    n = request.sampling_params.n
    if n > MAX_N:
        raise InvalidRequest(f"sampling_params.n must be at most {MAX_N}, got {n}")
    queued, running = model_info.max_queued_requests, model_info.max_running_requests
    if n > running + queued:  # its sequences queue one by one: never all admitted
        raise InvalidRequest(
            f"sampling_params.n={n} sequences can never be queued together: at most {running} run "
            f"and {queued} wait (--max-running-requests, --max-queued-requests)"
        )
    num_ids = len(request.tokenized.input_ids)
    if not num_ids:
        raise InvalidRequest("the prompt is empty (tokenized.input_ids has 0 tokens)")
    limit = model_info.max_context_length
    if num_ids >= limit:  # before copying or scanning it; the scheduler's admission checks the rest
        raise InvalidRequest(f"the prompt has {num_ids} tokens; the context limit is {limit} (prompt must be shorter)")
    # Each of the n sequences is its own copy of the prompt in the scheduler's queue. A call
    # may queue at most what the KV cache holds (what the engine could ever hold of it at once;
    # one prompt up to the context limit always, even beside a smaller cache).
    most = max(model_info.max_total_num_tokens, limit - 1)
    if max(n, 1) * num_ids > most:
        raise InvalidRequest(
            f"sampling_params.n={n} copies of a {num_ids}-token prompt are {n * num_ids} tokens; "
            f"one call may queue at most {most} (the KV cache's capacity)"
        )
    input_ids = list(request.tokenized.input_ids)
    vocab = model_info.vocab_size
    bad = out_of_vocabulary(input_ids, vocab)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab})")
    sampling = normalize_sampling(request.sampling_params, vocab)
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{len(sampling.stop)} stop strings; the most is {MAX_STOP_STRINGS}")
    longest = max(sampling.stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise InvalidRequest(f"a stop string has {len(longest)} characters; the most is {MAX_STOP_CHARS}")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"{len(sampling.stop_token_ids)} stop token ids; the most is {MAX_STOP_TOKEN_IDS}")
    bad = out_of_vocabulary(sampling.stop_token_ids, vocab)
    if bad is not None:
        raise InvalidRequest(f"stop token id {bad} is outside the vocabulary (size {vocab})")
    if request.return_logprob:
        if request.top_logprobs_num < 0:
            raise InvalidRequest(f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}")
        max_logprobs = model_info.max_logprobs
        for name, count in (
            ("top_logprobs_num", request.top_logprobs_num),
            ("token_ids_logprob", len(request.token_ids_logprob)),
        ):
            if count > max_logprobs:
                raise InvalidRequest(
                    f"{name} asks for {count} logprobs per token; the most is {max_logprobs} (--max-logprobs)"
                )
        bad = next((t for t in request.token_ids_logprob if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token_ids_logprob id {bad} is outside the vocabulary (size {vocab})")
        if request.logprob_start_len < -1:
            raise InvalidRequest(f"logprob_start_len must be >= 0 or -1 (none), got {request.logprob_start_len}")
        sampling.return_logprob = True
        sampling.top_logprobs_num = min(request.top_logprobs_num, vocab)
        sampling.token_ids_logprob = list(request.token_ids_logprob)
        sampling.logprob_start_len = request.logprob_start_len
    # The other length limits (max_new_tokens, KV capacity) are the scheduler's admission's.
    salt = ""
    sp = request.sampling_params
    if sp.HasField("custom_params") and "cache_salt" in sp.custom_params.fields:
        salt = sp.custom_params.fields["cache_salt"].string_value
    return AddRequest(request.request_id, input_ids, sampling, cache_salt=salt, disagg=disagg)


def to_embed_request(request, model_info: ModelInfo) -> AddRequest:
    """Validate an EmbedRequest against the embedding model and build the scheduler message
    (prefill only: the answer is the pooled vector)."""
    check_request_id(request.request_id)
    unsupported = {
        "mm_inputs": request.HasField("mm_inputs"),
        "token_type_ids": len(request.token_type_ids) > 0,
        "is_cross_encoder": request.is_cross_encoder,
        "texts": len(request.texts) > 0,
    }
    for name, present in unsupported.items():
        if present:
            raise InvalidRequest(f"{name} is not supported by this server (one tokenized text per Embed)")
    num_ids = len(request.tokenized.input_ids)
    if not num_ids:
        raise InvalidRequest("the input is empty (tokenized.input_ids has 0 tokens)")
    limit = model_info.max_context_length
    if num_ids > limit:
        raise InvalidRequest(f"the input has {num_ids} tokens; the context limit is {limit}")
    if num_ids > model_info.max_total_num_tokens:
        raise InvalidRequest(
            f"the input has {num_ids} tokens; the KV cache holds {model_info.max_total_num_tokens} tokens in all"
        )
    input_ids = list(request.tokenized.input_ids)
    bad = out_of_vocabulary(input_ids, model_info.vocab_size)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {model_info.vocab_size})")
    return AddRequest(request.request_id, input_ids, SamplingParams(max_new_tokens=0), embed=True)
