"""Every refusal of servicer.request_conversion, one request each: a value the daemon cannot
serve as sent is INVALID_ARGUMENT with a message naming the field, before anything reaches
the scheduler (test_request_conversion.py has the length, vocabulary and n rules)."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import sample_model_info
from servicer.request_conversion import InvalidRequest, to_add_request

INFO = sample_model_info(vocab_size=1000, max_context_length=64, max_running_requests=4, max_logprobs=20)


def request(rid="r", sp=None, custom=None, bias=None, **fields) -> pb.GenerateRequest:
    """A valid request (3 prompt tokens, 4 new) changed by `sp` (SamplingParams fields),
    `custom` (custom_params), `bias` (logit_bias) and GenerateRequest `fields`."""
    r = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=pb.SamplingParams(max_new_tokens=4, **(sp or {})),
        logprob_start_len=-1,
    )
    if custom:
        r.sampling_params.custom_params.update(custom)
    for token, value in (bias or {}).items():
        r.sampling_params.logit_bias[token] = value
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(r, name).extend(value)
        else:
            setattr(r, name, value)
    return r


REFUSED = {  # case: (request, what the message must say)
    "empty_request_id": (request(rid=""), "request_id is empty"),
    "negative_temperature": (request(sp=dict(temperature=-0.1)), "temperature must be >= 0"),
    "infinite_temperature": (request(sp=dict(temperature=float("inf"))), "temperature must be a finite number"),
    "nan_top_p": (request(sp=dict(top_p=float("nan"))), "top_p must be a finite number"),
    "top_p_over_1": (request(sp=dict(top_p=1.5)), "top_p must be in (0, 1]"),
    "negative_top_p": (request(sp=dict(top_p=-0.5)), "top_p must be in (0, 1]"),
    "top_k_-2": (request(sp=dict(top_k=-2)), "top_k must be -1 (off) or positive"),
    "min_p_over_1": (request(sp=dict(min_p=1.5)), "min_p must be in [0, 1]"),
    "negative_repetition_penalty": (request(sp=dict(repetition_penalty=-1.0)), "repetition_penalty must be > 0"),
    "frequency_penalty_3": (request(sp=dict(frequency_penalty=3.0)), "frequency_penalty must be in [-2, 2]"),
    "presence_penalty_-3": (request(sp=dict(presence_penalty=-3.0)), "presence_penalty must be in [-2, 2]"),
    "logit_bias_outside_vocab": (request(bias={"1000": 1.0}), "logit_bias token id 1000 is outside the vocabulary"),
    "logit_bias_nan": (request(bias={"5": float("nan")}), "logit_bias[5] is NaN"),
    "logit_bias_too_many": (
        request(bias={str(t): 1.0 for t in range(1025)}),
        "logit_bias has 1025 entries; the most is 1024",
    ),
    "too_many_stop_token_ids": (request(sp=dict(stop_token_ids=[5] * 1025)), "1025 stop token ids; the most is 1024"),
    "seed_a_string": (request(custom={"seed": "7"}), "seed must be an integer, got a string"),
    "seed_a_bool": (request(custom={"seed": True}), "seed must be an integer, got a bool"),
    "blank_regex": (request(sp=dict(regex="  ")), "sampling_params.regex is empty"),
    "blank_json_schema": (request(sp=dict(json_schema="")), "sampling_params.json_schema is empty"),
    "stop_token_id_outside_vocab": (
        request(sp=dict(stop_token_ids=[5, 1000])),
        "stop token id 1000 is outside the vocabulary (size 1000)",
    ),
    "negative_top_logprobs_num": (request(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num must be >= 0"),
    "token_ids_logprob_outside_vocab": (
        request(return_logprob=True, token_ids_logprob=[1000]),
        "token_ids_logprob id 1000 is outside the vocabulary",
    ),
    "token_ids_logprob_over_max": (
        request(return_logprob=True, token_ids_logprob=list(range(21))),
        "token_ids_logprob asks for 21 logprobs per token; the most is 20",
    ),
    "logprob_start_len_-2": (
        request(return_logprob=True, logprob_start_len=-2),
        "logprob_start_len must be >= 0 or -1",
    ),
    "input_embeds": (request(input_embeds=[0.1]), "input_embeds is not supported"),
    "custom_logit_processor": (request(custom_logit_processor="x"), "custom_logit_processor is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_a_message_naming_the_field(case):
    req, message = REFUSED[case]
    with pytest.raises(InvalidRequest) as e:
        to_add_request(req, INFO)
    assert e.value.code == "INVALID_ARGUMENT" and message in str(e.value), str(e.value)


def test_the_edges_of_each_range_are_accepted():
    """The limits themselves are valid: the refusals above are not off by one."""
    sp = dict(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        frequency_penalty=2.0,
        presence_penalty=-2.0,
        stop_token_ids=[999],
    )
    msg = to_add_request(
        request(
            sp=sp,
            bias={"999": -1e9},
            custom={"seed": -(2**63)},
            return_logprob=True,
            top_logprobs_num=20,
            token_ids_logprob=list(range(980, 1000)),
        ),
        INFO,
    )
    assert msg.sampling.logit_bias == {999: -100.0}  # clamped to OpenAI's range
    assert msg.sampling.seed == 2**63 and msg.sampling.stop_token_ids == [999]
    assert msg.sampling.top_logprobs_num == 20 and len(msg.sampling.token_ids_logprob) == 20


def test_proto3_zeros_mean_unset_and_cache_salt_is_passed_on():
    """What the router leaves unset arrives as zeros: top_p 0 is 1, top_k 0 is off,
    repetition_penalty 0 is 1; custom_params.cache_salt reaches the scheduler."""
    req = request(sp=dict(top_p=0.0, top_k=0, repetition_penalty=0.0), custom={"cache_salt": "tenant-1"})
    msg = to_add_request(req, INFO)
    assert msg.cache_salt == "tenant-1"
    s = msg.sampling
    assert (s.top_p, s.top_k, s.repetition_penalty, s.temperature) == (1.0, -1, 1.0, 0.0)
    assert to_add_request(request(), INFO).cache_salt == ""
