"""The multi-GPU goodput frontier (issues 37, 41): TP in compare.py's systems (ours and vLLM), disagg-npmd on
halves of the GPUs, frontier_plan.py's groups and device-time plan, the engine default's ratios to our baselines,
compare_merge.py, and bench/frontier_parallel.sh run end to end on CPU with a stand-in vLLM (two groups side by
side in slots of TP 2, merged into one table)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from typing import Any

import pytest

from tests.test_bench_compare import _load
from tests.test_bench_cpu_slots import TOPO_TWO_NODES
from tests.test_server import ROOT

compare = _load()
tp = _load("compare_tp")
plan = _load("frontier_plan")
cpu_slots = _load("cpu_slots")
frontier = _load("compare_frontier")
merge = _load("compare_merge")
MODEL = {p: plan._model(p) for p in ("llama-3.1-70b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-8b")}


@pytest.mark.parametrize("args,want", [("", 1), ("--max-model-len 8192", 1), ("--tensor-parallel-size 4", 4),
                                       ("-tp 2 --tensor-parallel-size=8", 8), ("--tensor-parallel-size 2 -tp 4", 4)])
def test_serve_tp(args: str, want: int) -> None:
    assert tp.serve_tp(args) == want


def test_tp_reaches_ours_and_vllm_and_disagg_takes_the_halves(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--dry-run", "--goodput-search", "--systems", "rapidserve,disagg-npmd,hybrid-1024,vllm:",
                         "--vllm-model", "/m", "--vllm-serve", "none", "--port", "8123", "--workloads", "4096:64",
                         "--serve-args", "--max-model-len 8192 --tensor-parallel-size 4"]) == 0
    lines = dict(x.split(": ", 1) for x in capsys.readouterr().out.splitlines()[:4])
    assert lines["rapidserve"].endswith("--port 8123 --max-model-len 8192 --tensor-parallel-size 4")
    assert lines["disagg-npmd"].endswith("--tensor-parallel-size 4 --mode disagg --prefill-tensor-parallel-size 2 "
                                         "--tensor-parallel-size 2")  # the later -tp wins (argparse)
    assert lines["hybrid-1024"].endswith("--mode hybrid --max-num-batched-tokens 1024")
    assert lines["vllm"].endswith("--port 8123 --max-model-len 8192 --tensor-parallel-size 4")
    for serve in ("--tensor-parallel-size 3", ""):  # disagg-npmd needs halves
        with pytest.raises(SystemExit):
            compare.main(["--dry-run", "--goodput-search", "--systems", "disagg-npmd", "--serve-args", serve])
        assert "needs an even --tensor-parallel-size >= 2" in capsys.readouterr().err
    assert "disagg-npmd" not in compare.SWEEP_SYSTEMS and "hybrid-1024" not in compare.SWEEP_SYSTEMS
    # the A/B systems' flags reach the server as written: duet-g256's buckets, duet100-g4096's SLO and buckets
    for name, want in (("duet-g256", "896,1024,1280,1536,1792,2048"),
                       ("duet100-g4096", "--slo-itl-ms 100 --prefill-graph-tokens 16,"),
                       ("duet-interp", "--policy duet --profile-lookup interpolate"),
                       ("duet-m90", "--policy duet --slo-margin 0.9"),
                       ("duet-perkind", "--policy duet --step-correction per-kind")):
        assert want in compare.SYSTEMS[name] and name not in compare.SWEEP_SYSTEMS


@pytest.mark.parametrize("group,preset,size,ours,vllm,note", [
    ("ours-tp", "llama-3.1-70b", 4, ["rapidserve", "disagg-npmd"], [], ""),
    ("ours-tp", "llama-3.1-70b", 2, ["rapidserve"], [], "131 GiB of bf16 weights a GPU"),  # 1P1D: a whole 70B
    ("ours-tp", "mixtral-8x7b", 2, ["rapidserve", "disagg-npmd"], [], ""),
    ("ours-tp", "qwen3-30b-a3b", 8, ["rapidserve", "disagg-npmd"], [], ""),  # 4 KV heads: 4P4D
    ("ours-tp", "qwen3-8b", 1, ["rapidserve"], [], "give an even TP >= 2"),
    ("hybrid-chunks", "llama-3.1-70b", 8, ["hybrid-512", "hybrid-1024", "hybrid-2048"], [], ""),
    ("vllm-default", "mixtral-8x7b", 4, [], ["vllm:"], ""),
    ("vllm-a", "qwen3-8b", 1, [], ["vllm:", "vllm:--max-num-batched-tokens 1024"], ""),
    ("ours-slo", "qwen3-8b", 1, ["duet@25", "duet@50", "duet@100", "duet@200", "duet@none"], [], ""),
    ("fill-ab", "qwen3-8b", 1, ["duet", "duet-g256"], [], ""),
    ("g4096-ab", "qwen3-8b", 1, ["duet@100", "duet100-g4096"], [], ""),
    ("lookup-ab", "qwen3-8b", 1, ["duet", "duet-roundup", "duet-interp"], [], ""),
    ("duet", "qwen3-8b", 1, ["duet"], [], ""),
    ("margin-ab", "qwen3-8b", 1, ["duet", "duet-m90"], [], ""),
    ("ours-slo+baselines", "qwen3-8b", 1,
     ["duet@25", "duet@50", "duet@100", "duet@200", "duet@none", "always-fused", "always-split"], [], ""),
    ("ours-tp+vllm-1024", "llama-3.1-70b", 4, ["rapidserve", "disagg-npmd"], ["vllm:--max-num-batched-tokens 1024"],
     ""),
])
def test_group_systems(group: str, preset: str, size: int, ours: list[str], vllm: list[str], note: str) -> None:
    got = plan.group_systems(group, MODEL[preset], size)
    assert got[:2] == (ours, vllm) and note in got[2] and bool(got[2]) == bool(note)


@pytest.mark.parametrize("group,size,match", [("nope", 1, "nope? give one of"), ("ours-tp+x", 2, "x? give"),
                                             ("ours-tp", 3, "3")])
def test_group_errors(group: str, size: int, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        plan.group_systems(group, MODEL["llama-3.1-70b"], size)


def split_parts(peer: Any, n: int) -> Any:
    """A .peer folder as `bash bench/vs_vllm.sh --split` leaves it: c0 .. c{n-1}, a part each, and the recipe."""
    for k in range(n):
        (peer / f"c{k}").mkdir(parents=True)
        (peer / f"c{k}" / f"part{k:02d}").write_bytes(b"x")
    (peer / "peer_vllm").mkdir(exist_ok=True)
    (peer / "bundle.tar").write_bytes(b"x")
    return peer


def test_the_stash_calls_are_the_parts_vs_vllm_cut(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One `vs_vllm.sh --stash` call per .peer/cK that `vs_vllm.sh --split` made (10 for vLLM 0.26.0's bundle),
    not a count written into the plan; where nothing is split yet, STASH_PARTS_UNSPLIT, said to be assumed."""
    peer = split_parts(tmp_path / ".peer", 10)
    n, whence = plan.stash_parts(peer)
    assert n == 10 and "c0 .. c9" in whence and "bash bench/vs_vllm.sh --split" in whence
    assert plan.stash_parts(split_parts(tmp_path / "three", 3))[0] == 3
    n, whence = plan.stash_parts(tmp_path / "nothing")
    assert n == plan.STASH_PARTS_UNSPLIT == 10 and "assumed" in whence and "--split" in whence
    monkeypatch.setattr(plan, "PEER_DIR", split_parts(tmp_path / "eleven", 11))
    text = "\n".join(plan.plan(MODEL["qwen3-8b"], "qwen3-8b", 1, 1, ["ours"]))
    assert "vLLM stash: 11 calls: ~88 s" in text and "c0 .. c10" in text
    text = "\n".join(plan.plan(MODEL["qwen3-8b"], "qwen3-8b", 1, 1, ["ours"], vllm_parts=4))  # --vllm-parts 4
    assert "vLLM stash: 4 calls: ~32 s" in text


def test_plan_says_what_fits_a_session(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan, "PEER_DIR", split_parts(tmp_path / ".peer", 10))
    lines = plan.plan(MODEL["llama-3.1-70b"], "llama-3.1-70b", 4, 4,
                      ["ours-tp", "hybrid-chunks", "vllm-default", "vllm-1024"])
    text = "\n".join(lines)
    assert "1 group(s) side by side" in lines[0] and "weights 131 GiB" in lines[1]
    assert [x.split(".", 1)[0].strip() for x in lines[2:-1]] == ["0", "1", "2", "3", "4", "5"]  # start, stash, 4 calls
    assert "vLLM stash: 10 calls" in text and "4. vllm-default [vllm:]" in text and "over" not in lines[-3]
    assert lines[-2].endswith("next session") and "over by" in lines[-1]
    two = plan.plan(MODEL["mixtral-8x7b"], "mixtral-8x7b", 8, 4, ["ours-tp", "hybrid-chunks"], stashed=True)
    assert "2 group(s) side by side" in two[0] and "ours-tp [rapidserve, disagg-npmd] | hybrid-chunks" in two[3]
    assert two[-1].endswith("fits") and "stash" not in "\n".join(two)
    ratio = plan.peak_guess(MODEL["mixtral-8x7b"], 4, 4096) / plan.peak_guess(MODEL["llama-3.1-70b"], 4, 4096)
    assert ratio == pytest.approx(69.50 / 12.75, rel=0.01)  # by active parameters
    with pytest.raises(ValueError, match="needs 8 GPUs"):
        plan.plan(MODEL["qwen3-8b"], "qwen3-8b", 4, 8, ["ours-tp"])
    # issue 37 on two GPUs: the five duet@B servers (~25 s each at TP 1), one bound a search, beside ours' three
    slo = plan.plan(MODEL["qwen3-8b"], "qwen3-8b", 2, 1, ["ours-slo", "ours"], num_prompts=48, max_probes=10,
                    stashed=True)
    assert slo[3].startswith("  1. ours-slo [duet@25, duet@50, duet@100, duet@200, duet@none] | ours [duet, ")
    assert "start-ups ~125 s, 5 search(es) of ~5 probes (one bound each)" in slo[3] and slo[-1].endswith("fits")
    assert "3 search(es) of ~8 probes (cut from 10 by BUDGET_S 540)" in slo[3]
    assert plan.probes_wanted("duet@none", 10) == 5 and plan.probes_wanted("duet", 10) == 10


def test_the_plan_counts_every_repetition() -> None:
    cfg = MODEL["qwen3-8b"]
    kw: dict[str, Any] = {"num_prompts": 48, "max_probes": 6, "stashed": True}
    once = plan.plan(cfg, "qwen3-8b", 1, 1, ["duet"], **kw)
    assert plan.plan(cfg, "qwen3-8b", 1, 1, ["duet"], repeats=1, **kw) == once
    twice = plan.plan(cfg, "qwen3-8b", 1, 1, ["duet"], repeats=2, **kw)
    calls = [next(x for x in lines if "duet [duet]" in x) for lines in (once, twice)]
    assert "each search 2 times (--search-repeats)" in twice[0]
    assert "1 search(es) x 2 repetitions of ~6 probes" in calls[1]
    assert not any("fit" in x for x in twice[1:-1])  # the budget holds both repetitions
    peak = plan.peak_guess(cfg, 1, 4096)
    fixed = plan.CALL_OVERHEAD_S + plan.STARTUP_S["duet-tp1"]  # the call's overhead and the server's start-up: once
    secs = [plan.group_call("duet", ["duet"], peak, 48, 6, 540, False, repeats=n).seconds - fixed for n in (1, 2, 3)]
    assert secs[1] == pytest.approx(2 * secs[0]) and secs[2] == pytest.approx(3 * secs[0])  # the searches: N x
    three = plan.plan(cfg, "qwen3-8b", 2, 1, ["ours-slo", "ours"], num_prompts=48, max_probes=10, stashed=True,
                      repeats=3)
    notes = [x for x in three if "does not fit 3 repetitions" in x]
    assert [x.split(":")[0].strip() for x in notes] == ["ours-slo", "ours"] and "more than a call's 600 s" in notes[1]
    assert "(cut from 10 by BUDGET_S 540 over 3 repetitions)" in three[-2]
    starved = plan.plan(cfg, "qwen3-8b", 1, 1, ["ours"], num_prompts=48, max_probes=10, stashed=True, repeats=20)
    assert any("BUDGET_S 540 cannot fit 20 repetitions" in x for x in starved)
    with pytest.raises(ValueError, match="--search-repeats 0"):
        plan.plan(cfg, "qwen3-8b", 1, 1, ["duet"], repeats=0)


def test_the_plan_leaves_out_the_closed_loop_a_prior_peak_replaces() -> None:
    """--search-peak-from-prior: no search runs its closed loop (num_prompts at once, num_prompts / peak s), so each
    system's search is that much shorter, and the plan run by frontier_parallel.sh reads the flag from SEARCH_ARGS."""
    cfg = MODEL["mixtral-8x7b"]
    peak = plan.peak_guess(cfg, 1, 4096)
    secs = [plan.group_call("vllm-a", ["vllm:", "vllm:--max-num-batched-tokens 1024"], peak, 48, 10, 5000, False,
                            peak_from_prior=reuse).seconds for reuse in (False, True)]
    assert secs[0] - secs[1] == pytest.approx(2 * 48 / peak)  # two systems' closed loops
    env = {**os.environ, "KIND_GPUS": "1", "GROUP": "duet"}  # one search well inside BUDGET_S
    totals = []
    for extra in ("", " --search-peak-from-prior"):
        r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**env, "SEARCH_ARGS": "--search-max-probes 10" + extra})
        assert r.returncode == 0, r.stderr
        totals.append(int(re.search(r"total ~(\d+) s of", r.stdout).group(1)))  # type: ignore[union-attr]
    assert totals[1] < totals[0]


@pytest.mark.parametrize("gib,want", [(None, 190.0), (15.0, 60.0), (131.0, 190.0), (73.0, 125.0), (4.0, 60.0)])
def test_vllm_startup_grows_with_the_model(gib: float | None, want: float) -> None:
    assert plan.vllm_startup_s(gib) == pytest.approx(want)


def test_an_8b_vllm_group_gets_its_probes() -> None:
    """qwen3-8b's vLLM starts in ~60 s (15 GiB of weights), not the 70B shape's 190: two vLLM servers leave its searches
    their probes (they made 10 each in one call on 2026-11-30)."""
    lines = plan.plan(MODEL["qwen3-8b"], "qwen3-8b", 2, 1, ["vllm-a"], prompt=2048, num_prompts=48, max_probes=10,
                      stashed=True)
    assert "2 search(es) of ~10 probes," in lines[3] and "cut from" not in lines[3], lines[3]


def g(bound: float | None, lo: float | None, status: str = "converged", hi: float | None = None) -> dict[str, Any]:
    return {"itl_bound_ms": bound, "share": 0.9, "goodput": lo or 0.0, "lo": lo, "hi": hi, "status": status}


NS = "not_searched"


def fr(label: str, e50: dict[str, Any], eun: dict[str, Any]) -> dict[str, Any]:
    return {"label": label, "title": "w", "workload": {}, "path": None, "finished": True, "stopped": None,
            "goodput": [eun, e50], "probes": [], "search": {"settings": {"itl_bounds_ms": [50.0], "shares": [0.9]}}}


OWN = [fr("rapidserve", g(50.0, 3.0), g(None, 6.0)), fr("disagg-npmd", g(50.0, 2.0), g(None, 3.0)),
       fr("hybrid-512", g(50.0, 1.5), g(None, 4.0)),
       fr("hybrid-2048", g(50.0, None, "below_min_rate", 1.0), g(None, 5.0)),
       fr("vllm", g(50.0, 1.0), g(None, 6.0, "unfinished"))]
OWN_META = {"model": "m", "workloads": [], "systems": [
    {"label": f["label"], "kind": "vllm" if f["label"] == "vllm" else "rapidserve", "flags": "", "status": "ok"}
    for f in OWN]}


def test_the_default_over_our_baselines() -> None:
    vs = {(x["over"], x["itl_bound_ms"]): x for x in frontier.versus_ours(OWN, {"vllm"})}
    assert sorted({o for o, _ in vs}) == ["best hybrid chunk", "disagg-npmd", "hybrid-2048", "hybrid-512"]
    assert vs[("disagg-npmd", 50.0)]["ratio"] == 1.5 and vs[("disagg-npmd", None)]["ratio"] == 2.0
    assert vs[("hybrid-2048", 50.0)]["ratio"] is None and not vs[("hybrid-2048", 50.0)]["exact"]  # 0 there
    best = vs[("best hybrid chunk", None)]
    assert best["over_system"] == "hybrid-2048" and best["ratio"] == 1.2 and best["exact"]
    assert vs[("best hybrid chunk", 50.0)]["over_system"] == "hybrid-512"
    assert frontier.versus_ours(OWN[1:], {"vllm"}) == []  # no rapidserve: no rows
    md = frontier.frontier_markdown(OWN, OWN_META)
    assert "| rapidserve / disagg-npmd | 1.50x | 2.00x | |" in md
    assert "| rapidserve / hybrid-2048 | >= 3.00x* | 1.20x | |" in md  # it fails at its lowest rate, 1: ours is 3
    assert "| rapidserve / best hybrid chunk | 2.00x | 1.20x | |" in md
    assert "| rapidserve / better vLLM | 3.00x | <= 1.00x* | |" in md  # vLLM's unbounded search: >= 6, unsettled


def _report(tmp_path: Any, name: str, frontiers: list[dict[str, Any]], **meta: Any) -> str:
    base = {"model": "m", "serve_args": "--tensor-parallel-size 4", "workloads": [], "itl_bounds_ms": [100, 50],
            "rates": "inf", "per_rate": "48 Poisson arrivals per probe", "arrival": "poisson", "seed": 0,
            "peak_fractions": None, "mode": "goodput_search", "search": {"max_probes": 6}, "peaks": {},
            "vllm_baseline": None}
    labels = {f["label"] for f in frontiers}
    m = {**base, "systems": [s for s in OWN_META["systems"] if s["label"] in labels], **meta}
    frontier.write_frontier_report(argparse.Namespace(out=str(tmp_path), name=name), m, [], plot=False,
                                   prior={"frontiers": frontiers})
    return str(tmp_path / f"{name}.json")


def test_merge_joins_the_groups_and_skips_what_does_not_compare(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    a = _report(tmp_path, "a", OWN[:2])
    b = _report(tmp_path, "b", OWN[2:])
    other_tp = _report(tmp_path, "c", OWN[2:3], serve_args="--tensor-parallel-size 2")
    again = _report(tmp_path, "d", OWN[:1])
    assert merge.main([a, str(tmp_path / "missing.json"), other_tp, b, again, "--out", str(tmp_path / "m"),
                       "--name", "all", "--no-plot"]) == 0
    err = capsys.readouterr().err
    assert "missing.json: no such file" in err and "ran with serve_args = '--tensor-parallel-size 2'" in err
    assert "rapidserve already in an earlier report" in err
    data = json.loads((tmp_path / "m" / "all.json").read_text())
    assert [f["label"] for f in data["frontiers"]] == [f["label"] for f in OWN]
    assert [s["report"] for s in data["systems"]] == [a, a, b, b, b]
    assert {x["over"] for x in data["versus_ours"]} >= {"disagg-npmd", "best hybrid chunk"}
    assert "| rapidserve / disagg-npmd |" in (tmp_path / "m" / "all.md").read_text()
    assert merge.main([str(tmp_path / "missing.json"), "--out", str(tmp_path), "--no-plot"]) == 1
    assert data["reference"] == "rapidserve"  # no duet@B ran: the engine's default as serve runs it


def test_merge_refuses_a_reference_that_is_none_of_its_systems(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # an unknown --reference used to be taken as given: every ratio row silently missing from the merged report
    a = _report(tmp_path, "a", OWN[:2])
    out = tmp_path / "m"
    with pytest.raises(SystemExit) as ei:
        merge.main([a, "--out", str(out), "--reference", "rapidserv", "--no-plot"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--reference 'rapidserv' is none of the merged systems" in err
    assert "rapidserve, disagg-npmd" in err and not out.exists()
    for bad, match in ((["--name", "x/y"], "argument --name"), (["--out", ""], "argument --out")):
        with pytest.raises(SystemExit) as ei:
            merge.main([a, "--out", str(out), *bad])
        assert ei.value.code == 2 and match in capsys.readouterr().err
    assert merge.main([a, "--out", str(out), "--reference", "disagg-npmd", "--no-plot"]) == 0


def test_merge_makes_the_composite_row_of_the_slo_group(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # a report of before --search-only-bounds existed (no such setting) joins one with it at its default (None)
    older = _report(tmp_path, "older", OWN[2:3])
    duet = [fr(label, g(50.0, 4.0 if label == "duet@50" else 9.0, "converged" if label == "duet@50" else NS),
               g(None, 7.0 if label == "duet@none" else 9.0, "at_max_rate" if label == "duet@none" else NS))
            for label in ("duet@50", "duet@none")]
    new = _report(tmp_path, "slo", duet, search={"max_probes": 6, "only_bounds": None},
                  systems=[{"label": f["label"], "kind": "rapidserve", "flags": "", "status": "ok"} for f in duet])
    assert merge.main([older, new, "--out", str(tmp_path / "m"), "--name", "all", "--no-plot"]) == 0
    assert "skipped" not in capsys.readouterr().err
    data = json.loads((tmp_path / "m" / "all.json").read_text())
    assert data["reference"] == "default (SLO = bound)" and [f["label"] for f in data["frontiers"]] == [
        "hybrid-512", "duet@50", "duet@none"]
    md = (tmp_path / "m" / "all.md").read_text()
    assert "| **default (SLO = bound)** | 4 | >= 7 |" in md
    assert "| default (SLO = bound) / hybrid-512 | 2.67x | >= 1.75x* | |" in md  # duet@none >= 7


# serve_vllm.sh's contract (MODEL PORT [flags]; its own session; pid and log in the run dir; 0 once healthy), its
# server a light stand-in for vLLM: an OpenAI-style streaming /v1/completions sending max_tokens chunks 2 ms apart
# (and the usage), which starts in a second where a CPU rapidserve server takes ten or more.
STAND_IN_SERVER = """
import asyncio, json, sys
from aiohttp import web
async def completions(req):
    body = await req.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(req)
    n = int(body["max_tokens"])
    for i in range(n):
        await asyncio.sleep(0.002)
        chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
    await resp.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())
    return resp
async def health(req):
    return web.Response(text="ok")
async def models(req):
    return web.json_response({"data": [{"id": "peer", "max_model_len": 256}]})
app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""
STAND_IN = f"""#!/usr/bin/env bash
MODEL=$1; PORT=$2; shift 2
echo "stand-in vllm for $MODEL: $*"
env | grep '^VLLM_CACHE' > "$STAND_IN_RUN/cache_env_$PORT"  # what a real vLLM would see of VLLM_CACHE
if [ -n "${{VLLM_CACHE_ROOT:-}}" ]; then  # compiles into its cache root, as vLLM does
  mkdir -p "$VLLM_CACHE_ROOT/torch_compile_cache/5eed5eed00/rank_0_0/backbone"
  echo "{{}}" > "$VLLM_CACHE_ROOT/torch_compile_cache/5eed5eed00/rank_0_0/backbone/vllm_compile_cache.py"
fi
setsid "$STAND_IN_PY" -c '{STAND_IN_SERVER}' "$PORT" > "$STAND_IN_RUN/vllm_$PORT.log" 2>&1 &
echo $! > "$STAND_IN_RUN/vllm_$PORT.pid"
for i in $(seq 1 120); do
  sleep 0.25
  "$STAND_IN_PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null \\
    && {{ echo "healthy"; exit 0; }}
  kill -0 "$(cat "$STAND_IN_RUN/vllm_$PORT.pid")" 2>/dev/null || {{ echo "died"; exit 1; }}
done
exit 1
"""


def _stand_in(tmp_path, **env: str) -> tuple[dict[str, str], Any, Any]:  # type: ignore[no-untyped-def]
    """The recipe with the stand-in vLLM, an 'installed' vLLM and the model folder; the environment for
    vs_vllm.sh / frontier_parallel.sh (tiny-llama, one probe), `env` over it. Returns (env, run_dir, out)."""
    recipe, site, run_dir, out = (tmp_path / d for d in ("recipe", "site", "run", "out"))
    for d in (recipe, site / "vllm", run_dir, tmp_path / "pm-tiny-llama"):
        d.mkdir(parents=True, exist_ok=True)
    (recipe / "serve_vllm.sh").write_text(STAND_IN)
    (recipe / "install.sh").write_text("exit 1\n")
    (recipe / "make_model.py").write_text("raise SystemExit(1)\n")
    (site / "vllm" / "__init__.py").write_text("__version__ = 'stand-in'\n")
    (tmp_path / "pm-tiny-llama" / "config.json").write_text("{}")  # the folder exists: not written again
    base = {**os.environ, "PYTHON": sys.executable, "STAND_IN_PY": sys.executable, "STAND_IN_RUN": str(run_dir),
            "PEER_VLLM_DIR": str(recipe), "PEER_SITE": str(site), "PEER_STASH": str(tmp_path / "stash"),
            "PEER_MODEL": str(tmp_path / "pm"), "FA3_FROM_VLLM": "0", "OUT": str(out), "PRESET": "tiny-llama",
            "WORKLOADS": "24:4", "NUM_PROMPTS": "4", "WARMUP": "1", "MAX_MODEL_LEN": "256",
            "SEARCH_ARGS": "--search-max-probes 1 --search-discard 1 --search-tolerance 0.5", "BUDGET_S": "170",
            "SERVE_ARGS": "--device cpu --num-kv-blocks 64"}
    return {**base, **env}, run_dir, out


@pytest.mark.skipif(shutil.which("setsid") is None or not os.path.isdir("/proc"), reason="needs setsid and /proc")
def test_frontier_parallel_on_cpu_two_groups_at_tp2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two groups side by side; VLLM_CACHE: the carried seed unpacked once into VLLM_CACHE_ROOT, which every vLLM
    start sees (VLLM_CACHE itself does not reach vLLM), and the seed's entries with the one vLLM compiled packed
    back into $OUT beside the 5 other files."""
    from tests.test_vllm_cache import _fake_root, vc

    _fake_root(tmp_path / "earlier_root")
    vc.pack(tmp_path / "earlier_root", tmp_path / "vllmcache")  # an earlier session's archive, carried
    env, run_dir, out = _stand_in(
        tmp_path, NGPU="4", TP="2", GROUP="hybrid-chunks,vllm-default", SYSTEMS="hybrid-512", REFERENCE="hybrid-512",
        NAME="tp2", TOPO_FILE=str(tmp_path / "topo.txt"), VLLM_CACHE=str(tmp_path / "vllmcache"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm_root"))
    # the GPUs' topology as nvidia-smi prints it (tests/test_bench_cpu_slots.py): each group pinned to its CPUs
    (tmp_path / "topo.txt").write_text(TOPO_TWO_NODES)
    argv = ["bash", "bench/frontier_parallel.sh", "--token-range", "3:1000", "--vllm-run-dir", str(run_dir)]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert set(os.listdir(out)) - {"tp2__fixed-24-4_frontier.png"} == {  # the plot, where matplotlib is there
        "frontier_hybrid-chunks.json", "frontier_vllm-default.json", "logs.tar.gz", "tp2.json", "tp2.md",
        "vllm_cache.tar.xz"}
    assert [f.name for f in run_dir.glob("cache_env_*")]  # vLLM started, and saw the root alone
    for f in run_dir.glob("cache_env_*"):
        assert f.read_text().split() == [f"VLLM_CACHE_ROOT={tmp_path / 'vllm_root'}"]
    last = r.stdout.strip().splitlines()[-1]  # after the table
    assert "]: vllm cache: 4 of 4 entries packed (" in last and "1 compiled in this run" in last, last
    assert f"in {out}/vllm_cache.tar.xz" in last
    assert vc.stats(out)["by_entry"].keys() == {e.rel for e in vc.entries(tmp_path / "vllm_root")}
    data = json.loads((out / "tp2.json").read_text())
    cmds = {s["label"]: s["command"] for s in data["systems"]}
    assert cmds["hybrid-512"].endswith("--tensor-parallel-size 2 --device cpu --num-kv-blocks 64 --mode hybrid "
                                       "--max-num-batched-tokens 512")
    assert cmds["vllm"].endswith("--max-model-len 256 --gpu-memory-utilization 0.8 --tensor-parallel-size 2")
    assert [f["label"] for f in data["frontiers"]] == ["hybrid-512", "vllm"]
    assert data["versus_better_vllm"] and all(x["better_vllm_system"] == "vllm" for x in data["versus_better_vllm"])
    md = (out / "tp2.md").read_text()
    assert "| **better vLLM** |" in md and "| hybrid-512 / better vLLM |" in md
    with tarfile.open(out / "logs.tar.gz") as t:
        setup = t.extractfile("./setup.log").read().decode()  # type: ignore[union-attr]
    assert "hybrid-chunks on GPUs 0,1, CPUs " in setup and "vllm-default on GPUs 2,3, CPUs " in setup
    pinned = re.findall(r"on GPUs [0-9,]+, CPUs ([0-9,-]+)", setup)
    assert len(pinned) == 2 and not cpu_slots.parse_cpu_list(pinned[0]) & cpu_slots.parse_cpu_list(pinned[1])
    assert "frontier plan: tiny-llama at TP 2 on 4 GPUs: 2 group(s) side by side" in setup
    assert "prepared: vLLM in" in setup and "failed" not in setup
    assert "vllm cache: 3 entries (7 files, " in setup  # the seed, once, for both groups
    assert f"from {tmp_path / 'vllmcache'} into {tmp_path / 'vllm_root'}" in setup


@pytest.mark.skipif(shutil.which("setsid") is None or not os.path.isdir("/proc"), reason="needs setsid and /proc")
def test_frontier_parallel_names_a_joined_groups_report_without_a_plus(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`a+b` (two groups' systems one after the other in one slot): its report reaches $OUT as frontier_a_b.json
    (2026-12-01: the device brought back no file named with a `+`, so the group's report, the one MERGE_WITH
    reads, stayed in logs.tar.gz), and the table holds both groups' systems."""
    env, run_dir, out = _stand_in(tmp_path, NGPU="1", GROUP="vllm-default+hybrid-chunks", SYSTEMS="hybrid-512",
                                  NAME="joined", PIN_CPUS="0")
    argv = ["bash", "bench/frontier_parallel.sh", "--token-range", "3:1000", "--vllm-run-dir", str(run_dir)]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert not [f for f in os.listdir(out) if "+" in f]
    assert {"frontier_vllm-default_hybrid-chunks.json", "joined.json", "joined.md"} <= set(os.listdir(out))
    data = json.loads((out / "frontier_vllm-default_hybrid-chunks.json").read_text())
    assert {s["label"] for s in data["systems"]} == {"vllm", "hybrid-512"}
    assert [f["label"] for f in json.loads((out / "joined.json").read_text())["frontiers"]] == ["vllm", "hybrid-512"]


@pytest.mark.skipif(shutil.which("setsid") is None or not os.path.isdir("/proc"), reason="needs setsid and /proc")
def test_vs_vllm_carries_the_compile_cache_from_call_to_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vs_vllm.sh with VLLM_CACHE: no archive yet (vLLM compiles, one line says so), this call's cache packed into
    $OUT; taken into the carried folder here, the next call seeds from it, vLLM finds its entry, and nothing new
    is packed."""
    from tests.test_vllm_cache import vc

    carried = tmp_path / "vllmcache"
    for call in (1, 2):
        env, run_dir, _ = _stand_in(tmp_path, GROUP="vllm-default", SYSTEMS="", VLLM_CACHE=str(carried),
                                    VLLM_CACHE_ROOT=str(tmp_path / f"root{call}"), OUT=str(tmp_path / f"out{call}"))
        out = tmp_path / f"out{call}"
        for f in run_dir.glob("cache_env_*"):
            f.unlink()  # the earlier call's
        r = subprocess.run(["bash", "bench/vs_vllm.sh", "--vllm-run-dir", str(run_dir)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        setup = (out / "vs_vllm_setup.log").read_text()
        assert [f.read_text().split() for f in run_dir.glob("cache_env_*")] == [
            [f"VLLM_CACHE_ROOT={tmp_path / f'root{call}'}"]]  # vLLM's one start saw the root, not VLLM_CACHE
        if call == 1:
            assert f"vllm cache: no vllm_cache.tar.xz nor vllm_cache.partNN in {carried}: vLLM compiles as" in setup
            assert "vllm cache: 1 of 1 entries packed (no seed, 1 compiled in this run): 1 files, " in setup
            assert {p.name for p in out.iterdir()} - {"frontier__fixed-24-4_frontier.png"} == {  # the plot: matplotlib
                "frontier.json", "frontier.md", "vllm_cache.tar.xz", "vs_vllm_detail.tar.gz", "vs_vllm_setup.log"}
            assert vc.main(["take", str(out), str(carried)]) == 0
        else:
            assert f"vllm cache: 1 entries (1 files, 0 KiB) from {carried} into {tmp_path / 'root2'}" in setup
            assert "vllm cache: nothing new" in setup and not (out / "vllm_cache.tar.xz").exists()


def test_frontier_parallel_plan_reads_the_workload_and_the_stash() -> None:
    """--plan estimates with the first workload's prompt length (WORKLOADS IN:OUT, or multiturn's conversation) and
    this checkout's stash parts."""
    env = {**os.environ, "KIND_GPUS": "2", "GROUP": "ours-slo", "WORKLOADS": "2048:28"}
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "2048-token prompts" in r.stdout, r.stdout + r.stderr
    n, whence = plan.stash_parts()  # the plan's own count of this checkout's .peer/c*
    assert f"vLLM stash: {n} calls" in r.stdout and whence in r.stdout
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "WORKLOADS": "multiturn"}, timeout=60)
    # multiturn: an arrival is a whole conversation (2048 + 5 x 256 new prompt tokens, 6 x 64 output tokens), whose
    # lifetime spans all its turns
    assert r.returncode == 0 and "3328-token prompts" in r.stdout, r.stdout + r.stderr
    assert "request lifetime 9.9 s" in r.stdout


def test_frontier_parallel_plans_the_workloads_lifetime() -> None:
    env = {**os.environ, "KIND_GPUS": "2", "GROUP": "baselines", "WORKLOADS": "1024:256",
           "SEARCH_ARGS": "--search-max-probes 10 --search-max-probe-arrivals 400"}
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "request lifetime 6.7 s" in r.stdout, r.stdout + r.stderr
    assert "1024-token prompts" in r.stdout and "(warm-up ~" in r.stdout


def test_frontier_parallel_plans_the_repetitions() -> None:
    """SEARCH_ARGS' --search-repeats N reaches the plan: each search N times, and where BUDGET_S cannot hold them."""
    env = {**os.environ, "KIND_GPUS": "2", "GROUP": "ours-slo,ours", "SEARCH_ARGS": "--search-max-probes 10 "
           "--search-repeats 3"}
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "each search 3 times (--search-repeats)" in r.stdout, r.stdout + r.stderr
    assert "ours-slo: BUDGET_S 540 does not fit 3 repetitions of each search" in r.stdout
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "SEARCH_ARGS": "--search-repeats 0"}, timeout=60)
    assert r.returncode == 2 and "--search-repeats 0: each search runs at least once" in r.stderr
