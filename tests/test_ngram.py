"""The n-gram drafter alone: what it proposes from a request's own tokens."""

from scheduler.messages import SamplingParams
from scheduler.ngram import NgramDrafter
from scheduler.request import Request


def request(tokens, **sampling):
    return Request("r", tokens, SamplingParams(**{"temperature": 0.0, **sampling}), 100, frozenset())


def test_the_longest_suffix_match_at_its_latest_occurrence_wins():
    drafter = NgramDrafter(max_draft_tokens=3)
    # suffix [7, 8]: after its first occurrence 1, 2; after its latest (as [5, 7, 8]) 9, 9
    req = request([7, 8, 1, 2, 5, 7, 8, 9, 9, 4, 5, 7, 8])
    assert drafter.propose(req, limit=10) == [9, 9, 4]  # the 3-gram [5, 7, 8], latest occurrence
    assert drafter.propose(req, limit=2) == [9, 9]


def test_no_draft_without_an_earlier_occurrence_of_two_tokens():
    drafter = NgramDrafter(max_draft_tokens=3)
    assert drafter.propose(request([1, 2, 3, 4, 5]), limit=3) == []
    assert drafter.propose(request([5, 1, 2, 3, 5]), limit=3) == []  # one token repeats: too weak a hint
    assert drafter.propose(request([1, 2, 3, 1, 2]), limit=0) == []


def test_the_index_follows_appended_tokens():
    drafter = NgramDrafter(max_draft_tokens=4)
    req = request([1, 2, 3, 4])
    assert drafter.propose(req, limit=4) == []
    req.token_ids += [1, 2]  # (as outputs are appended)
    assert drafter.propose(req, limit=4) == [3, 4, 1, 2]  # runs into the sequence's own end
    req.token_ids += [3, 9, 1, 2]
    assert drafter.propose(req, limit=4) == [3, 9, 1, 2]  # the latest occurrence now


def test_who_may_speculate():
    assert NgramDrafter.eligible(request([1, 2]))
    assert NgramDrafter.eligible(request([1, 2], temperature=0.7, top_p=0.9, logit_bias={5: 1.0}))
    assert not NgramDrafter.eligible(request([1, 2], repetition_penalty=1.2))
    assert not NgramDrafter.eligible(request([1, 2], temperature=0.7, seed=3))
    assert not NgramDrafter.eligible(request([1, 2], return_logprob=True))
    assert not NgramDrafter.eligible(request([1, 2], min_new_tokens=4))


def test_at_many_rows_only_requests_that_keep_their_drafts_draft():
    drafter = NgramDrafter(max_draft_tokens=3, doubling_rows=32)
    req = request([1, 2, 3, 1, 2])
    assert drafter.pays(req, rows=64)  # nothing verified yet: optimistic
    drafter.propose(req, limit=3)
    drafter.record(req, drafted=3, kept=1)  # kept share 0.7 + 0.3/3 = 0.8
    assert drafter.pays(req, rows=64)  # 64 / (64 + 32) = 0.67
    drafter.record(req, drafted=3, kept=0)  # 0.56
    assert not drafter.pays(req, rows=64) and drafter.pays(req, rows=32) and drafter.pays(req, rows=1)
    assert NgramDrafter(max_draft_tokens=3).pays(req, rows=256)  # no cost model: always
