"""Token ids -> text: streaming detokenization with stop strings; per-token text, bytes, logprobs.

`IncrementalDetokenizer` turns generated token ids into text deltas one token at a time. It decodes
only a small window (vLLM's / TGI's prefix offset + read offset technique): `prefix` is text already
returned, decoded again only so the new token is rendered in context (leading spaces of
sentencepiece tokens, multi-byte characters split across tokens). A delta whose decoded text ends in
U+FFFD (an incomplete UTF-8 sequence) is held back until the next tokens complete the character.

Stop strings are matched on the detokenized text: the earliest match ends the output before the stop
string (none that ends within the text of the first `min_tokens` tokens, as in vLLM:
`stop_rules.first_stop_string`), and text that may still become the start of a stop string is held back
until it cannot. With `include_stop` (vLLM's `include_stop_str_in_output`) the output ends after the stop
string instead, and nothing is held back: text is released as soon as it is complete, and a match is
searched over the new text and the released tail a stop string could straddle.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from rapidserve.stop_rules import first_stop_string
from rapidserve.tokenizer import Tokenizer

# How many prompt tokens give the first output token its context (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


class IncrementalDetokenizer:
    """Text deltas of one output sequence.

    `add(token_id)` returns the newly final text ("" if nothing is final yet); `flush()` at the end
    returns what was held back. Without stop strings the deltas joined equal
    `tokenizer.decode(output_ids)` (for byte-level BPE tokenizers; sentencepiece ones keep the leading
    space the prompt context gives the first token, as vLLM does). Once a stop string matched,
    `stopped` is True, `stop_str` is the string that matched, and later calls return "". Without a
    tokenizer (None: presets, served as token ids only) every delta is "".
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._floor = 0  # characters of text the first min_tokens tokens made: no stop string may end within it
        self.stopped = False
        self.stop_str: str | None = None
        self.output_ids: list[int] = []
        self.text = ""  # everything returned so far
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""  # final (complete) text held back because it may start a stop string
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        prefix = self._decode(context)
        if prefix.endswith(_REPLACEMENT):  # the prompt ends inside a character: give no context
            context, prefix = [], ""
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = prefix

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids or self.tokenizer is None:  # no tokenizer (presets): token ids only, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _next_text(self, final: bool) -> str:
        """Text of the tokens after the read offset, if complete (or `final`); advances the offsets."""
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(self._prefix_text) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return delta

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text that became final."""
        if self.stopped:
            return ""
        self.output_ids.append(token_id)
        self._ids.append(token_id)
        delta = self._next_text(final=False)
        if len(self.output_ids) <= self.min_tokens:
            self._floor = len(self.text) + len(self._pending) + len(delta)
        return self._release(delta, final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        """`add` each token in turn (stopping at a stop string); return the joined deltas."""
        out = []
        for t in token_ids:
            if self.stopped:
                break
            out.append(self.add(t))
        return "".join(out)

    def flush(self) -> str:
        """At the end of the sequence: the text still held back ("" after a stop string matched)."""
        if self.stopped:
            return ""
        return self._release(self._next_text(final=True), final=True)

    def _release(self, delta: str, final: bool) -> str:
        if not self.stop:
            self.text += delta
            return delta
        if self.include_stop:
            return self._release_through_stop(delta)
        if not delta and not final:
            return ""
        pending = self._pending + delta
        # Every match starts inside `pending`: earlier text was released only once it could not
        # begin a stop string.
        hit = first_stop_string(pending, self.stop, self._floor - len(self.text))
        if hit is not None:
            cut, self.stop_str = hit
            self.stopped = True
            out, self._pending = pending[:cut], ""
        elif final:
            out, self._pending = pending, ""
        else:
            hold = _longest_stop_prefix_suffix(pending, self.stop, self._max_hold)
            out, self._pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self.text += out
        return out


    def _release_through_stop(self, delta: str) -> str:
        """`include_stop`: release `delta`, cut just after the earliest stop string that ends in it."""
        tail = self.text[len(self.text) - self._max_hold:] if self._max_hold else ""
        window = tail + delta  # released text was searched already: every match here ends inside `delta`
        hit = first_stop_string(window, self.stop, self._floor - (len(self.text) - len(tail)))
        out = delta
        if hit is not None:
            start, self.stop_str = hit
            self.stopped = True
            out = window[len(tail):start + len(self.stop_str)]
        self.text += out
        return out


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`."""
    for n in range(min(max_len, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


# ---------------------------------------------------------------- token strings and logprobs shapes


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's char -> byte table (the inverse of its bytes_to_unicode)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER: Mapping[str, int] = MappingProxyType(_byte_decoder())


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The token alone as a string (U+FFFD for part of a character), as vLLM shows it in logprobs."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The raw UTF-8 bytes a token stands for (part of a character for some byte-level tokens)."""
    text = token_text(tokenizer, token_id)
    if _REPLACEMENT not in text:
        return text.encode()
    piece = tokenizer.hf.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte fallback
        if m:
            return bytes([int(m.group(1), 16)])
        if all(c in _BYTE_DECODER for c in piece):
            raw = bytes(_BYTE_DECODER[c] for c in piece)
            if raw.decode(errors="replace") == text:
                return raw
    return text.encode()


TopLogprobs = Sequence[tuple[int, float]] | None


def _lp(v: float | None) -> float:
    return MIN_LOGPROB if v is None or math.isnan(v) or v < MIN_LOGPROB else float(v)


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        top_logprobs: Sequence[TopLogprobs], text_offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs: {"tokens", "token_logprobs", "top_logprobs": [{token: lp}], "text_offset"}.

    The three sequences run in parallel, one entry per generated token. `text_offset` is where the
    first token starts in the choice's text (streams: the length of the text sent before it)."""
    strs = [token_text(tokenizer, t) for t in token_ids]
    offsets = list(itertools.accumulate((len(s) for s in strs[:-1]), initial=text_offset))[:len(strs)]
    return {"tokens": strs, "token_logprobs": [_lp(lp) for lp in logprobs],
            "top_logprobs": [{token_text(tokenizer, i): _lp(lp) for i, lp in top or ()} for top in top_logprobs],
            "text_offset": offsets}


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token_id), "logprob": _lp(logprob),
            "bytes": list(token_bytes(tokenizer, token_id))}


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float | None],
                  top_logprobs: Sequence[TopLogprobs]) -> dict[str, Any]:
    """Chat's logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{same 3 keys}]}]}."""
    content = []
    for t, lp, top in zip(token_ids, logprobs, top_logprobs, strict=True):
        entry = _chat_entry(tokenizer, t, lp)
        entry["top_logprobs"] = [_chat_entry(tokenizer, i, v) for i, v in top or ()]
        content.append(entry)
    return {"content": content}
