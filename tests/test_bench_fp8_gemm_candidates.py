"""bench/fp8_gemm_candidates.py (our fp8 GEMMs against cuBLASLt, vLLM's CUTLASS kernel and FlashInfer, per
projection and row count): the shapes taken from the presets, its flags refused by name, the checks before timing
(in this process, fake clocks), the ratios and the per-layer summary, the tables, FlashInfer's reasons, and the whole
script on the CPU (--dry-run, in a subprocess) with a vllm that does not import and with a stand-in vllm laid out as
0.26's `_custom_ops` (its `cutlass_scaled_mm` asserts the layout 0.26's wrapper and kernel check)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from bench_module import load_bench
from triton_interp import run_interpreted

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "bench" / "fp8_gemm_candidates.py")
fg = load_bench("fp8_gemm_candidates")
NAMES = ["ours", "cublaslt", "vllm", "flashinfer"]

FAKE_OPS = '''
import torch

CALLS = []


def cutlass_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None):
    # 0.26's wrapper (vllm/_custom_ops.py) and the checks of its compiled op
    assert out_dtype is torch.bfloat16 or out_dtype is torch.float16
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], "a [M, K], b [K, N]"
    assert a.stride(1) == 1 and b.stride(0) == 1, "a row-major, b column-major"
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.is_contiguous() and scale_b.is_contiguous()
    assert scale_a.numel() in (1, a.shape[0]) and scale_b.numel() in (1, b.shape[1])
    assert b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    out = (a.float() * scale_a.reshape(-1, 1)) @ (b.float() * scale_b.reshape(1, -1))
    return out.to(out_dtype)


def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False,
                     output=None, group_shape=None):
    # dynamic only: per token ([M, 1]) or, 0.26's default, per tensor ([1])
    assert input.ndim == 2 and scale is None
    top = torch.finfo(torch.float8_e4m3fn).max
    if use_per_token_if_dynamic:
        s = input.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top
    else:
        s = input.float().abs().amax().clamp(min=1e-12).reshape(1) / top
    return (input.float() / s).clamp(-top, top).to(torch.float8_e4m3fn), s
'''

FAKE_FLASHINFER_GEMM = '''
import torch


def fp8_linear(a, weight, a_scale, weight_scale, bias=None, *, out_dtype=torch.bfloat16, out=None):
    assert a.shape[1] == weight.shape[1] and a.shape[1] % 128 == 0, "[M, K] x [N, K], K a multiple of 128"
    assert tuple(a_scale.shape) == (a.shape[0],) and tuple(weight_scale.shape) == (weight.shape[0],)
    return ((a.float() * a_scale[:, None]) @ (weight.float() * weight_scale[:, None]).t()).to(out_dtype)
'''


def site(folder: Path, vllm: str | None = "ok", flashinfer: bool = False) -> Path:
    """A folder for --vllm-path: a vllm whose `_custom_ops` is 0.26's API in torch (`vllm` "broken": its import
    fails as a wheel built for another CUDA; None: no vllm), and with `flashinfer` a stand-in flashinfer."""
    folder.mkdir(parents=True)
    if vllm is not None:
        (folder / "vllm").mkdir()
        (folder / "vllm" / "__init__.py").write_text(
            'raise ImportError("libcudart.so.13: cannot open shared object file")\n' if vllm == "broken"
            else '__version__ = "0.26.0-fake"\n')
        (folder / "vllm" / "_custom_ops.py").write_text(FAKE_OPS)
    if flashinfer:
        (folder / "flashinfer").mkdir()
        (folder / "flashinfer" / "__init__.py").write_text('__version__ = "0.6.14-fake"\nfrom . import gemm\n')
        (folder / "flashinfer" / "gemm.py").write_text(FAKE_FLASHINFER_GEMM)
    return folder


def test_shapes_from_the_presets() -> None:
    assert fg.layer_shapes("llama-3.1-70b") == {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192),
                                                "down": (8192, 28672)}
    assert fg.layer_shapes("qwen3-8b") == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                                           "down": (4096, 12288)}


@pytest.mark.parametrize(("argv", "says"), [
    (["--rows", "1,0"], "--rows"),
    (["--rows", "16,16"], "--rows"),
    (["--rows", "4k"], "--rows"),
    (["--rows", ""], "--rows"),
    (["--models", ""], "--models '': empty or repeated"),
    (["--models", "mixtral-8x7b"], "--models 'mixtral-8x7b': mixtral-8x7b not a dense preset"),
    (["--models", "llama-3.1-70b,llama-3.1-70b"], "--models"),
    (["--models", "gpt-5"], "gpt-5 not a dense preset; allowed"),
    (["--budget-s", "0"], "--budget-s"),
    (["--budget-s", "inf"], "--budget-s"),
    (["--json", "/nonexistent-folder/x.json"], "--json"),
    (["--dry-run", "--rows", "4"], "drop --rows"),
    (["--dry-run", "--models", "qwen3-8b", "--rows", "4"], "drop --models, --rows"),
])
def test_flags_refused_by_name(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad flag is refused (exit 2) before anything runs, its name in the message."""
    with pytest.raises(SystemExit) as e:
        fg.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_needs_a_gpu_without_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert fg.main(["--rows", "4096", "--models", "qwen3-8b"]) == 2
    assert "needs a CUDA GPU (or --dry-run)" in capsys.readouterr().err


def clock(ms: float, fail: bool = False):  # noqa: ANN201 - a (fn, reps, device) -> ms clock
    def time_it(fn, reps, device):  # noqa: ANN001, ANN202
        fn()
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return ms
    return time_it


def test_measure_checks_before_timing() -> None:
    """A call is timed only once its output agrees with the float32 reference; one that is wrong or fails says so
    and is not timed, a missing candidate keeps its reason; where the graph capture fails, calls back to back."""
    g = torch.Generator().manual_seed(0)
    layer = fg.make_layer(48, 64, "cpu", g)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    x8, sx = fg.quantizer("cpu")(x)
    want = (x8.float() * sx) @ layer.dequantized().t()
    good = fg.ours("cpu").bind(layer)
    wrong = (lambda a, s: good[0](a, s) * 1.5, lambda a: good[1](a) * 1.5)

    def boom(*a: object) -> torch.Tensor:
        raise RuntimeError("no kernel image is available\nfor execution")

    kernels = {"ours": ("ours", good, ""), "cublaslt": ("cuBLASLt", wrong, ""),
               "vllm": ("vLLM", None, "vllm not importable: X"), "flashinfer": ("FlashInfer", (boom, good[1]), "")}
    names = lambda fn, device: ["nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "quant"]  # noqa: E731
    r = fg.measure(kernels, x, x8, sx, want, 3, "cpu", clock(0.25), clock(0.5), names)
    assert r["ours_gemm_us"] == r["ours_quant_us"] == 250.0 and r["ours_gemm_timing"] == "graph"
    assert r["ours_gemm_kernels"][0].startswith("nvjet_sm90") and r["cublaslt_gemm_kernels"] == []  # not timed
    assert r["vllm_quant_kernels"] == [] and r["flashinfer_gemm_kernels"] == []
    assert r["ours_gemm_why"] == r["ours_quant_why"] == "" and r["ours_gemm_err"] < 0.03
    assert r["cublaslt_gemm_us"] is None and r["cublaslt_quant_us"] is None
    assert r["cublaslt_gemm_why"] == f"cuBLASLt (gemm) disagrees with the reference: relative error " \
        f"{r['cublaslt_gemm_err']:.3g}" and r["cublaslt_gemm_err"] == pytest.approx(0.5, rel=0.05)
    assert r["vllm_gemm_why"] == r["vllm_quant_why"] == "vllm not importable: X" and r["vllm_gemm_err"] is None
    assert r["flashinfer_gemm_why"] == "FlashInfer (gemm) failed: RuntimeError: no kernel image is available"
    assert r["flashinfer_gemm_us"] is None and r["flashinfer_quant_us"] == 250.0
    r = fg.measure(kernels, x, x8, sx, want, 3, "cpu", clock(0.25, fail=True), clock(0.5))
    assert r["ours_gemm_us"] == 500.0 and r["ours_gemm_timing"] == "eager"
    assert r["ours_gemm_why"] == "ours (gemm) graph timing failed: RuntimeError: operation not permitted when " \
        "stream is capturing"
    r = fg.measure(kernels, x, x8, sx, want, 3, "cpu", clock(0.25, fail=True), clock(0.5, fail=True))
    assert r["ours_quant_us"] is None and r["ours_quant_timing"] is None
    assert r["ours_quant_why"].count("timing failed") == 2


def layer_rows(model: str, m: int, gemm: dict[str, list[float | None]], quant: dict[str, list[float | None]],
               projs: tuple[str, ...] = fg.PROJS) -> list[dict[str, object]]:
    """Finished rows of one layer at m rows, {candidate: us per projection} for each variant."""
    rows = []
    for i, p in enumerate(projs):
        row: dict[str, object] = {"model": model, "proj": p, "n": 64, "k": 32, "rows": m, "flops": 2 * m * 64 * 32,
                                  "ours_route": "_scaled_mm"}
        for n in NAMES:
            for v, times in (("gemm", gemm), ("quant", quant)):
                row.update({f"{n}_{v}_us": times.get(n, [None] * 4)[i], f"{n}_{v}_err": 1e-3 if n in times else None,
                            f"{n}_{v}_why": "" if n in times else "vllm not importable: X" if n == "vllm" else "",
                            f"{n}_{v}_timing": "graph"})
        rows.append(fg.finish_row(row, NAMES))
    return rows


GEMM = {"ours": [10.0, 20.0, 30.0, 40.0], "cublaslt": [12.0, 18.0, None, 44.0], "flashinfer": [8.0, 25.0, 27.0, 40.0]}
QUANT = {"ours": [15.0, 25.0, 35.0, 45.0], "cublaslt": [14.0, 30.0, 40.0, 50.0]}


def test_ratios_and_summary() -> None:
    """X/ours is X's time over ours, TFLOP/s = 2 M N K / time; per layer the fastest candidate's summed time over
    ours (ties to ours), each candidate's sum over ours only where it has all four; the prefill mix takes o with
    quant, the rest GEMM only; a layer missing a projection has no summary."""
    rows = layer_rows("m", 4096, GEMM, QUANT)
    qkv, o = rows[0], rows[1]
    assert qkv["flashinfer_gemm_over_ours"] == pytest.approx(0.8) and qkv["cublaslt_gemm_over_ours"] == 1.2
    assert qkv["vllm_gemm_over_ours"] is None and qkv["best_gemm"] == "flashinfer" and o["best_gemm"] == "cublaslt"
    assert qkv["ours_gemm_tflops"] == pytest.approx(2 * 4096 * 64 * 32 / 10e-6 / 1e12)
    assert rows[3]["best_gemm"] == "ours" and rows[2]["cublaslt_gemm_tflops"] is None  # tie at 40 us; untimed
    summary = fg.summarize(rows + layer_rows("m", 1, GEMM, QUANT, fg.PROJS[:3]), NAMES)
    assert [(s["rows"], s["mix"]) for s in summary] == [(4096, "gemm"), (4096, "quant"), (4096, "mix")]
    gemm, quant, mix = summary
    assert gemm["ours_us"] == 100.0 and gemm["best_us"] == 8.0 + 18.0 + 27.0 + 40.0
    assert gemm["best_over_ours"] == pytest.approx(0.93) and gemm["flashinfer_over_ours"] == 1.0
    assert gemm["cublaslt_over_ours"] is None and gemm["vllm_over_ours"] is None
    assert gemm["best"] == {"qkv": "flashinfer", "o": "cublaslt", "gate_up": "flashinfer", "down": "ours"}
    assert quant["ours_us"] == 120.0 and quant["cublaslt_over_ours"] == pytest.approx(134 / 120)
    assert quant["best_us"] == 14.0 + 25.0 + 35.0 + 45.0 and quant["flashinfer_over_ours"] is None
    assert mix["ours_us"] == 10.0 + 25.0 + 30.0 + 40.0 and mix["best_us"] == 8.0 + 25.0 + 27.0 + 40.0
    assert mix["best"]["o"] == "ours"  # type: ignore[index]


def candidates(why: str = "vllm not importable: X") -> list[object]:
    return [fg.GemmCandidate("ours", "ours", lambda layer: layer, version="triton: gpu_linear"),
            fg.GemmCandidate("cublaslt", "cuBLASLt", lambda layer: layer, version="torch _scaled_mm"),
            fg.GemmCandidate("vllm", "vLLM", None, why=why),
            fg.GemmCandidate("flashinfer", "FlashInfer", lambda layer: layer, version="0.6: gemm.fp8_linear")]


def test_tables() -> None:
    """The candidates' line, the GEMM-only then the with-quant table, the summary last; a row's note keeps its own
    failures ('|' kept out of the cells) and leaves the candidates' reasons to the first line."""
    rows = layer_rows("m", 4096, GEMM, QUANT)
    rows[2]["cublaslt_gemm_why"] = "cuBLASLt (gemm) failed: RuntimeError: a | b"
    failed = {"model": "m", "proj": "qkv", "n": 64, "k": 32, "rows": 8192, "flops": 1, "error": "row failed: OOM"}
    text = fg.table(rows + [failed], fg.summarize(rows, NAMES), candidates())
    lines = text.splitlines()
    assert lines[0] == "ours: triton: gpu_linear; cuBLASLt: torch _scaled_mm; vLLM: not measured: vllm not " \
        "importable: X; FlashInfer: 0.6: gemm.fp8_linear"
    heads = [i for i, ln in enumerate(lines) if ln.startswith("| model | proj |")]
    assert len(heads) == 2 and lines[heads[0] - 2].startswith("GEMM only: ") \
        and lines[heads[1] - 2].startswith("with quant: ")
    assert lines[heads[0]] == "| model | proj | N x K | rows | ours route | ours us | cuBLASLt us | vLLM us | " \
        "FlashInfer us | ours TFLOP/s | cuBLASLt TFLOP/s | vLLM TFLOP/s | FlashInfer TFLOP/s | cuBLASLt/ours | " \
        "vLLM/ours | FlashInfer/ours | fastest | max rel err | note |"
    qkv = lines[heads[0] + 2].split(" | ")
    assert qkv[:9] == ["| m", "qkv", "64 x 32", "4096", "_scaled_mm", "10.0", "12.0", "-", "8.0"]
    assert qkv[13:] == ["1.20", "-", "0.80", "FlashInfer", "1.0e-03", "- |"]
    gate_up = lines[heads[0] + 4]
    assert gate_up.endswith("| FlashInfer | 1.0e-03 | cuBLASLt (gemm) failed: RuntimeError: a / b |")
    assert lines[heads[1] - 4].endswith("| - | - | row failed: OOM |")
    assert all(ln.count("|") == lines[heads[0]].count("|") for ln in lines[heads[0]:heads[1] - 3] if ln)
    assert lines[-5].startswith("| model | rows | calls | ours us | best us | best/ours | fastest (qkv o gate_up")
    rows[0]["ours_gemm_kernels"] = ["nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT" + "x" * 40, "other"]
    rows[0]["flashinfer_gemm_kernels"] = ["a|b"]
    named = fg.table(rows + [failed], fg.summarize(rows, NAMES), candidates()).splitlines()
    assert named[:len(lines)] == lines and named[len(lines) + 1].startswith("The longest kernel of each GEMM-only")
    assert named[-1] == "| m | 4096 | qkv | `nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNTxxxxxxxxx` | - | - " \
        "| `a/b` |"
    assert lines[-3:] == [
        "| m | 4096 | GEMM only | 100.0 | 93.0 | 0.930 | FlashInfer cuBLASLt FlashInfer ours | - | - | 1.000 |",
        "| m | 4096 | with quant | 120.0 | 119.0 | 0.992 | cuBLASLt ours ours ours | 1.117 | - | - |",
        "| m | 4096 | prefill mix | 105.0 | 100.0 | 0.952 | FlashInfer ours FlashInfer ours | - | - | - |"]


def test_flashinfer_reasons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer: not importable, on a GPU without gemm.fp8_linear (sm_90) or the CPU, each said; on SM100 its
    per-token x per-channel GEMM gets x8 [M, K], the weight [N, K] and the scales as vectors, and agrees."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert fg.load_flashinfer(tmp_path, "cpu").why.startswith("flashinfer not importable: ModuleNotFoundError")
    path = site(tmp_path / "site", None, flashinfer=True)
    try:
        assert fg.load_flashinfer(path, "cpu").why == "flashinfer 0.6.14-fake: gemm.fp8_linear runs on " \
            "SM100/103/107 only, not the CPU"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        assert fg.load_flashinfer(path, "cuda").why.endswith("SM100/103/107 only, not sm_90")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
        cand = fg.load_flashinfer(path, "cuda")
        assert cand.why == "" and cand.version == "0.6.14-fake: gemm.fp8_linear"
        layer = fg.make_layer(32, 128, "cpu", torch.Generator().manual_seed(1))
        x8, sx = fg.quantizer("cpu")(torch.randn(3, 128))
        got = cand.bind(layer)[0](x8, sx)
        want = (x8.float() * sx) @ layer.dequantized().t()
        assert got.dtype == torch.bfloat16 and float((got.float() - want).abs().max() / want.abs().max()) < 1e-2
    finally:
        for mod in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            del sys.modules[mod]


def dry_run(tmp_path: Path, vllm_path: Path) -> tuple[str, dict]:  # type: ignore[type-arg]
    out = run_interpreted(SCRIPT, "--dry-run", "--vllm-path", str(vllm_path), "--json", str(tmp_path / "fg.json"),
                          timeout=300)
    return out, json.loads((tmp_path / "fg.json").read_text())


def test_dry_run_without_vllm(tmp_path: Path) -> None:
    """vLLM does not import: ours and cuBLASLt are checked and timed on every row (both calls), vLLM and FlashInfer
    say why; every layer has its summary; the tables come last (also beside the JSON)."""
    out, report = dry_run(tmp_path, site(tmp_path / "site", "broken"))
    why = "vllm not importable: ImportError: libcudart.so.13: cannot open shared object file"
    assert report["done"] and not report["skipped"] and report["candidates"]["vllm"]["why"] == why
    assert report["candidates"]["flashinfer"]["why"].startswith("flashinfer not importable")
    assert [(r["rows"], r["proj"]) for r in report["rows"]] == [(m, p) for m in (1, 5, 32) for p in fg.PROJS]
    for r in report["rows"]:
        assert r["ours_route"] == "reference" and r["vllm_gemm_why"] == why and r["vllm_gemm_us"] is None
        assert r["vllm_t_gemm_why"] == why and r["vllm_t_gemm_us"] is None
        for n in ("ours", "cublaslt"):
            for v in ("gemm", "quant"):
                assert r[f"{n}_{v}_why"] == "" and r[f"{n}_{v}_us"] > 0 and r[f"{n}_{v}_err"] < fg.TOL, (n, v, r)
                assert r[f"{n}_{v}_timing"] == "graph"
        assert r["cublaslt_t_gemm_why"] == r["cublaslt_t_quant_why"] == "" and r["cublaslt_t_quant_us"] > 0
        assert r["cublaslt_t_gemm_err"] < fg.QUANT_TOL and r["cublaslt_t_quant_err"] < fg.QUANT_TOL
    assert [(s["rows"], s["mix"]) for s in report["summary"]] == [(m, v) for m in (1, 5, 32) for v in fg.MIXES]
    assert all(0 < s["best_over_ours"] <= 1 and s["vllm_over_ours"] is None for s in report["summary"])
    assert all(isinstance(s["cublaslt_t_over_ours"], float) for s in report["summary"])
    tables = (tmp_path / "fg.md").read_text().strip()
    assert out.rstrip().endswith(tables) and f"vLLM: not measured: {why}" in tables.splitlines()[0]


def test_dry_run_with_a_stand_in_vllm(tmp_path: Path) -> None:
    """A vllm laid out as 0.26's, from --vllm-path: its cutlass_scaled_mm gets the layer as we lay it out (its
    checks of 0.26's layout pass) and its quantizer the bf16 rows; both calls agree with the reference, are timed."""
    out, report = dry_run(tmp_path, site(tmp_path / "site"))
    assert report["candidates"]["vllm"] == {"label": "vLLM", "version": "0.26.0-fake: cutlass_scaled_mm", "why": None}
    assert "vLLM: 0.26.0-fake: cutlass_scaled_mm" in out
    assert report["candidates"]["vllm_t"] == {"label": "vLLM tensor", "version": "0.26.0-fake: cutlass_scaled_mm, "
                                              "scalar scales", "why": None}
    for r in report["rows"]:
        for v in ("gemm", "quant"):
            assert r[f"vllm_{v}_why"] == "" and r[f"vllm_{v}_over_ours"] > 0, r
            assert r[f"vllm_{v}_err"] < (fg.TOL if v == "gemm" else fg.QUANT_TOL)
            assert r[f"vllm_t_{v}_why"] == "" and r[f"vllm_t_{v}_over_ours"] > 0 and r[f"vllm_t_{v}_err"] < fg.QUANT_TOL
    assert all(isinstance(s["vllm_over_ours"], float) for s in report["summary"])
    assert all(isinstance(s["vllm_t_over_ours"], float) for s in report["summary"])
    assert "| ours us | cuBLASLt us | vLLM us | FlashInfer us | cuBLASLt tensor us | vLLM tensor us |" in out


def test_tensor_wise_candidates_share_one_scale() -> None:
    """The tensor-wise calls: the rows re-quantized with one scale ([1, 1], the largest row's amax over fp8's max),
    the weight with one ([1]); the GEMM is the float32 product of exactly those operands (not ours' per-channel
    numbers), and within QUANT_TOL of the per-token reference, as the script checks before timing."""
    from bench import fp8_gemm_kernels as fk
    g = torch.Generator().manual_seed(3)
    layer = fg.make_layer(48, 64, "cpu", g)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    x[2] *= 8  # one outlier row: every row's scale follows it
    x8, sx = fg.quantizer("cpu")(x)
    a, s = fk.tensor_rows(x8, sx)
    assert a.dtype == x8.dtype and tuple(s.shape) == (1, 1)
    assert float(s) == pytest.approx(float((x8.float() * sx).abs().amax()) / torch.finfo(x8.dtype).max)
    w8, sw = fk.tensor_weight(layer)
    assert w8.shape == layer.weight.shape and tuple(sw.shape) == (1,)
    gemm, quantized, prepare = fk.cublaslt_tensor("cpu").bind(layer)
    assert prepare is fk.tensor_rows
    got = gemm(a, s).float()
    own = (a.float() * s) @ (w8.float() * sw).t()
    assert float((got - own).abs().max() / own.abs().max()) < 1e-2
    want = (x8.float() * sx) @ layer.dequantized().t()
    for out in (got, quantized(x).float()):
        assert float((out - want).abs().max() / want.abs().max()) < fg.QUANT_TOL
