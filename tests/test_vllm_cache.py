"""bench/vllm_cache.py and bench/cache_archive.py (CPU only): vLLM's torch.compile cache packed, split, unpacked under
another root (vllm_compile_cache.py's absolute paths moved), the entries a run read or compiled told apart, the
least recently used left out over the cap, missing and corrupt archives refused before anything is written, the
device's $OUT budget (into $OUT, else into a .tar.gz there), `take`, and bench/peer_env.sh's vllm_cache_seed /
vllm_cache_pack as the bench scripts call them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import cache_archive as ca
from bench import vllm_cache as vc

ROOT = Path(__file__).resolve().parent.parent
AOT = "a" * 64
PIECES = "0123456789"


def _fake_root(root: Path, pieces: str = PIECES, aot: str = AOT,
               artifact: bytes = b"artifact " * 100) -> dict[str, Path]:
    """A VLLM_CACHE_ROOT as vLLM 0.26's AOT compile leaves it (torch 2.11: the pieces in torch_compile_cache/<10 hex>,
    named by absolute path in vllm_compile_cache.py), with what pack leaves out beside it."""
    backbone = root / "torch_compile_cache" / pieces / "rank_0_0" / "backbone"
    aot_dir = root / "torch_compile_cache" / "torch_aot_compile" / aot
    for d in (backbone, aot_dir / "rank_0_0", aot_dir / "inductor_cache" / "locks",
              aot_dir / "inductor_cache" / "fxgraph" / "ab", root / "modelinfos", root / "startup_plan"):
        d.mkdir(parents=True, exist_ok=True)
    art = backbone / "artifact_compile_range_1_8192_subgraph_0"
    art.write_bytes(artifact)
    (backbone / "vllm_compile_cache.py").write_text(
        "{   ((1, 8192), 0, 'inductor_standalone'): {   'cache_key': 'fabc',\n"
        f"        'graph_handle': ('artifact_compile_range_1_8192_subgraph_0', '{art}')}}}}\n")
    (backbone / "computation_graph.py").write_text("class GraphModule: ...\n")
    (backbone / "cache_key_factors.json").write_text('{"config_hash": "c"}')
    (aot_dir / "rank_0_0" / "model").write_bytes(b"dynamo precompile")
    (aot_dir / "rank_0_0" / "model.123.tmp").write_bytes(b"a save in flight")
    (aot_dir / "inductor_cache" / "locks" / "x.lock").write_bytes(b"")
    (aot_dir / "inductor_cache" / "fxgraph" / "ab" / "fxentry").write_bytes(b"fx graph entry")
    (aot_dir / "inductor_cache" / "__pycache__").mkdir()
    (aot_dir / "inductor_cache" / "__pycache__" / "m.cpython-312.pyc").write_bytes(b"pyc")
    (root / "modelinfos" / "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json").write_text('{"hash": "h"}')
    (root / "startup_plan" / "startup_plan_x.json").write_text("{}")
    (root / "gpu_p2p_access_cache_for_0,1.json").write_text("{}")
    return {"backbone": backbone, "aot": aot_dir, "artifact": art}


def _names(path: Path) -> set[str]:
    with ca.open_archive(path, vc.NAME, vc.WHAT) as tar:
        return {m.name for m in tar.getmembers()}


KEPT = {f"torch_compile_cache/{PIECES}/rank_0_0/backbone/{n}" for n in (
    "artifact_compile_range_1_8192_subgraph_0", "vllm_compile_cache.py", "computation_graph.py",
    "cache_key_factors.json")} | {
    f"torch_compile_cache/torch_aot_compile/{AOT}/rank_0_0/model",
    f"torch_compile_cache/torch_aot_compile/{AOT}/inductor_cache/fxgraph/ab/fxentry",
    "modelinfos/vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"}


def test_pack_keeps_the_compile_cache_and_leaves_out_the_rest(tmp_path: Path) -> None:
    _fake_root(tmp_path / "root")
    r = vc.pack(tmp_path / "root", tmp_path / "out")
    assert r["names"] == ["vllm_cache.tar.xz"] and (r["entries"], r["in_cache"], r["files"]) == (3, 3, len(KEPT))
    assert _names(tmp_path / "out") == KEPT | {vc.MANIFEST}
    assert r["left_out"] == ["gpu_p2p_access_cache_for_0,1.json", "startup_plan/"]
    line = vc.pack_line(r)
    assert line.startswith("vllm cache: 3 of 3 entries packed: 7 files, ") and " -> " in line
    s = vc.stats(tmp_path / "out")
    assert (s["kind"], s["entries"], s["files"], s["packed_root"]) == ("archive", 3, 7, str(tmp_path / "root"))


def test_unpack_under_another_root_moves_the_artifact_paths(tmp_path: Path) -> None:
    f = _fake_root(tmp_path / "root")
    vc.pack(tmp_path / "root", tmp_path / "out")
    new = tmp_path / "elsewhere" / "root"
    t0 = time.time()
    r = vc.unpack(tmp_path / "out", new)
    assert (r["entries"], r["files"], r["rewritten"]) == (3, 7, 1)
    for rel in KEPT:
        p = new / rel
        assert p.stat().st_mtime <= t0 - 1 and p.stat().st_atime <= t0 - 1, rel  # before any read moves an atime
        if not rel.endswith("vllm_compile_cache.py"):
            assert p.read_bytes() == (tmp_path / "root" / rel).read_bytes()
    table = (new / "torch_compile_cache" / PIECES / "rank_0_0" / "backbone" / "vllm_compile_cache.py").read_text()
    assert str(new.resolve() / f["artifact"].relative_to(tmp_path / "root")) in table
    assert str(tmp_path / "root") + "/" not in table
    seed = json.loads((new / vc.SEED).read_text())
    assert set(seed["entries"]) == {e.rel for e in vc.entries(tmp_path / "root")}
    # the seed record is no entry: packing the unpacked root gives the same members again
    vc.pack(new, tmp_path / "again")
    assert _names(tmp_path / "again") == _names(tmp_path / "out")


def test_a_large_archive_is_split_and_joined(tmp_path: Path) -> None:
    _fake_root(tmp_path / "root", artifact=os.urandom(120 * 1024))
    r = vc.pack(tmp_path / "root", tmp_path / "out", split_mib=50 / 1024)
    assert r["names"] == ["vllm_cache.part00", "vllm_cache.part01", "vllm_cache.part02"]
    sizes = [(tmp_path / "out" / n).stat().st_size for n in r["names"]]
    assert all(s <= 50 * 1024 for s in sizes) and sum(sizes) == r["bytes"]
    assert vc.unpack(tmp_path / "out", tmp_path / "back")["files"] == 7
    art = f"torch_compile_cache/{PIECES}/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_0"
    assert (tmp_path / "back" / art).read_bytes() == (tmp_path / "root" / art).read_bytes()
    vc.pack(tmp_path / "root", tmp_path / "out")  # a smaller pack replaces the parts: none joined to it later
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["vllm_cache.tar.xz"]
    (tmp_path / "out" / "vllm_cache.tar.xz").unlink()
    vc.pack(tmp_path / "root", tmp_path / "out", split_mib=50 / 1024)
    (tmp_path / "out" / "vllm_cache.part01").unlink()
    with pytest.raises(vc.CacheError, match="without a gap"):
        vc.unpack(tmp_path / "out", tmp_path / "gap")


def _seeded(tmp_path: Path) -> tuple[Path, float]:
    _fake_root(tmp_path / "first")
    vc.pack(tmp_path / "first", tmp_path / "carried")
    root = tmp_path / "root"
    vc.unpack(tmp_path / "carried", root)
    return root, time.time()


def test_since_tells_what_the_run_read_and_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, since = _seeded(tmp_path)
    monkeypatch.setattr(ca, "atime_tracked", lambda folder: True)
    model = root / "torch_compile_cache" / "torch_aot_compile" / AOT / "rank_0_0" / "model"
    os.utime(model, (since + 5, model.stat().st_mtime))  # vLLM read the AOT model (a hit)
    r = vc.pack(root, tmp_path / "out", since=since, skip_unchanged=True)
    assert r["skipped"] and (r["read"], r["seeded"], r["kept"]) == (1, 3, 2)
    assert "nothing new" in vc.pack_line(r) and not (tmp_path / "out").exists()
    # the hit's inductor wrote a file into the seeded entry (grown); another setting compiled a new entry (and wrote
    # the model's modelinfos file again: read, its file count unchanged)
    (model.parent.parent / "inductor_cache" / "fxgraph" / "ab" / "sampler").write_bytes(b"sampler graph")
    _fake_root(root, pieces="fedcba9876", aot="b" * 64)
    r = vc.pack(root, tmp_path / "out", since=since, skip_unchanged=True)
    assert not r["skipped"] and (r["entries"], r["new"], r["grown"], r["read"], r["kept"]) == (5, 2, 1, 1, 1)
    line = vc.pack_line(r)
    assert "5 of 5 entries packed (1 of the seed's 3 read, 2 compiled in this run, 1 grown)" in line
    # the most recently used first; the new pieces' table names the root they were compiled under
    with ca.open_archive(tmp_path / "out", vc.NAME, vc.WHAT) as tar:
        manifest = json.load(tar.extractfile(vc.MANIFEST))  # type: ignore[arg-type]
    order = list(manifest["entries"])
    assert order.index(f"torch_compile_cache/torch_aot_compile/{AOT}") < order.index(f"torch_compile_cache/{PIECES}")
    # without atimes (noatime) nothing is known read, and every entry is still packed
    monkeypatch.setattr(ca, "atime_tracked", lambda folder: False)
    r = vc.pack(root, tmp_path / "out2", since=since)
    assert r["entries"] == 5 and "(the seed's 3, read or not: no atimes here, 2 compiled" in vc.pack_line(r)


def test_an_entry_from_an_earlier_call_on_the_machine_is_packed(tmp_path: Path) -> None:
    root, since = _seeded(tmp_path)
    _fake_root(root, pieces="1111111111", aot="c" * 64)  # an earlier call's, older than this unpack
    for f in root.rglob("*"):
        if f.is_file() and ("1111111111" in str(f) or "c" * 64 in str(f)):
            os.utime(f, (since - 50, since - 50))
    r = vc.pack(root, tmp_path / "out", since=since, skip_unchanged=True)
    assert not r["skipped"] and r["earlier"] == 2 and "2 from an earlier call on this machine" in vc.pack_line(r)


def test_over_the_cap_the_least_recently_used_are_left_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for i in range(4):  # incompressible, 100 KiB each; entry i last used i hours ago
        _fake_root(root, pieces=f"{i:010d}", aot=f"{i}" * 64, artifact=os.urandom(100 * 1024))
        for f in (root / "torch_compile_cache" / f"{i:010d}").rglob("*"):
            os.utime(f, (time.time() - 3600 * i, time.time() - 3600 * i))
    r = vc.pack(root, tmp_path / "out", max_mib=250 / 1024)
    assert r["bytes"] <= 250 * 1024 and r["trimmed"] >= 2 and "least recently used left out" in vc.pack_line(r)
    kept = {n.split("/")[1] for n in _names(tmp_path / "out") if n.startswith("torch_compile_cache/0")}
    assert "0000000000" in kept and "0000000003" not in kept


def test_missing_and_bad_archives_are_refused_before_anything_is_written(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "dest"
    with pytest.raises(vc.CacheError, match="no such file or folder"):
        vc.unpack(tmp_path / "missing", dest)
    (tmp_path / "empty").mkdir()
    with pytest.raises(vc.CacheError, match="holds no vllm_cache.tar.xz nor vllm_cache.partNN"):
        vc.unpack(tmp_path / "empty", dest)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "vllm_cache.tar.xz").write_bytes(b"not xz at all")
    with pytest.raises(vc.CacheError, match="not a readable vllm_cache archive"):
        vc.unpack(tmp_path / "junk", dest)
    _fake_root(tmp_path / "root", artifact=os.urandom(64 * 1024))
    vc.pack(tmp_path / "root", tmp_path / "good")
    data = (tmp_path / "good" / "vllm_cache.tar.xz").read_bytes()
    (tmp_path / "cut.tar.xz").write_bytes(data[:len(data) // 2])  # a part lost on the way
    with pytest.raises(vc.CacheError, match="not a readable vllm_cache archive"):
        vc.unpack(tmp_path / "cut.tar.xz", dest)
    with tarfile.open(tmp_path / "other.tar.xz", "w:xz") as tar:  # no manifest: not ours
        tar.add(tmp_path / "root" / "startup_plan" / "startup_plan_x.json", arcname="startup_plan/x.json")
    with pytest.raises(vc.CacheError, match="no readable vllm_cache.json"):
        vc.unpack(tmp_path / "other.tar.xz", dest)
    manifest = tmp_path / "vllm_cache.json"
    manifest.write_text(json.dumps({"root": "/r", "entries": {}}))
    for name, match in (("../evil", "not a plain file below its root"), ("startup_plan/x.json", "outside")):
        with tarfile.open(tmp_path / "bad.tar.xz", "w:xz") as tar:
            tar.add(manifest, arcname="vllm_cache.json")
            tar.add(manifest, arcname=name)
        with pytest.raises(vc.CacheError, match=match):
            vc.unpack(tmp_path / "bad.tar.xz", dest)
    assert not dest.exists() and not (tmp_path / "evil").exists()
    with pytest.raises(vc.CacheError, match="no torch_compile_cache entries nor modelinfos"):
        vc.pack(tmp_path / "empty", tmp_path / "out")
    assert vc.main(["unpack", str(tmp_path / "junk"), str(dest)]) == 1
    assert "vllm cache unpack:" in capsys.readouterr().err


def test_place_within_the_devices_budget(tmp_path: Path) -> None:
    _fake_root(tmp_path / "root", artifact=os.urandom(120 * 1024))
    out = tmp_path / "out"
    out.mkdir()
    for i in range(5):
        (out / f"frontier_g{i}.json").write_text("{}")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(out / "frontier_g0.json", arcname="./setup.log")
    r = vc.pack(tmp_path / "root", tmp_path / "staged", split_mib=50 / 1024)  # 3 parts
    parts = [Path(p) for p in r["paths"]]
    where = ca.place(parts, out, vc.NAME, out / "logs.tar.gz")  # 6 files there + 3 > 8: into logs.tar.gz
    assert where.startswith(f"inside {out / 'logs.tar.gz'} as vllm_cache/3 parts") and "pass the 8 files" in where
    assert sorted(p.name for p in out.iterdir()) == ["frontier_g0.json", "frontier_g1.json", "frontier_g2.json",
                                                     "frontier_g3.json", "frontier_g4.json", "logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {m.name for m in tar.getmembers()} >= {"./setup.log", "./vllm_cache/vllm_cache.part00"}
    names = ca.take(out, tmp_path / ".vllmcache", vc.NAME, vc.WHAT)  # found inside the .tar.gz
    assert names == ["vllm_cache.part00", "vllm_cache.part01", "vllm_cache.part02"]
    assert vc.unpack(tmp_path / ".vllmcache", tmp_path / "seeded")["files"] == 7
    # room at the top: the archive goes there, replacing the earlier pack's file
    r = vc.pack(tmp_path / "root", tmp_path / "staged")
    (out / "frontier_g4.json").unlink()
    (out / "vllm_cache.part00").write_bytes(b"an older pack's")
    assert ca.place([Path(p) for p in r["paths"]], out, vc.NAME, out / "logs.tar.gz").startswith(
        f"in {out}/vllm_cache.tar.xz")
    assert not (out / "vllm_cache.part00").exists()
    names = ca.take(out, tmp_path / ".vllmcache", vc.NAME, vc.WHAT)  # replaces the three parts
    assert names == ["vllm_cache.tar.xz"] and sorted(p.name for p in (tmp_path / ".vllmcache").iterdir()) == names
    # no room anywhere: refused, the archive left where it was
    for i in range(5, 12):
        (out / f"x{i}").write_text("x")
    r = vc.pack(tmp_path / "root", tmp_path / "staged")
    with pytest.raises(vc.CacheError, match="not returned: .*no .tar.gz"):
        ca.place([Path(p) for p in r["paths"]], out, vc.NAME, None)
    with pytest.raises(vc.CacheError, match="would reach 0.1 MiB"):
        ca.place([Path(p) for p in r["paths"]], out, vc.NAME, out / "logs.tar.gz", file_mib=0.1)
    with pytest.raises(vc.CacheError, match="no vllm_cache.tar.xz nor vllm_cache.partNN, at the top or inside"):
        ca.take(tmp_path / "staged" / "..", tmp_path / "nowhere", vc.NAME, vc.WHAT)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_root(tmp_path / "root")
    assert vc.main(["stats", str(tmp_path / "root")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["kind"], s["entries"], s["files"]) == ("cache", 3, 7) and "startup_plan/" in s["left_out"]
    assert vc.main(["pack", str(tmp_path / "root"), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vllm cache: 3 of 3 entries packed") and f"in {tmp_path / 'out'}/vllm_cache.tar.xz" in out
    assert vc.main(["unpack", str(tmp_path / "out"), str(tmp_path / "back")]) == 0
    assert "3 entries (7 files" in capsys.readouterr().out
    assert vc.main(["take", str(tmp_path / "out"), str(tmp_path / ".vllmcache")]) == 0
    assert "3 entries, 7 files" in capsys.readouterr().out


SHELL = r"""
set -u
py="$PYTHON"
say() { echo "test: $*"; }
. bench/peer_env.sh
vllm_cache_seed "$SEED_DIR"
echo "root=${VLLM_CACHE_ROOT:-unset} since=${vcache_since:-none}"
env | grep -q '^VLLM_CACHE_ROOT=' && echo exported
# vLLM started here would compile into the root: one new entry
mkdir -p "$VLLM_CACHE_ROOT/torch_compile_cache/feedfeed00/rank_0_0/backbone"
echo "{}" >"$VLLM_CACHE_ROOT/torch_compile_cache/feedfeed00/rank_0_0/backbone/vllm_compile_cache.py"
vllm_cache_pack "$OUT_DIR" "" $(($(date +%s) + 60))
"""


@pytest.mark.parametrize("seed", ["missing", "corrupt", "good"])
def test_the_bench_scripts_seed_and_pack(tmp_path: Path, seed: str) -> None:
    """bench/peer_env.sh as vs_vllm.sh and frontier_parallel.sh call it: a missing or unreadable archive says so in
    one line and vLLM compiles as without it; the pack's line says what it packed and read from the seed."""
    seed_dir = tmp_path / ".vllmcache"
    if seed == "corrupt":
        seed_dir.mkdir()
        (seed_dir / "vllm_cache.tar.xz").write_bytes(b"\xfd7zXZ\x00 cut short")
    elif seed == "good":
        _fake_root(tmp_path / "first")
        vc.pack(tmp_path / "first", seed_dir)
    env = {**os.environ, "PYTHON": sys.executable, "SEED_DIR": str(seed_dir), "OUT_DIR": str(tmp_path / "out"),
           "VLLM_CACHE_ROOT": str(tmp_path / "root")}
    r = subprocess.run(["bash", "-c", SHELL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("test: vllm cache:")]
    assert f"root={tmp_path / 'root'} since=" in r.stdout and "since=none" not in r.stdout and "exported" in r.stdout
    if seed == "missing":
        assert "no vllm_cache.tar.xz nor vllm_cache.partNN in" in lines[0] and "compiles as without it" in lines[0]
    elif seed == "corrupt":
        assert "could not be read" in lines[0] and "compiles as without it" in lines[0]
    else:
        assert lines[0].startswith("test: vllm cache: 3 entries (7 files")
    packed = 1 + (3 if seed == "good" else 0)
    assert f"vllm cache: {packed} of {packed} entries packed" in lines[1], lines
    assert ("no seed, " in lines[1]) == (seed != "good") and "1 compiled in this run" in lines[1]
    assert f"in {tmp_path / 'out'}/vllm_cache.tar.xz" in lines[1]
    assert vc.stats(tmp_path / "out")["entries"] == packed


def test_a_pack_stopped_while_it_adds_to_the_tar_gz_leaves_nothing_more_in_out(tmp_path: Path) -> None:
    """peer_env.sh's vllm_cache_pack runs the pack under `timeout` (SIGTERM at the call's budget). The .tar.gz
    fallback is taken when OUT's files are used up, and place writes it anew beside it: a SIGTERM there must not leave
    that half-written .tmp in OUT (one file over the device's 8, which drops another), and the .tar.gz stays whole."""
    _fake_root(tmp_path / "root")
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(ROOT / "bench" / "vllm_cache.py", arcname="./setup.log")
    before = (out / "logs.tar.gz").read_bytes()
    started = tmp_path / "adding"
    script = f"""
import sys, tarfile, time
sys.path.insert(0, {str(ROOT)!r})
from bench import vllm_cache as vc
def slow(self, *args, **kwargs):
    open({str(started)!r}, "w").close()
    time.sleep(60)
tarfile.TarFile.add = slow
sys.exit(vc.main(["pack", {str(tmp_path / "root")!r}, {str(out)!r}, "--fallback", {str(out / "logs.tar.gz")!r},
                  "--max-files", "1"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(600):
            if started.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert started.exists() and any(p.name.endswith(".tmp") for p in out.iterdir())
        proc.terminate()
        assert proc.wait(timeout=20) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz"]
    assert (out / "logs.tar.gz").read_bytes() == before
