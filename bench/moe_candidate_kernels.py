"""The candidates bench/moe_candidates.py times (issue 40): `Candidate`, one experts kernel with what it takes at a
row, ours (`ops/triton_moe.fused_moe` on the packaged tables) and vLLM's `fused_experts` (`load_vllm`: imported
first in a child process, `probe_import`, so a crash or hang there costs only vLLM's rows), or why it is not there;
`import_vllm` / `import_probed` serve bench/fp8_gemm_candidates.py too.
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
from rapidserve.ops.moe_tiles import MoeTables
from rapidserve.ops.triton_moe import fused_moe, moe_config

VLLM_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"
PROBE_S = 150  # the child process's import of vLLM (it takes ~10-20 s on the GPU machine)
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Candidate:
    """One experts kernel: `run(x, w13, w2, weights, ids) -> [T, h]` (None: not available, `why` says why);
    `describe(tokens, top_k, w13, w2)`: the tiles it takes there, for the row."""
    name: str  # the rows' key prefix: "ours" / "vllm"
    label: str  # in messages and the table
    run: Experts | None
    why: str = ""
    describe: Callable[[int, int, torch.Tensor, torch.Tensor], str] | None = None
    version: str = ""
    where: str = ""  # the folder it was imported from


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
                     describe=describe)


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
                     describe=describe, version=version, where=str(Path(str(vllm.__file__)).parent))
