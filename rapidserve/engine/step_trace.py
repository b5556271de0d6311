"""`--step-trace PATH`: every landed step of the one step loop, one JSON line each, for the cost models' analysis.

The decode worker (every mode's: rapid's, hybrid's, disagg's decode side; the leader rank under -tp N; engine i of
-dp N writes `PATH` with `.dp<i>` before its suffix, `trace_path`) appends a `StepRecord` per step it records
(engine/step_cycle.py `_complete`): the step's shape as the policy chose it, what it carried (decode rows, the sum of
their contexts, each prompt chunk's tokens and the cached tokens before it), what the policy predicted (raw, before
its online correction) and the correction and SLO margin it held then, and what the step took (device time, the
token gap it made, the device's idle time before it, the host's time to plan and launch it; engine/step_tally.py
says what each is). `bench/step_fit.py` reads such a file: per kind, how far the predictions were off by shape, and
which cost model would have fitted the steps.

Cost: only with the flag. A record costs a pass over the step's decode rows (their contexts) and one msgspec
encode, ~20 us at 300 rows on one CPU core; lines are buffered and written out with the worker's Stats (every
`stats_interval_s`) and when its loop ends however it ends (a Shutdown, a peer's death, an error), so only a worker
killed hard loses that interval's lines. A restarted worker appends to the same file: its first record follows the
last one the dead worker flushed, a line the dead worker left cut short (killed mid-write) dropped first. The file grows
~250 bytes a step (~20 MB an hour at 25 steps/s): a diagnostic for benchmarks, not for a server left running.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import msgspec

from rapidserve.config_base import ConfigError
from rapidserve.engine.decode_request import StepBatch
from rapidserve.engine.step_tally import KINDS, step_kind
from rapidserve.partition.shape import StepTiming


class StepRecord(msgspec.Struct, omit_defaults=True):
    """One landed step (module docstring). Times in ms; None where the worker could not tell (no gap: no request
    decoded in both this step and the one before; no idle time on a CPU)."""

    t: float  # time.monotonic() when the host recorded it
    kind: str  # step_tally.KINDS: fused, fused_decode, split, alone
    shape: str  # the policy's shape, e.g. "Fused(chunk_tokens=1024)"
    rows: int  # decode rows
    context_sum: int  # the decode rows' contexts (tokens each attends to, as launched: InFlight.context_sum), summed
    chunks: list[tuple[int, int]]  # prompt chunks: (tokens, cached tokens before them)
    measured_ms: float
    predicted_ms: float | None = None  # the policy's raw prediction (before its correction), if it made one
    gap_ms: float | None = None
    idle_ms: float | None = None
    host_ms: float | None = None
    correction: dict[str, float] = {}  # the policy's correction ratios then (step_tally.correction_ratios)
    launch: str = ""  # how it was launched (engine/step_cycle.py LAUNCHES): ahead, landed, quiet-pool, idle
    planned_ms: float | None = None  # the prediction the policy compared with the SLO (raw x its correction then)


def trace_path(path: str, data_parallel_rank: int | None) -> str:
    """Where engine `data_parallel_rank` of -dp N writes (None: the only engine): `steps.jsonl` -> `steps.dp1.jsonl`."""
    if data_parallel_rank is None:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.dp{data_parallel_rank}{p.suffix}"))


def check_trace_path(path: str) -> None:
    """ConfigError, naming --step-trace, unless `path` can be appended to (its folder exists and is writable; an
    existing file is appended to, not replaced)."""
    p = Path(path)
    if not path or p.is_dir():
        raise ConfigError(f"--step-trace {path!r}: give a file to append the steps to, e.g. --step-trace steps.jsonl")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"--step-trace {path}: folder {folder} does not exist; create it or give another path")
    if p.exists() and not os.access(p, os.W_OK) or not p.exists() and not os.access(folder, os.W_OK):
        raise ConfigError(f"--step-trace {path}: not writable by this user; give a path you can write")


class StepTrace:
    """The open trace of one worker: `add` a landed step, `flush` the buffered lines, `close` at the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - held for the worker's life, closed by close()
        self._file.truncate(whole_lines(path))  # a line cut short by a worker killed mid-write: dropped
        self._lines: list[bytes] = []
        self._enc = msgspec.json.Encoder()

    def add(self, batch: StepBatch, context_sum: int, launch: str, timing: StepTiming,
            correction: Mapping[str, float], at: float) -> None:
        """Buffer the record of a step that carried `batch` (its decode rows' contexts as launched: `context_sum`),
        was launched as `launch` says (step_cycle.LAUNCHES) and was recorded at `at` as `timing`."""
        rec = StepRecord(at, KINDS[step_kind(timing.shape, timing.chunk_tokens)], repr(timing.shape),
                         len(batch.decode), context_sum,
                         [(c.length, c.start) for c in batch.chunks], timing.measured_ms, timing.predicted_ms,
                         timing.gap_ms, timing.idle_ms, timing.host_ms, dict(correction), launch, timing.planned_ms)
        self._lines.append(self._enc.encode(rec) + b"\n")

    def flush(self) -> None:
        if self._lines:
            self._file.write(b"".join(self._lines))
            self._lines.clear()
            self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def whole_lines(path: str, tail: int = 1 << 16) -> int:
    """The size of the file at `path` up to and including its last newline (0 if it has none)."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - tail)
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                return start + at + 1
            end = start
    return 0


def read_trace(path: str | os.PathLike[str]) -> list[StepRecord]:
    """The records of a trace file; a last line cut short (a worker killed mid-write) is left out."""
    dec = msgspec.json.Decoder(StepRecord)
    out: list[StepRecord] = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError as e:
                if line.endswith(b"\n"):
                    raise ValueError(f"{path}:{i}: not a step record: {e}") from e
    return out
