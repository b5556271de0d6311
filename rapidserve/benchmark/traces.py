"""Production request traces: reading Azure LLM inference CSVs and Mooncake JSONL files.

A trace gives each request's arrival time and its prompt and output lengths in tokens; no text.
The format is detected from the contents (gzip from its magic bytes, so the file's name does not
matter):

- Azure LLM inference trace (github Azure/AzurePublicDataset; 2023 code and conversation, the
  traces of Splitwise, ISCA'24): a CSV whose header names `TIMESTAMP`, `ContextTokens` and
  `GeneratedTokens` (any order, case-insensitive, other columns ignored). TIMESTAMP is a wall-clock
  time `YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM|Z]` or a plain number of seconds. No prefix
  information: replayed prompts are random tokens per request.
- Mooncake (github kvcache-ai/Mooncake, FAST25-release/traces; Qin et al., FAST'25): JSON lines of
  `{"timestamp": ms from the start, "input_length", "output_length", "hash_ids": [...]}`, with
  `hash_ids` optional: one id per `HASH_BLOCK_TOKENS` (512) prompt tokens, exactly
  ceil(input_length / 512) of them; the same ids at the start of two prompts mean the same prefix.
  Other keys are read past, as the CSV's other columns (a trace is data others publish, not configuration).

Lengths are integers >= 0 (a 0 is sent as 1 token: no server takes an empty prompt or output).
Requests are sorted by time (stably) and their times made relative to the earliest. Any problem
is a `TraceError` (a ValueError) naming the `--trace` flag, the file and the line. `load_trace`
reads a file once per (path, size, mtime).
"""

from __future__ import annotations

import csv
import datetime
import functools
import gzip
import io
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from rapidserve.jsonfile import DuplicateKeyError, loads_unique

HASH_BLOCK_TOKENS = 512  # Mooncake: prompt tokens per hash id
TRACE_ARRIVALS: tuple[str, ...] = ("timestamps", "poisson")
TRACE_OVERFLOW: tuple[str, ...] = ("clip", "skip")
AZURE_COLUMNS: tuple[str, ...] = ("timestamp", "contexttokens", "generatedtokens")
_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(\.\d+)?\s*(Z|[+-]\d{2}:?\d{2})?")


class TraceError(ValueError):
    """A trace file that cannot be read: names the flag, the file and (when known) the line."""

    def __init__(self, path: str, message: str, line: int | None = None) -> None:
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"--trace {path}: {where}{message}")
        self.path, self.line = path, line


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its line in the file (1-based), arrival (seconds from the trace's
    earliest request), lengths in tokens, and its prompt's hash ids (None: the trace has none)."""

    line: int
    t_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Trace:
    path: str
    format: str  # "azure" or "mooncake"
    requests: tuple[TraceRequest, ...]

    @property
    def span_s(self) -> float:
        """Seconds from the earliest request to the latest."""
        return self.requests[-1].t_s if self.requests else 0.0

    @property
    def has_hash_ids(self) -> bool:
        return any(r.hash_ids is not None for r in self.requests)


@dataclass(frozen=True)
class TraceSpec:
    """How to replay a trace file (the window and the load points are in `BenchConfig`).

    arrivals: "timestamps" (the trace's own times, divided by each `--time-scale`) or "poisson"
    (the trace's lengths, in trace order, at Poisson arrivals of each `--request-rate`); start_s:
    the window's start in seconds of trace time from its earliest request; overflow: what to do
    with a request longer than the max model length ("clip" or "skip"); block_size: the engine's
    KV block size in tokens, for the ideal prefix-cache hit rate."""

    path: str
    arrivals: str = "timestamps"
    start_s: float = 0.0
    overflow: str = "clip"
    block_size: int = 16

    def check(self) -> None:
        """ValueError naming the flag and what is allowed."""
        if self.arrivals not in TRACE_ARRIVALS:
            raise ValueError(f"--trace-arrivals {self.arrivals!r} is not one of {', '.join(TRACE_ARRIVALS)}")
        if self.overflow not in TRACE_OVERFLOW:
            raise ValueError(f"--trace-overflow {self.overflow!r} is not one of {', '.join(TRACE_OVERFLOW)}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"--trace-start {self.start_s} must be a number of seconds >= 0")
        if self.block_size < 1:
            raise ValueError(f"--block-size {self.block_size} must be an integer >= 1")


def load_trace(path: str) -> Trace:
    """The trace in `path` (read once per path, size and modification time)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise TraceError(path, f"cannot read it: {e.strerror or e}") from None
    return _load(os.path.abspath(path), st.st_size, st.st_mtime_ns, path)


@functools.lru_cache(maxsize=4)
def _load(abspath: str, size: int, mtime_ns: int, shown: str) -> Trace:
    del size, mtime_ns  # cache keys only
    try:
        with open(abspath, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise TraceError(shown, f"cannot read it: {e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(shown, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not first:
        raise TraceError(shown, "the file is empty")
    if first.startswith("{"):
        fmt, requests = "mooncake", list(_mooncake(shown, text))
    elif "contexttokens" in first.lower():
        fmt, requests = "azure", list(_azure(shown, text))
    else:
        raise TraceError(shown, "neither an Azure CSV (a header naming TIMESTAMP,ContextTokens,GeneratedTokens) "
                                "nor Mooncake JSON lines ({\"timestamp\", \"input_length\", \"output_length\", "
                                "\"hash_ids\"})", 1)
    if not requests:
        raise TraceError(shown, "it holds no requests")
    requests.sort(key=lambda r: r.t_s)  # stable: equal times keep the file's order
    t0 = requests[0].t_s
    rel = tuple(TraceRequest(r.line, r.t_s - t0, r.input_len, r.output_len, r.hash_ids) for r in requests)
    return Trace(shown, fmt, rel)


def _length(path: str, line: int, name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(path, f"{name} {v!r} is not an integer >= 0", line)
    return v


def _mooncake(path: str, text: str) -> Iterator[TraceRequest]:
    for n, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            d = loads_unique(ln, path)
        except DuplicateKeyError as e:
            raise TraceError(path, (f"in `{e.where}`: " if e.where else "") + e.problem, n) from None
        except ValueError as e:
            raise TraceError(path, f"not a JSON object: {e}", n) from None
        if not isinstance(d, dict):
            raise TraceError(path, "not a JSON object", n)
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in d]
        if missing:
            raise TraceError(path, f"missing {', '.join(missing)}", n)
        ts = d["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceError(path, f"timestamp {ts!r} is not a number of milliseconds >= 0", n)
        n_in = _length(path, n, "input_length", d["input_length"])
        n_out = _length(path, n, "output_length", d["output_length"])
        ids = d.get("hash_ids")
        hash_ids: tuple[int, ...] | None = None
        if ids is not None:
            if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
                raise TraceError(path, "hash_ids is not a list of integers >= 0", n)
            need = -(-n_in // HASH_BLOCK_TOKENS)
            if len(ids) != need:
                raise TraceError(path, f"hash_ids has {len(ids)} ids but input_length {n_in} needs "
                                       f"ceil({n_in} / {HASH_BLOCK_TOKENS}) = {need}", n)
            hash_ids = tuple(ids)
        yield TraceRequest(n, ts / 1000.0, n_in, n_out, hash_ids)


def _azure(path: str, text: str) -> Iterator[TraceRequest]:
    rows = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    cols: list[int] = []
    for row in rows:
        n = rows.line_num
        if not any(c.strip() for c in row):
            continue
        if header is None:
            header = [c.strip().lower() for c in row]
            missing = [c for c in AZURE_COLUMNS if c not in header]
            if missing:
                raise TraceError(path, f"the CSV header {','.join(row)!r} lacks {', '.join(missing)} "
                                       "(expected TIMESTAMP,ContextTokens,GeneratedTokens)", n)
            cols = [header.index(c) for c in AZURE_COLUMNS]
            continue
        if len(row) != len(header):
            raise TraceError(path, f"{len(row)} fields where the header has {len(header)}", n)
        t = _azure_time(path, n, row[cols[0]].strip())
        lens = []
        for name, i in zip(AZURE_COLUMNS[1:], cols[1:], strict=True):
            try:
                lens.append(_length(path, n, name, int(row[i])))
            except ValueError:
                raise TraceError(path, f"{name} {row[i]!r} is not an integer >= 0", n) from None
        yield TraceRequest(n, t, lens[0], lens[1])


def _azure_time(path: str, line: int, text: str) -> float:
    """Seconds (since the epoch, or as given when the field is a number)."""
    m = _TIME.fullmatch(text)
    if m is None:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v):
            raise TraceError(path, f"TIMESTAMP {text!r} is neither YYYY-MM-DD HH:MM:SS[.fraction] nor a number "
                                   "of seconds", line)
        return v
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    try:
        whole = datetime.datetime(y, mo, d, h, mi, s, tzinfo=datetime.timezone.utc).timestamp()
    except ValueError as e:
        raise TraceError(path, f"TIMESTAMP {text!r}: {e}", line) from None
    tz = m.group(8)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        whole -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return whole + (float(m.group(7)) if m.group(7) else 0.0)
