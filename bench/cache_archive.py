"""The shared half of carrying an on-disk compile cache from one GPU session to the next: a cache's chosen files
packed into NAME.tar.xz, or parts NAME.part00, NAME.part01, ... of at most SPLIT_MIB MiB each (the device brings
files of at most 16 MiB back), such an archive read back from a folder, a part or the file itself and written out
with every file's times in the past, and which entries a run read or wrote since then (atimes, where the file system
keeps them). bench/triton_cache.py (Triton's kernel cache) and bench/vllm_cache.py (vLLM's torch.compile cache)
keep what is cache-specific: which files loading needs, how an archive's members must look, what to rewrite.

Also `place`: archive files into the device's $OUT within its budget (8 files, 16 MiB each, 64 MiB together), or
into a .tar.gz already there, and `take`: the newest archive from a call's files into the carried folder.
"""

from __future__ import annotations

import io
import lzma
import os
import re
import shutil
import tarfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

SPLIT_MIB = 15
CHUNK_MIB = 64
# what the device brings back from $OUT (/work/.library/device/README.md, Limits)
OUT_FILES = 8
OUT_FILE_MIB = 16
OUT_TOTAL_MIB = 64


class CacheError(Exception):
    """A missing folder, a tree that is not the cache it should be, or an archive that is not one of ours."""


def compress(data: bytes, preset: int, chunk_mib: int = CHUNK_MIB) -> bytes:
    """`data` as .xz: chunks of `chunk_mib` MiB compressed side by side (lzma lets go of the GIL), one xz stream
    each, joined (a valid .xz file, as `xz -T` writes: LZMAFile and tarfile's "r:xz" read every stream)."""
    size = chunk_mib * 1024 * 1024
    chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1)) as pool:
        return b"".join(pool.map(lambda c: lzma.compress(c, preset=preset), chunks))


def part_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(name)}\.part(\d+)$")


def archive_paths(folder: Path, name: str) -> list[Path]:
    """The archive files of `name` in `folder` (NAME.tar.xz and NAME.partNN), sorted."""
    parts = part_re(name)
    return sorted(p for p in folder.iterdir() if p.name == f"{name}.tar.xz" or parts.match(p.name))


def tar_bytes(members: Iterable[tuple[str, bytes, float]]) -> tuple[bytes, int]:
    """A PAX tar of (member name, data, mtime), and the data's total size."""
    buf = io.BytesIO()
    raw = 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mtime in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(mtime)
            tar.addfile(info, io.BytesIO(data))
            raw += len(data)
    return buf.getvalue(), raw


def write_archive(blob: bytes, out: Path, name: str, split_mib: float = SPLIT_MIB) -> list[Path]:
    """`blob` (a tar.xz) as out/NAME.tar.xz, or out/NAME.part00, .part01, ... when larger than `split_mib` MiB; the
    archive files of `name` already in `out` are removed first (never a stale part joined to a new archive)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in archive_paths(out, name):
        old.unlink()
    limit = int(split_mib * 1024 * 1024)
    if len(blob) <= limit:
        paths = [out / f"{name}.tar.xz"]
        paths[0].write_bytes(blob)
        return paths
    paths = []
    for i, start in enumerate(range(0, len(blob), limit)):
        paths.append(out / f"{name}.part{i:02d}")
        paths[-1].write_bytes(blob[start:start + limit])
    return paths


def archive_bytes(src: Path, name: str, what: str) -> bytes:
    """The archive's bytes: `src` a .tar.xz, one part, or a folder holding NAME.tar.xz or its parts (joined, part00
    up without a gap). `what` names the cache in the errors."""
    if src.is_dir():
        whole = src / f"{name}.tar.xz"
        pattern = part_re(name)
        parts = sorted((p for p in src.iterdir() if pattern.match(p.name)), key=lambda p: int(pattern.match(p.name)[1]))
        if whole.is_file():
            return whole.read_bytes()
        if parts:
            numbers = [int(pattern.match(p.name)[1]) for p in parts]
            if numbers != list(range(len(parts))):
                raise CacheError(f"{src}: the parts {[p.name for p in parts]} are not part00.. without a gap")
            return b"".join(p.read_bytes() for p in parts)
        raise CacheError(f"{src}: holds no {name}.tar.xz nor {name}.partNN")
    if src.is_file():
        return src.read_bytes()
    raise CacheError(f"{src}: no such file or folder (the packed {what})")


def open_archive(src: Path, name: str, what: str) -> tarfile.TarFile:
    """The archive at `src` (archive_bytes) opened and read through; CacheError when it is no readable tar.xz."""
    data = archive_bytes(src, name, what)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:xz")  # noqa: SIM115 (the caller closes it)
        tar.getmembers()  # read through: a truncated or corrupt archive fails here, before anything is written
        return tar
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        raise CacheError(f"{src}: not a readable {name} archive (tar.xz): {e}") from e


def safe_member(m: tarfile.TarInfo, src: Path, what: str) -> PurePosixPath:
    """A member's relative path, when it is a plain file below the archive's root (no absolute path, no '..');
    CacheError otherwise."""
    p = PurePosixPath(m.name)
    if not m.isfile() or p.is_absolute() or not p.parts or any(s in ("", ".", "..") for s in p.parts):
        raise CacheError(f"{src}: not a packed {what}: member {m.name!r} is not a plain file below its root")
    return p


def unpack_members(tar: tarfile.TarFile, members: Sequence[tuple[tarfile.TarInfo, PurePosixPath]], dest: Path,
                   transform: Callable[[PurePosixPath, bytes], bytes | None] | None = None) -> tuple[int, int]:
    """Write each (member, relative path) under `dest` (folders made), through `transform` (None: the member is not
    written), every file's atime and mtime its member's mtime but at least two seconds in the past (a later pack
    --since tells the files a run read or wrote). Returns (files written, bytes written)."""
    now = time.time()
    n = raw = 0
    for m, rel in members:
        data = tar.extractfile(m).read()  # type: ignore[union-attr]
        if transform is not None:
            data = transform(rel, data)  # type: ignore[assignment]
            if data is None:
                continue
        path = dest.joinpath(*rel.parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        t = min(float(m.mtime), now - 2)
        os.utime(path, (t, t))
        n += 1
        raw += len(data)
    return n, raw


def atime_tracked(cache: Path) -> bool:
    """Whether reading a file here moves its atime (not so under noatime): a probe file, its times set in the past,
    read once."""
    probe = cache / f".atime_probe.{os.getpid()}"
    try:
        probe.write_bytes(b"probe")
        old = time.time() - 3600
        os.utime(probe, (old, old))
        probe.read_bytes()
        return os.stat(probe).st_atime > old + 1
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def touched(files: Iterable[Path], since: float, atimes: bool) -> bool:
    """Whether any of the files was read (its atime, where tracked) or written at or after `since`."""
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        if st.st_mtime >= since or (atimes and st.st_atime >= since):
            return True
    return False


def written(files: Iterable[Path], since: float) -> bool:
    """Whether any of the files was written at or after `since` (in this run, not read from the seed)."""
    for f in files:
        try:
            if f.stat().st_mtime >= since:
                return True
        except OSError:
            continue
    return False


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def files_text(names: Sequence[str]) -> str:
    """One archive file's name, or `N parts FIRST..LAST`."""
    return names[0] if len(names) == 1 else f"{len(names)} parts {names[0]}..{names[-1]}"


def _returned(out: Path, leave: Sequence[Path]) -> list[Path]:
    """The files under `out` that a call would bring back, less `leave`."""
    skip = {p.resolve() for p in leave}
    return [f for f in sorted(out.rglob("*")) if f.is_file() and f.resolve() not in skip]


def place(paths: Sequence[Path], out: Path, name: str, fallback: Path | None = None, max_files: int = OUT_FILES,
          file_mib: float = OUT_FILE_MIB, total_mib: float = OUT_TOTAL_MIB) -> str:
    """Move the archive files `paths` into `out` when the files already there and they stay within the device's
    budget (`max_files` files, `total_mib` MiB together; the archive's own earlier files in `out` replaced); else
    add them to the .tar.gz `fallback` in `out` as NAME/<file> when it then stays under `file_mib` MiB; else
    CacheError saying why. Returns where they went, for the summary's line."""
    out.mkdir(parents=True, exist_ok=True)
    others = _returned(out, [*paths, *archive_paths(out, name)])
    size = sum(p.stat().st_size for p in paths)
    there = sum(f.stat().st_size for f in others)
    if len(others) + len(paths) <= max_files and there + size <= total_mib * 2**20:
        for old in archive_paths(out, name):
            if old not in paths:
                old.unlink()
        moved = []
        for p in paths:
            dest = out / p.name
            if p.resolve() != dest.resolve():
                shutil.move(str(p), dest)
            moved.append(dest.name)
        return f"in {out}/{files_text(moved)}"
    why = f"{len(others)} files ({mib(there)}) already in {out}, {len(paths)} more would pass the {max_files} files"
    if there + size > total_mib * 2**20:
        why = f"{mib(there)} already in {out} and {mib(size)} more would pass the {total_mib:g} MiB"
    if fallback is None or not fallback.is_file():
        raise CacheError(f"not returned: {why}, and no .tar.gz to add it to")
    if fallback.stat().st_size + size >= file_mib * 2**20 or there + size > total_mib * 2**20:
        raise CacheError(f"not returned: {why}, and {fallback.name} ({mib(fallback.stat().st_size)}) with it would "
                         f"reach {file_mib:g} MiB")
    with tarfile.open(fallback, "r:gz") as old:
        members = [(m, old.extractfile(m).read() if m.isfile() else None) for m in old.getmembers()]  # type: ignore[union-attr]
    # written beside it (a rename), and removed whatever stops it: a file left in `out` would be one more of its
    # max_files, which are taken when this runs (vllm_cache.py turns the bench scripts' timeout into an exception here)
    tmp = fallback.with_name(fallback.name + ".tmp")
    try:
        with tarfile.open(tmp, "w:gz") as new:
            for m, data in members:
                if PurePosixPath(m.name).parts[-2:-1] == (name,) and m.name.rsplit("/", 1)[-1].startswith(name + "."):
                    continue  # an earlier pack's files inside it
                new.addfile(m, io.BytesIO(data) if data is not None else None)
            for p in paths:
                new.add(p, arcname=f"./{name}/{p.name}")
        if tmp.stat().st_size >= file_mib * 2**20:
            raise CacheError(f"not returned: {why}, and {fallback.name} with it would reach {file_mib:g} MiB")
        tmp.replace(fallback)
    finally:
        tmp.unlink(missing_ok=True)
    for p in paths:
        p.unlink(missing_ok=True)
    return f"inside {fallback} as {name}/{files_text([p.name for p in paths])} ({why})"


def take(src: Path, dest: Path, name: str, what: str) -> list[str]:
    """The archive of `name` from a call's files `src` (NAME.tar.xz or its parts at the top, else inside a .tar.gz
    there, under NAME/) into the carried folder `dest`, whose earlier archive files of `name` it replaces (two
    packs' parts never mixed). Checks that the result reads as a tar.xz. Returns the file names written."""
    files: dict[str, bytes] = {}
    if archive_paths(src, name):
        files = {p.name: p.read_bytes() for p in archive_paths(src, name)}
    else:
        pattern = part_re(name)
        for tgz in sorted(src.glob("*.tar.gz")):
            try:
                with tarfile.open(tgz, "r:gz") as tar:
                    for m in tar.getmembers():
                        p = PurePosixPath(m.name)
                        if m.isfile() and p.parts[-2:-1] == (name,) and (
                                p.name == f"{name}.tar.xz" or pattern.match(p.name)):
                            files[p.name] = tar.extractfile(m).read()  # type: ignore[union-attr]
            except (tarfile.TarError, OSError, EOFError):
                continue
            if files:
                break
    if not files:
        raise CacheError(f"{src}: no {name}.tar.xz nor {name}.partNN, at the top or inside a .tar.gz (the packed "
                         f"{what})")
    staging = dest.with_name(dest.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for n, data in files.items():
        (staging / n).write_bytes(data)
    try:
        open_archive(staging, name, what).close()
    except CacheError:
        shutil.rmtree(staging)
        raise
    dest.mkdir(parents=True, exist_ok=True)
    for old in archive_paths(dest, name):
        old.unlink()
    for p in sorted(staging.iterdir()):
        shutil.move(str(p), dest / p.name)
    staging.rmdir()
    return sorted(files)
