"""bench/triton_cache.py: packing only what Triton needs to load a kernel from its cache, the split, the round trip,
and clear errors on bad input (CPU only; the last test compiles a small kernel for sm_90 with this machine's Triton,
and with Triton 3.6 when RAPIDSERVE_TRITON36 names its side directory)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import triton_cache as tc

ROOT = Path(__file__).resolve().parent.parent
IRS = ("source", "ttir", "ttgir", "llir", "ptx")


def _key(seed: str) -> str:
    return base64.b32encode(hashlib.sha256(seed.encode()).digest()).decode().rstrip("=")


def _kernel(cache: Path, seed: str, name: str, cubin: bytes = b"\x7fELF cubin") -> Path:
    """An entry as Triton 3.6's `compile` leaves it: the IRs, the binary, the metadata and the group of absolute
    paths."""
    d = cache / _key(seed)
    d.mkdir(parents=True)
    files = {f"{name}.{ext}": f"// {ext} of {name}\n".encode() * 20 for ext in IRS}
    files[f"{name}.cubin"] = cubin
    files[f"{name}.json"] = json.dumps({"name": name, "hash": seed, "target": {"backend": "cuda", "arch": 90,
                                                                                 "warp_size": 32}}).encode()
    for n, data in files.items():
        (d / n).write_bytes(data)
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {n: str(d / n) for n in files}}))
    return d


def _fake_cache(cache: Path) -> dict[str, Path]:
    out = {"a": _kernel(cache, "a", "_add_kernel"), "b": _kernel(cache, "b", "_mul_kernel")}
    out["utils"] = cache / _key("utils")
    out["utils"].mkdir()
    (out["utils"] / "cuda_utils.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF utils")
    out["launcher"] = cache / _key("launcher")
    out["launcher"].mkdir()
    (out["launcher"] / "__triton_launcher.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF launcher")
    (out["launcher"] / "tmp.pid_12_0000").mkdir()  # an interrupted write's folder
    out["tuned"] = cache / _key("tuned")
    out["tuned"].mkdir()
    (out["tuned"] / "_mm_kernel.autotune.json").write_text('{"key": [], "configs_timings": []}')
    out["partial"] = cache / _key("partial")  # a compile cut short: IRs, no group, no binary
    out["partial"].mkdir()
    (out["partial"] / "_cut_kernel.ttir").write_text("module {}")
    return out


def _members(path: Path) -> set[str]:
    with tc._open_archive(path) as tar:
        return {m.name for m in tar.getmembers()}


def test_pack_keeps_only_what_loading_needs(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    e = _fake_cache(cache)
    r = tc.pack(cache, tmp_path / "out")
    assert r["files"] == ["triton_cache.tar.xz"] and r["entries"] == 5 and r["in_cache"] == 6
    assert r["kernels"] == 2 and r["modules"] == 2
    a, b = e["a"].name, e["b"].name
    assert _members(tmp_path / "out") == {
        f"{a}/__grp___add_kernel.json", f"{a}/_add_kernel.json", f"{a}/_add_kernel.cubin",
        f"{b}/__grp___mul_kernel.json", f"{b}/_mul_kernel.json", f"{b}/_mul_kernel.cubin",
        f"{e['utils'].name}/cuda_utils.cpython-312-x86_64-linux-gnu.so",
        f"{e['launcher'].name}/__triton_launcher.cpython-312-x86_64-linux-gnu.so",
        f"{e['tuned'].name}/_mm_kernel.autotune.json"}
    with tarfile.open(tmp_path / "out" / "triton_cache.tar.xz") as tar:
        group = json.load(tar.extractfile(f"{a}/__grp___add_kernel.json"))  # type: ignore[arg-type]
    assert group == {"child_paths": {"_add_kernel.json": "_add_kernel.json", "_add_kernel.cubin": "_add_kernel.cubin"}}
    line = tc.pack_line(r, tmp_path / "out")
    assert "5 of 6 entries packed: 2 kernels, 2 C modules" in line and "triton_cache.tar.xz" in line


def test_a_group_without_its_binary_is_left_out(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    a = _kernel(cache, "a", "_add_kernel")
    b = _kernel(cache, "b", "_mul_kernel")
    (b / "_mul_kernel.cubin").unlink()
    r = tc.pack(cache, tmp_path / "out")
    assert r["entries"] == 1 and {m.split("/")[0] for m in _members(tmp_path / "out")} == {a.name}


def test_unpack_round_trip_makes_the_paths_absolute_and_the_times_past(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    e = _fake_cache(cache)
    tc.pack(cache, tmp_path / "out")
    dest = tmp_path / "elsewhere" / "cache"
    t0 = time.time()
    r = tc.unpack(tmp_path / "out", dest)
    assert r == {"entries": 5, "files": 9, "raw_bytes": r["raw_bytes"]}
    for f in dest.rglob("*"):  # before any read moves an atime
        if f.is_file():
            assert f.stat().st_mtime <= t0 - 1 and f.stat().st_atime <= t0 - 1, f
    a = dest / e["a"].name
    for n in ("_add_kernel.json", "_add_kernel.cubin"):
        assert (a / n).read_bytes() == (e["a"] / n).read_bytes()
    group = json.loads((a / "__grp___add_kernel.json").read_text())["child_paths"]
    assert group == {n: str(dest.resolve() / e["a"].name / n) for n in ("_add_kernel.json", "_add_kernel.cubin")}
    so = dest / e["launcher"].name / "__triton_launcher.cpython-312-x86_64-linux-gnu.so"
    assert so.read_bytes() == b"\x7fELF launcher"
    # packing the unpacked copy gives the same members again
    tc.pack(dest, tmp_path / "again")
    assert _members(tmp_path / "again") == _members(tmp_path / "out")


def test_a_large_archive_is_split_and_joined(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for i in range(3):  # incompressible binaries, 40 KiB each
        _kernel(cache, f"k{i}", f"_k{i}_kernel", cubin=os.urandom(40 * 1024))
    r = tc.pack(cache, tmp_path / "out", split_mib=50 / 1024)  # parts of at most 50 KiB
    assert r["files"] == ["triton_cache.part00", "triton_cache.part01", "triton_cache.part02"]
    sizes = [(tmp_path / "out" / n).stat().st_size for n in r["files"]]
    assert all(s <= 50 * 1024 for s in sizes) and sum(sizes) == r["bytes"]
    assert tc.unpack(tmp_path / "out", tmp_path / "back")["entries"] == 3
    for i in range(3):
        d = tmp_path / "back" / _key(f"k{i}")
        assert (d / f"_k{i}_kernel.cubin").read_bytes() == (cache / _key(f"k{i}") / f"_k{i}_kernel.cubin").read_bytes()
    assert "3 parts triton_cache.part00..triton_cache.part02" in tc.pack_line(r, tmp_path / "out")
    # a smaller pack into the same folder replaces the parts: no stale part is joined to the next archive
    r = tc.pack(cache, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["triton_cache.tar.xz"]
    (tmp_path / "out" / "triton_cache.tar.xz").unlink()
    tc.pack(cache, tmp_path / "out", split_mib=50 / 1024)
    (tmp_path / "out" / "triton_cache.part01").unlink()
    with pytest.raises(tc.CacheError, match="without a gap"):
        tc.unpack(tmp_path / "out", tmp_path / "gap")


def test_since_keeps_the_entries_the_run_read_or_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    e = _fake_cache(cache)
    since = time.time() - 100
    for d in e.values():
        for f in d.iterdir():
            os.utime(f, (since - 1000, since - 1000))  # the seed: all in the past
    read = e["a"] / "__grp___add_kernel.json"
    os.utime(read, (since + 5, since - 1000))  # read by the run (atime only)
    os.utime(e["launcher"] / "__triton_launcher.cpython-312-x86_64-linux-gnu.so", (since + 5, since + 5))  # new
    monkeypatch.setattr(tc, "atime_tracked", lambda cache: True)
    r = tc.pack(cache, tmp_path / "out", since=since)
    assert {m.split("/")[0] for m in _members(tmp_path / "out")} == {e["a"].name, e["launcher"].name}
    assert (r["entries"], r["reused"], r["created"]) == (2, 1, 1)
    assert "(1 read from the seed, 1 compiled in this run)" in tc.pack_line(r, tmp_path / "out")
    # where reads leave no trace (noatime), every entry is kept rather than the reused ones lost
    monkeypatch.setattr(tc, "atime_tracked", lambda cache: False)
    r = tc.pack(cache, tmp_path / "out", since=since)
    assert r["entries"] == 5 and "no atimes" in tc.pack_line(r, tmp_path / "out")
    # nothing touched since: a clear error, no archive
    monkeypatch.setattr(tc, "atime_tracked", lambda cache: True)
    with pytest.raises(tc.CacheError, match="none of its 6 entries was used or created since"):
        tc.pack(cache, tmp_path / "none", since=time.time() + 100)


def test_atime_probe_runs(tmp_path: Path) -> None:
    assert tc.atime_tracked(tmp_path) in (True, False)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_bad_input_gets_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(tc.CacheError, match="no such folder"):
        tc.pack(tmp_path / "missing", tmp_path / "out")
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "notes.txt").write_text("hello")
    with pytest.raises(tc.CacheError, match="not a Triton cache: no entry folders.*notes.txt"):
        tc.pack(tree, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(tc.CacheError, match="it is empty"):
        tc.pack(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(tc.CacheError, match="holds no triton_cache.tar.xz nor triton_cache.partNN"):
        tc.unpack(tree, tmp_path / "dest")
    with pytest.raises(tc.CacheError, match="no such file or folder"):
        tc.unpack(tmp_path / "missing", tmp_path / "dest")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "triton_cache.tar.xz").write_bytes(b"not xz at all")
    with pytest.raises(tc.CacheError, match="not a readable triton_cache archive"):
        tc.unpack(tmp_path / "junk", tmp_path / "dest")
    with tarfile.open(tmp_path / "other.tar.xz", "w:xz") as tar:  # a tar.xz of something else
        tar.add(tree / "notes.txt", arcname="../notes.txt")
    with pytest.raises(tc.CacheError, match="not a packed Triton cache: member '../notes.txt'"):
        tc.unpack(tmp_path / "other.tar.xz", tmp_path / "dest")
    assert not (tmp_path / "notes.txt").exists()
    with pytest.raises(tc.CacheError, match="neither a Triton cache"):
        tc.stats(tree)
    assert tc.main(["pack", str(tree), str(tmp_path / "out")]) == 1
    assert "triton_cache pack:" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_cli_and_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    _fake_cache(cache)
    assert tc.main(["stats", str(cache)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["kind"], s["entries"], s["kernels"], s["modules"]) == ("cache", 6, 2, 2)
    assert s["needed_bytes"] < s["bytes"] and ".ptx" in s["bytes_by_ext"]
    assert tc.main(["pack", str(cache), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.startswith("triton cache: 5 of 6 entries packed")
    assert tc.main(["stats", str(tmp_path / "out")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["kind"], s["entries"], s["kernels"], s["modules"], s["files"]) == ("archive", 5, 2, 2, 9)
    assert tc.main(["unpack", str(tmp_path / "out"), str(tmp_path / "back")]) == 0
    assert "5 entries (9 files" in capsys.readouterr().out


COMPILE = """
import json, sys
import triton, triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
k = triton.compile(ASTSource(_add_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                             {"BLOCK": 128}), target=GPUTarget("cuda", 90, 32))
print(json.dumps({"hit": hits, "asm": sorted(k.asm), "cubin": len(k.kernel), "triton": triton.__version__}))
"""


def _tritons() -> list[str | None]:
    side = os.environ.get("RAPIDSERVE_TRITON36")
    return [None] + ([side] if side and (Path(side) / "triton" / "__init__.py").exists() else [])


@pytest.mark.parametrize("side", _tritons(), ids=lambda s: "triton36" if s else "installed")
def test_triton_loads_a_kernel_from_the_unpacked_cache(tmp_path: Path, side: str | None) -> None:
    """The real thing: a kernel compiled for sm_90 into one cache, packed, unpacked under another path, is a cache
    hit there (Triton's own group lookup), with the cubin and no IR."""
    pytest.importorskip("triton")

    script = tmp_path / "compile_add.py"  # @jit functions must live in a file
    script.write_text(COMPILE)

    def compile_in(cache: Path, first: bool) -> dict:
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
        env.pop("TRITON_ALWAYS_COMPILE", None)
        if side:
            env["PYTHONPATH"] = side
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0 and first:
            pytest.skip(f"this Triton cannot compile for sm_90 here: {done.stderr[-500:]}")
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = compile_in(tmp_path / "a", True)
    assert first["hit"] == [False] and "ptx" in first["asm"]
    r = tc.pack(tmp_path / "a", tmp_path / "out")
    assert r["kernels"] == 1
    tc.unpack(tmp_path / "out", tmp_path / "b")
    again = compile_in(tmp_path / "b", False)
    assert again["hit"] == [True] and again["asm"] == ["cubin"] and again["cubin"] == first["cubin"]
    if side:
        assert again["triton"].startswith("3.6")
