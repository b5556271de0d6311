"""Rebuild tests/data/vllm_0_26_python_api.json from a vLLM wheel's Python source, read as text (never imported).

    python -m tests.vllm_python_api_extract /tmp/vllm-0.26.0-*.whl > tests/data/vllm_0_26_python_api.json

The wheel is a zip: its vllm/*.py files are parsed with ast where they lie, nothing is unpacked or run. Only names
and literal defaults are taken, the offline Python API's surface:
- `sampling_params`: vllm/sampling_params.py's SamplingParams fields (the public ones, not `_eos_token_id`...) and
  their defaults; `structured_outputs`: its StructuredOutputsParams' fields likewise;
- `llm_init`, `generate`, `chat`: the parameters of vllm/entrypoints/llm.py's `LLM.__init__`, `LLM.generate`,
  `LLM.chat` and their defaults; `engine_args`: vllm/engine/arg_utils.py's EngineArgs fields, which `LLM.__init__`
  takes through **kwargs, with their defaults followed to the config dataclass field they name
  (`ModelConfig.seed` -> vllm/config/model.py's default), `LLM.__init__`'s own first where it is not None;
- `request_output`, `completion_output`: vllm/outputs.py's RequestOutput.__init__ parameters and CompletionOutput
  fields and methods; `prompt_keys`: the keys of vllm/inputs/llm.py's prompt TypedDicts (TextPrompt, TokensPrompt,
  EmbedsPrompt, DataPrompt, ExplicitEncoderDecoderPrompt and their shared options);
- `tokenization_kwargs`: the keys vllm/renderers/params.py's TokenizeParams.with_kwargs reads.
A default is its JSON value where it is a literal (a set as a list), {"factory": "X"} for a dataclass field made by
X() (a config object's defaults), {"expr": "..."} for anything else. Not a test; run by hand when vLLM moves.
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from typing import Any

CONFIG_PREFIX = "vllm/config/"
FACTORY_VALUES: dict[str, Any] = {"dict": {}, "list": [], "set": []}


class Wheel:
    """The parsed modules of a vLLM wheel (a zip), by path."""

    def __init__(self, path: str) -> None:
        self.zip = zipfile.ZipFile(path)
        self._trees: dict[str, ast.Module] = {}

    def tree(self, name: str) -> ast.Module:
        if name not in self._trees:
            self._trees[name] = ast.parse(self.zip.read(name).decode())
        return self._trees[name]

    def classes(self, name: str) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in ast.walk(self.tree(name)) if isinstance(n, ast.ClassDef)}

    def config_fields(self) -> dict[str, dict[str, ast.expr | None]]:
        """class -> field -> its default's expression, of every class in vllm/config and EngineArgs."""
        out: dict[str, dict[str, ast.expr | None]] = {}
        names = sorted(n for n in self.zip.namelist() if n.startswith(CONFIG_PREFIX) and n.endswith(".py"))
        for name in [*names, "vllm/engine/arg_utils.py"]:
            for cls, node in self.classes(name).items():
                out.setdefault(cls, {}).update({s.target.id: s.value for s in node.body if isinstance(
                    s, ast.AnnAssign) and isinstance(s.target, ast.Name)})
        return out


def default_of(expr: ast.expr | None, fields: dict[str, dict[str, ast.expr | None]]) -> Any:
    """The JSON form of a default (see the module docstring); None when there is none."""
    if expr is None:
        return None
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.attr in fields.get(
            expr.value.id, {}):
        return default_of(fields[expr.value.id][expr.attr], fields)  # ModelConfig.seed
    if isinstance(expr, ast.Call):
        func = ast.unparse(expr.func)
        if func == "get_field" and len(expr.args) == 2 and isinstance(expr.args[1], ast.Constant):
            return default_of(fields[ast.unparse(expr.args[0])].get(str(expr.args[1].value)), fields)
        if func in ("field", "Field", "msgspec.field"):
            for kw in expr.keywords:
                if kw.arg == "default":
                    return default_of(kw.value, fields)
                if kw.arg == "default_factory":
                    made = ast.unparse(kw.value)
                    return FACTORY_VALUES.get(made, {"factory": made})
            return None
    try:
        value = ast.literal_eval(expr)
    except ValueError:
        return {"expr": ast.unparse(expr)}
    return sorted(value) if isinstance(value, (set, frozenset)) else list(value) if isinstance(value, tuple) \
        else value


def struct_fields(wheel: Wheel, name: str, cls: str) -> dict[str, Any]:
    """The public annotated fields of `cls` and their defaults."""
    fields = wheel.config_fields()
    return {s.target.id: default_of(s.value, fields) for s in wheel.classes(name)[cls].body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")}


def params(wheel: Wheel, name: str, cls: str, method: str) -> dict[str, Any]:
    """The parameters of `cls.method` (not self, not **kwargs) and their defaults (None where there is none)."""
    fn = next(n for n in wheel.classes(name)[cls].body if isinstance(n, ast.FunctionDef) and n.name == method)
    a = fn.args
    positional = [*a.posonlyargs, *a.args][1:]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = [*zip(positional, defaults, strict=True), *zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    fields = wheel.config_fields()
    return {arg.arg: default_of(d, fields) for arg, d in pairs}


def engine_args(wheel: Wheel, llm_init: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs' public fields and their defaults: `LLM.__init__`'s own where it has the argument with a default
    other than None (its None is "EngineArgs' default": a config object's, or {} for hf_overrides)."""
    own = struct_fields(wheel, "vllm/engine/arg_utils.py", "EngineArgs")
    return {name: d if llm_init.get(name) is None else llm_init[name] for name, d in own.items()}


def prompt_keys(wheel: Wheel) -> dict[str, list[str]]:
    classes = wheel.classes("vllm/inputs/llm.py")
    out = {}
    for cls in ("_PromptOptions", "TextPrompt", "TokensPrompt", "EmbedsPrompt", "DataPrompt",
                "ExplicitEncoderDecoderPrompt"):
        out[cls] = [s.target.id for s in classes[cls].body if isinstance(s, ast.AnnAssign)
                    and isinstance(s.target, ast.Name)]
    return out


def tokenization_kwargs(wheel: Wheel) -> list[str]:
    """The keys `TokenizeParams.with_kwargs` pops (the ones vLLM reads; it warns of any other)."""
    cls = wheel.classes("vllm/renderers/params.py")["TokenizeParams"]
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "with_kwargs")
    keys = [str(c.args[0].value) for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "pop" and c.args and isinstance(c.args[0], ast.Constant)]
    return list(dict.fromkeys(keys))


def completion_output(wheel: Wheel) -> dict[str, Any]:
    cls = wheel.classes("vllm/outputs.py")["CompletionOutput"]
    fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    return {"fields": fields, "methods": methods}


def main(path: str) -> dict[str, Any]:
    sp = "vllm/sampling_params.py"
    llm = "vllm/entrypoints/llm.py"
    init = params(Wheel(path), llm, "LLM", "__init__")
    wheel = Wheel(path)
    return {
        "vllm_version": "0.26.0",
        "extracted": "names and literal defaults only, by tests/vllm_python_api_extract.py from the vllm-0.26.0 "
                     "wheel's source read as text (ast, never imported)",
        "sampling_params": struct_fields(wheel, sp, "SamplingParams"),
        "structured_outputs": struct_fields(wheel, sp, "StructuredOutputsParams"),
        "llm_init": init,
        "engine_args": engine_args(wheel, init),
        "generate": params(wheel, llm, "LLM", "generate"),
        "chat": params(wheel, llm, "LLM", "chat"),
        "request_output": list(params(wheel, "vllm/outputs.py", "RequestOutput", "__init__")),
        "completion_output": completion_output(wheel),
        "prompt_keys": prompt_keys(wheel),
        "tokenization_kwargs": tokenization_kwargs(wheel),
    }


if __name__ == "__main__":
    json.dump(main(sys.argv[1]), sys.stdout, indent=1)
    sys.stdout.write("\n")
