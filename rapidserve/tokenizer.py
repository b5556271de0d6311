"""A thin wrapper over a transformers tokenizer: text <-> ids, chat prompts, stop tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.loader import ModelSource, load_hf_tokenizer


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
    def from_source(cls, source: ModelSource) -> Tokenizer | None:
        """The model's tokenizer, or None when it has none (presets)."""
        tok = load_hf_tokenizer(source)
        if tok is None:
            return None
        return cls(tok, source.config.eos_token_ids, source.chat_template)

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
                    tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The prompt text for `messages`, ending with the assistant's turn header (unless not
        `add_generation_prompt`; with `continue_final_message` the last message is left open instead).

        `tools` (OpenAI's `{"type": "function", "function": {...}}` dicts) go to the template as HF
        `apply_chat_template(tools=...)` passes them; a template that does not read them (SmolLM2's)
        leaves them out, as it does in transformers and vLLM."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt "
                             "(the completions endpoint) instead of chat messages")
        more = {"continue_final_message": True} if continue_final_message else {}
        text = self.hf.apply_chat_template([dict(m) for m in messages], chat_template=self.chat_template,
                                           tools=[dict(t) for t in tools] if tools else None,
                                           add_generation_prompt=add_generation_prompt, tokenize=False, **more)
        return str(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of the chat prompt (add_generation_prompt=True).

        The template already writes any BOS token, so the text is encoded without adding special
        tokens, as transformers does with tokenize=True.
        """
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)
