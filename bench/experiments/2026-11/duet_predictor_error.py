"""How far DuetServe's iteration predictor (partition/roofline.py, as partition/duet.py uses it) is from
steps measured on the GPU (issue 18). CPU only: it reads measurements already taken.

    python bench/experiments/2026-11/duet_predictor_error.py
        [--profile-run bench/results/partition_profile_h200/partition_profile.log]
        [--steps bench/results/step_profile.json] [--out bench/results]

- The measured peaks (GEMM FLOP/s, copy bandwidth, SMs) of that GPU come from the `rapidserve profile`
  log (its "roofline" block); the roofline's fitted constants keep their defaults.
- Whole steps: bench/step_profile.py's prefill (2 x 4096 tokens, FA3) and decode (batch 64 x 4096, a
  CUDA graph) of Qwen3-8B, GPU time (the sum of the step's kernel times) and wall time, against the
  roofline of the same step on the whole GPU (`mixed_operators`).
- The profile's entries (decode alone / beside prefill per split, prefill tokens/s): the error report
  `rapidserve profile` wrote beside the profile (`*.roofline.md`), quoted.
Writes <out>/duet_predictor_error.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for rapidserve

from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.partition.roofline import Peaks, mixed_operators, step_seconds  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "results"  # bench/results


def peaks_from_log(path: Path) -> Peaks:
    text = path.read_text()
    m = re.search(r'"peaks":\s*(\{[^}]*\})', text)
    if m is None:
        raise SystemExit(f"{path}: no roofline peaks found (run `rapidserve profile` without --no-roofline)")
    p = json.loads(m.group(1))
    return Peaks(matmul_flops=p["matmul_flops"], hbm_bw=p["hbm_bw"], num_compute_units=p["num_compute_units"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-run", type=Path, default=RESULTS / "partition_profile_h200" / "partition_profile.log")
    ap.add_argument("--steps", type=Path, default=RESULTS / "step_profile.json")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    peaks = peaks_from_log(a.profile_run)
    steps = json.loads(a.steps.read_text())
    cfg = preset_config(steps["model"].removeprefix("preset:"))
    n = peaks.num_compute_units
    shapes = {"prefill": ((), [(4096, 0), (4096, 0)]), "decode": ((4096,) * 64, [])}
    rows = []
    for r in steps["results"]:
        for phase, (contexts, chunks) in shapes.items():
            p = r[phase]
            gpu = sum(p["categories_ms"].values())
            pred = 1e3 * step_seconds(mixed_operators(cfg, contexts, chunks), n, peaks)
            rows.append((phase, r["backend"].split(" ")[0], p["wall_ms"], gpu, pred))
    report = a.profile_run.parent / next(
        f for f in os.listdir(a.profile_run.parent) if f.endswith(".roofline.md"))
    summary = "\n".join(report.read_text().split("\n\n")[1:2])
    lines = [f"# DuetServe's iteration predictor against measured steps ({steps['gpu']}, {steps['model']})", "",
             f"Command: `python bench/experiments/2026-11/duet_predictor_error.py`. Peaks from `{a.profile_run.name}`: "
             f"{peaks.matmul_flops / 1e12:.0f} TFLOP/s GEMM, {peaks.hbm_bw / 1e12:.2f} TB/s copy, {n} SMs; "
             f"steps from `{a.steps.name}` ({steps['date']}).", "",
             "| step | attention | measured wall ms | measured GPU ms | predicted ms | error vs GPU time |",
             "|---|---|---|---|---|---|"]
    for phase, backend, wall, gpu, pred in rows:
        shape = "2 x 4096 prompt tokens" if phase == "prefill" else "decode 64 x 4096 context"
        lines.append(f"| {shape} | {backend} | {wall:.1f} | {gpu:.1f} | {pred:.1f} | {(pred - gpu) / gpu:+.1%} |")
    lines += ["", "The profile's entries (decode alone and beside prefill on each split, prefill tokens/s), "
              f"from `{report.name}`:", "", summary, ""]
    text = "\n".join(lines)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "duet_predictor_error.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
