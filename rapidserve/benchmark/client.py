"""The HTTP side: streamed /v1/completions requests to any OpenAI-compatible server (aiohttp).

Each request streams (`stream: true`, `stream_options: {"include_usage": true}`) and asks for
exactly its output length (`max_tokens` = `min_tokens`, `ignore_eos`, greedy). A server-sent event
with choices is a chunk; its token count is `len(token_ids)` when the server sends ids (token-id-only
servers), else 1 if it has text, else 0 (an empty chunk carries no token and is skipped). The usage
event's completion_tokens is the request's output count and fixes up chunks that carried several
tokens without saying so (`stats.reconcile_chunk_tokens`). With `return_token_ids` (the multiturn
workload, which re-sends the outputs) the request also asks for vLLM's `return_token_ids`, so vLLM and
rapidserve stream each chunk's `token_ids` even when they have a tokenizer; servers that do not know the
field ignore it (most OpenAI-compatible servers ignore unknown fields). `Target.sampling` adds
fields to every request (`rapidserve bench --penalties`: presence, frequency and repetition penalties,
which leave greedy decoding of exactly `max_tokens` tokens, so the same work with the penalties on).

The streamed text is kept in the record (`generated_text`; `--save-result --save-detailed` writes it as
vLLM's `generated_texts`). A failure is recorded with its error text: `HTTP <status>: <OpenAI error
message or body>`, an error event inside the stream, a timeout, or the connection error.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rapidserve.benchmark.stats import RequestRecord, chunk_itls, reconcile_chunk_tokens
from rapidserve.benchmark.step_mix import parse_line, step_deltas


@dataclass
class Target:
    """Where and how to send: the server's base URL (no /v1), the model id, auth and per-request limit."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)  # sent as a header, never in a repr
    timeout_s: float = 600.0
    endpoint: str = "/v1/completions"
    sampling: Mapping[str, Any] = field(default_factory=dict)  # extra fields of every request (--penalties)
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request (--extra-body)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass
class Streamed:
    """What one streamed request produced."""

    record: RequestRecord
    token_ids: list[int] | None  # the output as ids when the server sent them


def error_text(status: int, body: str) -> str:
    """'HTTP 400: <message>' from an OpenAI-style error body, or the body's start."""
    msg = body.strip()
    try:
        d = json.loads(body)
        err = d.get("error") if isinstance(d, dict) else None
        if isinstance(err, dict) and err.get("message"):
            msg = str(err["message"])
        elif isinstance(err, str):
            msg = err
        elif isinstance(d, dict) and d.get("message"):
            msg = str(d["message"])
    except ValueError:
        pass
    return f"HTTP {status}: {msg[:300]}"


def completion_payload(model: str, prompt: Sequence[int], output_len: int,
                       return_token_ids: bool = False, sampling: Mapping[str, Any] | None = None,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One request's body; `sampling` (e.g. --penalties) then `extra` (e.g. a structured-output constraint)
    are merged in last."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt), "max_tokens": output_len,
                            "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, **(sampling or {}), **(extra or {})}
    if return_token_ids:
        body["return_token_ids"] = True
    return body


def chunk_text(choice: Mapping[str, Any]) -> str:
    """The text a choice carries (a completion's `text`, or a chat-style delta's content; '' for none)."""
    text = choice.get("text")
    if text is None:  # chat-style delta
        text = (choice.get("delta") or {}).get("content")
    return text if isinstance(text, str) else ""


def chunk_tokens(choice: Mapping[str, Any]) -> tuple[int, list[int] | None]:
    """(tokens this choice carries, its token ids if the server sent them)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids), [int(t) for t in ids]
    return (1 if chunk_text(choice) else 0), None


async def stream_completion(session: aiohttp.ClientSession, target: Target, prompt: Sequence[int], output_len: int,
                            record: RequestRecord, t0: float, return_token_ids: bool = False) -> Streamed:
    """Send one request now and fill `record` (times relative to `t0`, a perf_counter reading);
    `return_token_ids`: ask for the output's ids too (see the module docstring)."""
    record.prompt_tokens = len(prompt)
    record.requested_output_tokens = output_len
    times: list[float] = []
    counts: list[int] = []
    ids: list[int] | None = []
    usage_tokens: int | None = None
    texts: list[str] = []
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        timeout = aiohttp.ClientTimeout(total=target.timeout_s)
        body = completion_payload(target.model, prompt, output_len, return_token_ids, target.sampling,
                                  target.extra_body)
        async with session.post(target.url, json=body, headers=target.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                record.error = error_text(resp.status, await resp.text())
                record.e2e_s = time.perf_counter() - start
                return Streamed(record, None)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    record.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)
                    record.e2e_s = now - start
                    return Streamed(record, None)
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                n, chunk_ids = 0, None
                for choice in event.get("choices") or ():
                    k, cids = chunk_tokens(choice)
                    n += k
                    texts.append(chunk_text(choice))
                    if cids is not None:
                        chunk_ids = (chunk_ids or []) + cids
                if n > 0:
                    times.append(now)
                    counts.append(n)
                    if ids is not None and chunk_ids is not None:
                        ids.extend(chunk_ids)
                    else:
                        ids = None
            end = time.perf_counter()
    except asyncio.TimeoutError:
        record.error = f"timeout after {target.timeout_s:g} s"
        record.e2e_s = time.perf_counter() - start
        return Streamed(record, None)
    except (aiohttp.ClientError, ValueError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
        record.e2e_s = time.perf_counter() - start
        return Streamed(record, None)
    record.e2e_s = end - start
    record.generated_text = "".join(texts)
    if not times:
        record.error = "the stream carried no tokens"
        return Streamed(record, None)
    counts = reconcile_chunk_tokens(counts, usage_tokens)
    record.ttft_s = times[0] - start
    record.itl_s = chunk_itls(times, counts)
    record.output_tokens = usage_tokens if usage_tokens is not None else sum(counts)
    record.success = True
    return Streamed(record, ids if ids else None)


async def fetch_models(session: aiohttp.ClientSession, base_url: str, api_key: str | None,
                       timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """GET /v1/models: the served models (id, and max_model_len where the server says it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise ConnectionError(f"GET /v1/models: {error_text(resp.status, body)}")
        data = json.loads(body).get("data") or []
        return [m for m in data if isinstance(m, dict) and "id" in m]


_COUNTER_RE = re.compile(r"^(?:[A-Za-z_]+:)?(prefix_cache_queries|prefix_cache_hits|partition_steps|partition_switches)"
                         r"_total(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")
_CONFIG_RE = re.compile(r'config="([^"]*)"')
# Where the time to first token went (histogram sums and counts, seconds): rapidserve's and vLLM's
# `<prefix>:request_{queue,prefill}_time_seconds`, and rapidserve's admission and first-token hand-off.
TTFT_PHASES = ("queue", "admission", "prefill", "handoff")
_PHASE_RE = re.compile(r"^(?:[A-Za-z_]+:)?request_(queue_time|admission_time|prefill_time|first_token_handoff)"
                       r"_seconds_(sum|count)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")
_PHASE_NAMES = {"queue_time": "queue", "admission_time": "admission", "prefill_time": "prefill",
                "first_token_handoff": "handoff"}


async def server_counters(session: aiohttp.ClientSession, base_url: str, api_key: str | None,
                          timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's cumulative counters the report uses, from GET /metrics: `prefix_cache_queries` and
    `prefix_cache_hits` (prompt tokens; rapidserve's and vLLM's counters share the names
    `<prefix>:prefix_cache_{queries,hits}_total`), `partition_switches` and `partition_steps:<config>`
    (rapidserve's decode steps per compute partition), and rapidserve's step series by shape kind (step_mix.py).
    None when the server answers no metrics."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    got: dict[str, float] = {}
    for line in text.splitlines():
        step = parse_line(line)  # rapidserve's steps by shape kind (step_mix.py)
        if step is not None:
            got[step[0]] = got.get(step[0], 0.0) + step[1]
            continue
        p = _PHASE_RE.match(line)
        if p:
            key = f"phase_{p.group(2)}:{_PHASE_NAMES[p.group(1)]}"
            got[key] = got.get(key, 0.0) + float(p.group(4))
            continue
        m = _COUNTER_RE.match(line)
        if m:
            name = m.group(1)
            if name == "partition_steps":
                c = _CONFIG_RE.search(m.group(2) or "")
                name = f"partition_steps:{c.group(1) if c else '?'}"
            got[name] = got.get(name, 0.0) + float(m.group(3))
    return got


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """What a run adds to the report from the server's counters over it: `prefix_cache` (queried and hit
    tokens, hit rate) when the server counts them, `ttft_phases_ms` (the mean of each phase of the time
    to first token the server measures: `TTFT_PHASES`), `partition` (switches, decode steps per
    configuration) when it has more than one configuration, and `server_steps` / `server_step_correction` (the
    decode worker's steps by shape kind, step_mix.step_deltas) when the server counts them."""
    if before is None or after is None:
        return {}
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out: dict[str, Any] = {}
    if "prefix_cache_queries" in after:
        q, h = d["prefix_cache_queries"], d.get("prefix_cache_hits", 0.0)
        out["prefix_cache"] = {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q > 0 else None}
    phases = {}
    for name in TTFT_PHASES:
        n = d.get(f"phase_count:{name}", 0.0)
        if n > 0:
            phases[name] = round(d.get(f"phase_sum:{name}", 0.0) / n * 1e3, 2)
    if phases:
        out["ttft_phases_ms"] = phases  # mean per request over the run
    steps = {k.split(":", 1)[1]: int(v) for k, v in d.items() if k.startswith("partition_steps:") and v > 0}
    if len(steps) > 1 or d.get("partition_switches", 0.0) > 0:
        out["partition"] = {"switches": int(d.get("partition_switches", 0.0)), "decode_steps": steps}
    out.update(step_deltas(before, after))
    return out
