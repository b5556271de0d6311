"""Compile the Triton decode split kernel (rapidserve/attention/triton_paged_decode.py) for sm_90 on any machine (no
GPU) and report, per launch configuration, what decides its memory rate.

    python bench/decode_attn_compile.py --out DIR [--kv auto,fp8] [--size full|quick|dry]
    PYTHONPATH=DIR_WITH_TRITON_3.6 python bench/decode_attn_compile.py ...   # the GPU machines' Triton

Per configuration (bench/decode_attn_tune.py's candidates, Qwen3-8B's attention: 8 kv heads of 4 q heads, head_dim
128, pages of 16, bf16 q): whether the K/V tiles load as 16-byte cp.async and how many one-element global loads are
left (the H200 sweep's kernel had 256 a thread per tile under Triton 3.6), the K/V buffers the pipeliner keeps,
shared memory and registers a program, programs an SM (the H100/H200 limits of bench/amd_occupancy.py), and the
SASS instructions a thread of the loop's body. Triton's code for one kernel differs between versions (3.9 inferred
divisibilities that 3.6 lost), so the page names the Triton that compiled it. Writes DIR/decode_attn_compile.md and
.json and prints the table. The compile and the readings of SASS are bench/sm90_compile.py's, which
bench/kernel_compile_audit.py uses for every other kernel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sm90_compile import compile_sm90, cuobjdump, loop_body, programs_per_sm, resources  # noqa: E402
from rapidserve.attention.decode_config import DecodeConfig  # noqa: E402

SIGNATURE = {"q_ptr": "*bf16", "bt_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "part_ptr": "*fp32", "qk_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32", "stride_bt": "i32",
             "num_splits": "i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "count_ptr": "*i32"}
# one-element (or two-byte) global loads and 16-byte asynchronous copies, in the PTX
NARROW = re.compile(r"ld\.global(?:\.\w+)*\.[bus](?:8|16)\b")
CP16 = re.compile(r"cp\.async\.cg\.shared\.global\S* \[[^]]*\], \[[^]]*\], (?:16|0x10)\b")


def compile_split(cfg: DecodeConfig, kv: str = "bf16", *, head_dim: int = 128, group: int = 4, kv_heads: int = 8,
                  block_size: int = 16, window: int = 0, direct: bool = False,
                  target: tuple[str, int, int] = ("cuda", 90, 32)) -> Any:
    """The split kernel compiled as decode_attention launches it with `cfg` over a `kv` cache ("bf16" or "fp8":
    e4m3fn; fp8 with cfg.fp16_dots takes fp16 dots), pointers 16-byte aligned, q's strides multiples of 16."""
    import triton

    from rapidserve.attention import triton_paged_decode as tp

    fp8 = kv == "fp8"
    fn = tp._decode_split_kernel
    consts = {"NUM_KV_HEADS": kv_heads, "GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size,
              "BLOCK_G": max(16, triton.next_power_of_2(group)), "BLOCK_D": triton.next_power_of_2(head_dim),
              "BLOCK_N": cfg.block_n, "DIRECT": direct, "IEEE": False, "KV_FP8": fp8, "FP8_MAX": 448.0,
              "WINDOW": window, "F16_DOTS": fp8 and cfg.fp16_dots, "PREFETCH": cfg.prefetch,
              "USE_GDC": True, "ZERO_COUNTS": False}  # programmatic dependent launch as on sm_90 (ops/pdl.py)
    types = {**SIGNATURE, "kc_ptr": "*fp8e4nv" if fp8 else "*bf16", "vc_ptr": "*fp8e4nv" if fp8 else "*bf16"}
    signature = {n: types.get(n, "constexpr") for n in fn.arg_names}
    constexprs = {(i,): consts[n] for i, n in enumerate(fn.arg_names) if n not in types}
    aligned = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n in ("stride_qb", "stride_qh")]
    return compile_sm90(fn, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned},
                        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, target)


def kv_buffers(ttgir: str, block_n: int) -> int:
    """The K (or V) tile buffers the pipeliner allocates (0: the tiles are not staged in shared memory)."""
    found = re.findall(rf"local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x{block_n}x\d+x", ttgir)
    return max((int(n) for n in found), default=0)


def loop_sass(cubin: bytes) -> Any:
    """Opcodes of the kernel's largest loop body (the longest backward branch) in the cubin's SASS."""
    return loop_body(cuobjdump(cubin, "-sass"))


def analyse(kernel: Any, cfg: DecodeConfig) -> dict[str, Any]:
    """What one compiled variant does: its loads, buffers, resources and loop."""
    ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
    res = resources(cubin)
    regs, local = res["regs"], res["spill_bytes"]
    smem = int(kernel.metadata.shared)
    loop = loop_sass(cubin)
    programs, limiter = programs_per_sm(regs, smem, cfg.num_warps)
    return {"narrow_loads": len(NARROW.findall(ptx)), "cp_async_16": len(CP16.findall(ptx)),
            "cp_async": ptx.count("cp.async.c"), "buffers": kv_buffers(kernel.asm["ttgir"], cfg.block_n),
            "smem": smem, "regs": regs, "spill_bytes": local, "programs_per_sm": programs, "limiter": limiter,
            "loop_instructions": sum(loop.values()), "loop_top": dict(loop.most_common(6))}


def _key(cfg: DecodeConfig) -> str:
    return f"n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" pf" if cfg.prefetch else "") + \
        (" f16" if cfg.fp16_dots else "")


def report(rows: list[dict[str, Any]], meta: dict[str, str]) -> str:
    lines = [f"# Decode split kernel compiled for sm_90: Triton {meta['triton']} ({meta['date']})", "",
             f"Command: `{meta['command']}`. {meta['what']}. narrow: one- or two-byte global loads in the PTX (a "
             "thread's K/V elements one by one); cp16: 16-byte cp.async; buffers: K (and V) tiles in shared memory; "
             "programs/SM: H100/H200 limits (limiter); loop: SASS instructions a thread of the loop's body.", ""]
    for kv in dict.fromkeys(r["kv"] for r in rows):
        lines += [f"## KV cache {kv}", "", "| config | narrow | cp16 | buffers | smem B | regs | spill B | programs/SM "
                  "| loop | loop's most frequent |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["kv"] == kv):
            if "error" in r:
                lines.append(f"| {r['key']} | {r['error']} |" + " |" * 8)
                continue
            top = ", ".join(f"{k} {v}" for k, v in r["loop_top"].items())
            lines.append(f"| {r['key']} | {r['narrow_loads']} | {r['cp_async_16']} | {r['buffers']} | {r['smem']} | "
                         f"{r['regs']} | {r['spill_bytes']} | {r['programs_per_sm']} ({r['limiter']}) | "
                         f"{r['loop_instructions']} | {top} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.decode_attn_tune import candidates

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="auto,fp8", help="KV caches: auto (bf16) and/or fp8 (e4m3fn)")
    ap.add_argument("--size", default="full", choices=["full", "quick", "dry"], help="the tuner's candidate list")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import triton

    rows: list[dict[str, Any]] = []
    for kv in args.kv.split(","):
        fp8 = kv == "fp8"
        table = DecodeConfig(64, 4, 3, 2, fp8)  # only its waves and tile feed the candidates' extras
        for cfg in candidates(table, fp8, args.size):
            row: dict[str, Any] = {"kv": "fp8" if fp8 else "bf16", "key": _key(cfg), "config": cfg._asdict()}
            try:
                row.update(analyse(compile_split(cfg, row["kv"]), cfg))
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row of the report
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:80] if str(e).strip() else ''}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"triton": triton.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
            "command": "python bench/decode_attn_compile.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "what": "Qwen3-8B's attention (8 kv heads x 4, head_dim 128), pages of 16, bf16 q, split launch"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attn_compile.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    text = report(rows, meta)
    (args.out / "decode_attn_compile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
