#!/usr/bin/env python3
"""Size a rapidserve deployment from a measured profile (profiles/<gpu>__<model>.json).

For an inter-token-latency SLO it finds, per context bucket, the largest decode batch bucket whose
decode step beside a running prefill stays within the SLO in some configuration (the decode
latency a user sees while new requests are being prefilled), and reports:
  * --max-num-seqs for `rapidserve serve` (that batch);
  * the configuration that meets it with the most prefill throughput left;
  * per replica: decode tokens/s (batch x 1000 / step ms) and prefill tokens/s;
  * with --output-tokens-per-s (the demand): replicas and nodes needed, one replica per GPU.

    python3 deploy/size_from_profile.py profiles/nvidia-h100-80gb-hbm3__preset-llama-3-8b.json \\
        --itl-ms 30 --context 4096 --gpus-per-node 8 --output-tokens-per-s 20000

See docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rapidserve.partition.profile import Profile, ProfileError, load_profile  # noqa: E402
from rapidserve.partition.profile_lookup import bucket_up, entry_index  # noqa: E402


@dataclass(frozen=True)
class Sizing:
    context: int
    max_num_seqs: int | None  # None: not even the smallest batch meets the SLO
    config: str | None
    decode_ms: float | None  # the percentile used, beside prefill
    decode_ms_alone: float | None
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    replicas_needed: int | None = None
    nodes_needed: int | None = None


def size(profile: Profile, itl_ms: float, context: int, percentile: str = "p95") -> Sizing:
    """The largest batch bucket meeting `itl_ms` at `context` (rounded up to a profiled bucket)."""
    ctx = bucket_up(profile.context_buckets, context).bucket
    index = entry_index(profile)
    for batch in sorted(profile.batch_buckets, reverse=True):
        best = None
        for c in profile.configurations:
            e = index[(c.name, batch, ctx)]
            ms = getattr(e, f"decode_ms_beside_prefill_{percentile}")
            if ms <= itl_ms and (best is None or e.prefill_tokens_per_s > best[1].prefill_tokens_per_s):
                best = (ms, e)
        if best is not None:
            ms, e = best
            return Sizing(ctx, batch, e.config, ms, getattr(e, f"decode_ms_alone_{percentile}"),
                          batch * 1000.0 / ms, e.prefill_tokens_per_s)
    return Sizing(ctx, None, None, None, None, 0.0, 0.0)


def with_demand(s: Sizing, output_tokens_per_s: float, gpus_per_node: int) -> Sizing:
    if s.decode_tokens_per_s <= 0:
        return s
    replicas = max(1, math.ceil(output_tokens_per_s / s.decode_tokens_per_s))
    return Sizing(**{**asdict(s), "replicas_needed": replicas, "nodes_needed": math.ceil(replicas / gpus_per_node)})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path, help="a profiles/<gpu>__<model>.json file")
    p.add_argument("--itl-ms", type=float, required=True, help="inter-token latency SLO in milliseconds")
    p.add_argument("--context", type=int, action="append",
                   help="typical context length (prompt + output) of a request; repeatable "
                        "(default: every profiled context bucket)")
    p.add_argument("--percentile", choices=("p50", "p95"), default="p95")
    p.add_argument("--gpus-per-node", type=int, default=8, help="one replica per GPU (default 8)")
    p.add_argument("--output-tokens-per-s", type=float, default=None,
                   help="demand: output tokens per second over all replicas, to count replicas and nodes")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.itl_ms <= 0 or a.gpus_per_node <= 0:
        print("error: --itl-ms and --gpus-per-node must be positive", file=sys.stderr)
        return 2
    try:
        prof = load_profile(a.profile)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for ctx in a.context or prof.context_buckets:
        s = size(prof, a.itl_ms, ctx, a.percentile)
        if a.output_tokens_per_s is not None:
            s = with_demand(s, a.output_tokens_per_s, a.gpus_per_node)
        rows.append(s)
    if a.json:
        for s in rows:
            print(json.dumps(asdict(s)))
        return 0 if all(s.max_num_seqs for s in rows) else 1
    print(f"{prof.gpu} / {prof.model} ({prof.source} profile): ITL SLO {a.itl_ms:g} ms at {a.percentile}, "
          "decode beside prefill")
    print(f"{'context':>8} {'max-num-seqs':>12} {'config':>16} {'step ms':>8} {'alone ms':>8} "
          f"{'decode tok/s':>12} {'prefill tok/s':>13} {'replicas':>8} {'nodes':>5}")
    for s in rows:
        if s.max_num_seqs is None:
            print(f"{s.context:>8}  no batch size meets {a.itl_ms:g} ms at this context")
            continue
        print(f"{s.context:>8} {s.max_num_seqs:>12} {s.config:>16} {s.decode_ms:>8.1f} {s.decode_ms_alone:>8.1f} "
              f"{s.decode_tokens_per_s:>12.0f} {s.prefill_tokens_per_s:>13.0f} "
              f"{s.replicas_needed if s.replicas_needed is not None else '-':>8} "
              f"{s.nodes_needed if s.nodes_needed is not None else '-':>5}")
    return 0 if all(s.max_num_seqs for s in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
