"""`rapidserve.LLM`: the offline, single-process API, like vLLM's.

    llm = LLM(model="preset:tiny-llama")            # or a HF folder, a .gguf, None = SmolLM2
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tqdm import tqdm

from rapidserve.config import ConfigError
from rapidserve.config_builder import allow_long_max_model_len, build_engine_config
from rapidserve.core import EngineCore
from rapidserve.outputs import CompletionOutput, RequestOutput
from rapidserve.sampling_params import SamplingParams, resolve_bad_words
from rapidserve.sequence import Sequence as Seq
from rapidserve.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", *, show_progress: bool = True,
                 **kwargs: object) -> None:
        """`kwargs`: build_engine_config's; `allow_long_max_model_len` not given is read from
        $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN (as vLLM's LLM reads VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
        if kwargs.get("prefill_batch_tokens") is not None:  # before the model loads
            raise ConfigError("prefill_batch_tokens sizes the prefill worker's batches of `rapidserve serve --mode "
                              "rapid`; LLM (and `rapidserve generate`) runs one process, whose steps "
                              "max_num_batched_tokens bounds: drop prefill_batch_tokens (--prefill-batch-tokens)")
        if "allow_long_max_model_len" not in kwargs:
            kwargs["allow_long_max_model_len"] = allow_long_max_model_len(os.environ)
        cfg, source = build_engine_config(model, dtype=dtype, **kwargs)  # type: ignore[arg-type]
        self.config = cfg
        self.tokenizer = Tokenizer.from_source(source)  # type: ignore[arg-type]
        self.engine = EngineCore(cfg, source, show_progress=show_progress)  # type: ignore[arg-type]
        if self.tokenizer is not None:
            merged = tuple(dict.fromkeys(cfg.model_config.eos_token_ids + self.tokenizer.eos_token_ids))
            self.engine.eos_token_ids = merged
            self.engine.text_stop = self._stop_string_hit
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

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

    def _stop_string_hit(self, seq: Seq) -> str | None:
        if not seq.params.stop or self.tokenizer is None:
            return None
        tail = self.tokenizer.decode(seq.output_token_ids[-16:], seq.params.skip_special_tokens)
        return "stop" if any(s in tail for s in seq.params.stop) else None

    def _text(self, token_ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, params.skip_special_tokens)
        for s in params.stop:  # stop strings are left out of the output, as in vLLM
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
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
        requests: list[tuple[RequestOutput, list[Seq]]] = []
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
        while self.engine.has_work:
            for ev in self.engine.step():
                if ev.finish_reason is not None:
                    bar.update(1)
                    if ev.message:
                        errors[ev.seq.seq_id] = ev.message
        bar.close()
        for req, seqs in requests:
            req.num_cached_tokens = seqs[0].num_cached_tokens
            for i, s in enumerate(seqs):
                lp = s.output_logprobs if s.params.logprobs is not None else None
                req.outputs.append(CompletionOutput(
                    index=i, text=self._text(s.output_token_ids, s.params), token_ids=list(s.output_token_ids),
                    cumulative_logprob=sum(lp) if lp else None, logprobs=lp,
                    top_logprobs=s.output_top_logprobs if s.params.logprobs else None,
                    finish_reason=s.finish_reason, error=errors.get(s.seq_id)))
        return [r for r, _ in requests]
