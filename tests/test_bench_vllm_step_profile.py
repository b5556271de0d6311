"""bench/vllm_step_profile.py on CPU: vLLM's kernel names land in our categories, a request's device span and gaps
come from its kernels, the rows and the side-by-side comparison with a fused_step_profile report add up."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bench_module import load_bench
from torch.profiler import ProfilerActivity, profile, record_function

vsp = load_bench("vllm_step_profile")
step_profile = load_bench("step_profile")
REPORT_70B = Path(__file__).resolve().parents[1] / "bench/results/h200_1201b/fused_step_profile_70b_fp8.json"
VLLM_API = Path(__file__).resolve().parent / "data/vllm_0_26_python_api.json"  # names read from the 0.26.0 wheel


@pytest.mark.parametrize(("name", "cat"), [
    # vLLM 0.26: CUTLASS GEMMs, FA3 (a cutlass::device_kernel too), its CUDA ops, torch.compile's Triton kernels
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
     "cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedPingpong", "gemm"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
     "<2, cute::tuple<cute::C<1>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>",
     "kv write"),
    ("kernel_unified_attention_2d", "attention"),
    ("triton_red_fused__to_copy_abs_add_clamp_max_mean_mul_pow_reciprocal_rsqrt_3", "rmsnorm"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1", "rmsnorm"),
    ("triton_red_fused__to_copy_abs_clamp_max_mul_reciprocal_silu_slice_4", "silu-and-mul"),
    ("triton_red_fused__to_copy_abs_clamp_div_max_mul_reciprocal_5", "act quant"),
    ("triton_poi_fused_add_cat_index_select_mul_split_with_sizes_sub_2", "rope"),
    ("triton_poi_fused_add_0", "elementwise"),
    ("triton_poi_fused_embedding_0", "elementwise"),
    ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn, false>", "act quant"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>", "rmsnorm"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "rmsnorm"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>", "silu-and-mul"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rope"),
    # ours (bench/results/h200_1201b/fused_step_profile_70b_fp8.md): the same categories as before
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "gemm"),
    ("_prefill_kernel", "attention"),
    ("_rope_write_kernel", "rope"),
    ("_write_kv_kernel", "kv write"),
    ("_rms_norm_fp8_kernel", "rmsnorm"),
    ("_silu_and_mul_fp8_kernel", "silu-and-mul"),
    ("_quantize_tokens_kernel", "act quant"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, ", "elementwise"),
    ("Memset (Device)", "other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
])
def test_kernel_names_land_in_their_category(name: str, cat: str) -> None:
    assert step_profile.category(name) == cat


def test_kernel_times_leave_out_annotations_and_host_events() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="nvjet_sm90_tst_256x8", device_type=cuda, device_time=2000.0,
                              is_user_annotation=False)] * 2
    events += [SimpleNamespace(name="## Call CompiledFxGraph f3k ##", device_type=cuda, device_time=5000.0,
                               is_user_annotation=True),
               SimpleNamespace(name="aten::mm", device_type=cpu, device_time=0.0, is_user_annotation=False),
               SimpleNamespace(name="triton_red_fused__to_copy_abs_clamp_div_max_mul_reciprocal_5", device_type=cuda,
                               device_time=500.0, is_user_annotation=False)]
    prof = SimpleNamespace(events=lambda: events)
    cats, top = step_profile.kernel_times(prof, steps=2)
    assert cats == {"gemm": pytest.approx(2.0), "act quant": pytest.approx(0.25)}
    assert list(top) == ["nvjet_sm90_tst_256x8", "triton_red_fused__to_copy_abs_clamp_div_max_mul_reciprocal_5"]
    _, top = step_profile.kernel_times(prof, steps=2, top=1, name_chars=5)
    assert top == {"nvjet": pytest.approx(2.0)}


def test_the_request_windows_are_the_marked_ranges_of_a_real_profile() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function(vsp.MARK):
                torch.ones(64).sum()
        with record_function("something else"):
            torch.ones(64).sum()
    w = vsp.request_windows(prof)
    assert len(w) == 2 and all(s < e for s, e in w) and w[0][1] <= w[1][0]


def test_a_requests_span_and_busy_time_count_overlaps_once() -> None:
    windows = [(0.0, 100.0), (200.0, 300.0), (400.0, 500.0)]
    kernels = [(10.0, 30.0), (20.0, 40.0), (12.0, 25.0), (50.0, 60.0), (210.0, 250.0), (150.0, 160.0), (305.0, 310.0)]
    assert vsp.step_spans(windows, kernels) == [(pytest.approx(0.05), pytest.approx(0.04)),
                                                (pytest.approx(0.04), pytest.approx(0.04))]


def row(tokens: int, wall: list[float], cats: dict[str, float], spans: list[tuple[float, float]],
        batched: int = 8192) -> dict[str, Any]:
    return vsp.vllm_row(tokens, batched, wall, cats, {"void cutlass::device_kernel<x>": cats.get("gemm", 0.0)}, spans)


def test_a_row_gives_the_request_the_device_and_the_host() -> None:
    r = row(4096, [460.0, 455.0, 470.0], {"gemm": 390.0, "attention": 40.0},
            [(450.0, 440.0), (452.0, 441.0), (449.0, 442.0)])
    assert (r["ms"], r["min_ms"], r["max_ms"], r["device_ms"], r["gaps_ms"], r["host_ms"]) == (
        460.0, 455.0, 470.0, 450.0, 10.0, 10.0)
    assert r["tokens_per_s"] == pytest.approx(8904.35, abs=0.01) and r["device_tokens_per_s"] == pytest.approx(
        9102.22, abs=0.01)
    assert r["engine_steps"] == 1 and row(4096, [1.0], {}, [(1.0, 1.0)], batched=1024)["engine_steps"] == 4
    alone = row(4096, [460.0], {"gemm": 390.0, "attention": 40.0}, [])  # no window seen: the kernels' sum
    assert (alone["device_ms"], alone["gaps_ms"], alone["host_ms"]) == (430.0, 0.0, 30.0)
    line = vsp.table([r], ["gemm", "attention", "rope"]).splitlines()[2]
    assert line == ("| 4096 | 1 | 460.00 (455.00-470.00) | 8,904 | 450.00 | 9,102 | 390.00 | 40.00 | 0.00 | 10.00 "
                    "| 10.00 |")


def test_an_older_report_of_ours_has_its_quantization_moved_out_of_other() -> None:
    cats = {"gemm": 400.0, "other": 5.0}
    out, moved = vsp.rebinned(cats, {"nvjet_sm90_x": 400.0, "_quantize_tokens_kernel": 3.0, "Memset (Device)": 2.0})
    assert out == {"gemm": 400.0, "other": pytest.approx(2.0), "act quant": 3.0}
    assert moved == ["`_quantize_tokens_kernel` -> act quant"]
    assert vsp.rebinned({"gemm": 1.0, "other": 1.0}, {"_quantize_tokens_kernel": 3.0})[0] == {"gemm": 1.0, "other": 1.0}
    assert vsp.rebinned({"act quant": 3.0, "other": 1.0}, {"_quantize_tokens_kernel": 3.0})[1] == []
    # the 70B fp8 report of 2026-12-01: 3.25 of its 3.61 ms of 'other' a 4096-token step was the quantization
    shape = json.loads(REPORT_70B.read_text())["shapes"][4]
    assert shape["label"] == "rows 0, chunk 4096"
    out, _ = vsp.rebinned(shape["categories_ms"], shape["top_kernels_ms"])
    assert out["act quant"] == pytest.approx(3.2500063)
    assert out["elementwise"] == pytest.approx(0.0347733 + 0.0044697)
    assert out["other"] == pytest.approx(3.6119537 - 3.2500063 - 0.0347733 - 0.0044697)
    assert sum(out.values()) == pytest.approx(sum(shape["categories_ms"].values()))


OURS = {"model": "preset:llama-3.1-70b", "weights": "fp8", "backend": "fa3", "date": "2026-12-01T06:36+00:00",
        "shapes": [
            {"label": "rows 0, chunk 4096", "rows": 0, "context": 0, "chunk": 4096, "prefix": 0, "ms": 500.0,
             "categories_ms": {"gemm": 400.0, "attention": 70.0, "rmsnorm": 10.0, "other": 5.0},
             "top_kernels_ms": {"nvjet_sm90_x": 400.0, "_quantize_tokens_kernel": 3.0, "Memset (Device)": 2.0},
             "gaps_ms": 15.0},
            {"label": "rows 1 x 4097, chunk 4096", "rows": 1, "context": 4097, "chunk": 4096, "prefix": 0,
             "ms": 530.0, "categories_ms": {"gemm": 420.0}, "top_kernels_ms": {}, "gaps_ms": 0.0},
            {"label": "rows 0, chunk 1296 after 1616", "rows": 0, "context": 0, "chunk": 1296, "prefix": 1616,
             "ms": 200.0, "categories_ms": {"gemm": 150.0}, "top_kernels_ms": {}, "gaps_ms": 0.0}]}
VLLM_4096 = {"cats": {"gemm": 390.0, "attention": 40.0, "rmsnorm": 8.0, "act quant": 2.0, "other": 1.0},
             "spans": [(450.0, 441.0)] * 3, "wall": [460.0, 458.0, 463.0]}


def vllm_rows() -> list[dict[str, Any]]:
    return [row(4096, VLLM_4096["wall"], VLLM_4096["cats"], VLLM_4096["spans"]),
            row(8192, [990.0], {"gemm": 800.0}, [(960.0, 950.0)])]


def test_the_comparison_apportions_the_steps_difference() -> None:
    cmp = vsp.compare(OURS, vllm_rows(), vsp.CATS)
    assert [c["prompt_tokens"] for c in cmp] == [4096]  # 8192 is not in ours; its rows with decode or a prefix not
    c = cmp[0]
    got = {i["item"]: (i["ours_ms"], i["vllm_ms"], i["diff_ms"], i["share"]) for i in c["items"]}
    assert list(got) == ["step", "attention", "rmsnorm", "gemm", "act quant", "other", "gaps"]
    assert got["step"] == (500.0, 450.0, 50.0, 1.0)
    assert got["attention"] == (70.0, 40.0, 30.0, pytest.approx(0.6))
    assert got["gemm"] == (400.0, 390.0, 10.0, pytest.approx(0.2))
    assert got["act quant"] == (3.0, 2.0, 1.0, pytest.approx(0.02))  # ours moved out of 'other'
    assert got["other"] == (pytest.approx(2.0), 1.0, pytest.approx(1.0), pytest.approx(0.02))
    assert got["gaps"] == (15.0, 9.0, 6.0, pytest.approx(0.12))
    assert sum(v[2] for k, v in got.items() if k != "step") == pytest.approx(got["step"][2])  # it all adds up
    assert c["ours_tokens_per_s"] == pytest.approx(8192.0) and c["vllm_tokens_per_s"] == pytest.approx(9102.22, 1e-5)
    text = vsp.compare_table(cmp, "ours.json", [4096])
    assert text.startswith("### 4096 prompt tokens: ours 8,192 tokens/s, vLLM 9,102 (device ms; the request 460.00 "
                           "ms), vLLM/ours 1.11x")
    assert "| attention | 70.00 | 40.00 | +30.00 | 60% |" in text
    assert "| step | 500.00 | 450.00 | +50.00 | 100% |" in text
    assert "moved out of 'other' (ours.json predates their category): `_quantize_tokens_kernel` -> act quant" in text
    assert vsp.compare_table([], "ours.json", [512, 4096]) == (
        "No prompt length of this run is a chunk alone in ours.json (its: 512, 4096).")


def test_main_writes_the_tables_from_an_earlier_run_without_a_gpu(tmp_path: Path, capsys: Any) -> None:
    rows = vllm_rows()
    rows[1]["top_kernels_ms"] = {f"triton_poi_fused_add_{i}": 12.0 - i for i in range(12)}  # the JSON keeps 25
    earlier = {"args": {}, "vllm": "0.26.0", "gpu": "NVIDIA H200", "preset": "llama-3.1-70b", "weights": "fp8",
               "max_num_batched_tokens": 8192, "max_model_len": 8193, "rows": rows}
    (tmp_path / "v.json").write_text(json.dumps(earlier))
    (tmp_path / "ours.json").write_text(json.dumps(OURS))
    out = tmp_path / "out"
    assert vsp.main(["--vllm-report", str(tmp_path / "v.json"), "--compare", str(tmp_path / "ours.json"),
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.index("| prompt tokens |") < printed.index("### 4096 prompt tokens")  # the comparison last
    assert "| gaps | 15.00 | 9.00 | +6.00 | 12% |" in printed
    assert "- 3.000 `triton_poi_fused_add_9` (elementwise)\n\n" in printed and "fused_add_10" not in printed  # 10
    assert "# vLLM 0.26.0's prefill by kernel category: llama-3.1-70b fp8 on NVIDIA H200" in printed
    written = json.loads((out / "vllm_step_profile.json").read_text())
    assert list(written) == ["args", "vllm", "gpu", "preset", "weights", "max_num_batched_tokens", "max_model_len",
                             "compared_with", "compare", "rows"]
    assert written["compare"][0]["items"][0] == {"item": "step", "ours_ms": 500.0, "vllm_ms": 450.0, "diff_ms": 50.0,
                                                 "share": 1.0}
    assert [r["prompt_tokens"] for r in written["rows"]] == [4096, 8192]
    assert "| 70.00 | 40.00 | +30.00 | 60% |" in (out / "vllm_step_profile.md").read_text()
    assert "step: device ms (ours timed back to back)" in printed  # OURS has no idle_ms: fused_step_profile's default


@pytest.mark.parametrize("ours, said", [({}, "ours timed back to back"), ({"idle_ms": 0.0}, "ours timed back to back"),
                                        ({"idle_ms": 40.0}, "ours each after 40 ms idle, as vLLM's requests")])
def test_the_comparison_says_how_ours_were_timed(ours: dict[str, Any], said: str) -> None:
    assert vsp.ours_timing(ours) == said


def test_the_model_folder_must_declare_what_was_asked(tmp_path: Path) -> None:
    make_peer_model = load_bench("make_peer_model")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SystemExit, match="declares no quantization; --fp8 needs an FP8_DYNAMIC folder"):
        vsp.model_folder("llama-3.1-70b", True, str(tmp_path))
    assert vsp.model_folder("llama-3.1-70b", False, str(tmp_path)) == str(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": make_peer_model.FP8_DYNAMIC}))
    assert vsp.model_folder("llama-3.1-70b", True, str(tmp_path)) == str(tmp_path)
    with pytest.raises(SystemExit, match="declares fp8-dynamic; give --fp8"):
        vsp.model_folder("llama-3.1-70b", False, str(tmp_path))


def test_the_vllm_arguments_are_vllm_0_26s() -> None:
    api = json.loads(VLLM_API.read_text())
    assert api["vllm_version"] == "0.26.0"
    a = argparse.Namespace(gpu_memory_utilization=0.8, max_num_batched_tokens=8192)
    kwargs = vsp.llm_kwargs("/root/peermodel-llama-3.1-70b-fp8", a, 8193)
    assert set(kwargs) <= set(api["llm_init"]) | set(api["engine_args"])  # LLM passes the rest to EngineArgs
    assert api["engine_args"]["enable_prefix_caching"] is None  # None: on for a model that can; so False is given
    assert "enforce_eager" not in kwargs and api["llm_init"]["enforce_eager"] is False  # compiled graphs, the default
    assert set(vsp.SAMPLING) <= set(api["sampling_params"]) and api["sampling_params"]["max_tokens"] == 16
    assert set(vsp.GENERATE) <= set(api["generate"])
    assert "prompt_token_ids" in api["prompt_keys"]["TokensPrompt"]


class StandInLLM:
    """vllm.LLM as measure() uses it: its arguments, its vocabulary, the prompts it is given."""

    made: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.made.append(kwargs)
        self.prompts: list[list[int]] = []
        self.model_config = SimpleNamespace(get_vocab_size=lambda: 1000)
        StandInLLM.last = self

    def generate(self, prompts: list[dict[str, Any]], params: Any, use_tqdm: bool = True) -> list[Any]:
        assert params == {"max_tokens": 1, "ignore_eos": True} and use_tqdm is False
        self.prompts += [p["prompt_token_ids"] for p in prompts]
        torch.ones(8).sum()
        return []


def test_measure_runs_the_requests_through_a_stand_in_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_peer_model = load_bench("make_peer_model")
    gpu_timing = load_bench("gpu_timing")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": make_peer_model.FP8_DYNAMIC}))
    fake = SimpleNamespace(__version__="0.26.0", LLM=StandInLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", SimpleNamespace(TokensPrompt=lambda **kw: kw))
    for k in vsp.VLLM_ENV:
        monkeypatch.setenv(k, "1")  # restored after; the in-process engine is forced, the rest left as set
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    timed: list[int] = []

    def timer(fn: Any, reps: int) -> list[float]:
        for _ in range(reps + 1):  # a warm-up, then the timed calls
            fn()
        timed.append(reps)
        return [10.0, 12.0, 11.0][:reps]

    monkeypatch.setattr(gpu_timing, "time_ms", timer)
    a = argparse.Namespace(preset="llama-3.1-70b", fp8=True, model_dir=str(tmp_path), steps=3, max_model_len=8192,
                           max_num_batched_tokens=96, gpu_memory_utilization=0.8)
    meta, rows = vsp.measure(a, [64, 128])
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["HF_HUB_OFFLINE"] == "1"
    assert StandInLLM.made[-1] == vsp.llm_kwargs(str(tmp_path), a, 8192)
    assert [len(p) for p in StandInLLM.last.prompts] == [64] * 7 + [128] * 7  # 1 + 3 timed, 3 profiled, each length
    assert max(max(p) for p in StandInLLM.last.prompts) < 1000 and timed == [3, 3]
    assert [(r["prompt_tokens"], r["engine_steps"], r["ms"], r["min_ms"]) for r in rows] == [(64, 1, 11.0, 10.0),
                                                                                           (128, 2, 11.0, 10.0)]
    assert (meta["vllm"], meta["weights"], meta["max_model_len"], meta["gpu"]) == ("0.26.0", "fp8", 8192, "stand-in")
