"""bench/soak.py's parts that need no server: the Prometheus text parser, the checks' arithmetic
(flatness, capacity, counter comparison) and the request mix (the /proc and /dev/shm probes: soak_proc.py).

Everything here is a plain function of its arguments, so tests/test_soak.py checks it without a server.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# ---------------------------------------------------------------- Prometheus text format

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"n": "\n", '"': '"', "\\": "\\"}

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), text)


def parse_prometheus(text: str) -> Series:
    """Every sample of a Prometheus text exposition: {(name, sorted label pairs): value}.

    Comments (# HELP/# TYPE) and blank lines are skipped; a line that is not a sample raises ValueError
    naming it. Values may be NaN or +Inf/-Inf; an optional timestamp is ignored.
    """
    out: Series = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"line {n} is not a Prometheus sample: {line[:120]!r}")
        labels: list[tuple[str, str]] = []
        body = m.group(2) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None or lm.end() == pos:
                raise ValueError(f"line {n} has malformed labels: {line[:120]!r}")
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        try:
            value = float(m.group(3))
        except ValueError:
            raise ValueError(f"line {n} has a value that is not a number: {line[:120]!r}") from None
        out[(m.group(1), tuple(sorted(labels)))] = value
    return out


SUCCESS = "vllm:request_success_total"
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total",
            "generation_tokens": "vllm:generation_tokens_total",
            "engine_restarts": "rapidserve:engine_restarts_total",
            "worker_deaths": "rapidserve:engine_worker_deaths_total"}


def soak_counters(series: Series) -> dict[str, float | None]:
    """The counters the soak compares, summed over model names: ``success_<reason>`` for every finished
    reason the server reports, ``prompt_tokens``, ``generation_tokens``, ``engine_restarts``, ``worker_deaths`` (None
    where the server does not expose them)."""
    out: dict[str, float | None] = dict.fromkeys(COUNTERS)
    for (name, labels), v in series.items():
        if name == SUCCESS:
            key = "success_" + dict(labels).get("finished_reason", "")
            out[key] = (out.get(key) or 0.0) + v
        for short, full in COUNTERS.items():
            if name == full:
                out[short] = (out[short] or 0.0) + v
    return out


def counter_delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float | None]:
    """after - before per counter (a counter missing before counts from 0; missing after: None)."""
    return {k: (None if v is None else v - (before.get(k) or 0.0)) for k, v in after.items()}


def compare_counts(client: Mapping[str, int], server: Mapping[str, float | None],
                   raced: int = 0) -> dict[str, dict[str, Any]]:
    """Client counts against server counter deltas, per finished reason in `client`
    ({"stop": n, "length": n, "abort": n}): {reason: {"client", "server", "diff", "ok"}}. A reason the
    server has no series for counts 0 when it has others (a label not yet created), else None.

    `raced`: the client's stream aborts (a connection closed after some tokens) whose request the server may
    have finished before it saw the close: such a request is the client's abort and the server's stop or
    length. Up to `raced` aborts may so move: the abort count is short by k <= raced and stop and length are
    over by k between them, never under; then every reason reads ok, and the abort entry says how many raced."""
    family = any(k.startswith("success_") and v is not None for k, v in server.items())
    out: dict[str, dict[str, Any]] = {}
    for reason, n in client.items():
        s = server.get("success_" + reason, 0.0 if family else None)
        diff = None if s is None else s - n
        out[reason] = {"client": n, "server": s, "diff": diff, "ok": diff == 0}
    ends = [r for r in ("stop", "length") if r in out]
    if raced and "abort" in out and all(out[r]["diff"] is not None for r in ("abort", *ends)):
        moved = -out["abort"]["diff"]
        over = [out[r]["diff"] for r in ends]
        if 0 < moved <= raced and all(d >= 0 for d in over) and sum(over) == moved:
            for r in ("abort", *ends):
                out[r]["ok"] = True
            out["abort"]["raced"] = moved
    return out


# ---------------------------------------------------------------- checks' arithmetic


def flatness_windows(t_start: float, t_end: float, warmup_s: float, window_s: float = 300.0) -> dict[str, Any]:
    """The two windows a flatness check compares: after `warmup_s`, the first and last `window_s` when the
    rest of the run spans at least three of them, else its first and last fifth."""
    t0 = t_start + warmup_s
    span = t_end - t0
    if span <= 0:
        return {"first": None, "last": None, "rule": "no time left after the warm-up"}
    w, rule = (window_s, f"first/last {window_s:g} s") if span >= 3 * window_s else (span / 5, "first/last fifth")
    return {"first": (t0, t0 + w), "last": (t_end - w, t_end), "rule": f"{rule} after {warmup_s:g} s warm-up"}


def flatness(points: Sequence[tuple[float, float]], t_start: float, t_end: float, warmup_s: float,
             window_s: float = 300.0, rel_tol: float = 0.05, abs_tol: float = 0.0) -> dict[str, Any]:
    """Whether a series stayed flat: the mean of its last window is within `rel_tol` of its first window's
    mean (or within `abs_tol`, whichever is larger). `points` are (time, value). A window without a
    point takes the nearest point after the warm-up; "ok" is None when there are not two such points."""
    win = flatness_windows(t_start, t_end, warmup_s, window_s)
    res: dict[str, Any] = {"rule": win["rule"], "first_mean": None, "last_mean": None, "change": None, "ok": None}
    if win["first"] is None:
        return res
    (lo1, hi1), (lo2, hi2) = win["first"], win["last"]
    first_pts = [(t, v) for t, v in points if lo1 <= t <= hi1]
    last_pts = [(t, v) for t, v in points if lo2 <= t <= hi2]
    after = [(t, v) for t, v in points if lo1 <= t <= hi2]
    if after and (not first_pts or not last_pts):  # windows shorter than the sample interval
        first_pts, last_pts = first_pts or after[:1], last_pts or after[-1:]
        res["rule"] += " (nearest samples)"
    if not first_pts or not last_pts or first_pts == last_pts:
        res["rule"] += " (too few samples after the warm-up)"
        return res
    first = sum(v for _, v in first_pts) / len(first_pts)
    last = sum(v for _, v in last_pts) / len(last_pts)
    res.update(first_mean=first, last_mean=last)
    res["change"] = (last - first) / first if first else (0.0 if last == first else math.inf)
    res["ok"] = abs(last - first) <= max(rel_tol * abs(first), abs_tol)
    return res


def sustained_rate(finish_times: Iterable[float], t0: float, t1: float, skip_fraction: float = 0.2) -> float:
    """Completions per second over [t0 + skip_fraction * (t1 - t0), t1] (the ramp-up left out)."""
    lo = t0 + skip_fraction * (t1 - t0)
    if t1 <= lo:
        raise ValueError(f"empty window: t0={t0}, t1={t1}, skip_fraction={skip_fraction}")
    return sum(1 for t in finish_times if lo <= t <= t1) / (t1 - lo)


def target_rate(capacity: float, fraction: float) -> float:
    """The soak's arrival rate: `fraction` of the measured capacity (requests/s)."""
    if not capacity > 0:
        raise ValueError(f"the capacity probe measured {capacity:g} requests/s: nothing completed")
    if not 0 < fraction <= 1:
        raise ValueError(f"load fraction {fraction} must be in (0, 1]")
    return capacity * fraction


# ---------------------------------------------------------------- the request mix

# name: ((prompt tokens lo, hi), (max_tokens lo, hi), weight)
BUCKETS: dict[str, tuple[tuple[int, int], tuple[int, int], float]] = {
    "small": ((8, 64), (8, 32), 0.5),
    "medium": ((128, 512), (32, 128), 0.35),
    "long": ((1024, 2048), (128, 256), 0.15),
}
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired", "engineers",
         "watch", "server", "run", "for", "hours", "and", "count", "every", "token", "that", "streams", "past",
         "window", "on", "quiet", "night")

STOP_STRINGS = (".", " the")


@dataclass
class Mix:
    """What the request mix may draw (fractions are of all requests, of streams, of non-streams)."""

    max_model_len: int = 2048
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    stream_fraction: float = 0.5
    chat_fraction: float = 0.0  # 0 where the model has no tokenizer
    stop_fraction: float = 0.0  # requests with stop strings (0 where the model has no tokenizer)
    abort_stream_fraction: float = 0.1
    abort_timeout_fraction: float = 0.05
    abort_timeout_s: tuple[float, float] = (0.1, 0.5)
    token_ids: tuple[int, int] = (100, 5000)


@dataclass
class RequestSpec:
    """One request of the soak."""

    bucket: str
    chat: bool
    stream: bool
    prompt: list[int] | str  # token ids (/v1/completions) or text (chat)
    prompt_tokens: int  # exact for token ids, an estimate for text
    max_tokens: int
    ignore_eos: bool
    temperature: float
    seed: int
    abort_after_tokens: int | None = None  # a stream the client closes after this many tokens
    client_timeout_s: float | None = None  # a non-stream request the client gives up on
    stop: list[str] | None = None  # stop strings (text models): the server ends the request early with "stop"

    def payload(self, model: str) -> dict[str, Any]:
        """The JSON body."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "seed": self.seed, "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.stop:
            body["stop"] = self.stop
        return body

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt"] = self.prompt if isinstance(self.prompt, str) else f"<{len(self.prompt)} token ids>"
        return d


def _pick_bucket(rng: random.Random) -> str:
    names = list(BUCKETS)
    return rng.choices(names, weights=[BUCKETS[n][2] for n in names])[0]


def make_request(rng: random.Random, mix: Mix, allow_aborts: bool = True) -> RequestSpec:
    """Draw one request: bucket, endpoint, stream or not, lengths fitted to the model's context, and
    whether the client will abort it (aborted requests ignore EOS so that they are still running)."""
    bucket = _pick_bucket(rng)
    (plo, phi), (olo, ohi), _ = BUCKETS[bucket]
    pcap = mix.max_prompt_tokens or phi
    ocap = mix.max_output_tokens or ohi
    plen = max(1, min(rng.randint(plo, phi), pcap))
    out = max(1, min(rng.randint(olo, ohi), ocap))
    chat = rng.random() < mix.chat_fraction
    stream = rng.random() < mix.stream_fraction
    room = mix.max_model_len - 1
    if chat:  # text: ~1.3 tokens a word plus the chat template; leave a wide margin
        words = max(1, min(plen, (room - out - 64) // 2))
        prompt: list[int] | str = " ".join(rng.choice(WORDS) for _ in range(words))
        plen_est = 2 * words + 64
    else:
        plen = max(1, min(plen, room - 1))
        prompt = [rng.randrange(*mix.token_ids) for _ in range(plen)]
        plen_est = plen
    out = max(1, min(out, mix.max_model_len - plen_est))
    spec = RequestSpec(bucket, chat, stream, prompt, plen_est, out, ignore_eos=rng.random() < 0.5,
                       temperature=rng.choice((0.0, 0.8)), seed=rng.randrange(1 << 30))
    if allow_aborts and stream and out >= 4 and rng.random() < mix.abort_stream_fraction:
        spec.abort_after_tokens = rng.randint(1, out // 2)
        spec.ignore_eos = True
    elif allow_aborts and not stream and rng.random() < mix.abort_timeout_fraction:
        spec.client_timeout_s = rng.uniform(*mix.abort_timeout_s)
        spec.ignore_eos = True
        spec.max_tokens = max(out, min(ocap, mix.max_model_len - plen_est))
    elif rng.random() < mix.stop_fraction:
        spec.stop = list(STOP_STRINGS)
    return spec
