"""Compile a Triton kernel for Hopper (sm_90) on any machine (no GPU) and read what its SASS does with memory.

    kernel = compile_sm90(fn, signature, constexprs, attrs, {"num_warps": 4, "num_stages": 3})
    summary = summarise(kernel)

`compile_sm90` is `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` down to the cubin (ptxas ships
in the triton wheel); `summarise` disassembles it with the wheel's cuobjdump and counts, over the whole kernel (static
instructions, a loop's body once):

- ``ldg``: global loads by width in bits (SASS ``LDG.E.U8`` / ``.S8`` 8, ``.U16`` / ``.S16`` 16, ``LDG.E`` 32,
  ``.64``, ``.128``): a contiguous bf16 row that takes ``LDG.E.U16``, one element an instruction, lost a
  divisibility or contiguity fact on its way to the load (Triton vectorises a load only as far as it can prove
  the addresses contiguous and aligned: bench/results/kernel_compile_audit/README.md);
- ``stg``: global stores likewise;
- ``cp_async``: asynchronous global-to-shared copies by width in bits (SASS ``LDGSTS``: what the pipeliner stages
  with num_stages; 128 is a 16-byte copy; it needs 4 bytes or more, so a one-element bf16 tile is never staged);
  ``tma``: bulk tensor copies (``UTMALDG`` / ``UBLKCP``);
- ``mma``: "wgmma" (``HGMMA`` / ``QGMMA`` / ``IGMMA``: Hopper's warpgroup MMA from shared memory), "mma.sync"
  (``HMMA`` / ``IMMA``: the Ampere instruction, operands in registers), or "-" (no tensor-core instruction);
- ``short``: the source lines (PTX `.loc`, inlined helpers with their callers) whose global loads or stores are
  narrower than their tile allows (`short_accesses`: the TTGIR's tensor and layout give the elements a thread
  holds, so 16 bytes is the most it could move at once when they are contiguous; a one-element-a-thread tile is not
  short at 2 bytes), the way to tell a lost divisibility or contiguity fact from a small tile;
- ``pdl``: programmatic dependent launch (rapidserve/ops/pdl.py): the griddepcontrol.wait instructions (SASS
  ``ACQBULK``), the global accesses placed before the first of them (rule 1 wants none: loads, stores, copies and
  atomics; the bulk L2 prefetch ``UBLKPF`` is no access), the griddepcontrol.launch_dependents ones (``PREEXIT``:
  rule 2 wants them after the wait) and how many of the global loads come before the first of them (a late trigger:
  all but the epilogue's), in address order (`pdl_sites`, `pdl_text`);
- resources: registers and spill (``STACK`` + ``LOCAL``) bytes from ``cuobjdump -res-usage`` (`parse_res_usage`),
  shared memory from the compiled kernel's metadata, and the programs an SM holds (`programs_per_sm`: H100/H200
  limits) with what limits them.

Triton's code for one source differs between versions (3.9 infers divisibilities that 3.6, the GPU machines'
version, loses), so a reading names the Triton that compiled it: run under the GPU machines' Triton with
``PYTHONPATH=DIR_WITH_TRITON_3.6`` (bench/results/decode_attn_compile/README.md says how to install one there).
bench/decode_attn_compile.py and bench/kernel_compile_audit.py read their kernels with it.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.amd_occupancy import Hopper

SM90 = ("cuda", 90, 32)
WIDTHS = (8, 16, 32, 64, 128)
_WIDTH_TOKENS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_MMA = {"HGMMA": "wgmma", "QGMMA": "wgmma", "IGMMA": "wgmma", "HMMA": "mma.sync", "IMMA": "mma.sync"}


def compile_sm90(fn: Any, signature: dict[str, str], constexprs: dict[tuple[int, ...], Any],
                 attrs: dict[tuple[int, ...], Any], options: dict[str, Any],
                 target: tuple[str, int, int] = SM90) -> Any:
    """`fn` (a JITFunction) compiled for `target` (default sm_90): `signature` by argument name ("*bf16", "i32",
    "constexpr", ...), `constexprs` and `attrs` ({(i,): [["tt.divisibility", 16]]}, ...) by argument path, as
    Triton's JIT passes them to `triton.compile` (bench/amd_compile_check.make_job makes them from a launch).

    Always compiled afresh, with every IR kept: callers read the PTX and TTGIR, which a kernel loaded from a cache
    packed binary-only (bench/triton_cache.py, the GPU suite's seed) does not have."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with triton.knobs.compilation.scope():
        triton.knobs.compilation.always_compile = True
        triton.knobs.compilation.store_binary_only = False
        return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*target),
                              options=options)


def _tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def cuobjdump(cubin: bytes, flag: str) -> str:
    """`cuobjdump <flag>` of a cubin (the one in the triton wheel)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_tool("cuobjdump")), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without its predicate) of each SASS instruction."""
    return [(int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip()))
            for m in _INSTR.finditer(sass)]


def opcode(text: str) -> str:
    return text.split()[0] if text.split() else ""


def width(op: str) -> int:
    """Bits a load or store instruction moves (SASS opcode: `LDG.E.U16` 16, `LDG.E` 32, `LDGSTS.E.BYPASS.128` 128);
    `.LTC128B` and the like are cache hints, not widths."""
    found = [_WIDTH_TOKENS[t] for t in op.split(".")[1:] if t in _WIDTH_TOKENS]
    return found[-1] if found else 32


def by_width(ops: list[str]) -> dict[int, int]:
    """Count of each width among `ops` (only the widths present)."""
    counts = collections.Counter(width(o) for o in ops)
    return {w: counts[w] for w in WIDTHS if counts[w]}


def memory_ops(sass: str) -> dict[str, Any]:
    """Global loads / stores and cp.async copies by width, bulk copies, and the tensor-core family of a SASS listing
    (module docstring)."""
    ops = [opcode(t) for _, t in instructions(sass)]
    mma = sorted({_MMA[o.split(".")[0]] for o in ops if o.split(".")[0] in _MMA})
    return {"ldg": by_width([o for o in ops if o.split(".")[0] == "LDG"]),
            "stg": by_width([o for o in ops if o.split(".")[0] == "STG"]),
            "cp_async": by_width([o for o in ops if o.split(".")[0] == "LDGSTS"]),
            "tma": sum(o.split(".")[0] in ("UTMALDG", "UBLKCP") for o in ops),
            "mma": "+".join(mma) if mma else "-",
            "instructions": len(ops)}


_ACCESS = frozenset({"LDG", "STG", "LDGSTS", "ATOMG", "ATOM", "RED", "REDG", "UTMALDG", "UTMASTG", "UBLKCP"})
_LOADS = frozenset({"LDG", "LDGSTS", "UTMALDG", "UBLKCP"})


def pdl_sites(sass: str) -> dict[str, int]:
    """Programmatic dependent launch in a SASS listing (module docstring): `wait` and `dependents` instructions,
    `before_wait` global accesses before the first wait, `dependents_before_wait` 1 where the first launch_dependents
    comes before it (rule 2 of rapidserve/ops/pdl.py), `prefetch` bulk L2 prefetches, `loads` global loads and
    `loads_before_dependents` those before the first launch_dependents (all of them when there is none)."""
    ops = [(a, opcode(t).split(".")[0]) for a, t in instructions(sass)]
    waits = [a for a, o in ops if o == "ACQBULK"]
    deps = [a for a, o in ops if o == "PREEXIT"]
    loads = [a for a, o in ops if o in _LOADS]
    return {"wait": len(waits), "dependents": len(deps), "prefetch": sum(o == "UBLKPF" for _, o in ops),
            "before_wait": sum(o in _ACCESS and a < waits[0] for a, o in ops) if waits else 0,
            "dependents_before_wait": int(bool(deps) and (not waits or deps[0] < waits[0])),
            "loads": len(loads), "loads_before_dependents": sum(a < deps[0] for a in loads) if deps else len(loads)}


def pdl_text(sites: dict[str, int]) -> str:
    """`pdl_sites` in a table cell: "-" (no PDL), else the wait (with the accesses before it, when any), where the
    dependents start (after how many of the loads) and the prefetches."""
    if not sites.get("wait") and not sites.get("dependents"):
        return "-"
    wait = f"wait after {sites['before_wait']} accesses" if sites["before_wait"] else "wait first"
    deps = (f"dependents after {sites['loads_before_dependents']}/{sites['loads']} loads" if sites["dependents"]
            else "no dependents call")
    if sites.get("dependents_before_wait"):
        deps += ", dependents before the wait"
    return f"{wait}; {deps}" + (f"; L2 prefetch x{sites['prefetch']}" if sites["prefetch"] else "")


_LOC = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$")
_ELEM_BITS = {"bf16": 16, "f16": 16, "f32": 32, "f64": 64, "i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64}
_PTX_LOC = re.compile(r"^\s*\.loc\s+\d+\s+\d+\s+\d+\s*//\s*(.*)$")
_PTX_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.\w+)*)\s")
_PTX_CP = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\S*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)")


def _chains(ttgir: str) -> dict[str, tuple[str, ...]]:
    """Each TTGIR location alias as its source chain, innermost first ("file.py:line:col", then its callers)."""
    raw = {m.group(1): m.group(2) for m in map(_LOC.match, ttgir.splitlines()) if m}
    memo: dict[str, tuple[str, ...]] = {}

    def resolve(text: str, depth: int = 0) -> tuple[str, ...]:
        if depth > 64:
            return ()
        if (f := re.fullmatch(r'"([^"]+)":(\d+):(\d+)', text)) is not None:
            return (f"{Path(f.group(1)).name}:{f.group(2)}:{f.group(3)}",)
        if (c := re.fullmatch(r"callsite\(#(loc\d*) at #(loc\d*)\)", text)) is not None:
            return alias(c.group(1), depth) + alias(c.group(2), depth)
        if (n := re.fullmatch(r'"[^"]*"\(#(loc\d*)\)', text)) is not None:
            return alias(n.group(1), depth)
        return ()

    def alias(name: str, depth: int) -> tuple[str, ...]:
        if name not in memo:
            memo[name] = resolve(raw.get(name, ""), depth + 1)
        return memo[name]

    return {name: alias(name, 0) for name in raw}


def _tensor_type(text: str) -> tuple[list[int], str, str] | None:
    """(shape, element type, layout) of the first `tensor<...x!tt.ptr<T>, LAYOUT>` in `text`."""
    start = text.find("tensor<")
    if start < 0:
        return None
    depth, i = 0, start + len("tensor")
    for i in range(start + len("tensor"), len(text)):
        depth += {"<": 1, ">": -1}.get(text[i], 0)
        if depth == 0:
            break
    m = re.fullmatch(r"([0-9x]+)x!tt\.ptr<(\w+)>,\s*(.*)", text[start + len("tensor<"):i], re.S)
    if m is None:
        return None
    return [int(d) for d in m.group(1).split("x")], m.group(2), m.group(3).strip()


def _contiguous_dim(layout: str, rank: int, layouts: dict[str, str]) -> int:
    """The dimension a layout keeps consecutive in a thread (its order[0]; a slice's from its parent's), else the
    last."""
    text = layouts.get(layout, layout)
    sl = re.search(r"#ttg\.slice<\{dim = (\d+), parent = (#\w+)\}>", text)
    if sl is not None:
        d = int(sl.group(1))
        parent = _contiguous_dim(sl.group(2), rank + 1, layouts)
        return parent - (parent > d) if parent != d else rank - 1
    order = re.search(r"#ttg\.blocked<\{.*order = \[([0-9, ]+)\]", text)
    return int(order.group(1).split(",")[0]) if order is not None else rank - 1


def _elem_bits(t: str) -> int:
    return 8 if t.startswith("f8") else _ELEM_BITS.get(t, 32)


def global_access_sites(ttgir: str, num_warps: int) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
    """Each global access of the TTGIR by (kind, source chain): "load" (`tt.load`, the pipeliner's
    `ttg.async_copy_global_to_local`) or "store" (`tt.store`), with its element bits, shape, and `ideal` bits an
    access: what a thread could move at once if the compiler knew the addresses contiguous and aligned, min(128,
    element bits x its elements a thread, x the tensor's extent along the dimension its layout keeps consecutive); a
    scalar's own bits."""
    chains = _chains(ttgir)
    layouts = {m.group(1): m.group(2) for m in re.finditer(r"^(#\w+) = (#ttg\.\w+<.*>)\s*$", ttgir, re.M)}
    out: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for line in ttgir.splitlines():
        if " tt.load " in line or "ttg.async_copy_global_to_local" in line:
            kind = "load"
        elif " tt.store " in line:
            kind = "store"
        else:
            continue
        loc = re.search(r"loc\(#(loc\d*)\)\s*$", line)
        chain = chains.get(loc.group(1), ()) if loc else ()
        tensor = _tensor_type(line)
        if tensor is None:
            scalar = re.search(r":\s*!tt\.ptr<(\w+)>", line)
            bits = _elem_bits(scalar.group(1)) if scalar else 32
            out[kind, chain] = {"elem_bits": bits, "shape": [], "ideal": bits}
            continue
        shape, elem, layout = tensor
        bits, numel = _elem_bits(elem), 1
        for d in shape:
            numel *= d
        per_thread = max(1, numel // (32 * num_warps))
        along = shape[_contiguous_dim(layout, len(shape), layouts)]
        out[kind, chain] = {"elem_bits": bits, "shape": shape, "ideal": min(128, bits * min(per_thread, along))}
    return out


def ptx_access_sites(ptx: str) -> dict[tuple[str, tuple[str, ...]], dict[int, int]]:
    """The PTX's global accesses by (kind, the source chain of their `.loc`, innermost first), each as {bits: count}:
    "load" (`ld.global`, and the asynchronous copies `cp.async` into shared memory) and "store" (`st.global`)."""
    out: dict[tuple[str, tuple[str, ...]], dict[int, int]] = {}
    chain: tuple[str, ...] = ()
    for line in ptx.splitlines():
        if (loc := _PTX_LOC.match(line)) is not None:
            chain = tuple(f"{f}:{ln}:{c}" for f, ln, c in re.findall(r"([\w.]+\.py):(\d+):(\d+)", loc.group(1)))
            continue
        if (acc := _PTX_ACCESS.search(line)) is not None:
            mods = acc.group(2).split(".")
            vec = next((int(m[1:]) for m in mods if re.fullmatch(r"v\d", m)), 1)
            bits = next((int(m[1:]) for m in mods if re.fullmatch(r"[bsuf]\d+", m)), 32)
            kind, width = ("load" if acc.group(1) == "ld" else "store"), vec * bits
        elif (cp := _PTX_CP.search(line)) is not None:
            kind, width = "load", int(cp.group(1), 0) * 8
        else:
            continue
        site = out.setdefault((kind, chain), {})
        site[width] = site.get(width, 0) + 1
    return out


def short_accesses(ptx: str, ttgir: str, num_warps: int) -> list[dict[str, Any]]:
    """The global loads and stores whose widest access (PTX) at a source site is narrower than
    `global_access_sites`' ideal for it: "op" (load / store), "site" (the source chain as file:line, innermost
    first), "bits" (the widths used), "ideal", "elem_bits", "shape". A short site's addresses may be truly unaligned
    or gathered (a mask on a runtime bound, a table entry per row), or the compiler lost a fact that holds: reading
    the site's source decides."""
    ideal = global_access_sites(ttgir, num_warps)
    out = []
    for (kind, chain), used in ptx_access_sites(ptx).items():
        want = ideal.get((kind, chain))
        if want is None or not used or max(used) >= want["ideal"]:
            continue
        out.append({"op": kind, "site": " <- ".join(":".join(c.split(":")[:2]) for c in chain),
                    "bits": dict(sorted(used.items())), "ideal": want["ideal"], "elem_bits": want["elem_bits"],
                    "shape": want["shape"]})
    return out


def loop_body(sass: str) -> collections.Counter[str]:
    """Opcodes of the kernel's largest loop body (the longest backward branch) in a SASS listing."""
    ins = [(a, t) for a, t in instructions(sass)]
    best: list[str] = []
    for addr, text in ins:
        jump = re.search(r"\bBRA\b.*0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < addr:
            body = [t for a, t in ins if int(jump.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return collections.Counter(opcode(t) for t in best)


def programs_per_sm(regs: int, smem: int, num_warps: int, spec: Hopper | None = None) -> tuple[int, str]:
    """Programs an SM holds and what limits them (regs, smem, blocks, warps; H100 / H200 unless `spec`)."""
    spec = spec or Hopper()
    per_warp = -(-max(regs, 1) * 32 // spec.reg_unit) * spec.reg_unit
    limits = {"regs": spec.regs_per_sm // (per_warp * num_warps),
              "smem": spec.smem_per_sm // (smem + spec.smem_reserved_per_block),
              "blocks": spec.max_blocks_per_sm, "warps": spec.max_warps_per_sm // num_warps}
    most = min(limits.values())
    return most, ",".join(k for k, v in limits.items() if v == most)


def parse_res_usage(text: str) -> dict[str, int]:
    """Registers and spill bytes a thread from `cuobjdump -res-usage`'s text: spill is the stack frame (STACK: where
    ptxas puts spilled registers; a Triton kernel calls no function, every helper is inlined, so its frame holds
    nothing else) plus LOCAL. Before 2026-11-29 only LOCAL was read, which ptxas leaves 0 when it spills to the
    frame: the MoE down kernel of Qwen3-30B-A3B's prefill tiles (STACK 160) read as no spill."""
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        raise ValueError(f"cuobjdump -res-usage printed no REG/STACK/LOCAL line: {text!r}")
    return {"regs": int(found.group(1)), "spill_bytes": int(found.group(2)) + int(found.group(3))}


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and spill bytes a thread of a cubin (`parse_res_usage`)."""
    return parse_res_usage(cuobjdump(cubin, "-res-usage"))


def summarise(kernel: Any) -> dict[str, Any]:
    """What one compiled kernel does with memory and its resources (module docstring); `loop_top`: the most frequent
    opcodes of its largest loop's body, `loop_instructions` that body's length."""
    cubin = kernel.asm["cubin"]
    sass = cuobjdump(cubin, "-sass")
    res = resources(cubin)
    smem, warps = int(kernel.metadata.shared), int(kernel.metadata.num_warps)
    programs, limiter = programs_per_sm(res["regs"], smem, warps)
    loop = loop_body(sass)
    return {**memory_ops(sass), **res, "smem": smem, "num_warps": warps, "programs_per_sm": programs,
            "limiter": limiter, "short": short_accesses(kernel.asm["ptx"], kernel.asm["ttgir"], warps),
            "loop_instructions": sum(loop.values()), "loop_top": dict(loop.most_common(6)), "pdl": pdl_sites(sass)}


def widths_text(counts: dict[int, int] | dict[str, int]) -> str:
    """`{16: 256, 128: 4}` as "16b x256, 128b x4" ("-" for none); JSON's string keys alike."""
    return ", ".join(f"{w}b x{n}" for w, n in sorted(((int(w), n) for w, n in counts.items()))) or "-"


__all__ = ["SM90", "WIDTHS", "by_width", "compile_sm90", "cuobjdump", "instructions", "loop_body", "memory_ops",
           "pdl_sites", "pdl_text", "programs_per_sm", "resources", "summarise", "width", "widths_text"]
