"""The model's recommended sampling defaults: a Hugging Face folder's `generation_config.json`.

vLLM's `--generation-config auto` (its default) reads that file and applies its `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as the default `max_tokens`) where a request
leaves the field unset; a field the request sets wins. `--generation-config vllm` ignores the file and
`--generation-config FOLDER` reads the file of that folder instead. Like vLLM, `do_sample` is not read
(a file with `do_sample: false` and a temperature still gives that temperature), nor any other field
(the EOS ids are the model config's business: `ModelConfig.eos_token_ids`).

`SamplingDefaults` is the frozen result, part of the config tree (`EngineConfig.generation`), built once
by `config_builder` (which reads the file); GGUF files and presets carry no such file, so theirs is empty.
Plain data: imports nothing of rapidserve (config.py imports it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder


class GenerationConfigError(ValueError):
    """A generation config that cannot be applied; the message names the file, the field and what is allowed."""


def _real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field (SamplingParams' name) -> (the file's name, the check, what is allowed)
_RULES: dict[str, tuple[str, Any, str]] = {
    "temperature": ("temperature", lambda v: _real(v) and v >= 0, "a number >= 0"),
    "top_p": ("top_p", lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: _int(v) and v >= -1, "an integer >= -1 (0 and -1: off)"),
    "min_p": ("min_p", lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": ("repetition_penalty", lambda v: _real(v) and v > 0, "a number > 0"),
    "max_tokens": ("max_new_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1"),
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling defaults a request's unset fields take (None: the field's usual default); `source` says where
    they come from, for the start-up log line. `max_tokens` is the file's `max_new_tokens`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "none given"

    def __post_init__(self) -> None:
        for name, (file_name, ok, allowed) in _RULES.items():
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise GenerationConfigError(f"{self.source}: {file_name}={v!r} must be {allowed}; fix the file, or "
                                            "start with --generation-config vllm to ignore it")

    def params(self) -> dict[str, float | int]:
        """The set defaults, by their SamplingParams names (floats as floats)."""
        out: dict[str, float | int] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and v is not None:
                out[f.name] = v if f.name in ("top_k", "max_tokens") else float(v)
        return out

    def describe(self) -> str:
        """One line for the start-up log: which defaults apply and where they come from."""
        p = self.params()
        if not p:
            return f"sampling defaults: vLLM's (temperature 1, top_p 1, top_k off, ...): {self.source}"
        shown = ", ".join(f"{'max_tokens (max_new_tokens)' if k == 'max_tokens' else k}={v:g}" for k, v in p.items())
        return (f"sampling defaults from {self.source}: {shown}, where a request leaves them unset "
                "(--generation-config vllm ignores the model's)")


def sampling_defaults(d: Mapping[str, Any], source: str) -> SamplingDefaults:
    """The defaults a generation_config.json's object `d` sets (`source`: the file, for messages); unread
    fields are left alone, a null is unset, a bad value raises GenerationConfigError naming it."""
    kw = {name: d[file_name] for name, (file_name, _, _) in _RULES.items() if d.get(file_name) is not None}
    return SamplingDefaults(**kw, source=source)
