"""Stop strings over byte-level tokens that split a character (SmolLM2's real tokenizer):
the checker never releases a token whose bytes are not yet a whole character, matches a stop
string only once its last byte arrives, and trims at the token holding its first byte."""

from __future__ import annotations

import pytest

from scheduler.model_source import resolve_model
from scheduler.stop_strings import StopStringChecker, load_tokenizer

TEXT = "Hi 龘𝔘 there"  # 龘: 3 bytes, 𝔘: 4, each split over byte tokens (" 龘"'s first holds the space)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def ids(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    # the layout the cases below rely on: "Hi", " 龘" in 3 tokens, "𝔘" in 3, " there"
    assert len(ids) == 8 and pieces[0] == "Hi" and pieces[3] == "Hi 龘" and pieces[6] == "Hi 龘𝔘", pieces
    assert all(p.endswith("\ufffd") for p in pieces[1:3] + pieces[4:6]), pieces
    return ids


def feed(checker, ids):
    """Feed `ids` one by one up to a match: ([num_safe_tokens after each], (stop, keep) or None)."""
    safe = []
    for t in ids:
        match = checker.feed(t)
        safe.append(checker.num_safe_tokens())
        if checker.trim:  # (a trimmed match must still be able to drop the token holding its first byte)
            assert checker.num_safe_tokens() <= checker.num_decoded, "undecoded bytes released"
        if match:
            return safe, match
    return safe, None


def test_a_stop_string_of_split_bytes_matches_on_its_last_byte(tok, ids):
    safe, match = feed(StopStringChecker(tok, ["𝔘"], [1, 2]), ids)
    assert match == ("𝔘", 4) and len(safe) == 7  # found at 𝔘's last byte token; kept "Hi 龘"
    assert tok.decode(ids[:4]) == "Hi 龘"
    assert safe[:6] == [1, 1, 1, 4, 4, 4]  # " 龘"'s and then 𝔘's partial tokens held back


def test_the_trim_drops_the_whole_token_holding_the_first_byte(tok, ids):
    """A stop string starting inside a token (the space and 龘's first byte share one) is
    trimmed at that token: the space goes with it."""
    _, match = feed(StopStringChecker(tok, ["龘"], [1, 2]), ids)
    assert match == ("龘", 1) and tok.decode(ids[:1]) == "Hi"


def test_a_false_start_across_split_characters_is_released(tok, ids):
    """ "龘X" could start at 龘: its tokens wait until 𝔘 shows it does not; no match ever."""
    safe, match = feed(StopStringChecker(tok, ["龘X"], [1, 2]), ids)
    assert match is None
    assert safe == [1, 1, 1, 1, 1, 1, 7, 8]


def test_without_trimming_nothing_waits(tok, ids):
    """no_stop_trim: the stop string stays in the output, so every token goes at once, split
    characters too (as without stop strings); the match still waits for whole characters."""
    safe, match = feed(StopStringChecker(tok, ["𝔘"], [1, 2], trim=False), ids)
    assert match == ("𝔘", 4)
    assert safe == [1, 2, 3, 4, 5, 6, 7]


def test_a_stop_string_that_is_a_special_token_matches_by_id(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    hi = tok.encode("Hi there", add_special_tokens=False)
    checker = StopStringChecker(tok, ["<|im_end|>"], [1, 2], trim=True)
    matches = [checker.feed(t) for t in hi + [im_end]]
    assert matches[:-1] == [None] * len(hi) and matches[-1] == ("<|im_end|>", len(hi))  # the token is trimmed


def test_a_special_token_before_a_stop_string_is_kept(tok):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    big, paris = tok.encode(" big", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)
    checker = StopStringChecker(tok, ["Paris"], [1, 2], trim=True)
    _, match = feed(checker, big + [im_start] + paris)
    assert match == ("Paris", len(big) + 1)  # " big" and the special token stay; " Paris" goes
