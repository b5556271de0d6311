"""The candidates bench/moe_candidates.py times (issue 40): `Candidate`, one experts kernel with what it takes at a
row, ours (`ops/triton_moe.fused_moe` on the packaged tables), vLLM's `fused_experts` (`load_vllm`: imported
first in a child process, `probe_import`, so a crash or hang there costs only vLLM's rows) and torch's own grouped
GEMM (`grouped_mm`: `torch._grouped_mm`, CUTLASS on sm_90 / sm_100), or why one is not there; `import_vllm` /
`import_probed` serve bench/fp8_gemm_candidates.py too.

What `torch._grouped_mm(a [M, K], b [G, K, N], offs=...)` requires, from torch's source (aten/src/ATen/native/
GroupedMMUtils.h, cuda/GroupedBlas.cpp, cuda/GroupMM.cu, cuda/GroupMMCommon.cuh, torch/_meta_registrations.py; read
through the `search` corpus, pytorch/pytorch at main, not at the GPU machine's 2.11 tag) and from trying torch 2.13's
CPU build:
- `offs`: int32 (int64 is refused: "Offsets have to be int32"), 1-D, one entry per group (G = E here): the groups'
  cumulative row ends, on the device (the CUDA path reads it in its own setup kernel, no host read). Rows past
  offs[-1] are left unwritten (so offs[-1] must be every row). A group may be empty.
- No alignment of the groups' row counts in this 2d x 3d case: GroupMMCommon.cuh asserts multiples of 16 bytes only
  where the dynamic dimension is K (2d x 2d) or A / B are laid out along it (3d x 2d, column-major A); for a
  row-major A with groups along M each group's start is offs * K elements, 16-byte aligned because K is. So no
  padding: group sizes must be aligned where M is the contracted dimension (2d x 2d, a training backward's weight
  gradient), not in this forward.
- Strides: the last two dimensions row- or column-major with the other stride a multiple of 16 bytes ("strides
  should be multiple of 16 bytes", on the CPU too), data pointers 16-byte aligned on CUDA: h and I/tp multiples of 8
  in bf16 (every preset's are). B may be either layout (GroupMM.cu compiles all four); w13.transpose(-2, -1)
  ([E, h, 2I], strides (2I*h, 1, h)) is the column-major ("K-major") B, a view: no copy per call.
- dtype: on CUDA the CUTLASS path takes bfloat16 in and out on sm_90 / sm_100 only (`_scaled_mm_allowed_device(
  sm90_only, sm100_only)`: compute capability major 9 or 10); any other GPU or dtype takes `_grouped_mm_fallback`,
  a loop of mm over the groups after copying `offs` to the host (a sync: no CUDA graph), so this candidate is offered
  only where CUTLASS runs. On the CPU that same fallback runs float32, bfloat16 and float16 (checked here), which is
  what the CPU dry run and the tests measure: the flow and the numbers, not the kernel.
- Groups: fewer than 1024 (E <= 128 here). Tiles (GroupMM.cu at main, not checked against 2.11): 64x128x128
  ping-pong where the average rows per group or N is <= 128, else 128x256x64 cooperative, cluster 2x1x1.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from bench import moe_gemm
from rapidserve.ops import torch_ops
from rapidserve.ops.moe_tiles import MoeTables
from rapidserve.ops.triton_moe import fused_moe, moe_config

VLLM_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"
GMM_NAME = "torch_gmm"
PROBE_S = 150  # the child process's import of vLLM (it takes ~10-20 s on the GPU machine)
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Candidate:
    """One experts kernel: `run(x, w13, w2, weights, ids) -> [T, h]` (None: not available, `why` says why);
    `describe(tokens, top_k, w13, w2)`: the tiles (or path) it takes there, for the row."""
    name: str  # the rows' key prefix: "ours" / "vllm" / "torch_gmm"
    label: str  # in messages
    run: Experts | None
    why: str = ""
    describe: Callable[[int, int, torch.Tensor, torch.Tensor], str] | None = None
    version: str = ""
    where: str = ""  # the folder it was imported from
    column: str = ""  # the table's column prefix ("" = label)
    title: str = ""  # the table's heading clause when it runs (e.g. "vLLM 0.26.0: fused_experts"; "": none)
    config_head: str = "config"  # the heading of its `describe` column, after `column`

    @property
    def head(self) -> str:
        return self.column or self.label


def short(e: BaseException, limit: int = 200) -> str:
    """An exception as one line: its type and the first line of its message, at most `limit` characters."""
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def ours(tables: MoeTables | None) -> Candidate:
    def describe(t: int, k: int, w13: torch.Tensor, w2: torch.Tensor) -> str:
        e, i, h = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
        cfg = moe_config(t * k, e, i, h, w13.dtype, w13.device, tables)
        source = moe_gemm.tiles_source(tables, e, i, h, w13.dtype, w13.device)
        return f"{cfg.block_m}{f'+tail {cfg.tail_m}' if cfg.tail_m else ''} {source}"

    return Candidate("ours", "ours", lambda x, w13, w2, w, ids: fused_moe(x, w13, w2, w, ids, None, tables),
                     describe=describe, config_head="tiles")


def probe_import(module: str, path: Path | None, timeout: float = PROBE_S) -> str:
    """Import `module` in a child process first ("" if it imports; else why not, its traceback's last line), `path`
    first on its sys.path: an import that crashes the process (a compiled op built against another torch) or hangs
    would otherwise take our rows with it."""
    code = (f"import sys; sys.path.insert(0, {str(path)!r}); " if path is not None else "") + \
        f"import importlib; importlib.import_module({module!r})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"importing {module} took more than {timeout:g} s (in a child process)"
    if proc.returncode == 0:
        return ""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    if proc.returncode < 0:
        return f"importing {module} killed the child process (signal {-proc.returncode})"
    last = lines[-1].strip() if lines else f"exit {proc.returncode}, nothing on stderr"
    return last if len(last) <= 200 else last[:197] + "..."


def import_probed(module: str, path: Path | None) -> ModuleType | str:
    """`module`, imported here once a child process imported it (`probe_import`; `path` then put first on sys.path),
    or why not."""
    why = probe_import(module, path)
    if why:
        return why
    if path is not None and str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to import is the reason it is not measured
        return short(e)


def import_vllm(path: Path | None, module: str = VLLM_MODULE) -> tuple[ModuleType, ModuleType] | str:
    """(the vllm package, its `module`) from `path` (a folder holding the vllm package, pip --target; None: as
    installed), imported as `import_probed` does with vLLM's environment quietened; or why not."""
    if path is not None and not (path / "vllm" / "__init__.py").is_file():
        return f"--vllm-path {path} holds no vllm/__init__.py (install not run or failed?)"
    for var, value in (("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"), ("VLLM_LOGGING_LEVEL", "WARNING")):
        os.environ.setdefault(var, value)
    mod = import_probed(module, path)
    return mod if isinstance(mod, str) else (importlib.import_module("vllm"), mod)


def load_vllm(path: Path | None) -> Candidate:
    """vLLM's `fused_experts` as a candidate, or one that says why not ("vllm not importable: ..."). `path`: a
    folder holding the vllm package (pip --target), put first on sys.path."""
    def missing(why: str) -> Candidate:
        return Candidate("vllm", "vLLM", None, why=f"vllm not importable: {why}")

    got = import_vllm(path)
    if isinstance(got, str):
        return missing(got)
    vllm, fm = got
    version = str(getattr(vllm, "__version__", "?"))
    fused_experts = getattr(fm, "fused_experts", None)
    if fused_experts is None:
        return missing(f"vllm {version}: no fused_experts in {VLLM_MODULE}")

    def dtype_str(dtype: torch.dtype) -> str | None:
        """vLLM's config-file dtype of an unquantized layer (None for bf16/fp16, as _get_config_dtype_str)."""
        from vllm.model_executor.layers.fused_moe.config import _get_config_dtype_str

        return _get_config_dtype_str(dtype)

    def describe(t: int, k: int, w13: torch.Tensor, w2: torch.Tensor) -> str:
        e, i = w13.shape[0], w2.shape[2]
        d = dtype_str(w13.dtype)
        cfg = fm.try_get_optimal_moe_config(tuple(w13.shape), tuple(w2.shape), k, d, t)
        tuned = "tuned" if fm.get_moe_configs(e, i, d) else "default"
        naive = " naive" if t * k * 4 <= e else ""  # vLLM 0.26's _prepare_expert_assignment: no alignment
        return (f"{cfg.get('BLOCK_SIZE_M')}x{cfg.get('BLOCK_SIZE_N')}x{cfg.get('BLOCK_SIZE_K')} "
                f"g{cfg.get('GROUP_SIZE_M', 1)} w{cfg.get('num_warps', '?')} s{cfg.get('num_stages', '?')} "
                f"{tuned}{naive}")

    # positional, as 0.26's signature: (hidden_states, w1 [E, 2I, h], w2 [E, h, I], topk_weights, topk_ids);
    # activation SiLU-and-mul on [gate | up] (its default), no expert map, unquantized
    return Candidate("vllm", "vLLM", lambda x, w13, w2, w, ids: fused_experts(x, w13, w2, w, ids),
                     describe=describe, version=version, where=str(Path(str(vllm.__file__)).parent),
                     title=f"vLLM {version}: fused_experts")


def group_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k] int64: the (token, slot) pairs, numbered t * k + j, sorted by expert, each expert's in pair
    order (a stable sort); offs [E] int32: each expert's cumulative end in that order, torch._grouped_mm's `offs`)
    of ids [T, k], from device ops without a host read: the ends are a searchsorted of every expert id in the
    sorted ids (not bincount + cumsum: CUDA's bincount reads the ids' max and min on the host, which a CUDA graph
    cannot capture)."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


def grouped_mm_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
    """`ops.moe.moe_experts_ref`'s contract on torch._grouped_mm: the pairs sorted by expert (`group_pairs`), their
    tokens' rows gathered, gate|up = one grouped GEMM on w13 [E, 2I, h] seen as [E, h, 2I] (a column-major view),
    silu_and_mul, down = one grouped GEMM on w2 seen as [E, I, h]; each pair's row times its float32 routing weight
    rounded to x's dtype (the reference's `(y * w).to(dtype)`, in place), put back in pair order and summed over the
    k slots (float32 accumulation, one rounding; the reference adds in x's dtype). Fixed shapes, no host read: a
    CUDA graph captures it where _grouped_mm runs CUTLASS."""
    t, h = x.shape
    k = ids.shape[1]
    order, offs = group_pairs(ids, w13.shape[0])
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    act = torch_ops.silu_and_mul(torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs))
    down = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    down.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
    return torch.empty_like(down).index_copy_(0, order, down).view(t, k, h).sum(1)


def grouped_mm(device: str, dtype: torch.dtype) -> Candidate:
    """torch._grouped_mm's experts (`grouped_mm_experts`) as a candidate where it runs its CUTLASS kernel (bfloat16
    on compute capability 9.x / 10.x: the module docstring) or on the CPU (torch's mm-loop fallback: the dry run);
    else one that says why not."""
    version = torch.__version__
    label = "torch._grouped_mm"

    def missing(why: str) -> Candidate:
        return Candidate(GMM_NAME, label, None, why=why, version=version, column="torch")

    if not hasattr(torch, "_grouped_mm"):
        return missing(f"torch {version} has no _grouped_mm")
    if device == "cuda":
        if torch.version.hip:
            return missing(f"torch._grouped_mm on ROCm (HIP {torch.version.hip}) is not the CUTLASS kernel measured "
                           "here")
        major, minor = torch.cuda.get_device_capability()
        if major not in (9, 10):
            return missing(f"torch._grouped_mm runs CUTLASS on sm_90 / sm_100 only (this GPU: sm_{major}{minor}); "
                           "elsewhere an mm loop with a host sync")
        if dtype != torch.bfloat16:
            return missing(f"torch._grouped_mm runs CUTLASS in bfloat16 only (this run: {str(dtype).split('.')[-1]})")
    what = "cutlass grouped" if device == "cuda" else "mm-loop fallback"
    return Candidate(GMM_NAME, label, grouped_mm_experts, version=version, column="torch",
                     title=f"torch._grouped_mm ({what}, torch {version})",
                     describe=lambda t, k, w13, w2: f"{what} (torch {version})")
