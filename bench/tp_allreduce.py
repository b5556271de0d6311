"""What the per-phase communicators' all-reduces cost inside compute partitions (issue 17), on two GPUs.

Four processes, as rapid mode at TP 2 runs them: a decode and a prefill process on each GPU; the decode pair
is one NCCL communicator, the prefill pair another (rapidserve.parallel.group). Each process opens the
green-context partition streams of its role for every configuration (`overallocated`: the whole GPU; splitN:
N SMs to decode, the rest to prefill) and times, with CUDA events, all-reduces of the sizes a Qwen3-14B-shaped
model (hidden 5120, bf16) makes: decode batches of 1, 64 and 256 rows, prefill chunks of 1024 and 8192 rows.
Three phases per configuration: decode alone, prefill alone, both at once (each phase starts on a barrier).

    NCCL_NVLS_ENABLE=0 python bench/tp_allreduce.py --json out.json     # prints a markdown table last
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

HIDDEN = 5120
DECODE_ROWS = (1, 64, 256)
PREFILL_ROWS = (1024, 8192)
ITERS = 40


def _time(tp: Any, stream: Any, rows: int, iters: int) -> float:
    """Median-free mean of `iters` all-reduces on `stream` (ms each), after warm-ups."""
    import torch

    x = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=tp.device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            tp.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            tp.all_reduce(x)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _worker(role: str, rank: int, spec: Any, barrier: Any, q: Any, shares: tuple[float, ...]) -> None:
    import torch

    from rapidserve.config import ModelConfig
    from rapidserve.parallel.group import TPGroup
    from rapidserve.partition.backend import device_granularity, open_backend, plan_configurations

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    cfg = ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=HIDDEN, intermediate_size=17408, num_layers=40,
                      num_heads=40, num_kv_heads=8, head_dim=128)
    tp = TPGroup(spec, cfg, dev)
    configs = plan_configurations(device_granularity("cuda-green", dev), shares)
    backend = open_backend("cuda-green", dev, configs, (role,))  # type: ignore[arg-type]
    rows = DECODE_ROWS if role == "decode" else PREFILL_ROWS
    for c in configs:
        stream = backend.stream(c.name, role)  # type: ignore[arg-type]
        units = c.decode_units if role == "decode" else c.prefill_units
        for phase in ("decode alone", "prefill alone", "both"):
            barrier.wait()
            active = phase == "both" or phase.startswith(role)
            for n in rows:
                ms = _time(tp, stream, n, ITERS) if active else None
                if ms is not None and rank == 0:
                    q.put({"config": c.name, "role": role, "sms": units or "all", "phase": phase, "rows": n,
                           "ms": round(ms, 4), "gbps": round(2 * n * HIDDEN * 2 / (ms / 1e3) / 1e9, 1)})
            barrier.wait()
    q.put({"done": f"{role}.{rank}"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--shares", default="0.125,0.25,0.5", help="decode shares of the split configurations")
    a = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    from rapidserve.parallel.group import group_specs

    shares = tuple(float(s) for s in a.shares.split(","))
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(4), ctx.Queue()
    procs = []
    from rapidserve.engine.tp_workers import tp_env

    for role in ("decode", "prefill"):
        env = tp_env(role)  # what the engine gives each role (spawned children copy os.environ)
        os.environ.pop("NCCL_MAX_CTAS", None)
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for spec in group_specs(role, 2, "nccl"):
            procs.append(ctx.Process(target=_worker, args=(role, spec.rank, spec, barrier, q, shares)))
    for pr in procs:
        pr.start()
    rows: list[dict[str, Any]] = []
    done = 0
    while done < 4:
        r = q.get(timeout=600)
        if "done" in r:
            done += 1
        else:
            rows.append(r)
    for pr in procs:
        pr.join(30)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": {r: tp_env(r) for r in ("decode", "prefill")}, "rows": rows},
                      f, indent=1)
    caps = {r: tp_env(r).get("NCCL_MAX_CTAS") or "NCCL default" for r in ("decode", "prefill")}
    print(f"# all-reduce inside partitions, 2 GPUs, hidden {HIDDEN} bf16, mean of {ITERS}; NCCL_MAX_CTAS {caps}\n")
    print("| configuration | role | SMs | rows | alone (ms) | both phases at once (ms) | alone GB/s (algbw x2) |")
    print("|---|---|---|---|---|---|---|")
    key = {(r["config"], r["role"], r["rows"], r["phase"]): r for r in rows}
    for (c, role, n, ph), r in sorted(key.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if ph == "both":
            continue
        both = key.get((c, role, n, "both"))
        print(f"| {c} | {role} | {r['sms']} | {n} | {r['ms']:.3f} | {both['ms'] if both else '-'} | {r['gbps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
