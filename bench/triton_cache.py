"""Carry Triton's on-disk kernel cache from one GPU session to the next: pack what loading needs, unpack it elsewhere.

    python bench/triton_cache.py unpack SRC CACHE             # SRC: a folder holding triton_cache.tar.xz (or its
                                                              # parts triton_cache.partNN), or the archive itself
    python bench/triton_cache.py pack CACHE OUTDIR [--since EPOCH] [--split-mib 15]
    python bench/triton_cache.py stats PATH                   # a cache folder, an archive, or a folder holding one

Why: each session's GPU machine starts bare, and about half the GPU suite's time is Triton compiling the same kernels
again (bench/gpu_suite.sh --triton-cache DIR uses this). What Triton 3.6 needs to load a kernel without compiling it
(python/triton/compiler/compiler.py, `compile`): the cache entry is TRITON_CACHE_DIR/<base32 of the key's sha256>/
(runtime/cache.py, `get_cache_manager`); `fn_cache_manager.get_group(f"{name}.json")` reads `__grp__{name}.json`, whose
`child_paths` maps each file name to an ABSOLUTE path and keeps only those that exist; a hit needs `{name}.json` (the
metadata) among them, and `CompiledKernel` then reads the other children into `asm` and loads `asm[backend.binary_ext]`
(`cubin`; `hsaco` on ROCm). The IRs (`.source`, `.ttir`, `.ttgir`, `.llir`, `.ptx`) are written for inspection only:
TRITON_STORE_BINARY_ONLY=1 makes Triton itself store just cubin/hsaco and json. A kernel loaded from a packed cache so
has no `asm['ptx']` etc. (nothing in rapidserve/ or the GPU tests reads them; tests/test_fp8_fused.py's `asm['ttgir']`
is a CPU test). Beside the kernels, Triton caches C modules it builds with gcc under the same tree: `cuda_utils*.so`
(once) and `__triton_launcher*.so` (one per signature and constants: each a gcc run, runtime/build.py
`compile_module_from_src`, keyed by the C source and the platform); they are kept too, as are `*.autotune.json`
(the autotuner's choices, when its disk cache is on; rapidserve's kernels use no @triton.autotune).

The key (runtime/cache.py `get_cache_key`): `triton_key()` (Triton's version and the hashes of its compiler, backend
and language sources and libtriton.so), the source's hash (the kernel function's source and line, those of every
@jit function it calls, the constexpr globals it reads, signature, constexpr values, attributes), the backend's hash
(ptxas version and the target arch: 90 on an H100 or H200), the compile options (num_warps, num_stages, ...,
libdevice's file hash), and the cache-invalidating env vars that are set (MLIR_ENABLE_DUMP, TRITON_DISABLE_LINE_INFO,
...). The driver and the GPU model beyond its arch are not in it. So an entry made on one H200 loads on another with
the same Triton wheel; a changed kernel (or one that moved to another line), another Triton, or another ptxas gets
another key: a miss and a compile, never a stale kernel.

pack keeps, of the entries "used or created" since --since (any file of the entry read, so its atime, or written at
or after it; without --since, or where the file system keeps no atimes, every entry), only the files above, with the
group files' paths made bare names; unpack writes them back with the paths absolute under the new CACHE, and every
file's times in the past, so that the next pack can tell the entries the run read. The archive is a tar.xz, split
into parts of at most --split-mib MiB named triton_cache.part00, .part01, ... when larger (the device brings files
of at most 16 MiB back). Writing and reading the archive is bench/cache_archive.py's, shared with bench/vllm_cache.py
(vLLM's torch.compile cache); what loading needs and the group files' paths are this module's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

if __package__:  # imported as bench.triton_cache
    from . import cache_archive as ca
else:  # run as a script, or loaded by tests/bench_module.py: bench/ on the path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cache_archive as ca

# the packing, the archive's reading and the atime probe are bench/cache_archive.py's (shared with vllm_cache.py)
CacheError = ca.CacheError
atime_tracked = ca.atime_tracked
compress = ca.compress

NAME = "triton_cache"
SPLIT_MIB = ca.SPLIT_MIB
# xz preset 9 (a 64-MiB dictionary: the cubins are much alike) took no longer than 6 on 430 sm_90 kernels of
# rapidserve (bench/amd_compile_check --targets sm_90: 37 MiB of cubin+json): 1.4 MiB against 2.1 MiB, ~11 s on a
# shared 2-core machine; preset 1 1.2 s for 5.4 MiB. Tars larger than CHUNK_MIB are compressed in chunks side by side.
PRESET = 9
CHUNK_MIB = ca.CHUNK_MIB
ENTRY_RE = re.compile(r"^[A-Z2-7]{52}$")  # base32 of a sha256, '=' stripped (runtime/cache.py `_base32`)
GROUP_PREFIX = "__grp__"
BINARY_EXTS = (".cubin", ".hsaco")  # backend.binary_ext: nvidia, amd
PART_RE = ca.part_re(NAME)


@dataclass
class Entry:
    """One cache entry (a key's folder) and the files loading needs from it: name -> bytes (group files rewritten)."""

    key: str
    kernels: list[str] = field(default_factory=list)  # kernel names with a loadable group
    modules: list[str] = field(default_factory=list)  # C modules (.so)
    files: dict[str, bytes] = field(default_factory=dict)


def entry_dirs(cache: Path) -> list[Path]:
    """The entry folders of a Triton cache, sorted; CacheError when `cache` is missing or holds none."""
    if not cache.is_dir():
        raise CacheError(f"{cache}: no such folder (the Triton cache to pack)")
    dirs = sorted(p for p in cache.iterdir() if p.is_dir() and ENTRY_RE.match(p.name))
    if not dirs:
        others = sorted(p.name for p in cache.iterdir())[:5]
        raise CacheError(f"{cache}: not a Triton cache: no entry folders (52-character base32 names)"
                         + (f"; it holds {others}" if others else "; it is empty"))
    return dirs


def needed(d: Path) -> Entry:
    """What loading needs from the entry folder `d`: per group `__grp__X.json` whose metadata `X.json` and binary
    (X.cubin / X.hsaco) exist, those three (the group's paths made bare names); every `*.so` (Triton's C modules);
    every `*.autotune.json`. Temporary folders, IRs and anything else are left out."""
    e = Entry(d.name)
    for f in sorted(d.iterdir()):
        if not f.is_file():
            continue  # tmp.pid_* folders of an interrupted write
        if f.name.startswith(GROUP_PREFIX) and f.name.endswith(".json"):
            meta = f.name[len(GROUP_PREFIX):]
            kernel = meta[:-len(".json")]
            try:
                children = json.loads(f.read_text()).get("child_paths")
            except (OSError, ValueError, AttributeError):
                continue
            if not isinstance(children, dict):
                continue
            keep = [meta] + [kernel + ext for ext in BINARY_EXTS if kernel + ext in children]
            if meta not in children or len(keep) < 2 or not all((d / n).is_file() for n in keep):
                continue  # not loadable as it is: Triton would compile it again anyway
            for n in keep:
                e.files[n] = (d / n).read_bytes()
            e.files[f.name] = json.dumps({"child_paths": {n: n for n in keep}}).encode()
            e.kernels.append(kernel)
        elif f.suffix == ".so" or f.name.endswith(".autotune.json"):
            e.files[f.name] = f.read_bytes()
            if f.suffix == ".so":
                e.modules.append(f.name)
    return e


def _files(d: Path) -> list[Path]:
    return list(d.iterdir())


def pack(cache: Path, out: Path, since: float | None = None, split_mib: float = SPLIT_MIB,
         preset: int = PRESET) -> dict:
    """Pack what loading needs of the cache's entries used or created since `since` (every entry without it) into
    out/triton_cache.tar.xz, or out/triton_cache.partNN when larger than `split_mib` MiB (earlier ones replaced).
    Returns the counts and sizes; CacheError when `cache` is no cache or nothing loadable is left."""
    t0 = time.time()
    dirs = entry_dirs(cache)
    atimes = since is None or atime_tracked(cache)
    if since is not None:
        kept = [d for d in dirs if ca.touched(_files(d), since, atimes) or not atimes]
        new = sum(ca.written(_files(d), since) for d in kept)
    else:
        kept, new = dirs, 0
    entries = [e for e in (needed(d) for d in kept) if e.files]
    if not entries:
        raise CacheError(f"{cache}: none of its {len(dirs)} entries " + ("was used or created since "
                         f"{time.strftime('%FT%TZ', time.gmtime(since))} with a loadable kernel or module"
                         if since is not None else "holds a loadable kernel or module"))

    def mtime(key: str, name: str) -> float:
        try:
            return (cache / key / name).stat().st_mtime
        except OSError:
            return t0

    tar, raw = ca.tar_bytes((f"{e.key}/{name}", data, mtime(e.key, name))
                            for e in entries for name, data in sorted(e.files.items()))
    blob = ca.compress(tar, preset, CHUNK_MIB)
    paths = ca.write_archive(blob, out, NAME, split_mib)
    seeded = len(kept) - new if since is not None else None
    return {"entries": len(entries), "kernels": sum(len(e.kernels) for e in entries),
            "modules": sum(len(e.modules) for e in entries), "in_cache": len(dirs), "created": new,
            "reused": seeded, "atimes": atimes, "raw_bytes": raw, "bytes": len(blob),
            "files": [p.name for p in paths], "seconds": round(time.time() - t0, 1)}


def _open_archive(src: Path) -> tarfile.TarFile:
    """The archive at `src`: a .tar.xz, one part, or a folder holding triton_cache.tar.xz or its parts."""
    return ca.open_archive(src, NAME, "Triton cache")


def _members(tar: tarfile.TarFile, src: Path) -> Iterable[tuple[tarfile.TarInfo, str, str]]:
    for m in tar.getmembers():
        key, _, name = m.name.partition("/")
        if not (m.isfile() and ENTRY_RE.match(key) and name and "/" not in name and name not in (".", "..")):
            raise CacheError(f"{src}: not a packed Triton cache: member {m.name!r} is not <entry key>/<file>")
        yield m, key, name


def unpack(src: Path, cache: Path) -> dict:
    """Write the archive's entries under `cache` (made if missing), the group files' paths absolute there, every
    file's atime and mtime at least two seconds in the past (pack --since tells the entries a run read)."""
    tar = _open_archive(src)
    cache = cache.resolve()
    with tar:
        members = list(_members(tar, src))

        def absolute(rel: PurePosixPath, data: bytes) -> bytes:
            if not rel.name.startswith(GROUP_PREFIX):
                return data
            d = cache / rel.parent.name
            try:
                children = json.loads(data)["child_paths"]
                return json.dumps({"child_paths": {c: str(d / Path(p).name) for c, p in children.items()}}).encode()
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CacheError(f"{src}: {rel}: not a Triton group file ({e})") from e

        n, raw = ca.unpack_members(tar, [(m, PurePosixPath(key, name)) for m, key, name in members], cache, absolute)
    return {"entries": len({key for _, key, _ in members}), "files": n, "raw_bytes": raw}


def stats(path: Path) -> dict:
    """Counts and sizes of a cache folder (its entries, all files and those pack keeps) or of a packed archive."""
    if path.is_dir() and any(ENTRY_RE.match(p.name) for p in path.iterdir()):
        dirs = entry_dirs(path)
        total = sum(f.stat().st_size for d in dirs for f in d.iterdir() if f.is_file())
        entries = [needed(d) for d in dirs]
        by_ext: dict[str, int] = {}
        for d in dirs:
            for f in d.iterdir():
                if f.is_file():
                    ext = f.suffix or f.name
                    by_ext[ext] = by_ext.get(ext, 0) + f.stat().st_size
        return {"kind": "cache", "entries": len(dirs), "kernels": sum(len(e.kernels) for e in entries),
                "modules": sum(len(e.modules) for e in entries), "bytes": total,
                "needed_bytes": sum(len(b) for e in entries for b in e.files.values()),
                "bytes_by_ext": dict(sorted(by_ext.items(), key=lambda kv: -kv[1]))}
    if path.is_dir():
        if not (path / f"{NAME}.tar.xz").is_file() and not any(PART_RE.match(p.name) for p in path.iterdir()):
            raise CacheError(f"{path}: neither a Triton cache (no entry folders) nor a folder holding {NAME}.tar.xz "
                             f"or {NAME}.partNN")
        packed = sum(p.stat().st_size for p in ca.archive_paths(path, NAME))
    elif path.is_file():
        packed = path.stat().st_size
    else:
        raise CacheError(f"{path}: no such file or folder")
    with _open_archive(path) as tar:
        members = list(_members(tar, path))
    return {"kind": "archive", "entries": len({k for _, k, _ in members}),
            "kernels": sum(n.startswith(GROUP_PREFIX) for _, _, n in members),
            "modules": sum(n.endswith(".so") for _, _, n in members), "files": len(members),
            "raw_bytes": sum(m.size for m, _, _ in members), "bytes": packed}


mib = ca.mib


def pack_line(r: dict, out: Path) -> str:
    """The summary's line for a pack."""
    seed = ""
    if r["reused"] is not None:
        seed = (f" ({r['reused']} read from the seed, {r['created']} compiled in this run)" if r["atimes"] else
                " (no atimes on this file system: every entry kept)")
    files = ca.files_text(r["files"])
    return (f"triton cache: {r['entries']} of {r['in_cache']} entries packed{seed}: {r['kernels']} kernels, "
            f"{r['modules']} C modules, {mib(r['raw_bytes'])} -> {mib(r['bytes'])} in {out}/{files}, "
            f"{r['seconds']} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack what loading needs of CACHE into OUTDIR/triton_cache.tar.xz (or .partNN)")
    p.add_argument("cache", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--since", type=float, help="only entries read or written at or after this epoch second")
    p.add_argument("--split-mib", type=float, default=SPLIT_MIB, help="largest archive file (default %(default)s)")
    p.add_argument("--preset", type=int, default=PRESET, help="xz preset 0-9 (default %(default)s)")
    u = sub.add_parser("unpack", help="write the archive at SRC (or in the folder SRC) out as the cache CACHE")
    u.add_argument("src", type=Path)
    u.add_argument("cache", type=Path)
    s = sub.add_parser("stats", help="entries and sizes of a cache folder or an archive")
    s.add_argument("path", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            print(pack_line(pack(a.cache, a.out, a.since, a.split_mib, a.preset), a.out))
        elif a.cmd == "unpack":
            r = unpack(a.src, a.cache)
            print(f"triton cache: {r['entries']} entries ({r['files']} files, {mib(r['raw_bytes'])}) from {a.src} "
                  f"into {a.cache}")
        else:
            print(json.dumps(stats(a.path), indent=1))
    except CacheError as e:
        print(f"triton_cache {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
