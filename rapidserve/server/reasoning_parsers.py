"""Reasoning out of generated chat text (vLLM's `--reasoning-parser`): what the model thought, apart from its answer.

Both parsers read `<think>...</think>`; they differ in where the output begins:
- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the chat template ends the prompt with `<think>`, so the
  output begins inside the reasoning;
- `qwen3`: the same while thinking is on (Qwen3's default); with `chat_template_kwargs: {"enable_thinking":
  false}` the template writes an empty `<think></think>` into the prompt and the whole output is content
  (`thinks_first`). Only `false` itself turns it off, as Qwen3's template reads the variable (`is false`).
Inside the reasoning, an opening `<think>` the model writes itself at the very start (older Qwen3 templates leave
it to the model; whitespace before it goes with it) is dropped; the reasoning ends at the first `</think>`, and the
rest is content, as it came (vLLM keeps the blank line after the tag too). No `</think>` (cut short by
max_tokens): all of it is reasoning, and there is no content.

`split(text, thinking)` reads a whole answer; `ReasoningStream` reads it as it is generated, a delta at a time,
holding back only what may still become a tag (a tag may come in several pieces; nothing of a tag reaches either
field), and its pieces concatenate to exactly what `split` gives the whole text, however the text was cut.
`plan_reasoning` decides what one chat request gets; `tag_problem` is the start-up check of the tokenizer.
Pure string handling; no model, no server.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from rapidserve.server_config import REASONING_PARSERS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningPlan:
    """What a chat request's answer is split into: `thinking`: the output begins inside the reasoning (else it is
    all content); `include`: the reasoning is sent (vLLM's `include_reasoning`; false leaves it out)."""

    parser: str
    thinking: bool
    include: bool = True


@dataclass(frozen=True)
class Split:
    """An answer, or a piece of one: its reasoning and its content (None: none)."""

    reasoning: str | None
    content: str | None


def thinks_first(parser: str, template_kwargs: Mapping[str, Any]) -> bool:
    """Whether the output of a chat rendered with `template_kwargs` begins inside the reasoning."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {parser!r}; use one of {', '.join(REASONING_PARSERS)}")
    return parser == "deepseek_r1" or template_kwargs.get("enable_thinking") is not False


def plan_reasoning(parser: str | None, template_kwargs: Mapping[str, Any],
                   include: bool | None = None) -> ReasoningPlan | None:
    """The plan of a chat request on a server with reasoning parser `parser` (None: no plan, nothing is split)."""
    if parser is None:
        return None
    return ReasoningPlan(parser, thinks_first(parser, template_kwargs), include is not False)


def _after_open(text: str) -> int:
    """Where the reasoning starts in an output beginning inside it: past a leading `<think>` (and the whitespace
    before it), else 0."""
    body = text.lstrip()
    return len(text) - len(body) + len(THINK_OPEN) if body.startswith(THINK_OPEN) else 0


def split(text: str, thinking: bool) -> Split:
    """A whole answer's reasoning and content (see the module docstring). Not thinking: all content. Thinking:
    reasoning (a string, maybe empty) up to `</think>`, the content after it (None when nothing follows)."""
    if not thinking:
        return Split(None, text)
    body = text[_after_open(text):]
    reasoning, tag, content = body.partition(THINK_CLOSE)
    return Split(reasoning, content if tag and content else None)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """One answer's reasoning and content as it is generated: `feed` each new piece of text, `finish` at its end.

    Phases: "open" (only while thinking, before any reasoning: whitespace and a prefix of `<think>` are held), then
    "reasoning" (text held only while it may be the start of `</think>`), then "content" (passed straight on).
    Not thinking: "content" from the start."""

    def __init__(self, thinking: bool) -> None:
        self._phase = "open" if thinking else "content"
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the answer is still in its reasoning (no `</think>` yet, and it began thinking)."""
        return self._phase != "content"

    def feed(self, text: str) -> Split:
        """The reasoning and content `text` adds (None where it adds none)."""
        if self._phase == "content":
            return Split(None, text or None)
        self._held += text
        if self._phase == "open":
            body = self._held.lstrip()
            if THINK_OPEN.startswith(body) and len(body) < len(THINK_OPEN):
                return Split(None, None)  # whitespace and a piece of <think>, so far
            self._held = self._held[_after_open(self._held):]
            self._phase = "reasoning"
        reasoning, tag, content = self._held.partition(THINK_CLOSE)
        if tag:
            self._phase, self._held = "content", ""
            return Split(reasoning or None, content or None)
        keep = partial_suffix(self._held, THINK_CLOSE)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return Split(out or None, None)

    def finish(self) -> Split:
        """What is still held once the answer has ended: text that turned out to be no tag, reasoning."""
        out, self._held = self._held, ""
        return Split(out or None, None)


def tag_problem(vocab: Container[str]) -> str | None:
    """Why a tokenizer with `vocab` (its tokens) cannot serve a reasoning parser, or None: the think tags must be
    tokens of their own, as in the models these parsers are for (vLLM refuses to start without them too)."""
    missing = [t for t in (THINK_OPEN, THINK_CLOSE) if t not in vocab]
    if not missing:
        return None
    return (f"the model's tokenizer has no {' or '.join(missing)} token, so this model does not write its reasoning "
            "in think tags; drop --reasoning-parser (deepseek_r1 and qwen3 are for DeepSeek-R1, QwQ and Qwen3 models)")
