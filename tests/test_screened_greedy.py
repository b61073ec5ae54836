"""The screened greedy LM head (kernels/screened_greedy.py): the argmax of fp32 logits from a
bf16 copy of the weight and the exact logits of the tokens that can win, against the fp64
reference and the full fp32 head, ties and near-ties included; and the sampler taking it
for plain greedy rows only."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels, linear, sampling
from kernels.screened_greedy import ScreenedGreedyHead
from scheduler.messages import SamplingParams
from scheduler.request import Request
from scheduler.sampling_batch import BatchSampler


def head_or_skip(weight):
    head = ScreenedGreedyHead.build(weight)
    if head is None:
        pytest.skip("no bf16 instructions or no C compiler: the full fp32 head is used")
    return head


def reference(hidden, weight):
    return (hidden.double() @ weight.double().t()).argmax(dim=1)


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("vocab,hidden_size", [(4096, 64), (1000, 40), (8200, 96)])
def test_matches_the_full_head(rows, vocab, hidden_size):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.05
    head = head_or_skip(weight)
    x = torch.randn(rows, hidden_size, generator=g) * 3
    tokens = head(x)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, reference(x, weight))
    assert torch.equal(tokens, sampling.argmax_rows(linear.linear(x, weight)))


def test_near_ties_are_decided_by_the_fp32_logits():
    """Tokens whose bf16 logits equal the winner's but whose fp32 logits are just above it, and
    an exact tie (the first index wins, as argmax_rows picks)."""
    g = torch.Generator().manual_seed(1)
    vocab, hidden_size = 2048, 64
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.05
    x = torch.randn(4, hidden_size, generator=g)
    best = reference(x, weight).tolist()
    for r in range(4):  # a copy of row r's winner 2e-6 larger: the same bf16 weights
        weight[1000 + r] = weight[best[r]] * (1 + 2e-6)
        assert torch.equal(weight[1000 + r].bfloat16(), weight[best[r]].bfloat16())
    weight[1500] = weight[1000]  # row 0's new winner again, at a later index: an exact tie
    expected = [1000 + best.index(b) for b in best]  # (rows sharing a winner share its copy)
    assert reference(x, weight).tolist() == expected
    head = head_or_skip(weight)
    assert head(x).tolist() == expected
    assert torch.equal(head(x), sampling.argmax_rows(linear.linear(x, weight)))


def test_hidden_rows_a_stride_apart_and_declines():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(512, 64, generator=g)
    head = head_or_skip(weight)
    x = torch.randn(8, 128, generator=g)[:, ::2]  # not contiguous: copied
    assert torch.equal(head(x), reference(x, weight))
    assert head(x.bfloat16()) is None
    assert ScreenedGreedyHead.build(weight.bfloat16()) is None
    assert ScreenedGreedyHead.build(weight, bias=torch.zeros(512)) is None
    ones = torch.ones(8)
    approx = linear.linear(x.bfloat16(), weight.bfloat16())
    assert cpu_kernels.screened_argmax(approx, ones, ones, head.bounds, x.contiguous(), weight) is not None
    assert cpu_kernels.screened_argmax(approx.float(), ones, ones, head.bounds, x.contiguous(), weight) is None
    assert cpu_kernels.screened_argmax(approx[:2], ones[:2], ones[:2], head.bounds, x.contiguous(), weight) is None


class CountingHead:
    def __init__(self, weight):
        self.weight, self.calls = weight, 0

    def __call__(self, hidden):
        self.calls += 1
        return hidden @ self.weight.t()


@pytest.mark.parametrize("greedy", [True, False])
def test_sampler_takes_it_for_plain_greedy_rows_only(greedy):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(512, 64, generator=g)
    screened = head_or_skip(weight)
    full = CountingHead(weight)
    s = BatchSampler(full, torch.device("cpu"), torch.Generator().manual_seed(0), 512, greedy_head=screened)
    hidden = torch.randn(3, 64, generator=g)
    sp = dict(temperature=0.0) if greedy else dict(temperature=1.0, seed=5)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4, **sp), 4, frozenset({2})) for i in range(3)]
    tokens, _ = s.run([], hidden, [0, 1, 2], reqs)
    assert full.calls == (0 if greedy else 1)
    if greedy:
        assert torch.equal(tokens, reference(hidden, weight))
    logprob_req = Request(
        "lp",
        [1, 2, 3],
        SamplingParams(max_new_tokens=4, temperature=0.0, return_logprob=True, top_logprobs_num=2),
        4,
        frozenset(),
    )
    s.run([], hidden[:1], [0], [logprob_req])  # logprobs need the whole head
    assert full.calls == (1 if greedy else 2)
