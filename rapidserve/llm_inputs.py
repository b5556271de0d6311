"""What `LLM.generate` and `LLM.chat` take besides sampling parameters, as vLLM 0.26 takes it: read, or refused by name.

- Prompts (`prompts`): a string, a list of token ids, vLLM's prompt dicts (TextPrompt `{"prompt": text}`,
  TokensPrompt `{"prompt_token_ids": ids}`, whose optional "prompt" text is the output's `prompt`), or a list of
  these. A dict's other keys are accepted while they ask for nothing (None or empty: `multi_modal_data`,
  `mm_processor_kwargs`, `multi_modal_uuids`, `cache_salt`, `token_type_ids`; `prompt_token_offsets` with any value,
  it changes no generation) and refused by name otherwise, as is any key of vLLM's other prompt kinds (embeddings,
  encoder-decoder, data prompts) and any key vLLM does not read (`parse_prompts`).
- `tokenization_kwargs` (vLLM's TokenizeParams.with_kwargs keys, `Tokenization.of`): add_special_tokens,
  do_lower_case, truncate_prompt_tokens (k, or -1: as many as fit beside max_tokens), truncation_side,
  truncation / max_length (truncation True or "longest_first" keeps max_length tokens, or as many as fit; without
  truncation, a prompt longer than max_length is refused, as vLLM's length check does) are honoured;
  needs_detokenization changes nothing (an output's `prompt` is the prompt's text whenever it has one); padding
  and pad_prompt_tokens are refused unless off (prompts are never padded); any other key is refused.
- `lora_request` (None only: no LoRA adapters), `priority` (None or zeros, one per prompt: arrival order),
  `mm_processor_kwargs` (None or {}: text only): `check_request_args`.
- `chat_template_content_format`: "auto" or "string" (a message's text parts joined, `chat_messages`); "openai" is
  refused with `rapidserve serve`'s reason for the flag.
- `use_tqdm`: True, False, or a callable that makes the bar (vLLM's), `progress`.
Errors are `LLMArgumentError`s (ValueError) naming the argument, the key or the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tqdm import tqdm

from rapidserve.llm_args import LLMArgumentError
from rapidserve.prompt import Side, truncated
from rapidserve.sampling_checks import is_int, short
from rapidserve.vllm_reasons import WHY
from rapidserve.vllm_serve_flags import NO_OP, REFUSED

Prompt = str | list[int] | Mapping[str, Any]
_TEXT = WHY["mm_processor_kwargs"]
# a prompt dict's keys that ask for nothing unless set (None or empty), and why they are refused when set
PROMPT_IDLE_KEYS: MappingProxyType[str, str] = MappingProxyType({
    "multi_modal_data": _TEXT, "mm_processor_kwargs": _TEXT, "multi_modal_uuids": _TEXT,
    "cache_salt": WHY["cache_salt"],
    "token_type_ids": "token type ids are for cross-encoder (pooling) models; rapidserve serves generation"})
_DECODER_ONLY = "the models served here are decoder-only: give the prompt itself"
PROMPT_REFUSED_KEYS: MappingProxyType[str, str] = MappingProxyType({  # keys of vLLM's other prompt kinds: why refused
    "prompt_embeds": WHY["prompt_embeds"], "prompt_is_token_ids": WHY["prompt_embeds"],
    "encoder_prompt": _DECODER_ONLY, "decoder_prompt": _DECODER_ONLY,
    "data": REFUSED["--io-processor-plugin"], "data_format": REFUSED["--io-processor-plugin"]})
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # read: the text, the token ids
PROMPT_NO_EFFECT_KEYS = ("prompt_token_offsets",)  # the tokens' character offsets: no generation reads them
TOKENIZATION_KEYS = ("add_special_tokens", "do_lower_case", "truncate_prompt_tokens", "truncation_side", "max_length",
                     "truncation", "padding", "pad_prompt_tokens", "needs_detokenization")  # vLLM's, all read
_CONTENT_FORMATS = ("auto", "string")


@dataclass(frozen=True)
class PromptIn:
    """One prompt: its text (None for token ids given without one) and its token ids (None: to be encoded)."""

    text: str | None
    ids: list[int] | None


def _is_ids(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(is_int(t) for t in v)


def _one(p: object, where: str) -> PromptIn:
    if isinstance(p, str):
        return PromptIn(p, None)
    if _is_ids(p):
        return PromptIn(None, list(p))  # type: ignore[arg-type]
    if not isinstance(p, Mapping):
        raise LLMArgumentError(f"{where}={short(p)}: a prompt is a string, a list of token ids, or vLLM's prompt dict "
                               "({'prompt': text} or {'prompt_token_ids': ids})")
    for key, v in p.items():
        if key in PROMPT_KEYS or key in PROMPT_NO_EFFECT_KEYS:
            continue
        if key in PROMPT_IDLE_KEYS:
            if v is None or (isinstance(v, (Mapping, list, tuple)) and not v):
                continue
            raise LLMArgumentError(f"{where}[{key!r}]={short(v)} is not supported by rapidserve "
                                   f"({PROMPT_IDLE_KEYS[key]}): leave it out")
        why = PROMPT_REFUSED_KEYS.get(key, "not a key of vLLM's prompt dicts")
        raise LLMArgumentError(f"{where}[{key!r}] is not supported by rapidserve ({why}): leave it out")
    text, ids = p.get("prompt"), p.get("prompt_token_ids")
    if text is not None and not isinstance(text, str):
        raise LLMArgumentError(f"{where}['prompt']={short(text)} must be a string")
    if ids is not None and not _is_ids(ids):
        raise LLMArgumentError(f"{where}['prompt_token_ids']={short(ids)} must be a list of token ids")
    if text is None and ids is None:
        raise LLMArgumentError(f"{where}={short(p)} has neither 'prompt' nor 'prompt_token_ids'")
    return PromptIn(text, None if ids is None else list(ids))


def parse_prompts(prompts: Prompt | Sequence[Prompt]) -> list[PromptIn]:
    """`LLM.generate`'s `prompts`, one or a list of them, as PromptIns (LLMArgumentError naming a bad one)."""
    if isinstance(prompts, (str, Mapping)) or (_is_ids(prompts) and prompts):
        return [_one(prompts, "prompts")]
    if not isinstance(prompts, Sequence):
        raise LLMArgumentError(f"prompts={short(prompts)}: give a prompt or a list of prompts")
    return [_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _only_idle(name: str, v: Any, why: str) -> None:
    empty = v is None or (isinstance(v, (Mapping, list, tuple)) and not v)
    if not empty:
        raise LLMArgumentError(f"{name}={short(v)} is not supported by rapidserve ({why}): leave it out")


def check_request_args(n: int, lora_request: Any = None, priority: Sequence[int] | None = None,
                       mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
    """`generate`'s (and `chat`'s) lora_request, priority and mm_processor_kwargs for `n` prompts: accepted while
    they ask for nothing, else LLMArgumentError naming them (a priority list of another length, as vLLM's)."""
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    if any(r is not None for r in loras):
        raise LLMArgumentError(f"lora_request={short(lora_request)} is not supported by rapidserve "
                               f"({REFUSED['--enable-lora']}): leave it out")
    if isinstance(lora_request, (list, tuple)) and len(lora_request) != n:
        raise LLMArgumentError(f"lora_request has {len(lora_request)} entries for {n} prompts: give one per prompt")
    if priority is not None:
        if len(priority) != n:
            raise LLMArgumentError(f"priority has {len(priority)} entries for {n} prompts: give one per prompt")
        if any(p != 0 for p in priority):
            raise LLMArgumentError(f"priority={short(priority)} is not supported by rapidserve ({WHY['priority']}): "
                                   "leave it out, or give zeros")
    _only_idle("mm_processor_kwargs", mm_processor_kwargs, _TEXT)


@dataclass(frozen=True)
class Tokenization:
    """How prompts are tokenized and cut (vLLM's tokenization_kwargs): `add_special_tokens` None = the call's
    default (generate: True; chat: False, the template writes them); `keep` None = all, -1 = as many as fit beside
    the request's max_tokens; `limit`: a longer prompt is refused (max_length without truncation)."""

    add_special_tokens: bool | None = None
    lower: bool = False
    keep: int | None = None
    side: Side = "left"
    limit: int | None = None

    @classmethod
    def of(cls, kw: Mapping[str, Any] | None) -> Tokenization:
        """Read vLLM's tokenization_kwargs (LLMArgumentError naming a key it cannot honour)."""
        kw = dict(kw or {})

        def bad(key: str, why: str) -> LLMArgumentError:
            return LLMArgumentError(f"tokenization_kwargs[{key!r}]={short(kw[key])}: {why}")

        for key in ("add_special_tokens", "do_lower_case"):
            if key in kw and not isinstance(kw[key], bool):
                raise bad(key, "must be a bool")
        keep = kw.get("truncate_prompt_tokens")
        if keep is not None and not (is_int(keep) and (keep >= 1 or keep == -1)):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 for as many as fit")
        side = kw.get("truncation_side") or "left"
        if side not in ("left", "right"):
            raise bad("truncation_side", "must be 'left' (keep the last tokens) or 'right' (keep the first)")
        length = kw.get("max_length")
        if length is not None and not (is_int(length) and length >= 1):
            raise bad("max_length", "must be an integer >= 1")
        trunc = kw.get("truncation")
        if trunc in (True, "longest_first"):
            keep = length if length is not None else -1
        elif trunc == "do_not_truncate":
            keep = None
        elif trunc not in (None, False):
            raise bad("truncation", "rapidserve cuts prompts by truncation True or 'longest_first' (keeping "
                                    "max_length tokens) or not at all (False, 'do_not_truncate')")
        for key in ("padding", "pad_prompt_tokens"):
            if kw.get(key) not in (None, False, "do_not_pad"):
                raise bad(key, "prompts are never padded: leave it out")
        unknown = sorted(set(kw) - set(TOKENIZATION_KEYS))
        if unknown:
            raise bad(unknown[0], "not one of the tokenization arguments vLLM reads (add_special_tokens, "
                                  "truncate_prompt_tokens, truncation_side, truncation, max_length, do_lower_case)")
        return cls(kw.get("add_special_tokens"), bool(kw.get("do_lower_case")), keep, side,
                   length if trunc not in (True, "longest_first") else None)

    def text(self, text: str) -> str:
        return text.lower() if self.lower else text

    def cut(self, ids: list[int], context_cap: int, max_tokens: int | None, where: str) -> list[int]:
        """`ids` cut as asked (LLMArgumentError when longer than max_length without truncation)."""
        if self.limit is not None and len(ids) > self.limit:
            raise LLMArgumentError(f"{where} has {len(ids)} tokens, more than tokenization_kwargs max_length="
                                   f"{self.limit}: shorten it, or add truncation=True to cut it")
        keep = max(1, context_cap - (max_tokens or 1)) if self.keep == -1 else self.keep
        return truncated(ids, keep, self.side)


def chat_messages(conversation: Sequence[Mapping[str, Any]], content_format: str, where: str) -> list[dict[str, Any]]:
    """A conversation's messages as the template gets them (vLLM's "string" content format): a content given as
    parts is their texts joined by newlines; a part that is not text is refused by name."""
    if content_format not in _CONTENT_FORMATS:
        raise LLMArgumentError(f"chat_template_content_format={content_format!r} is not supported by rapidserve "
                               f"({NO_OP['--chat-template-content-format'][1]}): give 'auto' or 'string'")
    out = []
    for i, m in enumerate(conversation):
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise LLMArgumentError(f"{where}[{i}]['content'][{j}]={short(part)} is not supported by rapidserve "
                                           f"({_TEXT}): give text parts {{'type': 'text', 'text': ...}}")
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        out.append(msg)
    return out


def progress(use_tqdm: bool | Callable[..., Any], total: int, desc: str) -> Any:
    """The progress bar of a call: vLLM's use_tqdm is True (a tqdm bar), False (none) or a callable making one."""
    if callable(use_tqdm) and not isinstance(use_tqdm, bool):
        return use_tqdm(total=total, desc=desc)
    return tqdm(total=total, desc=desc, disable=not use_tqdm, leave=False)
