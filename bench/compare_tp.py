"""Tensor parallelism in bench/compare.py's systems (pure, tested on CPU).

`--serve-args "... --tensor-parallel-size N"` shards every server of ours over N GPUs and, being one of the
flags vLLM takes under the same name (compare_systems.SHARED_VALUE_FLAGS), every vLLM system too: each system
then holds the same N GPUs, one after the other.

`disagg-npmd` (our NPMD disaggregated baseline, `--mode disagg`) runs on those same N GPUs: a prefill side
tensor-parallel over the first N/2 and a decode side over the next N/2, each with its own copy of the weights
(`--prefill-tensor-parallel-size N/2 --tensor-parallel-size N/2`, which, coming after --serve-args on the
command line, wins over its N). It needs an even N >= 2 and the weights to fit N/2 GPUs
(bench/frontier_plan.py checks that before a GPU call).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from compare_systems import RAPIDSERVE, SYSTEMS, System

DISAGG_NPMD = "disagg-npmd"
TP_FLAGS: tuple[str, ...] = ("--tensor-parallel-size", "-tp")


def serve_tp(serve_args: str) -> int:
    """The tensor-parallel size --serve-args give (the last of --tensor-parallel-size / -tp, as argparse reads
    them; 1 without). ValueError for a value that is not a positive integer."""
    toks = shlex.split(serve_args)
    tp = "1"
    for i, t in enumerate(toks):
        name, eq, value = t.partition("=")
        if name in TP_FLAGS:
            tp = value if eq else (toks[i + 1] if i + 1 < len(toks) else "")
    if not tp.isdigit() or int(tp) < 1:
        raise ValueError(f"--serve-args: --tensor-parallel-size {tp!r}: give a positive integer")
    return int(tp)


def disagg_npmd_flags(tp: int) -> str:
    """`rapidserve serve` flags of NPMD disaggregation over `tp` GPUs: prefill on tp/2, decode on tp/2.
    ValueError when tp cannot be halved."""
    if tp < 2 or tp % 2:
        raise ValueError(f"{DISAGG_NPMD} splits the systems' GPUs in two halves (prefill, decode): it needs an even "
                         f"--tensor-parallel-size >= 2 in --serve-args (got {tp})")
    half = tp // 2
    return f"--mode disagg --prefill-tensor-parallel-size {half} --tensor-parallel-size {half}"


def resolve_tp_systems(systems: Sequence[System], serve_args: str) -> list[System]:
    """`systems` with `disagg-npmd` (named in --systems, its placeholder flags) given the flags of --serve-args'
    TP size; the others as they are. ValueError when it cannot run at that size."""
    out: list[System] = []
    for s in systems:
        if s.kind == RAPIDSERVE and s.label == DISAGG_NPMD and s.flags == SYSTEMS[DISAGG_NPMD]:
            s = s._replace(flags=disagg_npmd_flags(serve_tp(serve_args)))
        out.append(s)
    return out
