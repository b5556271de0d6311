"""`rapidserve.LLM`: the offline, single-process API, like vLLM's.

    llm = LLM(model="preset:tiny-llama")            # or a HF folder, a .gguf, None = SmolLM2
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text

`llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False})` renders conversations with
the chat template first (vLLM's `LLM.chat`). As in vLLM, `generate` without sampling parameters uses
`get_default_sampling_params()`: the model's recommended defaults (its generation_config.json;
`LLM(..., generation_config="vllm")` ignores them, `generation_config=FOLDER` reads that folder's), else
SamplingParams' own; given parameters are used as they are.

vLLM 0.26's arguments are all taken: `LLM(...)`'s by llm_args.py (honoured, accepted where they ask for what this LLM
does anyway, or refused by name), `generate`'s and `chat`'s, and its prompt dicts, by llm_inputs.py; the outputs carry
vLLM's attributes (outputs.py), `stop_reason` among them.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rapidserve import llm_args
from rapidserve.config_builder import allow_long_max_model_len, build_engine_config
from rapidserve.core import EngineCore, Generation
from rapidserve.llm_inputs import (
    Prompt,
    PromptIn,
    Tokenization,
    chat_messages,
    check_request_args,
    parse_prompts,
    progress,
)
from rapidserve.outputs import CompletionOutput, Logprob, RequestOutput
from rapidserve.sampling_params import SamplingParams, SamplingParamsError, resolve_bad_words
from rapidserve.stop_rules import first_stop_string
from rapidserve.tokenizer import RENDERER_OWNS, Tokenizer, check_chat_template, load_chat_template

log = logging.getLogger("rapidserve.llm")
Tqdm = bool | Callable[..., Any]  # vLLM's use_tqdm: a bar or none, or a callable that makes one


class LLM:
    def __init__(self, model: str | None = None, dtype: Any = "auto", *, show_progress: bool = True,
                 **kwargs: Any) -> None:
        """`kwargs`: vLLM's LLM / EngineArgs arguments (llm_args.py: each honoured, accepted where it asks for
        nothing here, or refused by name with why) and build_engine_config's own (`generation_config`: auto, vllm or
        a folder, as vLLM's; `device`, `num_kv_blocks`...). vLLM's `chat_template` (a file or the template) is
        `chat`'s default template; `use_tqdm_on_load=False` turns the loading progress off, as show_progress=False.
        `dtype`: auto, float32, float16, bfloat16, vLLM's half and float, or a torch dtype.
        `allow_long_max_model_len` not given is read from $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN (as vLLM's LLM reads
        VLLM_ALLOW_LONG_MAX_MODEL_LEN). The tree is built for the offline run (`run="offline"`), so a setting it does
        not read (prefill_batch_tokens, async_scheduling=False, ...) is a ConfigError before the model loads
        (policy_spec.check_settings)."""
        opts = llm_args.resolve(kwargs, inspect.signature(build_engine_config).parameters)
        if "allow_long_max_model_len" not in opts:
            opts["allow_long_max_model_len"] = allow_long_max_model_len(os.environ)
        if kwargs.get("use_tqdm_on_load") is False:
            show_progress = False
        template = kwargs.get("chat_template")
        template = None if template is None else load_chat_template(os.fspath(template), "chat_template")
        cfg, source = build_engine_config(model, dtype=llm_args.dtype_name(dtype), run="offline",  # type: ignore[arg-type]
                                          **opts)
        self.config = cfg
        log.info("%s", cfg.generation.describe())
        self.tokenizer = Tokenizer.from_source(source, chat_template=template)  # type: ignore[arg-type]
        eos = cfg.model_config.eos_token_ids
        if self.tokenizer is not None:
            eos = tuple(dict.fromkeys(eos + self.tokenizer.eos_token_ids))
        self.engine = EngineCore(cfg, source, show_progress=show_progress, eos_token_ids=eos,  # type: ignore[arg-type]
                                 text_stop=self._stop_string_hit if self.tokenizer is not None else None)
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no parameters (vLLM's method): the model's recommended
        defaults (generation_config.json; its max_new_tokens as max_tokens), else SamplingParams' own."""
        return SamplingParams(**self.config.generation.params())  # type: ignore[arg-type]

    def _encode(self, prompt: PromptIn, tok: Tokenization, add_special_tokens: bool) -> list[int]:
        if prompt.ids is not None:
            return list(prompt.ids)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (a preset?): pass prompts as token-id lists")
        assert prompt.text is not None
        special = add_special_tokens if tok.add_special_tokens is None else tok.add_special_tokens
        return self.tokenizer.encode(tok.text(prompt.text), add_special_tokens=special)

    def _resolve(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` tokenized here, where the tokenizer is (sampling_params.resolve_bad_words); stop strings
        refused without one (they are matched on the text, which a model without a tokenizer never makes)."""
        if params.stop and self.tokenizer is None:
            raise SamplingParamsError(f"stop={params.stop!r}: this model has no tokenizer (a preset?), so stop strings "
                                      "cannot be matched: use stop_token_ids")
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (a preset?): give bad_words_token_ids instead of bad_words")
        tok = self.tokenizer
        return resolve_bad_words(params, lambda text: tok.encode(text, add_special_tokens=False))

    def _stop_string_hit(self, seq: Generation) -> str | None:
        """"stop" once a stop string ends in the text, none of them within the first min_tokens outputs' (vLLM's
        rule, stop_rules.first_stop_string); else None. Only the last tokens' text is searched, once they all
        follow the first min_tokens: 16 more than the longest stop string's UTF-8 bytes (a token makes at least one
        byte of text), so a long stop string is found as soon as it ends."""
        params, ids = seq.params, seq.output_token_ids
        if not params.stop or self.tokenizer is None or len(ids) <= params.min_tokens:
            return None
        window = 16 + max(len(s.encode("utf-8")) for s in params.stop)
        if len(ids) - params.min_tokens > window:
            text, floor = self.tokenizer.decode(ids[-window:], params.skip_special_tokens), 0
        else:
            text, floor = self._text_and_floor(ids, params)
        return "stop" if first_stop_string(text, params.stop, floor) is not None else None

    def _text_and_floor(self, ids: list[int], params: SamplingParams) -> tuple[str, int]:
        """The text of `ids`, and how many of its characters the first min_tokens of them made."""
        assert self.tokenizer is not None
        floor = len(self.tokenizer.decode(ids[:params.min_tokens], params.skip_special_tokens)) \
            if params.min_tokens else 0
        return self.tokenizer.decode(ids, params.skip_special_tokens), floor

    def _finish(self, seq: Generation) -> tuple[str, int | str | None]:
        """The output text and stop_reason as vLLM makes them: the text up to the earliest stop string (of those
        that end past the first min_tokens outputs' text), which it
        keeps only with `include_stop_str_in_output`, as it keeps the text of the stop token (EOS, a stop id) that
        ended it; "" with detokenize=False. stop_reason: that stop string, or that stop token's id when it is one
        of stop_token_ids and not an EOS it would have stopped on anyway; None otherwise (EOS, length)."""
        params, ids = seq.params, seq.output_token_ids
        last = ids[-1] if seq.finish_reason == "stop" and ids else None
        eos = () if params.ignore_eos else self.engine.eos_token_ids
        stop_id = last if last in params.stop_token_ids and last not in eos else None
        if self.tokenizer is None or not params.detokenize:
            return "", stop_id
        text, floor = self._text_and_floor(ids, params)
        hit = first_stop_string(text, params.stop, floor)
        if hit is not None:
            cut, s = hit
            return (text[:cut + len(s)] if params.include_stop_str_in_output else text[:cut]), s
        if last is not None and not params.include_stop_str_in_output:
            return self.tokenizer.decode(ids[:-1], params.skip_special_tokens), stop_id  # ended by a stop token
        return text, stop_id

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: Tqdm = True,
             lora_request: Any = None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             tokenization_kwargs: Mapping[str, Any] | None = None, mm_processor_kwargs: Mapping[str, Any] | None = None,
             *, documents: Sequence[Mapping[str, str]] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat` (its arguments in its order): one conversation (a list of {"role", "content"} messages,
        content a string or text parts) or a list of them, rendered by the chat template (`chat_template`, else
        `LLM(chat_template=...)`'s, else the model's) with `chat_template_kwargs` as more template variables (Qwen3's
        `enable_thinking`), then generated as `generate` does (the rendered text encoded without special tokens
        unless tokenization_kwargs says add_special_tokens). Each output's `prompt` is the rendered text.
        ValueError for what cannot be rendered or is not served (llm_inputs.py)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (a preset?): chat needs one; use generate with token ids")
        owned = sorted(RENDERER_OWNS & set(chat_template_kwargs or {}))
        if owned:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(owned)}: give them as LLM.chat's own "
                             "arguments (tools, documents, chat_template, add_generation_prompt, "
                             "continue_final_message) or leave them out")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        if chat_template is not None:
            check_chat_template(chat_template, "chat_template")
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        check_request_args(len(conversations), lora_request, None, mm_processor_kwargs)
        tok = Tokenization.of(tokenization_kwargs)
        texts = [self.tokenizer.render_chat(
            chat_messages(c, chat_template_content_format, f"messages[{i}]"),  # type: ignore[arg-type]
            tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            documents=documents, template_kwargs=chat_template_kwargs, chat_template=chat_template)
            for i, c in enumerate(conversations)]
        return self._run([PromptIn(t, None) for t in texts], sampling_params, use_tqdm, tok, add_special_tokens=False)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: Tqdm = True, *,
                 lora_request: Any = None, priority: Sequence[int] | None = None,
                 tokenization_kwargs: Mapping[str, Any] | None = None,
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: each prompt (a string, token ids, or vLLM's prompt dict) with its sampling
        parameters (one for all, or one per prompt), in one batch; the outputs in the prompts' order.
        `tokenization_kwargs`, `lora_request`, `priority`, `mm_processor_kwargs`: as llm_inputs.py takes them."""
        inputs = parse_prompts(prompts)
        check_request_args(len(inputs), lora_request, priority, mm_processor_kwargs)
        return self._run(inputs, sampling_params, use_tqdm, Tokenization.of(tokenization_kwargs),
                         add_special_tokens=True)

    def _run(self, inputs: list[PromptIn], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: Tqdm, tok: Tokenization, add_special_tokens: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(inputs) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(inputs):
            raise ValueError(f"got {len(inputs)} prompts but {len(params)} sampling_params; "
                             "pass one SamplingParams or one per prompt")
        cap = self.engine.limits.context_cap
        encoded = [tok.cut(self._encode(x, tok, add_special_tokens), cap, p.max_tokens, f"prompt {i}")
                   for i, (x, p) in enumerate(zip(inputs, params, strict=True))]
        params = [self._resolve(p) for p in params]
        for ids, p in zip(encoded, params, strict=True):  # all checked before any is added
            self.engine.limits.check(ids)
            self.engine.limits.check_params(p)
        for so in dict.fromkeys(p.structured_outputs for p in params if p.structured_outputs is not None):
            self.engine.check_constraint(so)  # compiled once each, and tried: ValueError naming the field
        requests: list[tuple[RequestOutput, list[Generation]]] = []
        for x, ids, p in zip(inputs, encoded, params, strict=True):
            rid = str(self._next_id)
            self._next_id += 1
            seqs = [self.engine.add(f"{rid}-{i}", ids, p.for_sample(i)) for i in range(p.n)]
            requests.append((RequestOutput(rid, x.text, ids), seqs))
        bar = progress(use_tqdm, sum(len(s) for _, s in requests), "generating")
        errors: dict[str, str] = {}  # why each sequence that ended with "error" did
        try:
            while self.engine.has_work:
                for ev in self.engine.step():
                    if ev.finish_reason is not None:
                        bar.update(1)
                        if ev.message:
                            errors[ev.seq.seq_id] = ev.message
        except BaseException:  # a step failed (or an interrupt): none of this call's requests is left behind
            for _, seqs in requests:
                for s in seqs:
                    self.engine.abort(s)
            raise
        finally:
            bar.close()
        return [self._output(req, seqs, errors) for req, seqs in requests]

    def _output(self, req: RequestOutput, seqs: list[Generation], errors: Mapping[str, str]) -> RequestOutput:
        """`req` filled in from its finished samples."""
        cache = self.config.cache
        req.num_cached_tokens = seqs[0].num_cached_tokens
        full = len(req.prompt_token_ids) // cache.block_size * cache.block_size  # the prompt's full blocks
        req.num_cache_creation_tokens = max(0, full - req.num_cached_tokens) if cache.enable_prefix_caching else 0
        for i, s in enumerate(seqs):
            lp = s.output_logprobs if s.params.logprobs is not None else None
            text, stop_reason = self._finish(s)
            req.outputs.append(CompletionOutput(
                index=i, text=text, token_ids=list(s.output_token_ids), cumulative_logprob=sum(lp) if lp else None,
                logprobs=self._logprobs(s) if lp is not None else None,
                top_logprobs=s.output_top_logprobs if s.params.logprobs else None,
                finish_reason=s.finish_reason, error=errors.get(s.seq_id), stop_reason=stop_reason))
        return req

    def _logprobs(self, s: Generation) -> list[dict[int, Logprob]]:
        """vLLM's per-position {token id: Logprob}: the chosen token first (its rank from the sampler), then the top
        tokens (ranks 1..k), each with its text where the output is detokenized."""
        tok = self.tokenizer if s.params.detokenize else None
        texts: dict[int, str] = {}

        def text(t: int) -> str | None:
            if tok is None:
                return None
            if t not in texts:
                texts[t] = tok.decode([t], False)
            return texts[t]

        out: list[dict[int, Logprob]] = []
        tops = s.output_top_logprobs if s.params.logprobs else []
        for pos, (t, lp) in enumerate(zip(s.output_token_ids, s.output_logprobs, strict=False)):
            rank = s.output_ranks[pos] if pos < len(s.output_ranks) else None
            d = {t: Logprob(lp, rank, text(t))}
            for k, (tid, v) in enumerate(tops[pos] if pos < len(tops) else []):
                d.setdefault(tid, Logprob(v, k + 1, text(tid)))
            out.append(d)
        return out
