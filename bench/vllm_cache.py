"""Carry vLLM's torch.compile cache from one GPU session to the next (bench/vs_vllm.sh and bench/frontier_parallel.sh
with VLLM_CACHE=DIR): pack what a vLLM start loads instead of compiling, unpack it as the next machine's
VLLM_CACHE_ROOT.

    python bench/vllm_cache.py unpack SRC ROOT       # SRC: a folder holding vllm_cache.tar.xz (or .partNN), or the file
    python bench/vllm_cache.py pack ROOT OUT [--since EPOCH] [--skip-unchanged] [--fallback OUT/logs.tar.gz] ...
    python bench/vllm_cache.py stats PATH            # a VLLM_CACHE_ROOT, an archive, or a folder holding one
    python bench/vllm_cache.py take FILES DIR        # here: a call's returned files -> the carried DIR (.vllmcache)

Why: each vLLM start on a bare GPU machine spends ~29 s of its ~60-80 s in torch.compile ("init engine (profile,
create kv cache, warmup model) took 54.89 s (compilation: 29.22 s)"), compiling what the previous session compiled.

What vLLM 0.26 (torch 2.11 on the GPU machine) keeps under VLLM_CACHE_ROOT (vllm/envs.py: ~/.cache/vllm unless
VLLM_CACHE_ROOT is set; XDG_CACHE_HOME moves the default) and what a start reads back:
- torch_compile_cache/torch_aot_compile/<sha256>/rank_R_D/model (vllm/compilation/decorators.py; VLLM_USE_AOT_COMPILE
  is on by default from torch 2.10): Dynamo's precompiled function and the model's FX graph. The <sha256> is
  `aot_compile_hash_factors` (the hash of the vLLM env vars `envs.compile_factors` keeps, VllmConfig.compute_hash:
  model, cache, parallel, scheduler, compilation configs, vLLM's version) plus vLLM's version and the forward's
  qualname and line. A hit logs "Directly load AOT compilation from path ..."; `_verify_source_unchanged` then
  checks the traced source files' contents against the saved ones (changed: "Compiling model again due to a load
  failure from ..."). The same folder holds inductor_cache/, which decorators.py makes the process's
  TORCHINDUCTOR_CACHE_DIR before compiling or loading (so inductor writes there, not /tmp/torchinductor_$USER):
  its FX-graph/AOTAutograd entries and Triton kernels let later torch.compile calls (the sampler's, vLLM's
  custom ops') and any recompile hit; kept.
- torch_compile_cache/<10 hex>/rank_R_D/backbone/ (backends.py `VllmBackend.__call__`: the hash of the env factors,
  the config hash, the traced files' paths and contents, and the Inductor adaptor's hash, `get_inductor_factors`:
  torch's `torch_key`, the GPU system (CacheBase.get_system) and Inductor's config): vllm_compile_cache.py maps each
  (compile range, piece) to an artifact file of the standalone Inductor compile (compiler_interface.py
  `InductorStandaloneAdaptor`, binary format: torch_key + the AOTAutograd/FX-graph cache entries with their Triton
  kernels, self-contained: `CompiledArtifact.load` hot-loads them into the current inductor cache). Without the
  mega artifact (torch >= 2.12 only) the AOT `model` file holds the graph and `finalize_loading` loads each piece
  from here: a hit logs "Directly load the compiled graph(s) for compile range ... from the cache, took ... s".
  vllm_compile_cache.py names the artifacts by ABSOLUTE path: unpack rewrites the packing root into the new one,
  and the bench scripts use one fixed root (/tmp/vllm_cache_root) so the Triton group files' and Inductor's own
  absolute paths stay right too.
- modelinfos/<module>-<Class>.json (model_executor/models/registry.py): the model class's inspection, keyed by the
  model file's content hash; a hit skips a subprocess that imports vLLM and the model. Kept.
Left out: startup_plan/ (opt-in VLLM_ENABLE_STARTUP_PLAN: a memory plan that skips profiling: would change the KV
cache's size), gpu_p2p_access_cache_for_*.json (this machine's P2P probe, for the custom all-reduce), the FlashInfer
autotuner's and deep_gemm's caches (tuning and JIT of other kernels, not the compile cache), assets/, dummy_cache/;
in the kept entries lock files, *.tmp (atomic writes in flight), tmp.pid_* and __pycache__.

A cache from another vLLM, torch, Triton, GPU or configuration only misses: every key above changes, and vLLM
compiles as without it (the entry it writes then is packed beside the old ones). vLLM's own performance and
configuration are untouched: only where its cache lives.

pack keeps every entry (the seed's and this run's), the most recently used first, and leaves out the least recently
used ones while the archive would be over --max-mib; with --since (the end of the unpack) it tells the entries the
run read (atimes, where kept), compiled, or added files to, and --skip-unchanged writes no archive when the seed
already holds all of it. The archive member vllm_cache.json records the packing root and each entry's file count
and last use; unpack writes it to ROOT/vllm_cache_seed.json for the next pack.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

if __package__:  # imported as bench.vllm_cache
    from . import cache_archive as ca
else:  # run as a script, or loaded by tests/bench_module.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cache_archive as ca

CacheError = ca.CacheError
NAME = "vllm_cache"
WHAT = "vLLM cache"
MANIFEST = "vllm_cache.json"  # the archive's own member
SEED = "vllm_cache_seed.json"  # unpack's record in ROOT, for the next pack
COMPILE = "torch_compile_cache"
AOT = "torch_aot_compile"
MODELINFOS = "modelinfos"
COMPILE_CACHE_FILE = "vllm_compile_cache.py"  # the artifacts' absolute paths (backends.py CompilerManager)
SKIP_DIRS = ("__pycache__", "locks")
SKIP_DIR_PREFIXES = ("tmp.pid_",)
SKIP_SUFFIXES = (".tmp", ".lock")
# xz preset 6 (8-MiB dictionary) in 8-MiB chunks side by side: the pack runs in the last seconds of a device call
PRESET = 6
CHUNK_MIB = 8
# the archive's cap: the session carries it beside the working tree (~20 MiB) and .whl within 64 MiB
MAX_MIB = 30.0


@dataclass
class Entry:
    """One cache entry: a hash folder of torch_compile_cache (or of its torch_aot_compile), or a modelinfos file."""

    rel: str  # below the root, posix
    files: list[Path] = field(default_factory=list)
    raw: int = 0
    state: str = ""  # with --since: new, grown, read, earlier, kept
    last_use: float = 0.0


def _skipped(rel: PurePosixPath) -> bool:
    dirs = rel.parts[:-1]
    return (any(d in SKIP_DIRS or d.startswith(SKIP_DIR_PREFIXES) for d in dirs)
            or rel.name.endswith(SKIP_SUFFIXES) or rel.name.startswith(".atime_probe"))


def _files(root: Path, top: Path) -> list[Path]:
    if top.is_file() and not top.is_symlink():
        return [top]
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for n in sorted(filenames):
            f = Path(dirpath, n)
            if f.is_file() and not f.is_symlink() and not _skipped(PurePosixPath(f.relative_to(root).as_posix())):
                out.append(f)
    return out


def entries(root: Path) -> list[Entry]:
    """The cache's entries with the files pack keeps of each (sorted; none without a file)."""
    if not root.is_dir():
        raise CacheError(f"{root}: no such folder (the VLLM_CACHE_ROOT to pack)")
    tops: list[Path] = []
    compile_dir, modelinfos = root / COMPILE, root / MODELINFOS
    if compile_dir.is_dir():
        tops += sorted(p for p in compile_dir.iterdir() if p.is_dir() and p.name != AOT)
        if (compile_dir / AOT).is_dir():
            tops += sorted(p for p in (compile_dir / AOT).iterdir() if p.is_dir())
    if modelinfos.is_dir():
        tops += sorted(p for p in modelinfos.iterdir() if p.is_file() and p.suffix == ".json")
    out = []
    for top in tops:
        files = _files(root, top)
        if files:
            out.append(Entry(top.relative_to(root).as_posix(), files, sum(f.stat().st_size for f in files)))
    return out


def left_out(root: Path) -> list[str]:
    """What ROOT holds beside the kept trees (their names; pack leaves them out)."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir()
                  if p.name not in (COMPILE, MODELINFOS, SEED) and not p.name.startswith(".atime_probe"))


def _seed(root: Path) -> dict[str, dict]:
    try:
        got = json.loads((root / SEED).read_text()).get("entries", {})
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _compress(kept: list[Entry], root: Path, preset: int, chunk_mib: int) -> tuple[bytes, int]:
    manifest = {"format": 1, "root": str(root),
                "entries": {e.rel: {"files": len(e.files), "last_use": e.last_use} for e in kept}}
    members = [(MANIFEST, json.dumps(manifest, indent=1).encode(), time.time())]
    members += [(f.relative_to(root).as_posix(), f.read_bytes(), f.stat().st_mtime) for e in kept for f in e.files]
    tar, raw = ca.tar_bytes(members)
    return ca.compress(tar, preset, chunk_mib), raw


def pack(root: Path, out: Path, since: float | None = None, max_mib: float = MAX_MIB, split_mib: float = ca.SPLIT_MIB,
         preset: int = PRESET, chunk_mib: int = CHUNK_MIB, skip_unchanged: bool = False) -> dict:
    """Pack the cache's entries, the most recently used first, into out/vllm_cache.tar.xz (or .partNN over
    `split_mib` MiB), leaving out the least recently used while the archive is over `max_mib` MiB. With `since`:
    each entry's state against the seed (unpack's record in ROOT), and with `skip_unchanged` no archive when the
    seed holds every entry unchanged ("skipped" in the result). CacheError when there is nothing to pack."""
    t0 = time.time()
    root = root.resolve()
    found = entries(root)
    if not found:
        raise CacheError(f"{root}: no {COMPILE} entries nor {MODELINFOS} (did a vLLM start here compile anything?); "
                         f"it holds {left_out(root) or 'nothing'}")
    seed = _seed(root)
    atimes = since is not None and ca.atime_tracked(root)
    for e in found:
        old = seed.get(e.rel)
        last = max(f.stat().st_mtime for f in e.files)
        if since is None:
            e.last_use = last
            continue
        if ca.touched(e.files, since, atimes):
            e.last_use = t0
        elif isinstance(old, dict) and isinstance(old.get("last_use"), (int, float)):
            e.last_use = float(old["last_use"])
        else:
            e.last_use = last
        if not isinstance(old, dict):
            e.state = "new" if ca.written(e.files, since) else "earlier"  # earlier: an earlier call's on this machine
        elif len(e.files) > int(old.get("files", 0)):
            e.state = "grown"
        else:
            e.state = "read" if atimes and ca.touched(e.files, since, atimes) else "kept"
    count = {s: sum(e.state == s for e in found) for s in ("new", "grown", "read", "earlier", "kept")}
    result: dict = {"entries": 0, "in_cache": len(found), "seeded": len(seed), "since": since is not None,
                    "atimes": atimes, **count,
                    "trimmed": 0, "max_mib": max_mib, "left_out": left_out(root), "skipped": False}
    if skip_unchanged and since is not None and not (count["new"] or count["grown"] or count["earlier"]) \
            and {e.rel for e in found} <= set(seed):
        result.update(skipped=True, seconds=round(time.time() - t0, 1))
        return result
    kept = sorted(found, key=lambda e: (-e.last_use, e.rel))
    blob, raw = _compress(kept, root, preset, chunk_mib)
    limit = max_mib * 2**20
    for _ in range(4):  # leave out the least recently used, guessing the raw size that fits from the ratio so far
        if len(blob) <= limit or len(kept) == 1:
            break
        budget = sum(e.raw for e in kept) * limit / len(blob) * 0.9
        n, total = 0, 0
        while n < len(kept) and (n == 0 or total + kept[n].raw <= budget):
            total += kept[n].raw
            n += 1
        kept = kept[:max(n, 1)] if n < len(kept) else kept[:-1]
        blob, raw = _compress(kept, root, preset, chunk_mib)
    paths = ca.write_archive(blob, out, NAME, split_mib)
    result.update(entries=len(kept), trimmed=len(found) - len(kept), files=sum(len(e.files) for e in kept),
                  raw_bytes=raw, bytes=len(blob), paths=[str(p) for p in paths], names=[p.name for p in paths],
                  seconds=round(time.time() - t0, 1))
    return result


def pack_line(r: dict) -> str:
    """The summary's line for a pack (where the archive went is added by the caller)."""
    if r["skipped"]:
        return (f"vllm cache: nothing new: this run used only the seed's entries ({r['read']} of {r['seeded']} read"
                f"{'' if r['atimes'] else ', or unknown: no atimes here'}); no archive written: keep the carried one, "
                f"{r['seconds']} s")
    notes = []
    if r["since"]:
        if not r["seeded"]:
            notes.append("no seed")
        elif r["atimes"]:
            notes.append(f"{r['read']} of the seed's {r['seeded']} read")
        else:
            notes.append(f"the seed's {r['seeded']}, read or not: no atimes here")
        notes.append(f"{r['new']} compiled in this run")
        if r["grown"]:
            notes.append(f"{r['grown']} grown")
        if r["earlier"]:
            notes.append(f"{r['earlier']} from an earlier call on this machine")
    text = ", ".join(notes)
    if r["trimmed"]:
        text += f"{'; ' if text else ''}{r['trimmed']} least recently used left out over {r['max_mib']:g} MiB"
    return (f"vllm cache: {r['entries']} of {r['in_cache']} entries packed{f' ({text})' if text else ''}: "
            f"{r['files']} files, {ca.mib(r['raw_bytes'])} -> {ca.mib(r['bytes'])}, {r['seconds']} s")


def _manifest(tar: tarfile.TarFile, src: Path) -> dict:
    try:
        m = tar.getmember(MANIFEST)
        data = json.loads(tar.extractfile(m).read())  # type: ignore[union-attr]
        if not isinstance(data.get("entries"), dict) or not isinstance(data.get("root"), str):
            raise ValueError("no root or entries")
        return data
    except (KeyError, ValueError, AttributeError) as e:
        raise CacheError(f"{src}: not a packed vLLM cache: no readable {MANIFEST} ({e})") from e


def _members(tar: tarfile.TarFile, src: Path) -> list[tuple[tarfile.TarInfo, PurePosixPath]]:
    out = []
    for m in tar.getmembers():
        if m.name == MANIFEST:
            continue
        rel = ca.safe_member(m, src, WHAT)
        if rel.parts[0] not in (COMPILE, MODELINFOS) or len(rel.parts) < 2:
            raise CacheError(f"{src}: not a packed vLLM cache: member {m.name!r} is outside {COMPILE}/ and "
                             f"{MODELINFOS}/")
        out.append((m, rel))
    return out


def unpack(src: Path, root: Path) -> dict:
    """Write the archive's entries under `root` (made if missing; files already there replaced), the artifact paths
    of vllm_compile_cache.py moved from the packing root to `root`, every file's times in the past, and the seed's
    record ROOT/vllm_cache_seed.json for the next pack."""
    root = root.resolve()
    with ca.open_archive(src, NAME, WHAT) as tar:
        manifest = _manifest(tar, src)
        members = _members(tar, src)
        old, new = manifest["root"].rstrip("/") + "/", str(root).rstrip("/") + "/"
        rewritten = 0

        def moved(rel: PurePosixPath, data: bytes) -> bytes:
            nonlocal rewritten
            if rel.name == COMPILE_CACHE_FILE and old != new and old.encode() in data:
                rewritten += 1
                return data.replace(old.encode(), new.encode())
            return data

        root.mkdir(parents=True, exist_ok=True)
        n, raw = ca.unpack_members(tar, members, root, moved)
    (root / SEED).write_text(json.dumps({"from": str(src), "packed_root": manifest["root"],
                                         "entries": manifest["entries"]}, indent=1))
    return {"entries": len(manifest["entries"]), "files": n, "raw_bytes": raw, "rewritten": rewritten,
            "packed_root": manifest["root"]}


def stats(path: Path) -> dict:
    """A cache root's entries (sizes, and what pack leaves out) or a packed archive's."""
    if path.is_dir() and ((path / COMPILE).is_dir() or (path / MODELINFOS).is_dir()):
        found = entries(path)
        return {"kind": "cache", "entries": len(found), "files": sum(len(e.files) for e in found),
                "bytes": sum(e.raw for e in found), "by_entry": {e.rel: e.raw for e in found},
                "left_out": left_out(path)}
    if path.is_dir() and not ca.archive_paths(path, NAME):
        raise CacheError(f"{path}: neither a vLLM cache root ({COMPILE}/, {MODELINFOS}/) nor a folder holding "
                         f"{NAME}.tar.xz or {NAME}.partNN")
    if not path.exists():
        raise CacheError(f"{path}: no such file or folder")
    packed = sum(p.stat().st_size for p in ca.archive_paths(path, NAME)) if path.is_dir() else path.stat().st_size
    with ca.open_archive(path, NAME, WHAT) as tar:
        manifest = _manifest(tar, path)
        members = _members(tar, path)
    return {"kind": "archive", "entries": len(manifest["entries"]), "files": len(members),
            "raw_bytes": sum(m.size for m, _ in members), "bytes": packed, "packed_root": manifest["root"],
            "by_entry": manifest["entries"]}


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack ROOT's compile cache into OUT/vllm_cache.tar.xz (or .partNN)")
    p.add_argument("root", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--since", type=float, help="the unpack's end (epoch s): tell what the run read, wrote, added")
    p.add_argument("--skip-unchanged", action="store_true", help="no archive when the seed holds it all unchanged")
    p.add_argument("--max-mib", type=float, default=MAX_MIB, help="the archive's cap (default %(default)s)")
    p.add_argument("--split-mib", type=float, default=ca.SPLIT_MIB, help="largest file (default %(default)s)")
    p.add_argument("--preset", type=int, default=PRESET, help="xz preset 0-9 (default %(default)s)")
    p.add_argument("--fallback", type=Path, help="a .tar.gz in OUT to add the archive to when OUT's file budget "
                   f"({ca.OUT_FILES} files, {ca.OUT_TOTAL_MIB} MiB) has no room for it")
    p.add_argument("--max-files", type=int, default=ca.OUT_FILES, help="OUT's file budget (default %(default)s)")
    u = sub.add_parser("unpack", help="write the archive at SRC (or in the folder SRC) out as the cache root ROOT")
    u.add_argument("src", type=Path)
    u.add_argument("root", type=Path)
    s = sub.add_parser("stats", help="entries and sizes of a cache root or an archive")
    s.add_argument("path", type=Path)
    t = sub.add_parser("take", help="the archive from a call's files FILES (top level, or inside its .tar.gz) into "
                       "the carried folder DIR, replacing DIR's earlier archive files")
    t.add_argument("src", type=Path)
    t.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            staging = Path(tempfile.mkdtemp(prefix="vllm_cache_pack."))
            try:
                r = pack(a.root, staging, a.since, a.max_mib, a.split_mib, a.preset, skip_unchanged=a.skip_unchanged)
                line = pack_line(r)
                if not r["skipped"]:
                    # the bench scripts' `timeout` (SIGTERM) while the archive goes into OUT or its .tar.gz: an
                    # exception, so that place removes what it had half written there (SIGTERM's default leaves it)
                    term = signal.signal(signal.SIGTERM, _terminated)
                    try:
                        where = ca.place([Path(p) for p in r["paths"]], a.out, NAME, a.fallback, a.max_files)
                    except CacheError as e:
                        print(f"{line}; {e}")
                        return 1
                    finally:
                        signal.signal(signal.SIGTERM, term)
                    line += f"; {where}"
                print(line)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        elif a.cmd == "unpack":
            r = unpack(a.src, a.root)
            moved = f"; {r['rewritten']} vllm_compile_cache.py moved from {r['packed_root']}" if r["rewritten"] else ""
            print(f"vllm cache: {r['entries']} entries ({r['files']} files, {ca.mib(r['raw_bytes'])}) from {a.src} "
                  f"into {a.root}{moved}")
        elif a.cmd == "stats":
            print(json.dumps(stats(a.path), indent=1))
        else:
            names = ca.take(a.src, a.dest, NAME, WHAT)
            r = stats(a.dest)
            print(f"vllm cache: {ca.files_text(names)} from {a.src} into {a.dest}: {r['entries']} entries, "
                  f"{r['files']} files, {ca.mib(r['raw_bytes'])} -> {ca.mib(r['bytes'])}")
    except CacheError as e:
        print(f"vllm cache {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
