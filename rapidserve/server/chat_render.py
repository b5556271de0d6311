"""How a chat request's messages become its prompt, beyond the messages and tools (vLLM's fields).

`render_options` checks and merges what a chat request (/v1/chat/completions, or a chat on /tokenize) asks of the
chat template, into the keywords of `Tokenizer.apply_chat_template` (400 naming the field, before anything is
rendered):
- `add_generation_prompt` (default true): end with the assistant's turn header;
- `continue_final_message` (default false): end inside the last message so the model goes on with it;
  as in vLLM (and transformers) it needs `add_generation_prompt: false`;
- `documents`: a retrieval-augmented template's documents (objects of strings);
- `reasoning_effort` (none, minimal, low, medium, high, xhigh, max): a template variable, as vLLM passes it
  (gpt-oss's templates read it; others ignore it as vLLM's do); also accepted in `chat_template_kwargs`, where it
  must agree; at the top level it also sets `enable_thinking` (false for none, else true) unless
  `chat_template_kwargs` does, as vLLM does (Qwen3's and Gemma's templates read that);
- `chat_template_kwargs`: more template variables, an object of JSON values (Qwen3's `enable_thinking`);
  it may carry the three fields above too (vLLM merges them the same way): a value given both there and
  at the top level must agree. Names the renderer itself owns (`tokenize`, `messages`, `tools`...) are
  refused: they would change what is rendered, not a variable;
- `chat_template`: the request's own template, only on a server started with
  `--trust-request-chat-template` (vLLM's rule: a template is code the server runs), checked to parse;
- `add_special_tokens` (default false for chat): add the tokenizer's special tokens (BOS) when the
  rendered text is encoded, on top of those the template writes;
- the server's `--default-chat-template-kwargs`: variables a request gets unless it sets them itself.
Pure functions; no model, no server state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from rapidserve.server.errors import APIError, bad_request
from rapidserve.tokenizer import RENDERER_OWNS, ChatTemplateError, check_chat_template

MERGED_KWARGS = ("add_generation_prompt", "continue_final_message", "documents")  # top-level fields, too
RESERVED_KWARGS = RENDERER_OWNS - set(MERGED_KWARGS)  # refused in chat_template_kwargs


class ChatRenderFields(Protocol):
    """The fields a request renders a chat with (schemas.ChatCompletionRequest's, utility_routes.TokenizeRequest's);
    None: not given."""

    @property
    def add_generation_prompt(self) -> bool | None: ...
    @property
    def continue_final_message(self) -> bool | None: ...
    @property
    def documents(self) -> list[dict[str, str]] | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def add_special_tokens(self) -> bool | None: ...


def render_options(r: ChatRenderFields, trust_request_template: bool,
                   defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keywords of `Tokenizer.apply_chat_template` for `r` (beyond messages and tools), checked; `defaults`:
    the server's template variables (--default-chat-template-kwargs), under the request's own."""
    variables = dict(r.chat_template_kwargs or {})
    reserved = sorted(RESERVED_KWARGS & variables.keys())
    if reserved:
        hint = ("; give a template as the top-level 'chat_template'" if "chat_template" in reserved
                else "; tools go in the top-level 'tools'" if "tools" in reserved else "")
        raise bad_request("chat_template_kwargs", f"'chat_template_kwargs' may not set {', '.join(reserved)}: the "
                                                  f"renderer owns {'them' if len(reserved) > 1 else 'it'}{hint}")
    merged = {name: _merged(name, getattr(r, name), variables) for name in MERGED_KWARGS}
    effort = _merged("reasoning_effort", getattr(r, "reasoning_effort", None), variables)
    if effort is not None:  # a template variable (vLLM passes it to the template): gpt-oss's templates read it
        variables["reasoning_effort"] = effort
    top = getattr(r, "reasoning_effort", None)
    if top is not None and "enable_thinking" not in variables:  # as vLLM: templates that opt in to thinking
        variables["enable_thinking"] = top != "none"
    variables = {**(defaults or {}), **variables}  # the request's own win, as in vLLM
    add_prompt = True if merged["add_generation_prompt"] is None else merged["add_generation_prompt"]
    continue_final = bool(merged["continue_final_message"])
    if not isinstance(add_prompt, bool) or not isinstance(merged["continue_final_message"], bool | None):
        raise bad_request("chat_template_kwargs", "'chat_template_kwargs': add_generation_prompt and "
                                                  "continue_final_message must be true or false")
    if continue_final and add_prompt:
        raise bad_request("continue_final_message", "'continue_final_message' true needs 'add_generation_prompt': "
                                                    "false (the prompt cannot both end inside the last message and "
                                                    "start a new one)")
    documents = merged["documents"]
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)):
        raise bad_request("chat_template_kwargs", "'chat_template_kwargs': documents must be a list of objects of "
                                                  "strings")
    if r.chat_template is not None:
        if not trust_request_template:
            raise bad_request("chat_template", "'chat_template' in a request needs a server started with "
                                               "--trust-request-chat-template (a template is code the server runs); "
                                               "leave it out to use the server's template")
        try:
            check_chat_template(r.chat_template, "'chat_template'")
        except ChatTemplateError as e:
            raise bad_request("chat_template", str(e)) from None
    return {"add_generation_prompt": add_prompt, "continue_final_message": continue_final, "documents": documents,
            "template_kwargs": variables, "chat_template": r.chat_template,
            "add_special_tokens": bool(r.add_special_tokens)}


def template_failure(e: Exception, render: dict[str, Any]) -> APIError:
    """The 400 of a chat the template would not render (`render`: `render_options`' result). A template is code:
    whatever it raises (its raise_exception, a TypeError, a division by zero in a request's own template) is this
    request's inputs not fitting it, never the server's failure."""
    own = render["chat_template"] is not None
    return bad_request("chat_template" if own else "messages",
                       f"the chat template rejected {'this request' if own else repr('messages')}: "
                       f"{type(e).__name__}: {str(e)[:200]}")


def _merged(name: str, top: Any, variables: dict[str, Any]) -> Any:
    """A field given at the top level and/or in chat_template_kwargs (popped from `variables`): the one set."""
    inner = variables.pop(name, None)
    if top is not None and inner is not None and top != inner:
        raise bad_request("chat_template_kwargs", f"'{name}' is {_json(top)} but 'chat_template_kwargs.{name}' is "
                                                  f"{_json(inner)}: give it once, or the same in both")
    return top if top is not None else inner


def _json(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:40] + "..."
