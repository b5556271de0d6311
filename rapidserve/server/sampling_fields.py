"""A request body's sampling fields -> `SamplingParams`, with the model's defaults (requests.py's last step).

- `check_controls`: the logit controls' checks that need the model (token ids in the vocabulary, a
  tokenizer for bad_words), made before anything is tokenized;
- `resolve_max_tokens`: the field that asks (`max_completion_tokens`, `max_tokens`, /generate's
  `max_new_tokens`) within what the prompt leaves of the context, or the server's default;
- `build_params`: every field, where the request leaves one unset the model's recommended default
  (`SamplingDefaults`, from generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty),
  else vLLM's; a field the request sets always wins, as in vLLM.
Errors are 400s naming the field (`APIError`).
"""

from __future__ import annotations

import re
from typing import Any

from rapidserve.generation_config import SamplingDefaults
from rapidserve.prompt import PromptError, PromptLimits
from rapidserve.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs, resolve_bad_words
from rapidserve.server.errors import bad_request, show
from rapidserve.server.prompt_fields import asked_max_tokens
from rapidserve.server.schemas import CompletionRequest, RequestBody
from rapidserve.tokenizer import Tokenizer

# vLLM's defaults of the fields a model's generation config may set
VLLM_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                         "repetition_penalty": 1.0}


def logit_bias(r: RequestBody, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias {"token id": bias} as {id: bias}; every key a token id in the vocabulary."""
    out: dict[int, float] = {}
    for key, bias in (r.logit_bias or {}).items():
        t = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= t < vocab_size:
            raise bad_request("logit_bias", f"'logit_bias' has the key {show(key)}: keys must be token ids in "
                                            f"[0, {vocab_size}), written as decimal strings (e.g. \"50256\")")
        out[t] = bias
    return out


def check_controls(r: RequestBody, tokenizer: Tokenizer | None, vocab_size: int) -> None:
    """The logit controls' model-dependent checks (token ids in the vocabulary, a tokenizer for bad_words)."""
    logit_bias(r, vocab_size)
    if r.allowed_token_ids and max(r.allowed_token_ids) >= vocab_size:
        t = next(t for t in r.allowed_token_ids if t >= vocab_size)
        raise bad_request("allowed_token_ids", f"'allowed_token_ids' holds {t}: token ids must be integers in "
                                               f"[0, {vocab_size})")
    if r.bad_words and tokenizer is None:
        raise bad_request("bad_words", "this model has no tokenizer: 'bad_words' cannot be tokenized")
    if r.bad_words and any(w.strip() == "" for w in r.bad_words):
        raise bad_request("bad_words", "'bad_words' must hold non-blank strings")


def refuse_text_fields(r: RequestBody) -> None:
    """On a model without a tokenizer (presets: token ids in, token ids out, the text empty), a 400 naming a field
    that needs the text: stop strings (matched on it), completions' echo (the prompt as text) and logprobs (named
    by their tokens' texts). The fields that only shape the text (skip_special_tokens, include_stop_str_in_output)
    have nothing to shape and are accepted; bad_words are check_controls'."""
    if r.stop is not None and r.stop != []:
        raise bad_request("stop", "this model has no tokenizer: stop strings cannot be matched; use 'stop_token_ids'")
    if isinstance(r, CompletionRequest) and r.echo:
        raise bad_request("echo", "this model has no tokenizer: the prompt cannot be echoed as text; send 'echo' "
                                  "false or leave it out (return_token_ids: true answers the prompt's token ids)")
    if isinstance(r, CompletionRequest) and r.logprobs is not None:
        raise bad_request("logprobs", "this model has no tokenizer: logprobs name their tokens by text, which it "
                                      "cannot make; send 'logprobs' null or leave it out (return_token_ids: true "
                                      "answers the token ids)")


def resolve_max_tokens(r: RequestBody, longest_prompt: int, max_model_len: int, default: int) -> int:
    """The request's max_tokens: the field that asks, if it fits beside its longest prompt (else a 400
    naming it), or `default` capped by what that prompt leaves (at least 1)."""
    name, requested = asked_max_tokens(r)
    room = max_model_len - longest_prompt
    if requested is None:
        return max(1, min(default, room))
    if requested > room:
        raise bad_request(name, f"'{name}'={requested} plus the prompt's {longest_prompt} tokens is more than this "
                                f"model's maximum context length of {max_model_len} tokens: ask for at most "
                                f"{room}", code="context_length_exceeded")
    return requested


def _default(r: RequestBody, name: str, defaults: SamplingDefaults) -> Any:
    """The request's own value of `name`, else the model's default, else vLLM's."""
    own = getattr(r, name)
    if own is not None:
        return own
    model = getattr(defaults, name)
    return VLLM_DEFAULTS[name] if model is None else model


def build_params(r: RequestBody, n: int, max_tokens: int, logprobs: int | None,
                 structured: StructuredOutputs | None, tokenizer: Tokenizer | None, limits: PromptLimits,
                 defaults: SamplingDefaults) -> SamplingParams:
    """The request's SamplingParams (bad_words tokenized, every token id checked); a 400 naming the field."""
    stop = () if r.stop is None else (r.stop,) if isinstance(r.stop, str) else tuple(r.stop)
    try:
        params = SamplingParams(
            n=n, temperature=_default(r, "temperature", defaults), top_p=_default(r, "top_p", defaults),
            top_k=_default(r, "top_k", defaults), min_p=_default(r, "min_p", defaults),
            repetition_penalty=_default(r, "repetition_penalty", defaults), seed=r.seed, max_tokens=max_tokens,
            min_tokens=r.min_tokens or 0, stop_token_ids=tuple(r.stop_token_ids or ()), stop=stop,
            ignore_eos=bool(r.ignore_eos), logprobs=logprobs, skip_special_tokens=r.skip_special_tokens is not False,
            include_stop_str_in_output=bool(r.include_stop_str_in_output),
            presence_penalty=r.presence_penalty or 0.0, frequency_penalty=r.frequency_penalty or 0.0,
            logit_bias=logit_bias(r, limits.vocab_size), allowed_token_ids=r.allowed_token_ids,
            bad_words=tuple(r.bad_words or ()), structured_outputs=structured)
        if params.bad_words:
            tok = tokenizer
            assert tok is not None  # check_controls
            params = resolve_bad_words(params, lambda text: tok.encode(text, add_special_tokens=False))
            limits.check_params(params)
    except PromptError as e:
        raise bad_request("bad_words", str(e)) from None
    except SamplingParamsError as e:
        m = re.match(r"(\w+)[=:]", str(e))
        raise bad_request(m.group(1) if m else None, str(e)) from None
    return params
