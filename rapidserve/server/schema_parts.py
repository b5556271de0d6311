"""The parts of the request bodies (schemas.py): messages, tools, response formats, structured outputs, stream
options, and the bounds they share. Every Struct here refuses a field it does not declare (`Strict`): a body
never carries something this server would drop unseen (body.py names the field in its 400); vLLM's fields it
does not serve are declared as `Unsupported` and refused by name unless null (unsupported.py).
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rapidserve.sampling_params import INT32_MAX


class Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request Struct that refuses fields it does not declare (a 400 naming the field, body.py)."""


# A vLLM field this server does not serve: any JSON value decodes, and unsupported.py refuses all but null
# and the value of vLLM's that asks for nothing (its error names the field and that value).
Unsupported = Annotated[Any, Meta(description="vLLM's field, not supported by this server: only null or vLLM's "
                                              "default (the value that asks for nothing)")]

MAX_N = 16  # samples per prompt
MAX_TEMPERATURE = 2.0
MAX_PROMPTS = 1024  # prompts in one completions request (also bounded by the server's capacity)
MAX_MESSAGES = 1024
MAX_STOP_CHARS = 1024  # characters in one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_TOOLS = 128  # tools in one request, and tool calls in one message
MAX_BAD_WORD_CHARS = 256
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")

TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]  # and below the model's vocabulary size (checked per model)
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]
Text = Annotated[str, Meta(min_length=1)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class StreamOptions(Strict, kw_only=True):
    """Options of a streamed answer (only with `stream: true`)."""

    include_usage: bool | None = None
    continuous_usage_stats: Annotated[bool, Meta(description=(
        "with include_usage: every chunk also carries the usage of its choice so far (vLLM's field)"))] | None = None


class ContentPart(Strict, kw_only=True):
    """One part of a message's content: only text parts are supported."""

    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="a function name: 1 to 64 letters, "
                                    "digits, underscores or dashes")]


class CalledFunction(Strict, kw_only=True):
    """The function an earlier assistant turn called: its name and its arguments (a JSON object, as text)."""

    name: Annotated[str, Meta(min_length=1, max_length=256, description="the called function's name")]
    arguments: Annotated[str, Meta(description="the call's arguments: a JSON object as a string")] = "{}"


class MessageToolCall(Strict, kw_only=True):
    """One tool call of an earlier assistant message (OpenAI's shape)."""

    id: Annotated[str, Meta(max_length=256, description="the call's id, which the tool message answering it "
                                                         "quotes as tool_call_id")] = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict, kw_only=True):
    """One chat message; `content` may be null only for the assistant; `developer` is read as `system`.

    An assistant message may carry the `tool_calls` it made; a `tool` message answers one of them
    (`tool_call_id`) with its result as `content`."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: Annotated[str, Meta(max_length=256, description="the author's name (passed to the chat template)")] \
        | None = None
    tool_calls: Annotated[list[MessageToolCall], Meta(max_length=MAX_TOOLS, description=(
        f"only on assistant messages: at most {MAX_TOOLS} calls {{\"id\", \"type\": \"function\", "
        "\"function\": {\"name\", \"arguments\": a JSON object as a string}}"))] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256, description="only on tool messages: the id of the call this "
                                                                   "message answers")] | None = None
    # an assistant turn's reasoning, for templates that show earlier reasoning (vLLM's `reasoning`; its older name
    # `reasoning_content`, which vLLM renames): passed to the template under both names
    reasoning: Annotated[str, Meta(description="only on assistant messages: the reasoning of that turn")] | None = None
    reasoning_content: Annotated[str, Meta(description="the older name of 'reasoning'")] | None = None
    # null only (unsupported.py refuses the rest by name): vLLM's developer-message tools and DeepSeek V4 task
    # marker, and OpenAI's assistant-message fields that a client echoing a response back may carry
    tools: Unsupported = None
    task: Unsupported = None
    refusal: Unsupported = None
    audio: Unsupported = None
    function_call: Unsupported = None
    annotations: Unsupported = None


class FunctionDefinition(Strict, kw_only=True):
    """A function the model may call (OpenAI's shape)."""

    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="the arguments, as a JSON schema of an object (`\"type\": "
                                                           "\"object\"`); omitted: no arguments")] | None = None
    strict: bool | None = None  # passed to the chat template with the tool when set, as vLLM does
    defer_loading: bool | None = None  # the same (vLLM's)


class Tool(Strict, kw_only=True):
    """One tool: only functions."""

    type: Annotated[Literal["function"], Meta(description="\"function\" (the only kind of tool; the default, as "
                                                          "vLLM's)")] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None  # vLLM's: the function's defer_loading when that is unset


class NamedFunction(Strict, kw_only=True):
    name: FunctionName


class NamedToolChoice(Strict, kw_only=True):
    """Force a call of this function (one of `tools`)."""

    type: Annotated[Literal["function"], Meta(description="\"function\" (the default, as vLLM's)")] = "function"
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, Meta(
    description="\"none\" (no calls), \"auto\" (the model decides; needs the server's --enable-auto-tool-choice), "
                "\"required\" (at least one call) or {\"type\": \"function\", \"function\": {\"name\": one of tools}} "
                "(a call of that function); default: \"auto\" when tools are given, else \"none\"")]


MAX_CHOICES = 256  # guided_choice / structured_outputs.choice alternatives
MAX_GRAMMAR_CHARS = 65536  # regex and grammar texts (JSON schemas are bounded by the body size)
MAX_TEMPLATE_CHARS = 65536  # a chat request's own chat template
Regex = Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS, description="a non-empty regular expression "
                            f"of at most {MAX_GRAMMAR_CHARS} characters, matched against the whole output")]
Grammar = Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS, description="a non-empty Lark (or GBNF) "
                              f"grammar of at most {MAX_GRAMMAR_CHARS} characters")]
Choices = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(
    min_length=1, max_length=MAX_CHOICES, description=f"a list of 1 to {MAX_CHOICES} non-empty strings; the output is "
                                                      "exactly one of them")]
JsonSchemaValue = Annotated[dict[str, Any] | str, Meta(description="a JSON schema: an object, or its JSON text")]


class JsonSchemaFormat(Strict, kw_only=True):
    """`response_format.json_schema` (OpenAI): the output is one JSON value valid against `schema`."""

    name: Annotated[str, Meta(min_length=1, max_length=256, description="the schema's name")] | None = None
    description: str | None = None
    schema: Annotated[dict[str, Any], Meta(description="a JSON schema object")] | None = None
    strict: bool | None = None  # always enforced on this server


class ResponseFormat(Strict, kw_only=True):
    """`{"type": "text"}` (free text), `{"type": "json_object"}` (any JSON object) or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`; vLLM's `structural_tag` is refused by
    name (structured_fields.py)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: Unsupported = None  # structural_tag's (refused with it)
    triggers: Unsupported = None
    format: Unsupported = None


class StructuredOutputsBody(Strict, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json: JsonSchemaValue | None = None
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None
    disable_any_whitespace: Annotated[bool, Meta(description=(
        "JSON without whitespace between tokens: always so on this server (false, vLLM's default, is accepted: "
        "compact JSON is among what it allows)"))] | None = None
    disable_additional_properties: Annotated[bool, Meta(description=(
        "true: a JSON schema's objects that do not say `additionalProperties` get false"))] | None = None
    whitespace_pattern: Unsupported = None  # refused unless null (structured_fields.py)
    structural_tag: Unsupported = None

