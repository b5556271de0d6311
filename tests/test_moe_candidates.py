"""bench/moe_candidates.py (issue 40: our fused MoE experts against vLLM's and torch._grouped_mm's): its flags refused
by name, the tables (bench/moe_candidates_table.py: two candidates, three, and an older report's rows under three),
the checks before timing (fake candidates and clocks, in this process), vLLM's import failing, and the whole script
on the CPU under the Triton interpreter (--dry-run: our kernels interpreted) twice: with a vllm that does not import
(every row says why, ours still timed) and with a stand-in vllm package laid out as 0.26's, whose `fused_experts`
checks the arguments as 0.26's does and computes the experts in torch (both timed, compared); torch._grouped_mm runs
on torch's CPU fallback in both (checked against the reference and timed)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from bench_module import load_bench
from triton_interp import run_interpreted

from bench import moe_candidate_kernels as mck
from rapidserve.ops.moe import moe_experts_ref, route

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "bench" / "moe_candidates.py")
mc = load_bench("moe_candidates")

FAKE_FUSED_MOE = '''
import torch
import torch.nn.functional as F

CALLS = []


def get_moe_configs(E, N, dtype, block_n=None, block_k=None):
    return {1: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4,
                "num_stages": 5}}


def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
    E, _, N = w2_shape  # as 0.26: N is w2's last dim, the intermediate size
    configs = get_moe_configs(E, N, dtype)
    return configs[min(configs, key=lambda m: abs(m - M))]


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=None, apply_router_weight_on_input=False,
                  global_num_experts=-1, expert_map=None, quant_config=None):
    # 0.26's fused_experts_impl checks
    assert hidden_states.size(1) == w1.size(2), "Hidden size mismatch"
    assert topk_weights.size() == topk_ids.size(), "topk shape mismatch"
    assert hidden_states.is_contiguous() and w1.stride(-1) == 1 and w2.stride(-1) == 1
    assert topk_weights.stride(1) == 1
    assert w2.size(1) == hidden_states.size(1) and 2 * w2.size(2) == w1.size(1), "w1 [E, 2I, h], w2 [E, h, I]"
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
    assert activation is None and expert_map is None and quant_config is None
    n = w2.size(2)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for t in range(hidden_states.size(0)):
        for j in range(topk_ids.size(1)):
            e = int(topk_ids[t, j])
            gu = F.linear(hidden_states[t].float(), w1[e].float())
            act = F.silu(gu[:n]) * gu[n:]  # silu_and_mul: gate rows first
            out[t] += float(topk_weights[t, j]) * F.linear(act, w2[e].float())
    return out.to(hidden_states.dtype)
'''


def fake_vllm(folder: Path, broken: bool = False) -> Path:
    """A vllm package in folder/vllm: 0.26's module path to fused_experts (`broken`: its import fails as a wheel
    built for another CUDA does)."""
    pkg = folder / "vllm"
    fm = pkg / "model_executor" / "layers" / "fused_moe"
    fm.mkdir(parents=True)
    init = 'raise ImportError("libcudart.so.13: cannot open shared object file")\n' if broken else \
        '__version__ = "0.26.0-fake"\n'
    (pkg / "__init__.py").write_text(init)
    for d in (pkg / "model_executor", pkg / "model_executor" / "layers", fm):
        (d / "__init__.py").touch()
    (fm / "fused_moe.py").write_text(FAKE_FUSED_MOE)
    (fm / "config.py").write_text(textwrap.dedent('''
        import torch
        def _get_config_dtype_str(dtype, **kwargs):
            return "float32" if dtype == torch.float else None
    '''))
    return folder


@pytest.mark.parametrize(("argv", "names"), [
    (["--models", "llama3-8b"], "--models"),
    (["--models", "mixtral-8x7b,mixtral-8x7b"], "--models"),
    (["--tp", "0"], "--tp"),
    (["--models", "mixtral-8x7b", "--tp", "3"], "--tp"),
    (["--decode-batches", "1,2,2"], "--decode-batches"),
    (["--decode-batches", "0"], "--decode-batches"),
    (["--prefill-tokens", "1k"], "--prefill-tokens"),
    (["--budget-s", "0"], "--budget-s"),
    (["--budget-s", "nan"], "--budget-s"),
    (["--json", "/nonexistent-folder/x.json"], "--json"),
    (["--tables", "/nonexistent-folder"], "--tables"),
    (["--dry-run", "--models", "qwen3-30b-a3b", "--tp", "2"], "--models, --tp"),
    (["--dtype", "float32"], "--dtype"),
    (["--candidates", "ours,cutlass"], "--candidates 'ours,cutlass': unknown 'cutlass': comma-separated names from "
                                       "ours, vllm, torch_gmm"),
    (["--candidates", "ours,ours"], "--candidates"),
    (["--candidates", ""], "--candidates"),
])
def test_flags_refused_by_name(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad flag is refused (exit 2) before anything runs, its name in the message."""
    with pytest.raises(SystemExit) as e:
        mc.main(argv)
    assert e.value.code == 2
    assert names in capsys.readouterr().err


def test_dry_run_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        mc.main(["--dry-run"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_parsers() -> None:
    assert mc.parse_counts("--decode-batches", "4,1,64") == (4, 1, 64)
    assert mc.parse_budget("12.5") == 12.5
    assert mc.parse_candidates("torch_gmm,ours") == ("ours", "torch_gmm")  # the tables' order
    with pytest.raises(ValueError, match="--budget-s"):
        mc.parse_budget("inf")


OURS = mc.Candidate("ours", "ours", lambda *a: a[0], config_head="tiles")
VLLM = mc.Candidate("vllm", "vLLM", lambda *a: a[0], version="0.26.0", title="vLLM 0.26.0: fused_experts")
GMM = mc.Candidate("torch_gmm", "torch._grouped_mm", lambda *a: a[0], column="torch",
                   title="torch._grouped_mm (cutlass grouped, torch 2.11.0)")


def row(phase: str, tokens: int, names: tuple[str, ...] = ("ours", "vllm"), **kw: object) -> dict[str, object]:
    """A row as the script writes it for `names` (the default: a report from before torch_gmm)."""
    base: dict[str, object] = {"model": "qwen3-30b-a3b", "tp": 1, "phase": phase, "tokens": tokens,
                               "pairs": tokens * 8, "unique_experts": 8, "bytes_read": 75_000_000,
                               "ours_ms": None, "ours_eager_ms": None, "ours_err": None, "ours_config": None,
                               "ours_why": "", "vllm_ms": None, "vllm_eager_ms": None, "vllm_err": None,
                               "vllm_config": None, "vllm_why": "", "between_err": None}
    if "torch_gmm" in names:
        base.update({"torch_gmm_ms": None, "torch_gmm_eager_ms": None, "torch_gmm_err": None,
                     "torch_gmm_config": None, "torch_gmm_why": ""})
    base.update(kw)
    limit = base["ceiling_ms"] if phase == "decode" else base["bound_ms"]
    return mc.finish_row(base, float(limit), names)  # type: ignore[arg-type]


def test_tables() -> None:
    """Decode then prefill; vLLM/ours = vLLM's time over ours, each against the limit; '-' where a candidate was not
    timed, and the row's note says why ('|' kept out of the cell)."""
    rows = [row("decode", 1, ceiling_ms=0.019, ours_ms=0.038, ours_eager_ms=0.3, ours_err=1e-3, ours_config="16 tuned",
                vllm_ms=0.057, vllm_eager_ms=0.09, vllm_err=2e-3, between_err=2.5e-3,
                vllm_config="16x64x64 g1 w4 s5 tuned naive"),
            row("decode", 2, ceiling_ms=0.038, ours_ms=0.0587, vllm_why="vLLM failed: RuntimeError: a | b"),
            row("prefill", 8192, bound_ms=1.11, bound_by="flops", ours_ms=1.705, vllm_ms=1.5)]
    assert "torch_gmm_over_ours" not in rows[0]
    text = mc.table(rows, 4.8e12, [OURS, VLLM])
    lines = text.splitlines()
    assert lines[0] == "copy bandwidth 4.80 TB/s (read+write); vLLM 0.26.0: fused_experts"
    decode = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 1 |")][0].split(" | ")
    assert decode[4:10] == ["19.0", "38.0", "57.0", "1.50", "0.50", "0.33"]
    assert decode[10:14] == ["300.0", "90.0", "1.0e-03 / 2.0e-03 / 2.5e-03", "16 tuned"]
    assert decode[14] == "16x64x64 g1 w4 s5 tuned naive" and decode[15] == "- |"
    two = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 2 |")][0]
    assert "| 58.7 | - | - | 0.65 | - |" in two and two.endswith("| vLLM failed: RuntimeError: a / b |")
    head = [ln for ln in lines if ln.startswith("| model | tp | prefill tokens")][0]
    assert "bound us | bound by | ours us | vLLM us | vLLM/ours | ours of bound | vLLM of bound" in head
    pre = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 8192 |")][0].split(" | ")
    assert pre[4:11] == ["1110", "flops", "1705", "1500", "0.88", "0.65", "0.74"]
    assert all(ln.count("|") == head.count("|") for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 8192"))
    failed = {"model": "mixtral-8x7b", "tp": 2, "phase": "decode", "tokens": 64, "pairs": 128,
              "unique_experts": None, "bytes_read": None, "error": "row failed: OutOfMemoryError: CUDA out of memory"}
    last = mc.table(rows + [failed], 4.8e12, [OURS, VLLM]).splitlines()
    assert "| mixtral-8x7b | 2 | 64 | - | - | - | - | - | - | - | - | - | - / - / - | - | - | row failed: " \
        "OutOfMemoryError: CUDA out of memory |" in last
    missing = mc.table(rows[1:2], 4.8e12, [OURS, mc.Candidate("vllm", "vLLM", None, why="vllm not importable: X")])
    assert "vLLM not measured: vllm not importable: X" in missing.splitlines()[0]
    assert "prefill tokens" not in missing  # no prefill rows, no prefill table


def test_tables_with_three_candidates() -> None:
    """torch's columns beside each of ours and vLLM's, those keeping their names and order (a report from before it
    renders, '-' in torch's cells); torch/ours = its time over ours; its missing reason in the heading and note."""
    three = ("ours", "vllm", "torch_gmm")
    rows = [row("decode", 1, three, ceiling_ms=0.019, ours_ms=0.038, ours_eager_ms=0.3, ours_err=1e-3,
                ours_config="16 tuned", vllm_ms=0.057, vllm_eager_ms=0.09, vllm_err=2e-3, between_err=3e-3,
                vllm_config="16x64x64 g1 w4 s5 tuned naive", torch_gmm_ms=0.076, torch_gmm_eager_ms=0.2,
                torch_gmm_err=4e-3, torch_gmm_config="cutlass grouped (torch 2.11.0)"),
            row("prefill", 8192, three, bound_ms=1.11, bound_by="flops", ours_ms=1.705, vllm_ms=1.5,
                torch_gmm_why="torch._grouped_mm failed: RuntimeError: cutlass cannot implement"),
            row("prefill", 4096, bound_ms=0.6, bound_by="bytes", ours_ms=0.8, vllm_ms=1.0)]  # an older report's
    assert rows[0]["torch_gmm_over_ours"] == pytest.approx(2.0) and rows[0]["torch_gmm_of_limit"] == pytest.approx(0.25)
    lines = mc.table(rows, 4.8e12, [OURS, VLLM, GMM]).splitlines()
    assert lines[0] == ("copy bandwidth 4.80 TB/s (read+write); vLLM 0.26.0: fused_experts; "
                        "torch._grouped_mm (cutlass grouped, torch 2.11.0)")
    head = [ln for ln in lines if ln.startswith("| model | tp | decode batch")][0]
    assert head == ("| model | tp | decode batch | unique experts | ceiling us | ours us | vLLM us | torch us | "
                    "vLLM/ours | torch/ours | ours of ceiling | vLLM of ceiling | torch of ceiling | ours eager us | "
                    "vLLM eager us | torch eager us | rel err ours / vLLM / torch / between | ours tiles | "
                    "vLLM config | torch config | note |")
    decode = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 1 |")][0].split(" | ")
    assert decode[4:16] == ["19.0", "38.0", "57.0", "76.0", "1.50", "2.00", "0.50", "0.33", "0.25", "300.0", "90.0",
                            "200.0"]
    assert decode[16:20] == ["1.0e-03 / 2.0e-03 / 4.0e-03 / 3.0e-03", "16 tuned", "16x64x64 g1 w4 s5 tuned naive",
                             "cutlass grouped (torch 2.11.0)"]
    pre = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 8192 |")][0]
    assert "| 1705 | 1500 | - | 0.88 | - | 0.65 | 0.74 | - |" in pre
    assert pre.endswith("| torch._grouped_mm failed: RuntimeError: cutlass cannot implement |")
    old = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 | 4096 |")][0]
    assert "| 600 | bytes | 800 | 1000 | - | 1.25 | - | 0.75 | 0.60 | - |" in old and old.endswith("| - |")
    pre_head = [ln for ln in lines if ln.startswith("| model | tp | prefill tokens")][0]
    assert pre_head.count("|") == head.count("|") + 1  # + bound by
    assert pre.count("|") == old.count("|") == pre_head.count("|")
    absent = mc.Candidate("torch_gmm", "torch._grouped_mm", None, column="torch",
                          why="torch._grouped_mm runs CUTLASS on sm_90 / sm_100 only (this GPU: sm_80)")
    alone = mc.table(rows[:1], 4.8e12, [absent]).splitlines()
    assert alone[0].endswith("; torch._grouped_mm not measured: torch._grouped_mm runs CUTLASS on sm_90 / sm_100 "
                             "only (this GPU: sm_80)")
    assert alone[2] == ("| model | tp | decode batch | unique experts | ceiling us | torch us | torch of ceiling | "
                        "torch eager us | rel err torch / between | torch config | note |")  # no ours: no ratio


def test_measure_checks_before_timing() -> None:
    """A candidate is timed only once its output agrees with the reference; one that is wrong, fails, or is missing
    says so in the row, and the others keep their timings."""
    torch.manual_seed(0)
    e, h, i, t, k = 6, 16, 8, 5, 2
    w13, w2 = torch.randn(e, 2 * i, h) / 4, torch.randn(e, h, i) / 3
    x = torch.randn(t, h)
    weights, ids = route(torch.randn(t, e), k, True)
    want = moe_experts_ref(x, w13, w2, weights, ids)
    timed: list[str] = []

    def clock(ms: float):  # noqa: ANN202
        def time_it(fn, reps, device):  # noqa: ANN001, ANN202
            timed.append(f"{fn().shape[0]}:{ms}")
            return ms
        return time_it

    def boom(*args: object) -> torch.Tensor:
        raise RuntimeError("no kernel image\nfor this device")

    good = mc.Candidate("ours", "ours", lambda *a: moe_experts_ref(*a) * (1 + 1e-3), describe=lambda *a: "16 tuned")
    wrong = mc.Candidate("vllm", "vLLM", lambda *a: moe_experts_ref(*a) * 1.5)
    r = mc.measure([good, wrong], x, w13, w2, weights, ids, want, 3, "cpu", clock(0.25), clock(0.5))
    assert r["ours_ms"] == 0.25 and r["ours_eager_ms"] == 0.5 and r["ours_why"] == "" and r["ours_config"] == "16 tuned"
    assert r["ours_err"] == pytest.approx(1e-3, rel=0.05)
    assert r["vllm_ms"] is None and r["vllm_eager_ms"] is None and r["between_err"] is None
    assert r["vllm_why"] == f"vLLM disagrees with the reference: relative error {r['vllm_err']:.3g}"
    assert timed == ["5:0.25", "5:0.5"]
    failing = mc.Candidate("vllm", "vLLM", boom)
    r = mc.measure([good, failing], x, w13, w2, weights, ids, want, 3, "cpu", clock(1.0), clock(2.0))
    assert r["vllm_why"] == "vLLM failed: RuntimeError: no kernel image" and r["ours_ms"] == 1.0
    absent = mc.Candidate("vllm", "vLLM", None, why="vllm not importable: ModuleNotFoundError: No module named 'vllm'")
    r = mc.measure([good, absent], x, w13, w2, weights, ids, want, 3, "cpu", clock(1.0), clock(2.0))
    assert r["vllm_why"] == absent.why and r["vllm_err"] is None
    other = mc.Candidate("vllm", "vLLM", lambda *a: moe_experts_ref(*a) * (1 - 1e-3), describe=lambda *a: 1 / 0)
    r = mc.measure([good, other], x, w13, w2, weights, ids, want, 3, "cpu", clock(1.0), clock(2.0))
    assert r["vllm_ms"] == 1.0 and r["between_err"] == pytest.approx(2e-3, rel=0.05)
    assert str(r["vllm_config"]).startswith("? (ZeroDivisionError")
    row = mc.finish_row(r, 0.5, ["ours", "vllm"])
    assert row["vllm_over_ours"] == 1.0 and row["ours_of_limit"] == 0.5
    third = mc.Candidate("torch_gmm", "torch._grouped_mm", lambda *a: moe_experts_ref(*a) * (1 + 4e-3))
    r = mc.measure([good, other, third], x, w13, w2, weights, ids, want, 3, "cpu", clock(1.0), clock(2.0))
    assert r["torch_gmm_ms"] == 1.0 and r["between_err"] == pytest.approx(5e-3, rel=0.05)  # the widest pair


def test_load_vllm_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A --vllm-path without vllm, and a vllm whose import fails: a candidate that does not run, and why."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for var in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    empty = mc.load_vllm(tmp_path)
    assert empty.run is None and empty.why.startswith(f"vllm not importable: --vllm-path {tmp_path} holds no vllm")
    assert "vllm" not in sys.modules
    broken = mc.load_vllm(fake_vllm(tmp_path / "broken", broken=True))
    assert broken.run is None
    assert broken.why == "vllm not importable: ImportError: libcudart.so.13: cannot open shared object file"
    crash = fake_vllm(tmp_path / "crash")
    (crash / "vllm" / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    crashed = mc.load_vllm(crash)  # the child process dies, not this one
    assert crashed.run is None and crashed.why == (f"vllm not importable: importing {mck.VLLM_MODULE} killed the "
                                                   "child process (signal 11)")
    assert "vllm" not in sys.modules and str(crash) not in sys.path


def dry_run(tmp_path: Path, vllm_path: Path) -> tuple[str, dict]:  # type: ignore[type-arg]
    out = run_interpreted(SCRIPT, "--dry-run", "--vllm-path", str(vllm_path), "--json", str(tmp_path / "mc.json"),
                          timeout=300)
    return out, json.loads((tmp_path / "mc.json").read_text())


def test_dry_run_without_vllm(tmp_path: Path) -> None:
    """vLLM does not import: our kernels (interpreted) are still checked and timed, every row says why vLLM is not,
    and the table comes last (also written beside the JSON)."""
    out, report = dry_run(tmp_path, fake_vllm(tmp_path / "site", broken=True))
    why = "vllm not importable: ImportError: libcudart.so.13: cannot open shared object file"
    assert report["done"] and report["vllm"]["why"] == why and not report["skipped"]
    assert [(r["phase"], r["tokens"]) for r in report["rows"]] == [("decode", 1), ("decode", 4), ("prefill", 32)]
    assert report["candidates"]["torch_gmm"] == {"label": "torch._grouped_mm", "version": torch.__version__,
                                                 "why": None}
    for r in report["rows"]:
        assert r["vllm_why"] == why and r["vllm_ms"] is None and r["vllm_over_ours"] is None
        assert r["ours_why"] == "" and r["ours_ms"] > 0 and r["ours_err"] < mc.TOL and r["ours_of_limit"] > 0
        assert r["torch_gmm_why"] == "" and r["torch_gmm_err"] < mc.TOL and r["torch_gmm_over_ours"] > 0
        assert r["torch_gmm_config"] == f"mm-loop fallback (torch {torch.__version__})"
        assert r["between_err"] < mc.TOL
    assert r["bound_by"] in ("flops", "bytes") and report["rows"][0]["ceiling_ms"] > 0
    tables = (tmp_path / "mc.md").read_text().strip()
    assert out.rstrip().endswith(tables.splitlines()[-1]) and tables.splitlines()[-1].endswith(f"| {why} |")
    assert "| torch us |" in tables and "| torch/ours |" in tables


def test_dry_run_with_a_stand_in_vllm(tmp_path: Path) -> None:
    """A vllm package laid out as 0.26's, imported from --vllm-path: its fused_experts gets our layer's tensors as
    they are (its checks of 0.26's layout pass), agrees with the reference and with ours, and both are timed."""
    out, report = dry_run(tmp_path, fake_vllm(tmp_path / "site"))
    assert report["vllm"]["version"] == "0.26.0-fake" and report["vllm"]["why"] is None
    assert report["vllm"]["from"] == str(tmp_path / "site" / "vllm")
    assert "vLLM: 0.26.0-fake from" in out
    for r in report["rows"]:
        assert r["ours_why"] == "" and r["vllm_why"] == "", r
        assert r["vllm_err"] < mc.TOL and r["between_err"] < mc.TOL and r["vllm_over_ours"] > 0
        assert r["torch_gmm_why"] == "" and r["torch_gmm_over_ours"] > 0
    naive = [r["vllm_config"] for r in report["rows"]]
    assert naive == ["16x64x64 g1 w4 s5 tuned naive", "16x64x64 g1 w4 s5 tuned", "16x64x64 g1 w4 s5 tuned"]


def test_bench_layer_rows_budget_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU with torch stand-ins for both kernels (no Triton): a row per decode batch then per prefill size, each
    with its limit; none past the deadline (listed instead); a row whose bound fails says so and the next one runs."""
    ref = mc.Candidate("ours", "ours", moe_experts_ref)
    alt = mc.Candidate("vllm", "vLLM", lambda *a: moe_experts_ref(*a) * (1 + 1e-3))
    rows: list[dict[str, object]] = []
    skipped: list[str] = []
    args = ("tiny-mixtral", 1, torch.float32, 1e10, [ref, alt], "cpu", (1, 3), (8, 16), (1, 1))
    mc.bench_layer(*args, float("-inf"), rows.append, skipped)
    assert rows == [] and skipped == ["tiny-mixtral tp1 decode 1", "tiny-mixtral tp1 decode 3",
                                      "tiny-mixtral tp1 prefill 8", "tiny-mixtral tp1 prefill 16"]
    calls = iter([None, RuntimeError("cuBLAS failed")])

    def bound(*a: object) -> dict[str, object]:
        err = next(calls)
        if err:
            raise err
        return {"dense_ms": 0.5, "bytes_read": 1, "bound_ms": 0.5, "bound_by": "flops"}

    monkeypatch.setattr(mc.moe_gemm, "prefill_bound", bound)
    mc.bench_layer(*args, float("inf"), rows.append, skipped := [])
    assert [(r["phase"], r["tokens"]) for r in rows] == [("decode", 1), ("decode", 3), ("prefill", 8), ("prefill", 16)]
    assert not skipped and all(r["ours_why"] == r["vllm_why"] == "" for r in rows)
    assert rows[0]["unique_experts"] == 2 and rows[0]["ceiling_ms"] == pytest.approx(rows[0]["bytes_read"] / 1e7)
    assert rows[2]["ours_of_limit"] == pytest.approx(0.5 / rows[2]["ours_ms"]) and "error" not in rows[2]
    assert rows[3]["error"] == "row failed: RuntimeError: cuBLAS failed" and rows[3]["ours_ms"] > 0
