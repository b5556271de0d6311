"""Quantized checkpoints other than the FP8 forms served (compressed-tensors float-quantized, Hugging Face fp8:
tests/test_fp8_checkpoints.py) are refused by name before any weight is read (loader/quant.py,
loader/fp8_checkpoint.py), and vLLM's --quantization / --kv-cache-dtype are refused unless fp8/none/auto and
auto/fp8/fp8_e4m3/a float dtype (config_builder.check_unsupported_options).

Each case is a tiny folder written here: config.json (a one-layer llama) + model.safetensors, with what the
quantizer in question writes (its quantization_config, its side file, its tensors and dtypes)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rapidserve.config_base import ConfigError
from rapidserve.loader import ModelLoadError, UnsupportedQuantization, expected_tensor_shapes, hf, resolve_model
from rapidserve.loader.hf import config_from_hf_dict
from tests.test_cli import usage_error

CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
Q = "model.layers.0.self_attn.q_proj"


def float_tensors() -> dict[str, torch.Tensor]:
    shapes = expected_tensor_shapes(config_from_hf_dict(CONFIG, "config.json"))
    return {name: torch.randn(shape).to(torch.bfloat16) for name, shape in shapes.items()}


def write_folder(tmp: Path, *, quant: dict[str, Any] | None = None, key: str = "quantization_config",
                 side: tuple[str, dict[str, Any]] | None = None,
                 edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> str:
    cfg = dict(CONFIG)
    if quant is not None:
        cfg[key] = quant
    (tmp / "config.json").write_text(json.dumps(cfg))
    if side is not None:
        (tmp / side[0]).write_text(json.dumps(side[1]))
    tensors = float_tensors()
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(tmp / "model.safetensors"))
    return str(tmp)


def fp8_weight_and_scale(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight"] = t[f"{Q}.weight"].float().to(torch.float8_e4m3fn)
        t[f"{Q}.{suffix}"] = torch.ones(1, dtype=torch.float32)
    return edit


def gptq_awq_tensors(t: dict[str, torch.Tensor]) -> None:
    """AWQ / GPTQ: each linear layer's `weight` replaced by packed int32 `qweight`, `qzeros` and `scales`."""
    for name in [n for n in t if n.endswith("_proj.weight")]:
        base = name.removesuffix(".weight")
        out, inp = t.pop(name).shape
        t[f"{base}.qweight"] = torch.zeros(inp, out // 8, dtype=torch.int32)
        t[f"{base}.qzeros"] = torch.zeros(1, out // 8, dtype=torch.int32)
        t[f"{base}.scales"] = torch.ones(1, out, dtype=torch.float16)


def bnb_tensors(t: dict[str, torch.Tensor]) -> None:
    w = t.pop(f"{Q}.weight")
    t[f"{Q}.weight"] = torch.zeros(w.numel() // 2, 1, dtype=torch.uint8)
    t[f"{Q}.weight.absmax"] = torch.ones(4, dtype=torch.float32)
    t[f"{Q}.weight.quant_map"] = torch.ones(16, dtype=torch.float32)
    t[f"{Q}.weight.quant_state.bitsandbytes__nf4"] = torch.zeros(8, dtype=torch.uint8)


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}


def ct(weights: dict[str, Any], acts: dict[str, Any] | None = FP8_TOKENS, fmt: str = "float-quantized",
       **more: Any) -> dict[str, Any]:
    """A compressed-tensors quantization_config of one group (llm-compressor's layout)."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"], **more}


FP8_HINT = ("use the bf16 checkpoint", "with --quantization fp8")
UNQUANTIZED_HINT = ("use the model's unquantized bf16/fp16 checkpoint",)
SERVED = ("rapidserve serves bf16/fp16/fp32 Hugging Face checkpoints, FP8 ones (compressed-tensors float-quantized, "
          "Hugging Face fp8) and GGUF files")

# case -> (folder writer, what the one-line error must say)
DECLARED: dict[str, tuple[Callable[[Path], str], tuple[str, ...]]] = {
    "compressed-tensors int8 W8A8": (
        lambda tmp: write_folder(tmp, quant=ct({**FP8_WEIGHTS, "type": "int"}, {**FP8_TOKENS, "type": "int"},
                                               fmt="int-quantized")),
        ("quantized with int8 (compressed-tensors int-quantized)", *UNQUANTIZED_HINT)),
    "compressed-tensors fp8 weight-only (W8A16)": (
        lambda tmp: write_folder(tmp, quant=ct(FP8_WEIGHTS, None), edit=fp8_weight_and_scale("weight_scale")),
        ("fp8 (compressed-tensors float-quantized)", "weight-only, W8A16", *FP8_HINT)),
    "compressed-tensors MXFP8 (group scales)": (
        lambda tmp: write_folder(tmp, quant=ct({**FP8_WEIGHTS, "strategy": "group", "group_size": 32},
                                               {**FP8_TOKENS, "strategy": "group", "group_size": 32})),
        ("fp8 (compressed-tensors float-quantized)", "fp8 weight scales 'group'", *FP8_HINT)),
    "compressed-tensors fp8 with per-head KV cache scales": (
        lambda tmp: write_folder(tmp, quant=ct(FP8_WEIGHTS, kv_cache_scheme={"num_bits": 8, "type": "float",
                                                                             "strategy": "attn_head"})),
        ("kv_cache_scheme has 'attn_head' scales", "per-head scales are not", *FP8_HINT)),
    "compressed-tensors int8 KV cache": (
        lambda tmp: write_folder(tmp, quant=ct(FP8_WEIGHTS, kv_cache_scheme={"num_bits": 8, "type": "int",
                                                                             "strategy": "tensor"})),
        ("kv_cache_scheme is int 8-bit", "served: 8-bit float, --kv-cache-dtype fp8", *FP8_HINT)),
    "compressed-tensors fp8, older compression_config key, static per-token": (
        lambda tmp: write_folder(tmp, quant={**ct(FP8_WEIGHTS, {**FP8_TOKENS, "dynamic": False}),
                                             "quant_method": "compressed_tensors"}, key="compression_config"),
        ("fp8 (compressed-tensors float-quantized)", "config.json compression_config",
         "activation scales static 'token'", *FP8_HINT)),
    "HF fp8 e5m2": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}),
        ("quantized with fp8", "fmt 'e5m2'", *FP8_HINT)),
    "HF fp8 block scales with static activations": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3",
                                             "weight_block_size": [128, 128]}),
        ("quantized with fp8 (block scales 128x128)", "block weight scales with static activations", *FP8_HINT)),
    "compressed-tensors int4 W4A16": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "compressed-tensors", "format": "pack-quantized",
                                             "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}),
        ("int4 (compressed-tensors pack-quantized)", *UNQUANTIZED_HINT)),
    "HF fp8 with block scales": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "weight_block_size": [128, 128]},
                                 edit=fp8_weight_and_scale("weight_scale_inv")),
        ("quantized with fp8 (block scales 128x128)", *FP8_HINT)),
    "fbgemm fp8": (lambda tmp: write_folder(tmp, quant={"quant_method": "fbgemm_fp8"}), ("fbgemm_fp8", *FP8_HINT)),
    "AWQ in config.json": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                             "zero_point": True}, edit=gptq_awq_tensors),
        ("quantized with awq (4-bit)", *UNQUANTIZED_HINT)),
    "AWQ quant_config.json (AutoAWQ)": (
        lambda tmp: write_folder(tmp, side=("quant_config.json", {"w_bit": 4, "q_group_size": 128, "zero_point": True,
                                                                  "version": "GEMM"}), edit=gptq_awq_tensors),
        ("quantized with awq (4-bit) (quant_config.json)", *UNQUANTIZED_HINT)),
    "GPTQ in config.json": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
                                 edit=gptq_awq_tensors),
        ("quantized with gptq (4-bit)", *UNQUANTIZED_HINT)),
    "GPTQ quantize_config.json (AutoGPTQ)": (
        lambda tmp: write_folder(tmp, side=("quantize_config.json", {"bits": 4, "group_size": 128, "desc_act": True,
                                                                     "sym": True}), edit=gptq_awq_tensors),
        ("quantized with gptq (4-bit) (quantize_config.json)", *UNQUANTIZED_HINT)),
    "bitsandbytes 4-bit": (
        lambda tmp: write_folder(tmp, quant={"quant_method": "bitsandbytes", "load_in_4bit": True,
                                             "bnb_4bit_quant_type": "nf4"}, edit=bnb_tensors),
        ("quantized with bitsandbytes 4-bit (nf4)", *UNQUANTIZED_HINT)),
    "bitsandbytes 8-bit without quant_method": (
        lambda tmp: write_folder(tmp, quant={"load_in_8bit": True}), ("bitsandbytes 8-bit",)),
    "ModelOpt hf_quant_config.json": (
        lambda tmp: write_folder(tmp, side=("hf_quant_config.json", {"producer": {"name": "modelopt"},
                                                                     "quantization": {"quant_algo": "FP8"}})),
        ("quantized with fp8 (NVIDIA ModelOpt) (hf_quant_config.json)", *FP8_HINT)),
    "quantization_config inside text_config": (
        lambda tmp: write_folder(tmp, key="text_config", quant={"quantization_config": {"quant_method": "gptq",
                                                                                        "bits": 8}}),
        ("gptq (8-bit)", "config.json text_config.quantization_config")),
    "quantization_config naming no method": (
        lambda tmp: write_folder(tmp, quant={"bits": 4}), ("a quantization_config that names no quant_method",)),
}


@pytest.fixture
def no_weight_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """hf.safe_open wrapped: every tensor read (get_tensor, or a slice's data) fails the test; the names of
    files whose headers were opened are listed."""
    real = hf.safe_open
    opened: list[str] = []

    class Guard:
        def __init__(self, file: str, **kw: Any) -> None:
            opened.append(file)
            self.inner = real(file, **kw)

        def __enter__(self) -> Guard:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_slice(self, name: str) -> Any:
            view = self.inner.get_slice(name)

            class Header:  # shape and dtype only
                def get_shape(self) -> list[int]:
                    return list(view.get_shape())

                def get_dtype(self) -> str:
                    return str(view.get_dtype())

            return Header()

        def get_tensor(self, name: str) -> torch.Tensor:
            raise AssertionError(f"weight {name} was read")

    monkeypatch.setattr(hf, "safe_open", Guard)
    yield opened


@pytest.mark.parametrize("case", list(DECLARED))
def test_a_declared_quantization_is_refused_by_name_before_any_weight_file_is_opened(
        case: str, tmp_path: Path, no_weight_read: list[str]) -> None:
    write, needles = DECLARED[case]
    folder = write(tmp_path)
    with pytest.raises(UnsupportedQuantization) as e:
        resolve_model(folder)
    msg = str(e.value)
    assert isinstance(e.value, ModelLoadError)  # the CLI's and the server's start-up errors
    assert "\n" not in msg and folder in msg and SERVED in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert no_weight_read == []  # config.json and the side files only: not even a safetensors header


@pytest.mark.parametrize("case", list(DECLARED))
def test_dummy_weights_of_a_declared_quantization_are_refused_too(case: str, tmp_path: Path,
                                                                  no_weight_read: list[str]) -> None:
    """--load-format dummy reads only config.json (random float weights): a checkpoint that declares a method is
    still refused by name, not served as a float model of its shapes."""
    write, needles = DECLARED[case]
    folder = write(tmp_path)
    with pytest.raises(UnsupportedQuantization) as e:
        resolve_model("dummy:" + folder)
    assert all(needle in str(e.value) for needle in needles), str(e.value)
    assert no_weight_read == []


SCALE_LEAVES = ["weight_scale", "input_scale", "k_scale", "weight_scale_inv", "weight_scale_2", "qweight", "qzeros",
                "scales", "g_idx", "weight_packed", "weight_zero_point", "weight.absmax", "weight.SCB"]


@pytest.mark.parametrize("leaf", SCALE_LEAVES)
def test_a_quantizer_tensor_without_a_quantization_config_is_refused_by_name(
        leaf: str, tmp_path: Path, no_weight_read: list[str]) -> None:
    """Float weights everywhere, but one tensor only a quantizer writes: not ignored."""
    folder = write_folder(tmp_path, edit=lambda t: t.__setitem__(f"{Q}.{leaf}", torch.ones(1)))
    with pytest.raises(UnsupportedQuantization) as e:
        resolve_model(folder)
    msg = str(e.value)
    assert "\n" not in msg and f"tensor {Q}.{leaf}" in msg and "config.json has no quantization_config" in msg, msg
    assert no_weight_read and all(f.endswith("model.safetensors") for f in no_weight_read)  # headers only


@pytest.mark.parametrize(("dtype", "name"), [(torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2"),
                                             (torch.int8, "I8"), (torch.uint8, "U8")])
def test_a_weight_stored_in_a_quantized_dtype_is_refused(dtype: torch.dtype, name: str, tmp_path: Path,
                                                         no_weight_read: list[str]) -> None:
    """No scale and no config at all: the weight's dtype alone says it would load wrong."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight"] = t[f"{Q}.weight"].float().clamp(-1, 1).to(dtype)

    folder = write_folder(tmp_path, edit=edit)
    with pytest.raises(UnsupportedQuantization, match=f"weight {Q}.weight is stored as {name}"):
        resolve_model(folder)


def test_a_float_folder_still_loads(tmp_path: Path) -> None:
    """F32 and F16 weights beside BF16 ones, and a float tensor the model does not read (rotary inv_freq)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight"] = t[f"{Q}.weight"].float()
        t["model.norm.weight"] = t["model.norm.weight"].half()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    source = resolve_model(write_folder(tmp_path, edit=edit))
    got = dict(source.weights())
    assert set(got) == set(expected_tensor_shapes(source.config))


def test_the_error_pickles_as_itself() -> None:
    e = UnsupportedQuantization("/m", "this checkpoint is quantized with fp8")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is UnsupportedQuantization and str(back) == str(e) and back.path == "/m"


@pytest.mark.parametrize("command", [["serve"], ["serve", "--mode", "hybrid"], ["generate", "--prompt", "hi"],
                                     ["profile"]])
@pytest.mark.parametrize("case", ["compressed-tensors int8 W8A8", "AWQ in config.json", "GPTQ quantize_config.json "
                                  "(AutoGPTQ)", "bitsandbytes 4-bit"])
def test_the_cli_exits_2_with_one_line_naming_the_method(command: list[str], case: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = DECLARED[case][0](tmp_path)
    err = usage_error(capsys, *command, "--model", folder, "--device", "cpu")
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rapidserve: error: cannot load model"), err
    assert DECLARED[case][1][0] in lines[0], err


def test_the_cli_names_a_scale_tensor_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_folder(tmp_path, edit=lambda t: t.__setitem__(f"{Q}.input_scale", torch.ones(1)))
    err = usage_error(capsys, "serve", "--model", folder, "--device", "cpu")
    assert len(err.strip().splitlines()) == 1 and f"{Q}.input_scale" in err, err


# ------------------------------------------------------------------------ --quantization / --kv-cache-dtype

@pytest.mark.parametrize("command", [["serve"], ["serve", "--mode", "hybrid"], ["generate", "--prompt", "hi"],
                                     ["profile"]])
@pytest.mark.parametrize(("flag", "needle"), [
    (["--quantization", "gptq"], "--quantization 'gptq'"),
    (["-q", "awq"], "--quantization 'awq'"),
    (["--quantization", "compressed-tensors"], "--quantization 'compressed-tensors'"),
    (["--quantization", "bitsandbytes"], "--quantization 'bitsandbytes'"),
    (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype 'fp8_inc'"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype 'int8'"),
    (["--kv-cache-dtype", "fp8_e5m2"], "e5m2 (no scales, 2 mantissa bits) is not built here: use fp8"),
    (["--kv-cache-dtype", "fp16"], "(kv_cache_dtype='fp16'): not a KV cache dtype; use one of auto, fp8, fp8_e4m3"),
])
def test_vllm_quantization_flags_are_refused_by_name(command: list[str], flag: list[str], needle: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import rapidserve.config_builder as cb

    monkeypatch.setattr(cb, "resolve_model", lambda *a, **k: pytest.fail("the model was looked at first"))
    err = usage_error(capsys, *command, "--model", "preset:tiny-llama", "--device", "cpu", *flag)
    assert needle in err and "drop the flag" in err, err


@pytest.mark.parametrize("flags", [[], ["--quantization", "none"], ["--quantization", "auto"], ["-q", "None"],
                                   ["--kv-cache-dtype", "auto"],
                                   ["--quantization", "auto", "--kv-cache-dtype", "auto"], ["-q", "FP8"],
                                   ["--quantization", "fp8", "--kv-cache-dtype", "auto"],
                                   ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "FP8_E4M3"],
                                   ["--kv-cache-dtype", "float32"]])
def test_none_auto_and_fp8_are_accepted(flags: list[str]) -> None:
    from unittest import mock

    from rapidserve.cli import main

    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", "--mode", "hybrid", *flags]) == 0
    _, build, _ = run_.call_args.args  # run(scfg, build, model): the tree is built once the port is bound
    cfg = build()[0]
    assert cfg.model == "preset:tiny-llama"
    fp8 = any(f.lower() == "fp8" and flags[i - 1] in ("--quantization", "-q") for i, f in enumerate(flags) if i)
    assert cfg.quantization.method == ("fp8" if fp8 else "none") and cfg.quantization.online == fp8
    kv = next((f.lower() for i, f in enumerate(flags) if i and flags[i - 1] == "--kv-cache-dtype"), "auto")
    assert cfg.cache.kv_cache_dtype == ("fp8" if kv.startswith("fp8") else "auto")
    assert cfg.cache.kv_scales is None  # a preset carries no calibrated scales


@pytest.mark.parametrize("kwargs", [{"quantization": "awq"}, {"quantization": "gptq"}, {"kv_cache_dtype": "fp8_e5m2"}])
def test_llm_refuses_them_before_loading(kwargs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import rapidserve.config_builder as cb
    from rapidserve import LLM

    monkeypatch.setattr(cb, "resolve_model", lambda *a, **k: pytest.fail("the model was looked at first"))
    with pytest.raises(ConfigError, match=f"{next(iter(kwargs))}="):
        LLM("preset:tiny-llama", device="cpu", **kwargs)  # type: ignore[arg-type]
