"""`rapidserve.LLM`: the offline, single-process API, like vLLM's.

    llm = LLM(model="preset:tiny-llama")            # or a HF folder, a .gguf, None = SmolLM2
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text

`llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False})` renders conversations with
the chat template first (vLLM's `LLM.chat`). As in vLLM, `generate` without sampling parameters uses
`get_default_sampling_params()`: the model's recommended defaults (its generation_config.json;
`LLM(..., generation_config="vllm")` ignores them, `generation_config=FOLDER` reads that folder's), else
SamplingParams' own; given parameters are used as they are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from rapidserve.config_builder import allow_long_max_model_len, build_engine_config
from rapidserve.core import EngineCore, Generation
from rapidserve.outputs import CompletionOutput, RequestOutput
from rapidserve.sampling_params import SamplingParams, resolve_bad_words
from rapidserve.tokenizer import RENDERER_OWNS, Tokenizer, check_chat_template

Prompt = str | list[int]
log = logging.getLogger("rapidserve.llm")


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", *, show_progress: bool = True,
                 **kwargs: object) -> None:
        """`kwargs`: build_engine_config's (`generation_config`: auto, vllm or a folder, as vLLM's);
        `allow_long_max_model_len` not given is read from $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN (as vLLM's LLM reads
        VLLM_ALLOW_LONG_MAX_MODEL_LEN). The tree is built for the offline run (`run="offline"`), so a setting it does
        not read (prefill_batch_tokens, async_scheduling=False, ...) is a ConfigError before the model loads
        (policy_spec.check_settings)."""
        if "allow_long_max_model_len" not in kwargs:
            kwargs["allow_long_max_model_len"] = allow_long_max_model_len(os.environ)
        cfg, source = build_engine_config(model, dtype=dtype, run="offline", **kwargs)  # type: ignore[arg-type]
        self.config = cfg
        log.info("%s", cfg.generation.describe())
        self.tokenizer = Tokenizer.from_source(source)  # type: ignore[arg-type]
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

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (a preset?): pass prompts as token-id lists")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _resolve(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` tokenized here, where the tokenizer is (sampling_params.resolve_bad_words)."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (a preset?): give bad_words_token_ids instead of bad_words")
        tok = self.tokenizer
        return resolve_bad_words(params, lambda text: tok.encode(text, add_special_tokens=False))

    def _stop_string_hit(self, seq: Generation) -> str | None:
        if not seq.params.stop or self.tokenizer is None:
            return None
        tail = self.tokenizer.decode(seq.output_token_ids[-16:], seq.params.skip_special_tokens)
        return "stop" if any(s in tail for s in seq.params.stop) else None

    def _text(self, seq: Generation) -> str:
        """The output text as vLLM makes it: up to the earliest stop string, which it keeps only with
        `include_stop_str_in_output`, as it keeps the text of the stop token (EOS, a stop id) that ended it."""
        if self.tokenizer is None:
            return ""
        params, ids = seq.params, seq.output_token_ids
        text = self.tokenizer.decode(ids, params.skip_special_tokens)
        hits = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
        if hits:
            cut, s = min(hits)
            return text[:cut + len(s)] if params.include_stop_str_in_output else text[:cut]
        if seq.finish_reason == "stop" and ids and not params.include_stop_str_in_output:
            return self.tokenizer.decode(ids[:-1], params.skip_special_tokens)  # ended by a stop token
        return text

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
             documents: Sequence[Mapping[str, str]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of them,
        rendered by the chat template (the model's, or `chat_template`) with `chat_template_kwargs` as more
        template variables (Qwen3's `enable_thinking`), then generated as `generate` does. Each output's
        `prompt` is the rendered text. ValueError for what cannot be rendered."""
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
        texts = [self.tokenizer.render_chat(c, tools, add_generation_prompt=add_generation_prompt,  # type: ignore
                                            continue_final_message=continue_final_message, documents=documents,
                                            template_kwargs=chat_template_kwargs, chat_template=chat_template)
                 for c in conversations]
        tok = self.tokenizer
        outs = self.generate([tok.encode(t, add_special_tokens=False) for t in texts], sampling_params, use_tqdm)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(plist) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(plist):
            raise ValueError(f"got {len(plist)} prompts but {len(params)} sampling_params; "
                             "pass one SamplingParams or one per prompt")
        encoded = [self._encode(prompt) for prompt in plist]
        params = [self._resolve(p) for p in params]
        for (_, ids), p in zip(encoded, params, strict=True):  # all checked before any is added
            self.engine.limits.check(ids)
            self.engine.limits.check_params(p)
        for so in dict.fromkeys(p.structured_outputs for p in params if p.structured_outputs is not None):
            self.engine.check_constraint(so)  # compiled once each, and tried: ValueError naming the field
        requests: list[tuple[RequestOutput, list[Generation]]] = []
        for (text, ids), p in zip(encoded, params, strict=True):
            rid = str(self._next_id)
            self._next_id += 1
            seqs = []
            for i in range(p.n):
                seqs.append(self.engine.add(f"{rid}-{i}", ids, p.for_sample(i)))
            requests.append((RequestOutput(rid, text, ids), seqs))
        total = sum(len(s) for _, s in requests)
        bar = tqdm(total=total, desc="generating", disable=not use_tqdm, leave=False)
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
        for req, seqs in requests:
            req.num_cached_tokens = seqs[0].num_cached_tokens
            for i, s in enumerate(seqs):
                lp = s.output_logprobs if s.params.logprobs is not None else None
                req.outputs.append(CompletionOutput(
                    index=i, text=self._text(s), token_ids=list(s.output_token_ids),
                    cumulative_logprob=sum(lp) if lp else None, logprobs=lp,
                    top_logprobs=s.output_top_logprobs if s.params.logprobs else None,
                    finish_reason=s.finish_reason, error=errors.get(s.seq_id)))
        return [r for r, _ in requests]
