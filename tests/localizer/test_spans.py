"""Span windows: each token's text as it reads in the sentence (leading spaces kept)."""
from __future__ import annotations

from gradloc.localizer.spans import _token_texts

# SentencePiece-like: "▁" is a leading space, which decoding drops at the start of the text
VOCAB = {1: "▁the", 2: "▁bell", 3: "s", 4: "▁rings", 5: "."}


def _decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids).replace("▁", " ").lstrip(" ")


def test_window_tokens_keep_their_leading_spaces_and_join_to_the_decoded_text():
    ids = [1, 2, 3, 4, 5]
    assert _token_texts(_decode, ids, 1, 5) == (" bell", "s", " rings", ".")
    assert "".join(_token_texts(_decode, ids, 0, 5)) == _decode(ids)  # position 0 has no predecessor
    assert _decode([2]) == "bell"  # what decoding alone would have shown


def test_a_failing_decode_gives_the_token_alone_or_nothing():
    calls = []

    def flaky(ids: list[int]) -> str:
        calls.append(len(ids))
        if len(ids) == 2:
            raise RuntimeError("tokenizer error")
        return _decode(ids)

    assert _token_texts(flaky, [1, 2, 3], 1, 3) == ("bell", "s")  # pairs fail: alone
    assert max(calls) == 2 and len(calls) == 3 + 2  # one decode alone per token, one pair per token
