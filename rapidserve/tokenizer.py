"""A thin wrapper over a transformers tokenizer: text <-> ids, chat prompts, stop tokens; chat templates
given by hand (`load_chat_template`: vLLM's `--chat-template`, a file or the template itself) and their
syntax check (`check_chat_template`). Torch-free at import (the loader is imported where a tokenizer is
loaded), so that `rapidserve serve` reads and checks `--chat-template` before it binds its port."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

if TYPE_CHECKING:
    from rapidserve.loader import ModelSource

JINJA_CHARS = "{}\n"  # a --chat-template value with none of these is a file name, never a template
# apply_chat_template's own parameters (and what it passes the template itself), never template variables:
# a chat_template_kwargs key among them would change what is rendered, not fill a variable
RENDERER_OWNS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
                           "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                           "tokenizer_kwargs", "sanitize_control_tokens", "add_generation_prompt",
                           "continue_final_message"})


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or does not parse; the message says where and why."""


def load_chat_template(value: str, what: str = "--chat-template") -> str:
    """The chat template `value` names, as vLLM reads its `--chat-template`: the text of the file at that
    path, else (when the value holds a Jinja character: a brace or a newline) the value itself, its
    backslash escapes (`\\n`) decoded. A value that looks like a path but cannot be read, and a template
    that does not parse, raise ChatTemplateError naming `what`."""
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        if not any(c in value for c in JINJA_CHARS):
            raise ChatTemplateError(f"{what} {value!r} looks like a file path but cannot be read ({e}); give a "
                                    "readable Jinja file, or the template itself") from None
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    check_chat_template(text, what)
    return text


def check_chat_template(text: str, what: str = "chat_template") -> None:
    """Raise ChatTemplateError naming `what` when `text` is not a Jinja template transformers can compile
    (the same compiler `apply_chat_template` uses, with its `{% generation %}` tag and loop controls)."""
    if not text.strip():
        raise ChatTemplateError(f"{what} is empty: give a Jinja chat template")
    try:
        _compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{what} does not parse: {e.message} (line {e.lineno} of the template)") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{what} does not parse: {e}") from None


def _compile_template(text: str) -> None:
    try:  # transformers' own compiler (private, so looked up each time; the plain parse below if it moved)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)


class Tokenizer:
    """Encode/decode and chat-template rendering for one model.

    `eos_token_ids` is the union of the tokenizer's eos token and the model config's eos ids (e.g.
    SmolLM2's `<|im_end|>`, id 2), the set generation stops on.
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None) -> None:
        self.hf = hf_tokenizer
        ids: list[int] = [int(i) for i in eos_token_ids]
        tok_eos = getattr(hf_tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in ids:
            ids.append(tok_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        own = getattr(hf_tokenizer, "chat_template", None)
        self.chat_template: str | None = own if isinstance(own, str) and own else chat_template

    @classmethod
    def from_source(cls, source: ModelSource, chat_template: str | None = None) -> Tokenizer | None:
        """The model's tokenizer, or None when it has none (presets). `chat_template`: a template used instead
        of the model's (`--chat-template`)."""
        from rapidserve.loader import load_hf_tokenizer  # (torch: not at this module's import)

        tok = load_hf_tokenizer(source)
        if tok is None:
            return None
        out = cls(tok, source.config.eos_token_ids, source.chat_template)
        if chat_template is not None:
            out.chat_template = chat_template
        return out

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        bos = getattr(self.hf, "bos_token_id", None)
        return bos if isinstance(bos, int) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, documents: Sequence[Mapping[str, str]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None) -> str:
        """The prompt text for `messages`, by default ending with the assistant's turn header.

        `tools` (OpenAI's `{"type": "function", "function": {...}}` dicts) and `documents` go to the
        template as HF `apply_chat_template(tools=..., documents=...)` passes them; a template that does
        not read them (SmolLM2's) leaves them out, as it does in transformers and vLLM.
        `add_generation_prompt`: end with the assistant's turn header; `continue_final_message`: end inside
        the last message instead, for the model to go on with it (not both). `template_kwargs`: more
        variables of the template (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`).
        `chat_template`: this template instead of the tokenizer's."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; send a plain prompt "
                             "(the completions endpoint) instead of chat messages")
        text = self.hf.apply_chat_template([dict(m) for m in messages], chat_template=template,
                                           tools=[dict(t) for t in tools] if tools else None,
                                           documents=[dict(d) for d in documents] if documents else None,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tokenize=False,
                                           **dict(template_kwargs or {}))
        return str(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None, *, add_special_tokens: bool = False,
                            **render: Any) -> list[int]:
        """Token ids of the chat prompt (`render_chat`'s keywords in `render`).

        The template already writes any BOS token, so the text is encoded without adding special
        tokens, as transformers does with tokenize=True (vLLM's chat `add_special_tokens`, default false).
        """
        return self.encode(self.render_chat(messages, tools, **render), add_special_tokens=add_special_tokens)
