"""Does telling cuBLAS (and FA3) how many SMs a green context holds speed up prefill on a split?

    python bench/experiments/2026-11/carveout_ab.py [--model preset:qwen3-8b] [--attention-backend triton]

A prefill forward of 2 x 4096 tokens runs on the prefill stream of each split (green contexts), with
torch's SM carveout unset (cuBLAS sizes its grids for the whole GPU, so a persistent GEMM on a
116-SM context runs its last wave part-empty) and set to the SMs outside the context
(CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET / cublasSetSmCountTarget). Also on the whole GPU for
reference. Medians of 8 forwards after 3 warm-ups; prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # bench/experiments/2026-11
BENCH = os.path.dirname(os.path.dirname(HERE))  # bench/: the shared helpers (gpu_timing, model_runner)
sys.path[:0] = [HERE, BENCH, os.path.dirname(BENCH)]  # and the repository root, for rapidserve

from model_runner import engine_config, preset_source  # noqa: E402

from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.partition.backend import CudaGreenBackend, on_stream  # noqa: E402
from rapidserve.partition.profile import Configuration  # noqa: E402
from rapidserve.runner import ModelRunner, PrefillItem  # noqa: E402


def timed(fn: object, stream: torch.cuda.Stream, reps: int = 8, warmup: int = 3) -> list[float]:
    out = []
    with on_stream(stream):
        for i in range(warmup + reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()  # type: ignore[operator]
            e.record()
            e.synchronize()
            if i >= warmup:
                out.append(s.elapsed_time(e))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--attention-backend", default="auto")
    a = ap.parse_args()
    setc = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setc is None:
        print("this torch has no _set_sm_carveout_experimental")
        return 2
    name = a.model.removeprefix("preset:")
    mcfg = preset_config(name)
    ecfg = engine_config(name, mcfg, "bfloat16", (1,), 8192, 0.6)
    ecfg = dataclasses.replace(ecfg, runner=dataclasses.replace(ecfg.runner, attention_backend=a.attention_backend))
    runner = ModelRunner(ecfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [Configuration(f"split{d}", d, total - d) for d in (16, 32, 64)]
    backend = CudaGreenBackend(torch.device("cuda"), configs, ("prefill",))
    g = torch.Generator().manual_seed(0)
    items = [PrefillItem(torch.randint(0, mcfg.vocab_size, (4096,), generator=g).tolist(), 0,
                         list(range(i * 256, (i + 1) * 256))) for i in range(2)]
    rows = []
    whole = torch.cuda.Stream()
    base = statistics.median(timed(lambda: runner.prefill(items), whole))
    rows.append(("whole GPU", total, "unset", base, 1.0))
    for c in configs:
        stream = backend.stream(c.name, "prefill")
        for carve in (None, total - c.prefill_units):
            setc(carve)
            ms = statistics.median(timed(lambda: runner.prefill(items), stream))
            rows.append((c.name, c.prefill_units, "unset" if carve is None else str(carve), ms, base / ms))
        setc(None)
    print(f"\n{torch.cuda.get_device_name()}, {a.model}, attention {runner.attn.name}, prefill 2x4096")
    print(f"{'partition':10} {'prefill SMs':>11} {'carveout':>9} {'ms':>8} {'vs whole':>9}")
    for r in rows:
        print(f"{r[0]:10} {r[1]:>11} {r[2]:>9} {r[3]:8.1f} {r[4]:9.2f}")
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
