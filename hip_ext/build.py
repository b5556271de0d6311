"""Build helper for ``native/hip_cumask.c`` -> ``libhip_cumask.so`` (gcc, no hipcc needed).

The C file only needs HIP *types* (it reaches the functions with ``dlopen``/``dlsym``), so it is
compiled with plain gcc. It uses the real ``hip/hip_runtime_api.h`` when found (Debian's
``libamdhip64-dev`` puts it in /usr/include/hip; ROCm in /opt/rocm/include) and otherwise the
minimal ``native/hip_shim.h``. Run ``python -m hip_ext.build OUT_DIR`` to build by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCE = NATIVE_DIR / "hip_cumask.c"
LIB_NAME = "libhip_cumask.so"
HIP_HEADER = Path("hip") / "hip_runtime_api.h"
ENV_HIP_LIBRARY = "RAPIDSERVE_LIBAMDHIP64"
DEFAULT_HIP_LIBRARY = "libamdhip64.so"


class BuildError(RuntimeError):
    """gcc is missing or the compile failed (message carries gcc's output)."""


@dataclass(frozen=True)
class BuildResult:
    path: Path
    used_shim: bool
    include_dir: Path | None


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc"))


def find_hip_include() -> Path | None:
    """Directory holding ``hip/hip_runtime_api.h``, or None."""
    candidates = [os.environ.get("HIP_INCLUDE_DIR"), "/opt/rocm/include", "/usr/include"]
    for cand in candidates:
        if cand and (Path(cand) / HIP_HEADER).is_file():
            return Path(cand)
    return None


def hip_library_path() -> str:
    """The libamdhip64 the native module should dlopen; env ``RAPIDSERVE_LIBAMDHIP64`` read now."""
    return os.environ.get(ENV_HIP_LIBRARY) or DEFAULT_HIP_LIBRARY


def compile_shared(sources: list[Path], out: Path, extra_args: list[str] | None = None) -> Path:
    """Compile C ``sources`` into the shared library ``out`` with gcc."""
    cc = find_compiler()
    if cc is None:
        raise BuildError("no C compiler found (looked for $CC or gcc on PATH)")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [cc, "-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE"]
    cmd += extra_args or []
    cmd += [str(s) for s in sources] + ["-o", str(out), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"compile failed (rc={proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out


def build_native(out_dir: Path, *, use_shim: bool | None = None) -> BuildResult:
    """Build ``libhip_cumask.so`` into ``out_dir``; ``use_shim=None`` means shim only if no headers."""
    include = None if use_shim else find_hip_include()
    if use_shim is False and include is None:
        raise BuildError(f"HIP headers ({HIP_HEADER}) not found and use_shim=False")
    args = ["-I", str(NATIVE_DIR)]
    if include is None:
        args.append("-DRS_USE_HIP_SHIM")
    else:
        # HIP headers need a platform macro; C-mode gcc warns on some of their constructs.
        args += ["-D__HIP_PLATFORM_AMD__", "-isystem", str(include)]
    path = compile_shared([SOURCE], Path(out_dir) / LIB_NAME, args)
    return BuildResult(path=path, used_shim=include is None, include_dir=include)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0]) if args else Path.cwd()
    res = build_native(out_dir)
    src = "hip_shim.h" if res.used_shim else f"HIP headers in {res.include_dir}"
    print(f"built {res.path} against {src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
