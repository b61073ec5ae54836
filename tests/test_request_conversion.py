"""Request validation at the servicer edge (servicer.request_conversion), on smg-grpc-proto
messages: what is refused before anything reaches the scheduler."""

from __future__ import annotations

import msgspec
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import sample_model_info
from servicer.request_conversion import InvalidRequest, to_add_request

INFO = sample_model_info(vocab_size=1000, max_context_length=64, max_running_requests=4, max_logprobs=20)


def request(input_ids, n=1, **sp):
    return pb.GenerateRequest(
        request_id="r",
        tokenized=pb.TokenizedInput(input_ids=input_ids),
        sampling_params=pb.SamplingParams(**{"max_new_tokens": 4, **sp}, n=n),
        logprob_start_len=-1,
    )


def test_a_good_request_becomes_an_add_request():
    msg = to_add_request(request([1, 2, 3]), INFO)
    assert msg.request_id == "r" and msg.input_ids == [1, 2, 3] and msg.sampling.max_new_tokens == 4


def test_a_prompt_over_the_context_is_refused_before_its_tokens_are_scanned():
    with pytest.raises(InvalidRequest) as e:
        to_add_request(request([5000] * 64), INFO)  # out of vocabulary too: the length answers first
    assert e.value.code == "INVALID_ARGUMENT" and "context limit is 64" in str(e.value)


def test_an_out_of_vocabulary_token_is_named():
    with pytest.raises(InvalidRequest) as e:
        to_add_request(request([1, 1000, 2]), INFO)
    assert "token id 1000 is outside the vocabulary (size 1000)" in str(e.value)


@pytest.mark.parametrize("queued,n,refused", [(60, 64, False), (2, 6, False), (2, 7, True), (0, 5, True)])
def test_n_beyond_what_can_ever_queue_together_is_invalid(queued, n, refused):
    """With --max-queued-requests, n sequences queue one by one: more than running + queued
    would always be RESOURCE_EXHAUSTED (retried by the router forever): INVALID_ARGUMENT."""
    info = msgspec.structs.replace(INFO, max_queued_requests=queued)
    if not refused:
        to_add_request(request([1, 2], n=n), info)
        return
    with pytest.raises(InvalidRequest) as e:
        to_add_request(request([1, 2], n=n), info)
    assert e.value.code == "INVALID_ARGUMENT" and "--max-queued-requests" in str(e.value), e.value


def test_max_new_tokens_0_is_a_prompt_only_request():
    assert to_add_request(request([1, 2], max_new_tokens=0), INFO).sampling.max_new_tokens == 0


def test_min_new_tokens_over_max_new_tokens_is_invalid():
    with pytest.raises(InvalidRequest) as e:
        to_add_request(request([1, 2], min_new_tokens=5), INFO)  # max_new_tokens 4
    assert "min_new_tokens (5) must be at most max_new_tokens (4)" in str(e.value)


PD_INFO = sample_model_info(disaggregation_mode="decode", disaggregation_bootstrap_port=8998)


def _pd_request(n=1, **params):
    req = pb.GenerateRequest(
        request_id="pd", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]), sampling_params=pb.SamplingParams(n=n)
    )
    req.disaggregated_params.CopyFrom(
        pb.DisaggregatedParams(**{"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7, **params})
    )
    return req


def test_a_pd_leg_carries_its_bootstrap_params():
    msg = to_add_request(_pd_request(), PD_INFO)
    assert (msg.disagg.bootstrap_host, msg.disagg.bootstrap_port, msg.disagg.bootstrap_room) == ("10.0.0.1", 8998, 7)


@pytest.mark.parametrize(
    "request_, info, words",
    [
        (_pd_request(), INFO, "--disaggregation-mode null"),  # a plain daemon
        (pb.GenerateRequest(request_id="x", tokenized=pb.TokenizedInput(input_ids=[5])), PD_INFO, "must carry"),
        (_pd_request(n=2), PD_INFO, "n > 1"),
        (_pd_request(bootstrap_host=""), PD_INFO, "bootstrap_host"),
        (_pd_request(bootstrap_port=0), PD_INFO, "bootstrap_port"),
        (_pd_request(bootstrap_room=-1), PD_INFO, "bootstrap_room"),
    ],
)
def test_pd_legs_that_cannot_run_are_invalid(request_, info, words):
    with pytest.raises(InvalidRequest) as e:
        to_add_request(request_, info)
    assert e.value.code == "INVALID_ARGUMENT" and words in str(e.value)
