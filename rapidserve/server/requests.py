"""Request parsing for the generation endpoints: a request body -> one validated `GenRequest`, or `APIError`.

The edge, in order; each step refuses with a 4xx naming the field before any costly work is done:
1. headers (body.py `check_headers`, called by the server first): JSON content type (415), size (413);
2. the body (body.py `decode_body`): UTF-8 JSON, an object, nested at most MAX_DEPTH deep, decoded into
   the endpoint's Struct (schemas.py), which checks types and static ranges;
3. what depends on the model and the server (`_prepare`): the model name (404), unsupported features,
   token ids below the vocabulary size, seed + n within int64, prompts x n within the server's
   capacity (a request that could never be admitted is a 400, not a 503), and texts no longer than
   max_model_len * CHARS_PER_TOKEN_BOUND characters, so no huge text is ever tokenized;
4. tokenization and the chat template (`_tokenize`), off the event loop for long inputs
   (`parse_request_async`);
5. the context-length check and the `SamplingParams` (`_finish`, with sampling_fields.py: a field the
   request leaves unset takes the model's recommended default, `ProtocolContext.defaults`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rapidserve.generation_config import SamplingDefaults
from rapidserve.prompt import PromptError, PromptLimits
from rapidserve.sampling_params import SEED_MAX, SamplingParams, StructuredOutputs
from rapidserve.server.body import decode_body
from rapidserve.server.chat_render import render_options, template_failure
from rapidserve.server.errors import APIError, bad_request, show
from rapidserve.server.prompt_fields import truncated, truncation
from rapidserve.server.reasoning_parsers import ReasoningPlan, plan_reasoning
from rapidserve.server.sampling_fields import build_params, check_controls, refuse_text_fields, resolve_max_tokens
from rapidserve.server.schemas import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestBody,
)
from rapidserve.server.structured_fields import check_servable, structured_field_of, structured_outputs_of
from rapidserve.server.tools import ToolPlan, plan_tools, template_messages
from rapidserve.server.unsupported import refuse_unsupported
from rapidserve.server_config import REASONING_PARSERS
from rapidserve.structured import GrammarCache, GrammarError, GrammarTrials, check
from rapidserve.tokenizer import Tokenizer

Kind = Literal["completion", "chat", "generate"]
CHARS_PER_TOKEN_BOUND = 64  # no token is longer: texts beyond max_model_len * this cannot fit, untokenized
OFFLOAD_CHARS = 4096  # inputs longer than this are tokenized in a worker thread, not on the event loop
OFFLOAD_BYTES = 256 * 1024  # bodies larger than this are decoded and checked in a worker thread


@dataclass(frozen=True)
class ProtocolContext:
    """What validation needs to know about the served model."""

    tokenizer: Tokenizer | None  # None: the model has no tokenizer (presets); only token-id prompts
    served_model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    tool_parser: str | None = None  # the tool-call format of tool_choice "auto"; None: auto not enabled
    trust_request_chat_template: bool = False  # a chat request may bring its own chat_template
    reasoning_parser: str | None = None  # chat answers are split into reasoning and content (--reasoning-parser)
    defaults: SamplingDefaults = SamplingDefaults()  # the model's, for the sampling fields a request leaves unset
    # Structured-output constraints checked so far (compiled once each; rapidserve/structured).
    grammars: GrammarCache = field(default_factory=lambda: GrammarCache(check, 256), compare=False)
    # Whether the grammar engine can serve each constraint with the model's tokenizer (compiled and tried
    # off the loop, structured_fields.check_servable); None: not checked here (no tokenizer: the workers fail it)
    trials: GrammarTrials | None = field(default=None, compare=False)
    # vLLM's server flags: template variables a chat gets unless it sets them, no tools to the template with
    # tool_choice "none", usage in every answer
    default_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_tools_when_none: bool = False
    force_include_usage: bool = False


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request.

    - prompts: token ids, one list per prompt (completions accept a batch; chat/generate have one).
      Each prompt is generated `params.n` times; completions choice index = prompt_idx * n + i.
    - prompt_texts: the prompt's text where it was given as text (or, with `echo`, decoded from the
      ids); None otherwise.
    - include_usage: whether the response carries `usage` (always for non-streaming responses;
      for streams only with `stream_options.include_usage`).
    - logprobs_style: which logprobs shape to answer ("completion", "chat") or None for none.
    """

    kind: Kind
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    user: str | None = None
    safety_identifier: str | None = None  # chat's end-user id for abuse monitoring: logged with `user`
    logprobs_style: Literal["completion", "chat"] | None = None
    tools: ToolPlan | None = None  # chat: what its tools ask for (mode "none" without tools); None: not a chat
    structured_param: str | None = None  # the field that set params.structured_outputs (errors name it)
    reasoning: ReasoningPlan | None = None  # chat on a server with a reasoning parser: how its answer is split
    request_id: str | None = None  # the request's own id (vLLM's request_id): the response's id is built on it
    return_token_ids: bool = False  # answer the token ids too (vLLM's return_token_ids)
    continuous_usage: bool = False  # every streamed chunk carries its choice's usage (stream_options)


# ---------------------------------------------------------------- what depends on the model and server


@dataclass(frozen=True)
class _Plan:
    """A decoded body that passed every check that needs no tokenizer."""

    kind: Kind
    model: str
    body: RequestBody
    n: int
    sources: list[str | list[int]]  # completions/generate: each prompt, as text or token ids
    messages: list[dict[str, Any]] | None  # chat: the messages for the template
    prompt_param: str
    work: int  # characters to tokenize (or token ids to decode for echo)
    tools: ToolPlan | None = None
    structured: StructuredOutputs | None = None
    render: dict[str, Any] | None = None  # chat: the keywords of Tokenizer.apply_chat_template (chat_render.py)
    structured_param: str | None = None  # the field that set it ("tools" for a tool_choice's constraint)
    reasoning: ReasoningPlan | None = None


def _resolve_model(name: str | None, ctx: ProtocolContext) -> str:
    names = ctx.served_model_names
    if name is None:  # the names are one model's (--served-model-name A B): as vLLM, the first
        return names[0]
    if name not in names:
        raise APIError(404, f"The model {show(name)} does not exist; this server serves {', '.join(names)}",
                       param="model", code="model_not_found")
    return name


def _check_prompt(ids: list[int], where: str, param: str, ctx: ProtocolContext) -> None:
    """The one prompt check (rapidserve/prompt.py), as a 400 naming the field."""
    try:
        PromptLimits(ctx.vocab_size, ctx.max_model_len).check(ids, where)
    except PromptError as e:
        raise bad_request(param, str(e), code=e.code) from None


def _check_text_size(chars: int, where: str, param: str, ctx: ProtocolContext) -> None:
    limit = ctx.max_model_len * CHARS_PER_TOKEN_BOUND
    if chars > limit:
        raise bad_request(param, f"This model's maximum context length is {ctx.max_model_len} tokens, but '{where}' "
                                 f"has {chars} characters: more than {limit} characters cannot fit",
                          code="context_length_exceeded")


def _prompt_sources(r: CompletionRequest | GenerateRequest) -> list[tuple[str, str | list[int]]]:
    """Each prompt, as text or token ids, with its name in error messages ("prompt" or "prompt[i]")."""
    p = r.prompt
    if isinstance(p, str) or all(isinstance(t, int) for t in p):
        return [("prompt", p)]  # type: ignore[list-item]
    if all(isinstance(t, str) for t in p) or all(isinstance(t, list) for t in p):
        if len(p) > MAX_PROMPTS:
            raise bad_request("prompt", f"'prompt' holds {len(p)} prompts: at most {MAX_PROMPTS} per request")
        return [(f"prompt[{i}]", s) for i, s in enumerate(p)]  # type: ignore[misc]
    raise bad_request("prompt", "'prompt' must be a string, a list of token ids, a list of strings or a list of "
                                "lists of token ids (not a mix)")


def _completion_sources(r: CompletionRequest | GenerateRequest,
                        ctx: ProtocolContext) -> tuple[list[str | list[int]], int]:
    """The prompts, checked without tokenizing them, and the characters (or ids, for echo) to tokenize (decode)."""
    sources: list[str | list[int]] = []
    work = 0
    for where, s in _prompt_sources(r):
        if isinstance(s, str):
            _check_text_size(len(s), where, "prompt", ctx)
            if ctx.tokenizer is None:
                raise bad_request("prompt", f"this model has no tokenizer: send '{where}' as a list of token ids")
            work += len(s)
        else:
            s = truncated(s, *truncation(r, ctx.max_model_len))
            _check_prompt(s, where, "prompt", ctx)
            work += len(s) if getattr(r, "echo", False) else 0
        sources.append(s)
    return sources, work


def _check_admissible(n_prompts: int, n: int, param: str, max_choices: int | None) -> None:
    """A request of more sequences than the server can ever hold would wait forever: 400, not 503."""
    if max_choices is not None and n_prompts * n > max_choices:
        raise bad_request(param if n_prompts > max_choices else "n",
                          f"this request asks for {n_prompts * n} sequences ({n_prompts} prompt(s) x n={n}), more "
                          f"than this server can ever hold at once ({max_choices} sequences: the running seats, "
                          f"--max-num-seqs capped by the largest decode graph, + --max-waiting): send at most "
                          f"{max_choices} per request")


def _with_tool_constraint(so: StructuredOutputs | None, tools: ToolPlan, ctx: ProtocolContext) \
        -> StructuredOutputs | None:
    """The request's one constraint once `tool_choice` has its say: a required or named choice constrains the
    output to its tools' JSON schema (checked and compiled like any other), which excludes a
    response_format or structured-output field in the same request."""
    tool_so = tools.structured_outputs()
    if tool_so is None:
        return so
    if so is not None:
        raise bad_request("tool_choice", "'tool_choice' required or a named function constrains the output to the "
                                         "tools' arguments: it cannot be combined with 'response_format' "
                                         "json_object/json_schema or a structured-output field; drop one")
    try:
        ctx.grammars.compile(tool_so)
    except GrammarError as e:
        if e.kind == "engine":
            raise APIError(501, f"'tool_choice' cannot be served: {e}", type="not_implemented_error",
                           param="tool_choice") from None
        raise bad_request("tools", f"the tools' parameter schemas cannot be enforced: {e}") from None
    return tool_so


def _check_constraint_after_reasoning(reasoning: ReasoningPlan | None, param: str | None) -> None:
    """A 400 for a constraint (from `param`) on an answer that begins with reasoning: vLLM applies it only once the
    reasoning has ended; this server's grammar would constrain the reasoning too, so the two are not combined."""
    if reasoning is None or not reasoning.thinking or param is None:
        return
    name = "tool_choice" if param == "tools" else param.split(".")[0]
    drop = "use tool_choice \"auto\" or \"none\"" if name == "tool_choice" else f"drop '{name}'"
    if reasoning.parser == "qwen3":
        drop += ", or send 'chat_template_kwargs': {\"enable_thinking\": false} for an answer without reasoning"
    raise bad_request(name, f"'{name}' constrains the output, but with --reasoning-parser {reasoning.parser} the "
                            "answer begins with the model's reasoning, which this server would constrain too "
                            f"(vLLM constrains only what follows it): {drop}")


def _prepare(kind: str, body: bytes, ctx: ProtocolContext, max_choices: int | None) -> _Plan:
    """Decode `body` and run every check that needs no tokenizer (cheap: no text is tokenized here)."""
    r = decode_body(kind, body)
    model = _resolve_model(r.model, ctx)
    n = r.n or 1
    refuse_unsupported(r, n)
    check_controls(r, ctx.tokenizer, ctx.vocab_size)
    if r.seed is not None and r.seed + n - 1 > SEED_MAX:
        raise bad_request("seed", f"'seed' + n - 1 must fit in a 64-bit signed integer (sample j of n uses seed + j):"
                                  f" with n={n}, 'seed' may be at most {SEED_MAX - n + 1}")
    if r.stop_token_ids and max(r.stop_token_ids) >= ctx.vocab_size:
        t = next(t for t in r.stop_token_ids if t >= ctx.vocab_size)
        raise bad_request("stop_token_ids", f"'stop_token_ids' holds {t}: token ids must be integers in "
                                            f"[0, {ctx.vocab_size})")
    if ctx.tokenizer is None:
        refuse_text_fields(r)
    if r.stream_options is not None and not r.stream:
        raise bad_request("stream_options", "'stream_options' is only allowed when 'stream' is true")
    so = structured_outputs_of(r, ctx.grammars)
    param = structured_field_of(r) if so is not None else None
    if isinstance(r, ChatCompletionRequest):
        messages = template_messages(r)
        tools = plan_tools(r, ctx.tool_parser)
        render = render_options(r, ctx.trust_request_chat_template, ctx.default_template_kwargs)
        work = sum(len(m["content"]) for m in messages) + sum(len(json.dumps(t)) for t in tools.tools) + len(
            json.dumps([render["documents"], render["template_kwargs"]]))
        _check_text_size(work, "messages", "messages", ctx)
        if ctx.tokenizer is None:
            raise bad_request("messages", "this model has no tokenizer or chat template: use /v1/completions with "
                                          "token ids")
        _check_admissible(1, n, "messages", max_choices)
        so = _with_tool_constraint(so, tools, ctx)
        param = param or ("tools" if so is not None else None)
        if r.include_reasoning is False and ctx.reasoning_parser is None:  # vLLM ignores it here; we cannot honour it
            raise bad_request("include_reasoning", "include_reasoning: false leaves the reasoning out of the answer, "
                                                   "which needs a server started with --reasoning-parser (one of "
                                                   f"{', '.join(REASONING_PARSERS)}): without one the reasoning is "
                                                   "not told apart from the content; drop the field or start the "
                                                   "server with a parser")
        reasoning = plan_reasoning(ctx.reasoning_parser, render["template_kwargs"], r.include_reasoning)
        _check_constraint_after_reasoning(reasoning, param)
        return _Plan(kind, model, r, n, [], messages, "messages", work, tools, so, render,  # type: ignore[arg-type]
                     structured_param=param, reasoning=reasoning)
    sources, work = _completion_sources(r, ctx)
    _check_admissible(len(sources), n, "prompt", max_choices)
    return _Plan(kind, model, r, n, sources, None, "prompt", work, None, so,  # type: ignore[arg-type]
                 structured_param=param)


def _check_servable(plan: _Plan, ctx: ProtocolContext) -> None:
    """The plan's constraint, tried with the model's tokenizer (structured_fields.check_servable)."""
    if plan.structured is not None and plan.structured_param is not None and ctx.trials is not None:
        check_servable(plan.structured, plan.structured_param, ctx.trials)


# ---------------------------------------------------------------- tokenization and the sampling params


def _tokenize(plan: _Plan, ctx: ProtocolContext) -> tuple[list[list[int]], list[str | None]]:
    """The prompts' token ids and texts (echo: decoded from the ids). Slow for long inputs: run off the loop."""
    tok = ctx.tokenizer
    keep, side = truncation(plan.body, ctx.max_model_len)
    if plan.messages is not None:
        assert tok is not None and plan.render is not None
        tools = list(plan.tools.tools) if plan.tools is not None and plan.tools.tools else None
        if plan.tools is not None and plan.tools.mode == "none" and ctx.exclude_tools_when_none:
            tools = None
        try:
            ids = tok.apply_chat_template(plan.messages, tools=tools, **plan.render)
        except Exception as e:  # the template's code failed on this request's inputs
            raise template_failure(e, plan.render) from None
        return [truncated(ids, keep, side)], [None]
    special = getattr(plan.body, "add_special_tokens", None) is not False
    encoded = [tok.encode(s, add_special_tokens=special) if isinstance(s, str) else s  # type: ignore[union-attr]
               for s in plan.sources]
    prompts = [truncated(p, keep, side) for p in encoded]
    texts = [s if isinstance(s, str) and len(p) == len(e) else None  # a truncated text is decoded for echo
             for s, p, e in zip(plan.sources, prompts, encoded, strict=True)]
    if getattr(plan.body, "echo", False) and tok is not None:
        texts = [t if t is not None else tok.decode(p) for t, p in zip(texts, prompts, strict=True)]
    return prompts, texts


def _finish(plan: _Plan, prompts: list[list[int]], texts: list[str | None], ctx: ProtocolContext) -> GenRequest:
    r = plan.body
    for i, p in enumerate(prompts):
        _check_prompt(p, plan.prompt_param if len(prompts) == 1 else f"{plan.prompt_param}[{i}]",
                      plan.prompt_param, ctx)
    logprobs: int | None = None
    style: Literal["completion", "chat"] | None = None
    if isinstance(r, ChatCompletionRequest):
        if r.logprobs:
            logprobs, style = r.top_logprobs or 0, "chat"
        elif r.top_logprobs is not None:
            raise bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    elif isinstance(r, CompletionRequest):
        logprobs = r.logprobs
        style = "completion" if logprobs is not None else None
        if r.echo and logprobs is not None:
            raise bad_request("echo", "'echo' with 'logprobs' would need the prompt's logprobs (prompt_logprobs), "
                                      "which this server does not compute: drop one of them")
    max_tokens = resolve_max_tokens(r, max(len(p) for p in prompts), ctx.max_model_len, ctx.default_max_tokens)
    params = build_params(r, plan.n, max_tokens, logprobs, plan.structured, ctx.tokenizer,
                          PromptLimits(ctx.vocab_size, ctx.max_model_len), ctx.defaults)
    if plan.tools is not None and plan.tools.mode == "auto" and plan.tools.parser == "mistral":
        # Mistral's [TOOL_CALLS] is a special token: the text keeps special tokens to be parsed (as vLLM does)
        params = params.replace(skip_special_tokens=False)
    include_usage = ctx.force_include_usage or (not r.stream if r.stream_options is None else
                                                bool(r.stream_options.include_usage))
    continuous = r.stream_options is not None and bool(r.stream_options.continuous_usage_stats)
    if continuous and not include_usage:
        raise bad_request("stream_options", "'stream_options.continuous_usage_stats' adds usage to every chunk: it "
                                            "needs 'stream_options.include_usage': true too")
    return GenRequest(kind=plan.kind, model=plan.model, prompts=prompts, prompt_texts=texts, params=params,
                      stream=bool(r.stream), include_usage=include_usage, echo=bool(getattr(r, "echo", False)),
                      user=r.user, safety_identifier=getattr(r, "safety_identifier", None), logprobs_style=style,
                      tools=plan.tools, structured_param=plan.structured_param,
                      reasoning=plan.reasoning, request_id=r.request_id, return_token_ids=bool(r.return_token_ids),
                      continuous_usage=continuous)


def parse_request(kind: str, body: bytes, ctx: ProtocolContext, max_choices: int | None = None) -> GenRequest:
    """Validate the JSON `body` of a request to the `kind` endpoint; raise `APIError` if it is invalid.

    `max_choices`: the most prompts x n the server can ever hold (None: no bound). Tokenizes on the
    calling thread; a server calls `parse_request_async`."""
    plan = _prepare(kind, body, ctx, max_choices)
    _check_servable(plan, ctx)
    return _finish(plan, *_tokenize(plan, ctx), ctx)


async def parse_request_async(kind: str, body: bytes, ctx: ProtocolContext,
                              max_choices: int | None = None) -> GenRequest:
    """As `parse_request`, with large bodies decoded and long inputs tokenized in the loop's executor, so
    the event loop never waits on them."""
    loop = asyncio.get_running_loop()
    if len(body) > OFFLOAD_BYTES:
        plan = await loop.run_in_executor(None, _prepare, kind, body, ctx, max_choices)
    else:
        plan = _prepare(kind, body, ctx, max_choices)
    if plan.structured is not None and ctx.trials is not None and not ctx.trials.known(plan.structured):
        await loop.run_in_executor(None, _check_servable, plan, ctx)  # a compile and a few masks
    else:
        _check_servable(plan, ctx)  # a cached verdict, or nothing to try
    if plan.work > OFFLOAD_CHARS:
        prompts, texts = await loop.run_in_executor(None, _tokenize, plan, ctx)
    else:
        prompts, texts = _tokenize(plan, ctx)
    return _finish(plan, prompts, texts, ctx)
