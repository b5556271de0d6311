"""The request bodies of the generation endpoints, declared once as msgspec Structs.

`CompletionRequest` (POST /v1/completions), `ChatCompletionRequest` (POST /v1/chat/completions) and
`GenerateRequest` (POST /generate) are what a body is decoded into (`requests.decode_body`) and what
/openapi.json describes (`openapi.py`). The constraints here are the static ones: types, and ranges
that bound every value the engine will encode (int64 seeds, bounded counts and lengths); what
depends on the served model (vocabulary size, context length, capacity) is checked in requests.py.
A field a Struct does not declare is refused by name (schema_parts.Strict), never dropped: vLLM ignores
unknown fields, this server says so. Each field's `description` says what is allowed;
validation errors quote it.
"""

from typing import Annotated, Any, Literal

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
from rapidserve.server.schema_parts import (
    CHAT_ROLES,
    MAX_BAD_WORD_CHARS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TEMPLATE_CHARS,
    MAX_TOOLS,
    ChatMessage,
    Choices,
    Grammar,
    JsonSchemaValue,
    Regex,
    ResponseFormat,
    StopString,
    StreamOptions,
    Strict,
    StructuredOutputsBody,
    Text,
    TokenId,
    TokenIds,
    Tool,
    ToolChoice,
    Unsupported,
)

# A field's description (what its error messages quote as "'field' is ...") sits on its non-null type.
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX, description="the most tokens to generate: an integer >= 1 that, "
                                "with the prompt, fits in the context (default: what is left, at most the server's "
                                "--default-max-tokens)")]
Stop = Annotated[StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)], Meta(
    description=f"a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of at most {MAX_STOP_STRINGS}"
                " such strings")]
NotSupported = "not supported by this server: only {} or null"

Penalty = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), subtracted from the logit of a token {{}}"
BadWord = Annotated[str, Meta(min_length=1, max_length=MAX_BAD_WORD_CHARS)]
MessagesHelp = (f"a non-empty list of at most {MAX_MESSAGES} messages {{\"role\": one of {', '.join(CHAT_ROLES)}; "
                "\"content\": a string or a list of {\"type\": \"text\", \"text\": string}}")


class _SamplingRequest(Strict, kw_only=True):
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
    return_token_offsets: Unsupported = None  # vLLM's /render endpoints' (ignored by its generation endpoints)
    logprob_token_ids: Unsupported = None
    ec_transfer_params: Unsupported = None
    repetition_detection: Unsupported = None
    thinking_token_budget: Unsupported = None  # vLLM's cap on reasoning tokens
    # SGLang's, which vllm-router (deploy/router) adds to every request it forwards, at their defaults
    no_stop_trim: Unsupported = None
    return_hidden_states: Unsupported = None
    # vLLM's: keep only the last (or first) k prompt tokens (the rendered chat's too) when the prompt is longer
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT32_MAX, description=(
        "an integer >= 1: a longer prompt keeps only this many tokens (its last; its first with truncation_side "
        "\"right\"); -1: as many as fit beside max_tokens"))] | None = None
    truncation_side: Annotated[Literal["left", "right"], Meta(description=(
        "which end truncate_prompt_tokens cuts: \"left\" keeps the last tokens (the default, as vLLM's for "
        "generation), \"right\" the first"))] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=256, description=(
        "the response's id is \"cmpl-\" (chat: \"chatcmpl-\") and this, as vLLM's (1 to 256 characters)"))] \
        | None = None
    return_token_ids: Annotated[bool, Meta(description=(
        "true: each choice (/generate: the answer) also carries its token ids (`token_ids`) and the prompt's "
        "(`prompt_token_ids`; streams: in each choice's first chunk), as vLLM's"))] | None = None
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
        "without one false is refused (the reasoning is not told apart from the content), true changes "
        "nothing"))] | None = None
    reasoning_effort: Annotated[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"], Meta(description=(
        "a chat template variable, as in vLLM: templates that read `reasoning_effort` (gpt-oss's) render it; "
        "the same as chat_template_kwargs.reasoning_effort; unless chat_template_kwargs sets enable_thinking, it "
        "sets it too (false for \"none\", else true), as vLLM does"))] | None = None
    media_io_kwargs: Unsupported = None  # vLLM's: text-only models here
    return_prompt_text: Unsupported = None
    return_assistant_tokens_mask: Unsupported = None  # vLLM's /render endpoints'
    separate_reasoning: Unsupported = None  # SGLang's, forwarded by vllm-router at its default (true)
    stream_reasoning: Unsupported = None  # as separate_reasoning
    # OpenAI's fields that vLLM does not declare (it ignores them): refused by name unless they ask for nothing
    store: Unsupported = None
    metadata: Unsupported = None
    service_tier: Unsupported = None
    modalities: Unsupported = None
    verbosity: Unsupported = None
    prediction: Unsupported = None
    audio: Unsupported = None
    function_call: Unsupported = None
    functions: Unsupported = None
    moderation: Unsupported = None
    web_search_options: Unsupported = None
    prompt_cache_retention: Unsupported = None
    prompt_cache_options: Unsupported = None
    # accepted, with no effect here (unsupported.NO_EFFECT says why)
    prompt_cache_key: Annotated[str, Meta(description=(
        "accepted: this server's prefix cache is automatic and shared, so a key changes nothing"))] | None = None
    safety_identifier: Annotated[str, Meta(description=(
        "an end-user id for abuse monitoring: written to the request's log line, as `user`; it does not change "
        "the answer"))] | None = None


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
