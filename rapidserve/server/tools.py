"""Tool calling, the request side (issue 19): what a chat request's `tools` and `tool_choice` mean.

`plan_tools` checks them (400 naming the field) and decides, as vLLM does:
- no tools, or `tool_choice: "none"`: plain chat (the tools still go to the chat template, as in vLLM,
  so the model knows them; its text is never parsed for calls);
- `"auto"` (the default when tools are given): the model decides; its text is parsed with the server's
  tool-call parser (`--tool-call-parser`), which vLLM enables only with `--enable-auto-tool-choice`;
- `"required"`: the output is constrained to a JSON array of one or more `{"name": <a tool's name>,
  "parameters": <that tool's arguments>}` (the items' anyOf over the tools);
- a named function: the output is constrained to that function's `parameters` schema, and the answer
  is one call of it with the output as its arguments.
The constraint is `SamplingParams.structured_outputs` (a JSON schema), which the grammar engine enforces.

`resolve_parser` picks the parser of `--tool-call-parser auto` from the chat template and the model
family; `template_messages` turns the request's messages into what chat templates read (HF's shapes), and
`template_tools` its tools (for /v1/chat/completions and /tokenize alike).
Pure functions; no model, no server state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from rapidserve.sampling_params import StructuredOutputs
from rapidserve.server.errors import bad_request
from rapidserve.server.schema_parts import ChatMessage, NamedToolChoice, Tool
from rapidserve.server.schemas import ChatCompletionRequest
from rapidserve.server_config import TOOL_CALL_PARSERS

ToolMode = Literal["none", "auto", "required", "named"]
_FAMILY_PARSER = MappingProxyType({"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes", "llama": "llama3_json",
                                  "mistral": "mistral", "mixtral": "mistral"})


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for.

    - mode: "none" (no parsing), "auto" (parse with `parser`), "required" or "named" (constrained);
    - tools: the tools as dicts for the chat template (HF `apply_chat_template(tools=...)`);
    - names: the tools' function names, in order;
    - parser: the tool-call format to parse ("auto" mode only);
    - function: the forced function's name ("named" mode only);
    - schema: the JSON schema the output is constrained to ("required" and "named"), as JSON text;
    - parallel: the request's parallel_tool_calls is not false; false keeps only the first call the model makes, as
      vLLM's answer does ("auto"; "required"'s schema allows one call then, and "named" makes one anyway).
    """

    mode: ToolMode
    tools: tuple[dict[str, Any], ...]
    names: tuple[str, ...]
    parser: str | None = None
    function: str | None = None
    schema: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the generated text is turned into tool calls."""
        return self.mode != "none"

    def structured_outputs(self) -> StructuredOutputs | None:
        return None if self.schema is None else StructuredOutputs(json=self.schema)


def resolve_parser(flag: str, chat_template: str | None, arch: str) -> str | None:
    """The tool-call format for `--tool-call-parser flag`: the flag itself, or for "auto" the format
    the chat template writes calls in (`<tool_call>`: hermes; `[TOOL_CALLS]`: mistral; `<|python_tag|>` /
    `"parameters"`: llama3_json), else the model family's (Qwen2/Qwen3/Qwen3-MoE: hermes, Llama: llama3_json,
    Mistral/Mixtral: mistral); None if unknown."""
    if flag not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {flag!r}: use one of {', '.join(TOOL_CALL_PARSERS)}")
    if flag != "auto":
        return flag
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    return _FAMILY_PARSER.get(arch)


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template reads `tools` at all (templates that do not just leave them out)."""
    return bool(chat_template) and "tools" in (chat_template or "")


def _check_parameters(i: int, t: Tool) -> None:
    p = t.function.parameters
    if p is None:
        return
    kind = p.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise bad_request("tools", f"'tools[{i}].function.parameters' must be a JSON schema of an object "
                                   f"(\"type\": \"object\"), got \"type\": {json.dumps(kind)}")
    if "properties" in p and not isinstance(p["properties"], dict):
        raise bad_request("tools", f"'tools[{i}].function.parameters.properties' must be an object mapping "
                                   "argument names to their schemas")
    if "$defs" in p and not isinstance(p["$defs"], dict):
        raise bad_request("tools", f"'tools[{i}].function.parameters.$defs' must be an object mapping names to "
                                   "schemas")


def _tool_dict(t: Tool) -> dict[str, Any]:
    f: dict[str, Any] = {"name": t.function.name}
    if t.function.description is not None:
        f["description"] = t.function.description
    f["parameters"] = t.function.parameters if t.function.parameters is not None else {
        "type": "object", "properties": {}}
    defer = t.function.defer_loading if t.function.defer_loading is not None else t.defer_loading
    for key, v in (("strict", t.function.strict), ("defer_loading", defer)):  # set ones, as vLLM passes them
        if v is not None:
            f[key] = v
    out: dict[str, Any] = {"type": "function", "function": f}
    if t.defer_loading is not None:
        out["defer_loading"] = t.defer_loading
    return out


def template_tools(tools: list[Tool]) -> tuple[dict[str, Any], ...]:
    """The tools as the chat template gets them (`_tool_dict`), checked (400 naming 'tools'): the one rendering of
    a request's tools, for /v1/chat/completions and /tokenize alike, so both count the same prompt."""
    for i, t in enumerate(tools):
        _check_parameters(i, t)
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise bad_request("tools", f"'tools' holds two functions named {dup!r}: function names must be distinct")
    return tuple(_tool_dict(t) for t in tools)


def _mode(choice: str | NamedToolChoice | None, has_tools: bool) -> ToolMode:
    if isinstance(choice, NamedToolChoice):
        return "named"
    if choice is None:
        return "auto" if has_tools else "none"
    return choice  # type: ignore[return-value]


def _defs(tools: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The `$defs` of every tool's parameters, merged (the same name must mean the same schema)."""
    defs: dict[str, Any] = {}
    for i, t in enumerate(tools):
        for name, d in t["function"]["parameters"].get("$defs", {}).items():
            if name in defs and defs[name] != d:
                raise bad_request("tools", f"'tools[{i}]' defines $defs.{name} differently from an earlier tool: "
                                           "with tool_choice \"required\" the tools' $defs must agree; rename one")
            defs[name] = d
    return defs


def required_schema(tools: tuple[dict[str, Any], ...], parallel: bool) -> dict[str, Any]:
    """The output of tool_choice "required": a JSON array of one (`parallel` False: exactly one) or more
    calls {"name": a tool's name, "parameters": its arguments}, each item any of the tools. Unlike vLLM's,
    an item has no other keys (`additionalProperties: false`): otherwise a model may open an extra key
    and never close it, and the output would not parse as a call."""
    items = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    defs = _defs(tools)
    if defs:
        schema["$defs"] = defs
    return schema


def plan_tools(r: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """The request's tool plan, or a 400 naming the field. `auto_parser`: the server's tool-call format
    for "auto" (None: auto tool choice is not enabled, as vLLM without --enable-auto-tool-choice)."""
    tools = r.tools or []
    dicts = template_tools(tools)
    names = tuple(t.function.name for t in tools)
    mode = _mode(r.tool_choice, bool(tools))
    if mode in ("none", "auto") and not tools:
        return ToolPlan("none", dicts, names)  # nothing to call: plain chat
    if mode in ("required", "named") and not tools:
        raise bad_request("tool_choice", f"'tool_choice' {_show(r.tool_choice)} needs 'tools': give the functions "
                                         "the model may call")
    if mode == "none":
        return ToolPlan("none", dicts, names)
    if mode == "auto":
        if auto_parser is None:
            raise bad_request("tool_choice", "\"auto\" tool choice needs a server started with "
                                             "--enable-auto-tool-choice (and --tool-call-parser for models whose "
                                             "family is not recognised); send tool_choice \"required\", a named "
                                             "function or \"none\" instead")
        return ToolPlan("auto", dicts, names, parser=auto_parser, parallel=r.parallel_tool_calls is not False)
    if mode == "required":
        schema = required_schema(dicts, r.parallel_tool_calls is not False)
        return ToolPlan("required", dicts, names, schema=json.dumps(schema, ensure_ascii=False),
                        parallel=r.parallel_tool_calls is not False)
    assert isinstance(r.tool_choice, NamedToolChoice)
    name = r.tool_choice.function.name
    if name not in names:
        raise bad_request("tool_choice", f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                                         f"({', '.join(names)})")
    params = dicts[names.index(name)]["function"]["parameters"]
    return ToolPlan("named", dicts, names, function=name, schema=json.dumps(params, ensure_ascii=False))


def _show(choice: object) -> str:
    return f'"{choice}"' if isinstance(choice, str) else "naming a function"


def template_messages(r: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them (HF's shapes): text content joined; `developer` as
    `system`; an assistant's `tool_calls` with their arguments as a dict (as vLLM passes them: templates
    write them with `tojson`) and its `reasoning` (or `reasoning_content`) under both names, as vLLM passes it; a
    tool message's `tool_call_id`. 400 naming the message when one cannot be rendered."""
    return [_template_message(i, m) for i, m in enumerate(r.messages)]


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    if m.content is None and m.role != "assistant":
        raise bad_request("messages", f"'messages[{i}].content' must be a string or a list of text parts "
                                      "(null only for the assistant)")
    if m.tool_calls and m.role != "assistant":
        raise bad_request("messages", f"'messages[{i}].tool_calls' is only allowed on assistant messages")
    content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or [])
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:  # vLLM drops it from other roles' messages; refused here, never dropped
        if m.role != "tool":
            raise bad_request("messages", f"'messages[{i}].tool_call_id' is only allowed on tool messages (it names "
                                          "the call a tool message answers)")
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if m.reasoning is not None and m.reasoning_content is not None and m.reasoning != m.reasoning_content:
        raise bad_request("messages", f"'messages[{i}]' has both 'reasoning' and 'reasoning_content' (its older "
                                      "name), and they differ: give one")
    if reasoning is not None:
        if m.role != "assistant":
            raise bad_request("messages", f"'messages[{i}].reasoning' is only allowed on assistant messages")
        out["reasoning"] = out["reasoning_content"] = reasoning  # vLLM passes both names to the template
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                raise bad_request("messages", f"'messages[{i}].tool_calls[{j}].function.arguments' must be a JSON "
                                              "object as a string, e.g. \"{\\\"city\\\": \\\"Paris\\\"}\"")
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out
