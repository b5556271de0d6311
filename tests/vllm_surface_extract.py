"""Rebuild tests/data/vllm_0_26_surface.json from a vLLM wheel's Python source, read as text (never imported).

    unzip -q -o vllm-0.26.0-*.whl 'vllm/entrypoints/*' 'vllm/engine/arg_utils.py' 'vllm/sampling_params.py' \
        'vllm/config/*' -d /tmp/vllm026
    python -m tests.vllm_surface_extract /tmp/vllm026 > tests/data/vllm_0_26_surface.json   # then keep the notes

Only names are taken: the annotated fields of vLLM's request models (pydantic classes, TypedDicts, dataclasses;
their aliases where they have one) and the option strings of `vllm serve`'s parser (`add_argument` calls of
EngineArgs / AsyncEngineArgs and make_arg_parser, and the fields of the FrontendArgs dataclasses, which become
`--field-name`). A flag whose config field is typed bool (not `bool | str | None`) also gets its `--no-` form,
as vLLM's get_kwargs makes it with BooleanOptionalAction. Not a test; run by hand when vLLM moves.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

ENTRY = "vllm/entrypoints"
REQUEST_MODELS: dict[str, tuple[str, str]] = {  # group -> (file, class)
    "completion": (f"{ENTRY}/openai/completion/protocol.py", "CompletionRequest"),
    "chat": (f"{ENTRY}/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
    "tokenize_prompt": (f"{ENTRY}/serve/tokenize/protocol.py", "TokenizeCompletionRequest"),
    "tokenize_chat": (f"{ENTRY}/serve/tokenize/protocol.py", "TokenizeChatRequest"),
    "detokenize": (f"{ENTRY}/serve/tokenize/protocol.py", "DetokenizeRequest"),
    "stream_options": (f"{ENTRY}/openai/engine/protocol.py", "StreamOptions"),
    "response_format": (f"{ENTRY}/openai/engine/protocol.py", "ResponseFormat"),
    "response_format.json_schema": (f"{ENTRY}/openai/engine/protocol.py", "JsonSchemaResponseFormat"),
    "structured_outputs": ("vllm/sampling_params.py", "StructuredOutputsParams"),
    "tools[]": (f"{ENTRY}/openai/chat_completion/protocol.py", "ChatCompletionToolsParam"),
    "tools[].function": (f"{ENTRY}/openai/engine/protocol.py", "FunctionDefinition"),
    "tool_choice": (f"{ENTRY}/openai/chat_completion/protocol.py", "ChatCompletionNamedToolChoiceParam"),
    "messages[]": (f"{ENTRY}/chat_utils.py", "CustomChatCompletionMessageParam"),
}


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def _alias(value: ast.expr | None) -> str | None:
    if isinstance(value, ast.Call):
        for kw in value.keywords:
            if kw.arg == "alias" and isinstance(kw.value, ast.Constant):
                return str(kw.value.value)
    return None


def model_fields(root: Path, file: str, cls: str) -> list[str]:
    """The public annotated fields of `cls` (by their JSON name: the alias where there is one)."""
    out = []
    for stmt in _classes(root / file)[cls].body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            if name.startswith("_") or "ClassVar" in ast.unparse(stmt.annotation):
                continue
            out.append(_alias(stmt.value) or name)
    return out


def _config_types(root: Path) -> dict[str, dict[str, str]]:
    """Every config dataclass of vllm/config and EngineArgs: class -> field -> its annotation's text."""
    out: dict[str, dict[str, str]] = {}
    for path in [*sorted((root / "vllm/config").glob("*.py")), root / "vllm/engine/arg_utils.py"]:
        for name, node in _classes(path).items():
            out.setdefault(name, {}).update({s.target.id: ast.unparse(s.annotation) for s in node.body if isinstance(
                s, ast.AnnAssign) and isinstance(s.target, ast.Name)})
    return out


def _is_bool(annotation: str) -> bool:
    parts = {p.strip() for p in annotation.split("|")}
    return "bool" in parts and parts != {"bool", "str", "None"}


def engine_flags(root: Path) -> list[str]:
    """The option strings of EngineArgs.add_cli_args and AsyncEngineArgs.add_cli_args (with `--no-` forms)."""
    tree = ast.parse((root / "vllm/engine/arg_utils.py").read_text())
    types = _config_types(root)
    kwargs_of: dict[str, str] = {}  # model_kwargs -> ModelConfig
    flags: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func) == "get_kwargs" and isinstance(node.targets[0], ast.Name):
            kwargs_of[node.targets[0].id] = ast.unparse(node.value.args[0])
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        boolean = any(kw.arg == "action" and "BooleanOptionalAction" in ast.unparse(kw.value) for kw in node.keywords)
        for kw in node.keywords:  # **model_kwargs["field"], or **{**model_kwargs["field"], ...}
            subs = [s for s in ast.walk(kw.value) if isinstance(s, ast.Subscript) and isinstance(s.value, ast.Name)
                    and s.value.id in kwargs_of] if kw.arg is None else []
            for sub in subs:
                key = ast.literal_eval(sub.slice)
                ann = types.get(kwargs_of[sub.value.id], {}).get(key) or types["EngineArgs"].get(key, "")
                boolean = boolean or _is_bool(ann)
        flags += names
        flags += [f"--no-{n[2:]}" for n in names if boolean and n.startswith("--")]
    return flags


def frontend_flags(root: Path) -> list[str]:
    """make_arg_parser's own flags and the FrontendArgs dataclasses' fields as flags."""
    path = root / f"{ENTRY}/openai/cli_args.py"
    classes = _classes(path)
    flags: list[str] = []
    for node in ast.walk(classes.get("make_arg_parser") or ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "make_arg_parser":
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
                        call.func.attr == "add_argument":
                    flags += [a.value for a in call.args if isinstance(a, ast.Constant) and
                              str(a.value).startswith("-")]
    for cls in ("BaseFrontendArgs", "FrontendArgs"):
        for s in classes[cls].body:
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                flag = "--" + s.target.id.replace("_", "-")
                flags.append(flag)
                if _is_bool(ast.unparse(s.annotation)):
                    flags.append("--no-" + flag[2:])
    return flags


def openai_only(fields: dict[str, list[str]]) -> dict[str, list[str]]:
    """OpenAI's request fields (the installed openai package's TypedDicts) that vLLM does not declare: vLLM
    accepts and ignores them; they are here because a client sends them to vLLM and to rapidserve alike."""
    from openai.types import completion_create_params as completion
    from openai.types.chat import ChatCompletionAssistantMessageParam
    from openai.types.chat import completion_create_params as chat

    def keys(td: Any) -> set[str]:
        return set(td.__annotations__)

    return {"completion": sorted(keys(completion.CompletionCreateParamsBase) - set(fields["completion"])),
            "chat": sorted(keys(chat.CompletionCreateParamsBase) - set(fields["chat"])),
            "messages[]": sorted(keys(ChatCompletionAssistantMessageParam) - set(fields["messages[]"]))}


def main(root: Path) -> dict[str, Any]:
    fields = {group: model_fields(root, f, c) for group, (f, c) in REQUEST_MODELS.items()}
    # ChatCompletionRequest's before-validator renames a message's reasoning_content to reasoning: vLLM takes both
    fields["messages[]"].append("reasoning_content")
    return {
        "vllm_version": "0.26.0",
        "extracted": ("names only, by tests/vllm_surface_extract.py from the vllm-0.26.0 wheel's source read as text "
                      "(ast, never imported): request models' annotated fields, `vllm serve` add_argument option "
                      "strings and FrontendArgs fields as --flags, --no- forms of bool fields"),
        "sources": {group: f"{f}:{c}" for group, (f, c) in REQUEST_MODELS.items()} | {
            "serve_flags.frontend": f"{ENTRY}/openai/cli_args.py:make_arg_parser,BaseFrontendArgs,FrontendArgs",
            "serve_flags.engine": "vllm/engine/arg_utils.py:EngineArgs.add_cli_args,AsyncEngineArgs.add_cli_args",
            "openai_only": "openai-python's CompletionCreateParamsBase (chat, completions) and "
                           "ChatCompletionAssistantMessageParam, less vLLM's names (vLLM ignores these)"},
        "request_fields": fields,
        "openai_only": openai_only(fields),
        "serve_flags": {"frontend": sorted(set(frontend_flags(root))), "engine": sorted(set(engine_flags(root)))},
    }


if __name__ == "__main__":
    json.dump(main(Path(sys.argv[1])), sys.stdout, indent=1)
    sys.stdout.write("\n")
