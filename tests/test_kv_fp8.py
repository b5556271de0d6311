"""The fp8 KV cache's settings, checkpoint scales, pool and profiles (issue 39), on CPU:

- `--kv-cache-dtype` / `LLM(kv_cache_dtype=...)`: auto, fp8, fp8_e4m3 and the model's dtype by name served, vLLM's
  other values refused by name; auto turns fp8 on for a checkpoint that declares a kv_cache_scheme; a GPU without
  fp8 (mocked) is refused before anything loads;
- a checkpoint's k/v scales under every name vLLM reads, checked (shape, dtype, positive finite, every layer) and
  refused naming the tensor; the layers hold them (doubled for ROCm's e4m3fnuz);
- the pool: fp8 elements, twice the tokens of bf16 (four times fp32's) in the same memory; shared with an attached
  process with its dtype checked; moved between disagg pools bit for bit;
- profiles: a profile of fp8 weights or an fp8 KV cache is another file and another variant, refused for the other;
  the roofline reads fp8 KV at one byte an element."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidserve import LLM
from rapidserve.config import CacheConfig, ModelConfig
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import resolve_kv_cache
from rapidserve.engine_settings import check_unsupported_options
from rapidserve.kv_pool import KVPoolSpec, check_fp8_kv_device, kv_cache_dtype, num_blocks_for_budget
from rapidserve.llm import build_engine_config
from rapidserve.loader import ModelLoadError, UnsupportedQuantization, resolve_model
from rapidserve.quant_config import KVScales
from tests.test_quantized_checkpoints import write_folder

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KV_ONLY = {"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": KV_SCHEME}
ATTN = "model.layers.0.self_attn"


# ------------------------------------------------------------------------------------------------ the flag
@pytest.mark.parametrize(("value", "want"), [(None, "auto"), ("auto", "auto"), ("fp8", "fp8"), (" FP8_E4M3 ", "fp8"),
                                             ("bfloat16", "bfloat16"), ("float32", "float32")])
def test_kv_cache_dtype_values_served(value: str | None, want: str) -> None:
    assert check_unsupported_options(None, value) == (None, want)


@pytest.mark.parametrize(("value", "needle"), [
    ("fp8_e5m2", "e5m2 (no scales, 2 mantissa bits) is not built here: use fp8"),
    ("fp8_inc", "Intel Gaudi's fp8 cache"), ("fp8_ds_mla", "no MLA models here"), ("int8", "int8 cache"),
    ("half", "not a KV cache dtype; use one of auto, fp8, fp8_e4m3, bfloat16, float16, float32"),
])
def test_other_kv_cache_dtypes_are_refused_by_name(value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype") as e:
        check_unsupported_options(None, value)
    assert needle in str(e.value) and f"kv_cache_dtype={value!r}" in str(e.value)


def test_the_cache_section_checks_itself() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp16'; use one of auto, fp8"):
        CacheConfig(kv_cache_dtype="fp16")
    scales = KVScales(((0.5, 0.25),))
    with pytest.raises(ConfigError, match="kv_scales are the fp8 KV cache's"):
        CacheConfig(kv_scales=scales)
    assert CacheConfig(kv_cache_dtype="fp8").layer_kv_scales(3) == ((1.0, 1.0),) * 3
    assert CacheConfig(kv_cache_dtype="fp8", kv_scales=scales).layer_kv_scales(1) == ((0.5, 0.25),)
    for bad in ((0.0, 1.0), (1.0, -2.0), (math.inf, 1.0), (math.nan, 1.0)):
        with pytest.raises(ValueError, match="layer 0's kv scales"):
            KVScales((bad,))
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", kv_cache_dtype="fp8")
    layers = cfg.model_config.num_layers
    with pytest.raises(ConfigError, match=f"kv_scales has {layers + 1} layers' scales, the model {layers} layers"):
        dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_scales=KVScales(((1.0, 1.0),) * (layers + 1))))


class Source:
    """The two fields of a ModelSource that resolve_kv_cache reads."""

    def __init__(self, scheme: bool = False, scales: KVScales | None = None) -> None:
        self.kv_cache_scheme, self.kv_scales = scheme, scales


CPU = torch.device("cpu")
CAL = KVScales(((0.5, 0.25),))


@pytest.mark.parametrize(("flag", "scheme", "scales", "want"), [
    ("auto", False, None, ("auto", None)),
    ("auto", False, CAL, ("auto", None)),  # undeclared scales: logged, the cache stays float
    ("auto", True, CAL, ("fp8", CAL)),  # the checkpoint's kv_cache_scheme, as vLLM resolves auto
    ("auto", True, None, ("fp8", None)),  # --load-format dummy of such a checkpoint: uncalibrated
    ("fp8", False, None, ("fp8", None)),
    ("fp8", False, CAL, ("fp8", CAL)),
    ("float32", True, CAL, ("auto", None)),  # the model's dtype by name: unquantized, the scheme not used
])
def test_resolve_kv_cache(flag: str, scheme: bool, scales: KVScales | None, want: tuple[str, Any]) -> None:
    cache = resolve_kv_cache(flag, Source(scheme, scales), torch.float32, CPU, CacheConfig())  # type: ignore[arg-type]
    assert (cache.kv_cache_dtype, cache.kv_scales) == want


def test_a_float_name_must_be_the_models_dtype() -> None:
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype bfloat16: the model computes in float32 \(--dtype\)"):
        resolve_kv_cache("bfloat16", Source(), torch.float32, CPU, CacheConfig())  # type: ignore[arg-type]


def test_uncalibrated_fp8_warns_how_to_calibrate(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="rapidserve.config"):
        build_engine_config("preset:tiny-llama", device="cpu", kv_cache_dtype="fp8")
    [rec] = [r for r in caplog.records if "KV cache" in r.message]
    assert "uncalibrated scales" in rec.message and "accuracy may drop" in rec.message
    assert "llm-compressor's kv_cache_scheme" in rec.message


class FakeGpu:
    """torch.cuda as an sm_80 GPU (an A100): no fp8."""

    def __init__(self, mp: pytest.MonkeyPatch, capability: tuple[int, int] = (8, 0)) -> None:
        import rapidserve.ops.fp8 as fp8

        mp.setattr(fp8, "fp8_supported", lambda dev: torch.device(dev).type == "cuda" and capability >= (8, 9))
        mp.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        mp.setattr(torch.version, "hip", None)


def test_a_gpu_without_fp8_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeGpu(monkeypatch)
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8: NVIDIA A100-SXM4-80GB has compute capability 8\.0, "
                                          r"and an fp8 KV cache needs fp8 support \(NVIDIA compute capability 8\.9"):
        check_fp8_kv_device(gpu)
    with pytest.raises(ConfigError, match="use --kv-cache-dtype auto"):
        resolve_kv_cache("fp8", Source(), torch.bfloat16, gpu, CacheConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"the checkpoint's kv_cache_scheme asks for an fp8 KV cache .*use "
                                          r"--kv-cache-dtype bfloat16 to keep the cache unquantized"):
        resolve_kv_cache("auto", Source(scheme=True), torch.bfloat16, gpu, CacheConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compute capability 8.0"):  # the runner's own check, before the model
        kv_cache_dtype(CacheConfig(kv_cache_dtype="fp8"), torch.bfloat16, gpu)
    assert kv_cache_dtype(CacheConfig(), torch.bfloat16, gpu) == torch.bfloat16  # auto: nothing asked of the GPU
    check_fp8_kv_device(CPU)  # the CPU stores fp8 as it is


def test_a_gpu_with_fp8_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeGpu(monkeypatch, (9, 0))
    monkeypatch.setattr("rapidserve.kv_pool.fp8_dtype", lambda device: torch.float8_e4m3fn)
    gpu = torch.device("cuda", 0)
    assert kv_cache_dtype(CacheConfig(kv_cache_dtype="fp8"), torch.bfloat16, gpu) == torch.float8_e4m3fn
    assert resolve_kv_cache("fp8", Source(), torch.bfloat16, gpu, CacheConfig()).fp8_kv  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------- checkpoint scales
def kv_tensors(names: dict[str, float], shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    def edit(t: dict[str, torch.Tensor]) -> None:
        for name, value in names.items():
            t[name] = torch.full(shape, value, dtype=dtype)
    return edit


@pytest.mark.parametrize("names", [
    {f"{ATTN}.k_scale": 0.5, f"{ATTN}.v_scale": 0.25},  # llm-compressor, vLLM's fp8 checkpoints
    {f"{ATTN}.k_proj.k_scale": 0.5, f"{ATTN}.v_proj.v_scale": 0.25},  # ModelOpt
    {f"{ATTN}.k_proj.output_scale": 0.5, f"{ATTN}.v_proj.output_scale": 0.25},  # older compressed-tensors
], ids=["k_scale", "modelopt", "output_scale"])
def test_checkpoint_scales_are_read_under_every_name(names: dict[str, float], tmp_path: Path) -> None:
    folder = write_folder(tmp_path, quant=KV_ONLY, edit=kv_tensors(names))
    source = resolve_model(folder)
    assert source.quantization is None and source.kv_cache_scheme  # float weights, an fp8 cache declared
    assert source.kv_scales is not None and source.kv_scales.scales == ((0.5, 0.25),)
    assert all(n not in dict(source.weights()) for n in names)  # never in the weight stream
    cfg, _ = build_engine_config(folder, device="cpu")
    assert cfg.cache.kv_cache_dtype == "fp8" and cfg.cache.kv_scales == source.kv_scales


def test_one_kv_scale_serves_both(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, quant=KV_ONLY, edit=kv_tensors({f"{ATTN}.kv_scale": 0.75}, (1,), torch.bfloat16))
    assert resolve_model(folder).kv_scales.scales == ((0.75, 0.75),)  # type: ignore[union-attr]


def test_undeclared_scales_are_read_and_used_with_fp8_only(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, edit=kv_tensors({f"{ATTN}.k_scale": 0.5, f"{ATTN}.v_scale": 0.25}))
    assert not resolve_model(folder).kv_cache_scheme
    assert build_engine_config(folder, device="cpu")[0].cache.kv_cache_dtype == "auto"
    cache = build_engine_config(folder, device="cpu", kv_cache_dtype="fp8")[0].cache
    assert cache.kv_scales is not None and cache.kv_scales.scales == ((0.5, 0.25),)


GOOD = {f"{ATTN}.k_scale": 0.5, f"{ATTN}.v_scale": 0.25}
BAD: dict[str, tuple[Any, type[Exception], str]] = {
    "zero": (kv_tensors({**GOOD, f"{ATTN}.v_scale": 0.0}), ModelLoadError,
             f"tensor {ATTN}.v_scale is 0.0: a KV cache scale must be a positive finite number"),
    "negative": (kv_tensors({**GOOD, f"{ATTN}.k_scale": -1.0}), ModelLoadError, f"tensor {ATTN}.k_scale is -1.0"),
    "inf": (kv_tensors({**GOOD, f"{ATTN}.k_scale": math.inf}), ModelLoadError, f"tensor {ATTN}.k_scale is inf"),
    "nan": (kv_tensors({**GOOD, f"{ATTN}.v_scale": math.nan}), ModelLoadError, f"tensor {ATTN}.v_scale is nan"),
    "per head": (kv_tensors(GOOD, (2,)), ModelLoadError,
                 f"tensor {ATTN}.k_scale has shape [2]: KV cache scales are one per tensor"),
    "int": (kv_tensors(GOOD, (), torch.int32), ModelLoadError, f"tensor {ATTN}.k_scale is stored as I32"),
    "missing v": (kv_tensors({f"{ATTN}.k_scale": 0.5}), ModelLoadError, f"tensor {ATTN}.v_scale is missing: its "
                                                                        "kv_cache_scheme declares an fp8 KV cache"),
    "declared, none": (None, ModelLoadError, f"tensor {ATTN}.k_scale is missing"),
    "twice": (kv_tensors({**GOOD, f"{ATTN}.k_proj.k_scale": 0.5}), ModelLoadError, "both give layer 0's k_scale"),
    "no such layer": (kv_tensors({**GOOD, "model.layers.3.self_attn.k_scale": 0.5}), ModelLoadError,
                      "tensor model.layers.3.self_attn.k_scale is a KV cache scale of layer 3; the model has 1 layers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_scales_are_refused_naming_the_tensor(case: str, tmp_path: Path) -> None:
    edit, error, needle = BAD[case]
    folder = write_folder(tmp_path, quant=KV_ONLY, edit=edit)
    with pytest.raises(error) as e:
        resolve_model(folder)
    assert needle in str(e.value), str(e.value)


def test_dummy_weights_of_a_declared_checkpoint_take_fp8_uncalibrated(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, quant=KV_ONLY, edit=kv_tensors(GOOD))
    cfg, _ = build_engine_config(folder, device="cpu", load_format="dummy")
    assert cfg.cache.kv_cache_dtype == "fp8" and cfg.cache.kv_scales is None


def test_a_scheme_not_served_is_refused_by_name(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, quant={**KV_ONLY, "kv_cache_scheme": {**KV_SCHEME, "dynamic": True}})
    with pytest.raises(UnsupportedQuantization, match="its kv_cache_scheme is dynamic"):
        resolve_model(folder)


# ------------------------------------------------------------------------------------------------ the pool
def test_capacity_doubles_at_the_same_memory() -> None:
    spec = {"num_layers": 4, "num_blocks": 1, "num_kv_heads": 8, "block_size": 16, "head_dim": 128}
    bf16, fp8 = KVPoolSpec(**spec, dtype=torch.bfloat16), KVPoolSpec(**spec, dtype=torch.float8_e4m3fn)
    assert bf16.bytes_per_block == 2 * fp8.bytes_per_block
    budget = 10 * 2**30
    assert (num_blocks_for_budget(budget, fp8.bytes_per_block, 16, 4096)
            == 2 * num_blocks_for_budget(budget, bf16.bytes_per_block, 16, 4096))


@pytest.mark.parametrize(("dtype", "factor"), [("bfloat16", 2), ("float32", 4)])
def test_the_runner_allocates_fp8_with_more_blocks(dtype: str, factor: int) -> None:
    kw: dict[str, Any] = {"device": "cpu", "dtype": dtype, "show_progress": False, "max_model_len": 256}
    plain, fp8 = LLM("preset:tiny-qwen3", **kw), LLM("preset:tiny-qwen3", kv_cache_dtype="fp8", **kw)
    a, b = plain.engine.runner, fp8.engine.runner
    assert a.kv_pool.tensor.dtype == getattr(torch, dtype) and b.kv_pool.tensor.dtype == torch.float8_e4m3fn
    # the CPU pool's fixed byte budget (cpu_kv_bytes), in whole blocks of each size
    budget = plain.config.cache.cpu_kv_bytes
    assert b.kv_pool.num_blocks == budget // b.kv_pool.spec.bytes_per_block
    assert a.kv_pool.spec.bytes_per_block == factor * b.kv_pool.spec.bytes_per_block
    assert factor * a.kv_pool.num_blocks <= b.kv_pool.num_blocks < factor * (a.kv_pool.num_blocks + 1)
    assert b.limits.context_cap >= a.limits.context_cap
    for layer in b.model.layers:
        assert layer.k_scale.dtype == torch.float32 and float(layer.k_scale) == float(layer.v_scale) == 1.0
    assert all(layer.k_scale is None for layer in a.model.layers)
    assert a.block_manager().salt != b.block_manager().salt  # the prefix cache's hashes differ with the K/V


def test_fnuz_pools_double_the_scales() -> None:
    from rapidserve.attention import get_attention_backend
    from rapidserve.models.transformer import CausalLM
    from rapidserve.ops import get_ops

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    meta = torch.device("meta")
    for kv_dtype, factor in ((torch.float8_e4m3fn, 1.0), (torch.float8_e4m3fnuz, 2.0)):
        m = CausalLM(cfg, get_ops(CPU), get_attention_backend("torch", CPU), torch.float32, CPU, kv_dtype=kv_dtype,
                     kv_scales=[(0.5, 0.25), (1.0, 2.0)])
        assert [(float(x.k_scale), float(x.v_scale)) for x in m.layers] == [(0.5 * factor, 0.25 * factor),
                                                                           (factor, 2 * factor)]
    with pytest.raises(ValueError, match="2 layers' kv scales for 2 layers|1 layers' kv scales for 2 layers"):
        CausalLM(cfg, get_ops(CPU), get_attention_backend("torch", CPU), torch.float32, meta,
                 kv_dtype=torch.float8_e4m3fn, kv_scales=[(1.0, 1.0)])
    with pytest.raises(ValueError, match="kv_scales are an fp8 KV cache's"):
        CausalLM(cfg, get_ops(CPU), get_attention_backend("torch", CPU), torch.float32, meta, kv_scales=[(1.0, 1.0)])


def test_an_attached_process_gets_the_pools_dtype_and_the_scales() -> None:
    from rapidserve.runner import ModelRunner
    from rapidserve.runner.inputs import PrefillItem
    from rapidserve.runner.model_sharing import SharedStateError, attach_model, export_shared

    cfg, source = build_engine_config("preset:tiny-llama", device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16,
                                      enforce_eager=True)
    runner = ModelRunner(cfg, source, show_progress=False)
    state = export_shared(runner.model, runner.kv_pool)
    assert state.kv.dtype == torch.float8_e4m3fn and "layers.0.k_scale" in state.params
    args = (cfg.model_config, runner.ops, runner.attn, runner.dtype, runner.device, max(cfg.max_model_len, 1), state)
    layers = cfg.model_config.num_layers
    model, pool = attach_model(*args, kv_dtype=torch.float8_e4m3fn, kv_scales=cfg.cache.layer_kv_scales(layers))
    assert pool.tensor.data_ptr() == runner.kv_pool.tensor.data_ptr() and pool.tensor.dtype == torch.float8_e4m3fn
    assert model.layers[1].k_scale.data_ptr() == runner.model.layers[1].k_scale.data_ptr()
    with pytest.raises(SharedStateError, match=r"unexpected \['layers.0.k_scale', .*the exporter's KV cache is fp8 "
                                               r"and this one's is not, or the reverse \(--kv-cache-dtype\)"):
        attach_model(*args)  # a worker whose config keeps the cache in float32
    float_pool = dataclasses.replace(state, kv=torch.zeros(state.kv.shape).share_memory_())
    with pytest.raises(SharedStateError, match=r"the KV pool has dtype torch.float32, expected torch.float8_e4m3fn: "
                                               r".*--kv-cache-dtype"):
        attach_model(*args[:-1], float_pool, kv_dtype=torch.float8_e4m3fn, kv_scales=cfg.cache.layer_kv_scales(layers))
    runner.prefill([PrefillItem(list(range(3, 40)), 0, [0, 1, 2])])
    assert runner.kv_pool.tensor[:, :, :3].float().abs().sum() > 0  # written in fp8, through the shared memory


def test_disagg_moves_fp8_blocks_bit_for_bit() -> None:
    from rapidserve.parallel.kv_connector import DevicePeerConnector

    shape = (2, 2, 5, 2, 4, 8)
    local = (torch.randn(shape) * 10).to(torch.float8_e4m3fn)
    remote = torch.zeros((2, 2, 7, 2, 4, 8)).to(torch.float8_e4m3fn)
    c = DevicePeerConnector(local, remote)
    c.push([0, 3], [6, 1]).wait()
    assert torch.equal(remote[:, :, 6].view(torch.uint8), local[:, :, 0].view(torch.uint8))
    assert torch.equal(remote[:, :, 1].view(torch.uint8), local[:, :, 3].view(torch.uint8))
    c.pull([6], [4]).wait()
    assert torch.equal(local[:, :, 4].view(torch.uint8), local[:, :, 0].view(torch.uint8))
    with pytest.raises(ValueError, match="differ in more than their number of blocks"):
        DevicePeerConnector(local, torch.zeros(shape, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------ profiles
def test_profiles_are_keyed_by_the_weights_and_the_kv_cache(tmp_path: Path) -> None:
    from rapidserve.partition.profile import (
        Configuration,
        ProfileError,
        ProfileVariant,
        load_profile,
        profile_filename,
        save_profile,
        variant_of,
    )
    from rapidserve.partition.roofline import Peaks
    from rapidserve.partition.roofline_profile import roofline_profile

    names = {profile_filename("NVIDIA H200", "preset:qwen3-8b", tp, ProfileVariant(q, kv))
             for tp in (1, 2) for q in ("none", "fp8") for kv in ("auto", "fp8")}
    assert len(names) == 8 and "nvidia-h200__preset-qwen3-8b__fp8__kvfp8__tp2.json" in names
    assert profile_filename("NVIDIA H200", "preset:qwen3-8b") == "nvidia-h200__preset-qwen3-8b.json"  # as before
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", kv_cache_dtype="fp8", quantization="fp8")
    assert variant_of(cfg) == ProfileVariant("fp8", "fp8")
    peaks = Peaks(1e15, 3e12, 132)
    args = (cfg.model_config, "H200", "preset:tiny-llama", peaks, [Configuration("overallocated", 0, 132)], [1, 8],
            [512, 4096], 256)
    fp8 = roofline_profile(*args, kv_bytes=1, variant=variant_of(cfg), quant=cfg.quantization)
    plain = roofline_profile(*args)
    assert (fp8.quantization, fp8.kv_cache_dtype) == ("fp8", "fp8") and plain.variant == ProfileVariant()
    with pytest.raises(ValueError, match="variant quantization='fp8' but the weights estimated are float"):
        roofline_profile(*args, kv_bytes=1, variant=variant_of(cfg))  # an fp8 profile is estimated with fp8 weights
    # the KV read halves: decode over 4096 positions gains more with fp8 KV than at no context to speak of (the fp8
    # weights' gain is the same at both)
    by = {(e.batch, e.context): e.decode_ms_alone_p50 for e in fp8.entries}
    base = {(e.batch, e.context): e.decode_ms_alone_p50 for e in plain.entries}
    assert by[(8, 4096)] < base[(8, 4096)] and (base[(8, 4096)] - by[(8, 4096)]) > (base[(8, 512)] - by[(8, 512)])
    path = tmp_path / "p.json"
    save_profile(fp8, path)
    assert load_profile(path, expect_variant=ProfileVariant("fp8", "fp8")).variant == ProfileVariant("fp8", "fp8")
    with pytest.raises(ProfileError, match=r"field `kv_cache_dtype`: the profile measures fp8 weights, an fp8 KV "
                                           r"cache, this run uses fp8 weights, the model dtype KV cache"):
        load_profile(path, expect_variant=ProfileVariant("fp8", "auto"))
    save_profile(plain, path)
    with pytest.raises(ProfileError, match="field `quantization`: the profile measures unquantized weights"):
        load_profile(path, expect_variant=ProfileVariant("fp8", "fp8"))
    raw = path.read_text().replace('"kv_cache_dtype": "auto"', '"kv_cache_dtype": "fp16"')
    path.write_text(raw)
    with pytest.raises(ProfileError, match="field `kv_cache_dtype`: must be one of auto, fp8, got 'fp16'"):
        load_profile(path)


def test_the_roofline_counts_fp8_kv_at_one_byte() -> None:
    from rapidserve.partition.roofline import decode_operators, prefill_operators, totals

    cfg = build_engine_config("preset:qwen3-8b", device="cpu")[0].model_config
    kv = 2 * cfg.num_kv_heads * cfg.head_dim  # K and V of one position, elements
    for ops in (lambda b: decode_operators(cfg, 8, 4096, kv_bytes=b),
                lambda b: prefill_operators(cfg, 512, kv_bytes=b)):
        (_, bf16), (_, fp8) = totals(ops(None)), totals(ops(1))
        assert bf16 > fp8 > 0
    (_, d16), (_, d8) = totals(decode_operators(cfg, 8, 4096)), totals(decode_operators(cfg, 8, 4096, kv_bytes=1))
    # 8 sequences read 4096 positions and write one, in every layer: a byte less per element
    assert d16 - d8 == pytest.approx(cfg.num_layers * kv * 8 * 4097, rel=1e-9)


def test_the_metrics_report_the_cache_dtype() -> None:
    from rapidserve.server.metrics import cache_config_labels

    assert cache_config_labels(CacheConfig(kv_cache_dtype="fp8"), 10)["cache_dtype"] == "fp8"
    assert cache_config_labels(CacheConfig(), 10)["cache_dtype"] == "auto"


@pytest.mark.parametrize("capability,hip,refused", [((8, 0), None, "compute capability 8.0"),
                                                   ((8, 6), None, "compute capability 8.6"),
                                                   ((9, 0), None, None), ((8, 9), None, None),
                                                   ((9, 0), "6.2", "has no fp8")])
def test_fp8_weights_on_a_gpu_without_fp8_are_refused_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                                      capability: tuple[int, int], hip: str | None,
                                                                      refused: str | None) -> None:
    """--quantization fp8, or an FP8 checkpoint, on a GPU without fp8 (an A100, an A10, an MI250): a ConfigError
    naming the GPU and what to do, from the config builder (before any weight is read) and from the runner's own
    check; a GPU with fp8, fp8 off, or the CPU (its reference path): nothing."""
    from rapidserve.config import ParallelConfig
    from rapidserve.config_builder import resolve_quantization
    from rapidserve.loader import resolve_model
    from rapidserve.ops.fp8 import check_fp8_weights_device

    FakeGpu(monkeypatch, capability if hip is None else (0, 0))
    monkeypatch.setattr(torch.version, "hip", hip)
    gpu = torch.device("cuda", 0)
    source = resolve_model("preset:tiny-llama")
    cases = [(lambda: resolve_quantization("fp8", source, "preset:tiny-llama", ParallelConfig(), gpu),
              r"--quantization fp8: NVIDIA A100-SXM4-80GB .*rapidserve's fp8 GEMMs need fp8 support \(NVIDIA compute "
              r"capability 8\.9 or later.*drop --quantization fp8"),
             (lambda: check_fp8_weights_device(gpu, True, "fp8 per-channel", True),
              r"the model is an FP8 checkpoint \(fp8 per-channel\): .*serve the model's bf16 original")]
    for call, says in cases:
        if refused is None:
            call()
        else:
            with pytest.raises(ConfigError, match=says) as ei:
                call()
            assert refused in str(ei.value)
    check_fp8_weights_device(gpu, False, "none", False)  # fp8 off: nothing asked
    check_fp8_weights_device(CPU, True, "fp8 per-channel", False)  # the CPU runs the reference path
    assert resolve_quantization(None, source, "preset:tiny-llama", ParallelConfig(), gpu).method == "none"
