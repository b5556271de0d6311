"""How long a worker's loop stalls while a big grammar compiles (CPU, in this process).

Hybrid mode's worker (the decode worker alone, every step fused; tiny preset, random weights, a small
trained tokenizer, CPU) streams one plain request; meanwhile a request with a large JSON schema arrives
(`--props` string properties with a pattern: llguidance takes seconds to compile it). Reported: the compile's
own time, the longest gap between two loop turns (`DecodeWorker.turn`) and the plain request's tokens while the
structured one waited for its grammar, then whether the structured request completed. Before the compile moved
off the loop the longest gap is the compile; after, it is one step.

    python bench/grammar_compile_stall.py [--props 4000] [--turns 5000] [--torch-threads N]

On a small CPU box keep `--torch-threads 1`: torch's intra-op threads and the compile's thread then
share the cores without OpenMP barriers waiting on a descheduled thread (tens of ms per turn on 2
cores); a GPU worker's forward does not use them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.loader import resolve_model
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from tests.test_structured_workers import tiny_tokenizer_dir
from tests.test_worker_faults import FakeIO, _fused_worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--props", type=int, default=4000)
    ap.add_argument("--turns", type=int, default=5000)
    ap.add_argument("--torch-threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.torch_threads)
    tok = tiny_tokenizer_dir(Path(tempfile.mkdtemp()) / "tok")
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=160,
                                 block_size=16, max_model_len=2048, tokenizer=tok, allow_long_max_model_len=True)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    runner = ModelRunner(cfg, source, show_progress=False)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"}
                                               for i in range(a.props)}, "required": ["p0"]}
    so = StructuredOutputs(json=json.dumps(schema))
    io = FakeIO()
    w = _fused_worker(cfg, runner, io)
    # warm: the tokenizer view and a small grammar, so only the big schema's compile is measured
    warm = StructuredOutputs(regex="[a-z]{3}")
    io.inbox.append(m.NewRequest("warm", [3, 4, 5], SamplingParams(max_tokens=4, structured_outputs=warm), 0.0))
    for _ in range(200):
        w.turn()
        if not w.inflight and not w.sched.reqs:
            break
    t0 = time.perf_counter()
    template = w.grammar._compile(so)  # the compile alone, on a fresh book's compiler (not cached by it)
    compile_s = time.perf_counter() - t0
    del template
    io.sent["d2r"].clear()  # (the worker holds that list)
    io.inbox.append(m.NewRequest("plain", [3, 4, 5, 6], SamplingParams(max_tokens=1900, ignore_eos=True), 0.0))
    w.turn()
    w.turn()
    io.inbox.append(m.NewRequest("json", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=24,
                                                                  structured_outputs=so), 0.0))
    turns: list[tuple[float, int, bool]] = []  # (time, plain tokens so far, json has a token)
    t_start = time.perf_counter()
    for _ in range(a.turns):
        w.turn()
        got: dict[str, int] = {}
        for b in io.of("d2r", m.TokenBatch):
            for t in b.tokens:
                got[t.req_id] = got.get(t.req_id, 0) + 1
        turns.append((time.perf_counter(), got.get("plain", 0), "json" in got))
        if got.get("json") and "json" not in w.sched.reqs:  # its last token was recorded
            break
    first_json = next((i for i, (_, _, j) in enumerate(turns) if j), None)
    upto = turns[: (first_json if first_json is not None else len(turns)) + 1]
    times = [t_start] + [t for t, _, _ in upto]
    gaps = [b - c for c, b in zip(times, times[1:], strict=False)]
    waited = upto[-1][0] - t_start
    res: dict[str, Any] = {
        "props": a.props, "torch_threads": a.torch_threads, "compile_s": round(compile_s, 3),
        "turns_until_json_token": len(upto), "wait_for_json_first_token_s": round(waited, 3),
        "longest_loop_gap_s": round(max(gaps), 3), "median_loop_gap_ms": round(sorted(gaps)[len(gaps) // 2] * 1e3, 2),
        "plain_tokens_meanwhile": upto[-1][1],
        "json_done": any(f.req_id == "json" for f in io.of("d2r", m.Finished)) or any(
            t.req_id == "json" and t.finish_reason for b in io.of("d2r", m.TokenBatch) for t in b.tokens),
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
