"""The request bodies of the generation endpoints, declared once as msgspec Structs.

`CompletionRequest` (POST /v1/completions), `ChatCompletionRequest` (POST /v1/chat/completions) and
`GenerateRequest` (POST /generate) are what a body is decoded into (`requests.decode_body`) and what
/openapi.json describes (`openapi.py`). The constraints here are the static ones: types, and ranges
that bound every value the engine will encode (int64 seeds, bounded counts and lengths); what
depends on the served model (vocabulary size, context length, capacity) is checked in requests.py.
Unknown fields are ignored, as OpenAI and vLLM do. Each field's `description` says what is allowed;
validation errors quote it.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rapidserve.sampling_params import (
    INT32_MAX,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
)

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


class StreamOptions(msgspec.Struct, kw_only=True):
    """Options of a streamed answer (only with `stream: true`)."""

    include_usage: bool | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content: only text parts are supported."""

    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="a function name: 1 to 64 letters, "
                                    "digits, underscores or dashes")]


class CalledFunction(msgspec.Struct, kw_only=True):
    """The function an earlier assistant turn called: its name and its arguments (a JSON object, as text)."""

    name: Annotated[str, Meta(min_length=1, max_length=256, description="the called function's name")]
    arguments: Annotated[str, Meta(description="the call's arguments: a JSON object as a string")] = "{}"


class MessageToolCall(msgspec.Struct, kw_only=True):
    """One tool call of an earlier assistant message (OpenAI's shape)."""

    id: Annotated[str, Meta(max_length=256, description="the call's id, which the tool message answering it "
                                                         "quotes as tool_call_id")] = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
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


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A function the model may call (OpenAI's shape)."""

    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="the arguments, as a JSON schema of an object (`\"type\": "
                                                           "\"object\"`); omitted: no arguments")] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """One tool: only functions."""

    type: Annotated[Literal["function"], Meta(description="\"function\" (the only kind of tool)")]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """Force a call of this function (one of `tools`)."""

    type: Annotated[Literal["function"], Meta(description="\"function\"")]
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


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """`response_format.json_schema` (OpenAI): the output is one JSON value valid against `schema`."""

    name: Annotated[str, Meta(min_length=1, max_length=256, description="the schema's name")] | None = None
    description: str | None = None
    schema: Annotated[dict[str, Any], Meta(description="a JSON schema object")] | None = None
    strict: bool | None = None  # always enforced on this server


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`{"type": "text"}` (free text), `{"type": "json_object"}` (any JSON object) or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json: JsonSchemaValue | None = None
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None


# A field's description (what its error messages quote as "'field' is ...") sits on its non-null type.
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX, description="the most tokens to generate: an integer >= 1 that, "
                                "with the prompt, fits in the context (default: what is left, at most the server's "
                                "--default-max-tokens)")]
Stop = Annotated[StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)], Meta(
    description=f"a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of at most {MAX_STOP_STRINGS}"
                " such strings")]
NotSupported = "not supported by this server: only {} or null"

# A vLLM field this server does not serve: any JSON value decodes, and unsupported.py refuses all but null
# and the value of vLLM's that asks for nothing (its error names the field and that value).
Unsupported = Annotated[Any, Meta(description="vLLM's field, not supported by this server: only null or vLLM's "
                                              "default (the value that asks for nothing)")]
Penalty = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), subtracted from the logit of a token {{}}"
BadWord = Annotated[str, Meta(min_length=1, max_length=MAX_BAD_WORD_CHARS)]
MessagesHelp = (f"a non-empty list of at most {MAX_MESSAGES} messages {{\"role\": one of {', '.join(CHAT_ROLES)}; "
                "\"content\": a string or a list of {\"type\": \"text\", \"text\": string}}")


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """The fields every generation endpoint takes (vLLM's names and defaults; null = the default)."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE, description=f"a number in [0, {MAX_TEMPERATURE:g}]"
                                       " (0 = greedy; default 1)")] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0, description="a number in (0, 1] (1 = off)")] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX, description=f"-1, 0 (both off) or an integer in [1, {INT32_MAX}] "
                               "(values of at least the vocabulary size are off too)")] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0, description="a number in [0, 1] (0 = off)")] | None = None
    seed: Annotated[int, Meta(ge=SEED_MIN, le=SEED_MAX, description="a 64-bit signed integer; sample j of n uses "
                              "seed + j, which must fit as well")] | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS, description=f"a list of at most "
                                                  f"{MAX_STOP_TOKEN_IDS} token ids")] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX, description="an integer >= 0, at most max_tokens")] \
        | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    add_special_tokens: Annotated[bool, Meta(description=(
        "add the tokenizer's special tokens (BOS) when a text prompt is encoded: default true for completions and "
        "/generate, false for chat (whose template writes them)"))] | None = None
    include_stop_str_in_output: Annotated[bool, Meta(description=(
        "true: the text keeps the stop string, or the text of the stop token (EOS, stop_token_ids), that ended "
        "it (vLLM's field); default false: both are left out"))] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY, description=Penalty.format(
        "that is among the outputs so far"))] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY, description=Penalty.format(
        "once per time it is among the outputs so far"))] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, description="a number > 0 (1 = off): a token of the prompt or "
                                              "the outputs has its logit divided by it if positive, else multiplied "
                                              "by it")] | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES, description=(
        f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (as strings, e.g. \"50256\") in the vocabulary, "
        f"each to a bias added to its logit (clamped to [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}])"))] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS, description=(
        f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids in the vocabulary: only these may be "
        "generated"))] | None = None
    bad_words: Annotated[list[BadWord], Meta(max_length=MAX_BAD_WORDS, description=(
        f"a list of at most {MAX_BAD_WORDS} words (non-blank strings of at most {MAX_BAD_WORD_CHARS} characters) "
        "that must not be generated"))] | None = None
    # vLLM's fields this server refuses unless they ask for nothing (unsupported.py).
    use_beam_search: Annotated[bool, Meta(description="not supported by this server (it samples): only false or "
                                                      "null")] | None = None
    length_penalty: Annotated[float, Meta(description="beam search's length penalty: no effect without beam search "
                                                      "(as in vLLM), which this server does not do")] | None = None
    prompt_logprobs: Annotated[int, Meta(description="not supported by this server (the logprobs of prompt tokens "
                                                     "are not computed): only null")] | None = None
    priority: Unsupported = None
    spaces_between_special_tokens: Unsupported = None
    return_tokens_as_token_ids: Unsupported = None
    logits_processors: Unsupported = None
    cache_salt: Unsupported = None
    kv_transfer_params: Unsupported = None
    vllm_xargs: Unsupported = None
    mm_processor_kwargs: Unsupported = None
    guided_decoding_backend: Unsupported = None
    guided_whitespace_pattern: Unsupported = None
    structural_tag: Unsupported = None
    # vLLM's: keep only the last k prompt tokens (the rendered chat's too) when the prompt is longer
    truncate_prompt_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX, description=(
        "an integer >= 1: a longer prompt keeps only its last this many tokens"))] | None = None
    response_format: ResponseFormat | None = None
    # Structured outputs (vLLM's fields; at most one of these and a non-text response_format).
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: JsonSchemaValue | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None


N = Annotated[int, Meta(ge=1, le=MAX_N, description=f"the samples per prompt: an integer in [1, {MAX_N}]")]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]")]
BestOf = Annotated[int, Meta(description="not supported by this server (it returns every sample): only null or "
                                        "equal to n")]
PromptItem = Text | TokenId | TokenIds  # decoded as one list, then checked not to mix (msgspec's unions hold one list)


def prompt_json_schema() -> dict[str, Any]:
    """The shapes `CompletionRequest.prompt` accepts, exactly (msgspec's schema of it allows mixed lists)."""
    token_id = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
    batch = {"minItems": 1, "maxItems": MAX_PROMPTS}
    return {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token_id, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, **batch},
        {"type": "array", "items": {"type": "array", "items": token_id, "minItems": 1}, **batch}]}


class CompletionRequest(_SamplingRequest, kw_only=True):
    """POST /v1/completions."""

    prompt: Annotated[Text | Annotated[list[PromptItem], Meta(min_length=1)], Meta(  # batch size: requests.py
        description=f"a non-empty string, a list of token ids, or a batch of at most {MAX_PROMPTS} strings or of at "
                    f"most {MAX_PROMPTS} lists of token ids (not a mix)")]
    n: N | None = None
    logprobs: Logprobs | None = None
    echo: bool | None = None
    best_of: BestOf | None = None
    suffix: Annotated[str, Meta(description=NotSupported.format('""'))] | None = None
    prompt_embeds: Unsupported = None


# The chat template's inputs, as chat requests and /tokenize's chats take them (server/chat_render.py checks them).
AddGenerationPrompt = Annotated[bool, Meta(description="end the prompt with the assistant's turn header (default "
                                                       "true)")]
ContinueFinalMessage = Annotated[bool, Meta(description="end the prompt inside the last message, for the model to "
                                                        "go on with it (default false); needs add_generation_prompt "
                                                        "false")]
Documents = Annotated[list[dict[str, str]], Meta(max_length=MAX_MESSAGES, description=(
    f"at most {MAX_MESSAGES} documents for a retrieval-augmented chat template, each an object of strings "
    "(e.g. {\"title\", \"text\"}); a template that does not read them leaves them out"))]
RequestChatTemplate = Annotated[str, Meta(min_length=1, max_length=MAX_TEMPLATE_CHARS, description=(
    f"a Jinja chat template of at most {MAX_TEMPLATE_CHARS} characters for this request instead of the "
    "server's; only on a server started with --trust-request-chat-template"))]
ChatTemplateKwargs = Annotated[dict[str, Any], Meta(description=(
    "more variables for the chat template, an object of JSON values (e.g. {\"enable_thinking\": false} for "
    "Qwen3); it may also carry add_generation_prompt, continue_final_message and documents"))]


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES, description=MessagesHelp)]
    n: N | None = None
    max_completion_tokens: MaxTokens | None = None  # wins over max_tokens
    best_of: BestOf | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS, description=(
        f"at most {MAX_TOOLS} tools {{\"type\": \"function\", \"function\": {{\"name\": 1 to 64 letters, digits, "
        "underscores or dashes (a function name), \"description\", \"parameters\": a JSON schema object}}, with "
        "distinct names"))] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Annotated[bool, Meta(description="false: at most one call (enforced with tool_choice "
                                                          "\"required\"); default true")] | None = None
    echo: Unsupported = None  # vLLM's chat echo (the last message before the answer)
    # How the chat template renders the messages (vLLM's fields; server/chat_render.py checks them; /tokenize
    # takes the same ones).
    add_generation_prompt: AddGenerationPrompt | None = None
    continue_final_message: ContinueFinalMessage | None = None
    documents: Documents | None = None
    chat_template: RequestChatTemplate | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    include_reasoning: Annotated[bool, Meta(description=(
        "on a server with --reasoning-parser: false leaves the reasoning out of the answer (default true); "
        "without one there is no reasoning to include"))] | None = None
    reasoning_effort: Annotated[Literal["low", "medium", "high"], Meta(description=(
        "a chat template variable, as in vLLM: templates that read `reasoning_effort` (gpt-oss's) render it; "
        "the same as chat_template_kwargs.reasoning_effort"))] | None = None
    thinking_token_budget: Unsupported = None  # vLLM's cap on reasoning tokens: refused (server/unsupported.py)


class GenerateRequest(_SamplingRequest, kw_only=True):
    """POST /generate (the plain native shape): one prompt, one sample."""

    prompt: Annotated[Text | TokenIds, Meta(description="a non-empty string or a non-empty list of token ids")]
    n: Annotated[int, Meta(ge=1, le=1, description="1 or null: /generate makes one sample")] | None = None
    max_new_tokens: MaxTokens | None = None  # used when max_tokens is null


RequestBody = CompletionRequest | ChatCompletionRequest | GenerateRequest


def body_type(kind: str) -> type[RequestBody]:
    """The body Struct of the `kind` endpoint ("completion", "chat" or "generate")."""
    types: dict[str, type[RequestBody]] = {
        "completion": CompletionRequest, "chat": ChatCompletionRequest, "generate": GenerateRequest}
    if kind not in types:
        raise ValueError(f"kind={kind!r} must be one of {', '.join(types)}")
    return types[kind]
