"""W8A16 through the model (issue 39, ops/triton_w8a16.py) on CPU: a tiny real Qwen3 and Llama (transformers' own
random init, tests/fp8_folders.py) under `--quantization fp8` (per-channel weights, per-token activations), the torch
bundle with W8A16 forced on every projection of at most 64 rows (`fp8.reference_linear_half`, the kernel's numbers:
tests/test_w8a16.py), against the same model in bf16 and under W8A8 (the torch bundle as it is):

- the plumbing: a W8A16 projection gets fp16 rows from the plain producers (the norms' `*_half` ops and a decode
  step's attention write `fp8.HalfRows`; no fused quantizer; a prefill's o_proj takes the float rows), and an MLP whose
  gate|up and down both run W8A16 takes SiLU-and-mul in gate|up's op (`Ops.fp8_linear_silu_and_mul`, fp16 rows out);
- the numbers: prefill and decode logits nearer bf16's than W8A8's, and within the fp8 bounds of
  tests/test_fp8_checkpoints.py (REL_BF16, MAX_BF16).
On the GPU (the kernel, Qwen3-8B-shaped layers): tests/test_w8a16_gpu.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from fp8_folders import float_folder
from test_fp8_fold import counting

from rapidserve.ops import Ops, fp8
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem

REL_BF16, MAX_BF16 = 0.06, 0.10  # tests/test_fp8_checkpoints.py's fp8-vs-bf16 bounds
PROMPTS = [[(7 * i + 3) % 500 + 3 for i in range(21)], [(5 * i + 1) % 400 + 3 for i in range(9)]]
TABLES = [[0, 1], [2]]


def forced_w8a16(ops: Ops, max_rows: int = 64) -> Ops:
    """The torch bundle with W8A16 on every per-token fp8 projection of at most `max_rows` rows (the path regardless
    of a table: what `with_w8a16(bundle, w8a16_table.forced(gpu))` does on a GPU)."""
    def w8a16(rows: int, layer: fp8.Fp8Linear) -> bool:
        return fp8.takes_rows(layer) and 0 < rows <= max_rows

    def fp8_linear(x: torch.Tensor, layer: fp8.Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
        if w8a16(x.shape[0], layer):
            return fp8.reference_linear_half(x, layer, bias)
        return ops.fp8_linear(x, layer, bias)

    return dataclasses.replace(ops, name=ops.name + "-w8a16", w8a16=w8a16, fp8_linear=fp8_linear,
                               fp8_linear_half=fp8.reference_linear_half)


W8A16_OPS = ("rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8", "fp8_linear_rows", "fp8_linear",
             "fp8_linear_silu_and_mul", "add_rms_norm", "silu_and_mul", "rms_norm_half", "add_rms_norm_half",
             "fp8_linear_half")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("w8a16")
    return {a: float_folder(tmp / a, a) for a in ("qwen3", "llama")}


def _runner(folder: Path, quantization: str | None) -> ModelRunner:
    from rapidserve.config_builder import build_engine_config

    kw = {"quantization": quantization} if quantization else {}
    cfg, source = build_engine_config(str(folder), device="cpu", dtype="bfloat16", num_kv_blocks=16,
                                      max_model_len=256, enforce_eager=True, **kw)  # type: ignore[arg-type]
    return ModelRunner(cfg, source, show_progress=False)


def _steps(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits of the two prompts' last tokens, the logits of one decode step after them), float32."""
    pre = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(PROMPTS, TABLES, strict=True)])
    dec = runner.decode([DecodeItem(11, 21, TABLES[0]), DecodeItem(12, 9, TABLES[1])])
    return pre.float(), dec.float()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_w8a16_takes_the_plain_producers_and_is_nearer_bf16_than_w8a8(arch: str, folders: dict[str, Path]) -> None:
    r8 = _runner(folders[arch], "fp8")
    layers = r8.model.cfg.num_layers
    w8a8 = _steps(r8)
    calls: Counter[str] = Counter()
    r8.model.ops = counting(forced_w8a16(r8.model.ops), calls, W8A16_OPS)
    w8a16 = _steps(r8)  # rewrites the same slots (the K/V of W8A16's own prefill)
    # every projection of both steps (30 and 2 rows) ran W8A16: no quantizing producer, no quantized rows
    for name in ("rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8", "fp8_linear_rows", "silu_and_mul"):
        assert calls[name] == 0, (name, calls)
    assert calls["rms_norm_half"] + calls["add_rms_norm_half"] == 2 * 2 * layers, calls  # the norms write fp16 rows
    assert calls["fp8_linear_silu_and_mul"] == 2 * layers, calls  # gate|up with SiLU-and-mul, each step and layer
    # q|k|v and down take the fp16 rows in both steps, o_proj in the decode step (the attention writes them there)
    assert calls["fp8_linear_half"] == (2 + 3) * layers, calls
    assert calls["fp8_linear"] == layers, calls  # o_proj of the prefill: the attention's float rows
    bf16 = _steps(_runner(folders[arch], None))
    for step, got, old, want in zip(("prefill", "decode"), w8a16, w8a8, bf16, strict=True):
        top = float(want.abs().max())
        assert _rel(got, want) <= REL_BF16 and float((got - want).abs().max()) <= MAX_BF16 * top, step
        assert _rel(got, want) < _rel(old, want), (step, _rel(got, want), _rel(old, want))


def test_w8a16_off_changes_nothing(folders: dict[str, Path]) -> None:
    """W8A16 on at no row count (a table without the step's rows): the W8A8 logits bit for bit, and the fused
    producers quantize as before."""
    r8 = _runner(folders["qwen3"], "fp8")
    want = _steps(r8)
    calls: Counter[str] = Counter()
    r8.model.ops = counting(forced_w8a16(r8.model.ops, max_rows=1), calls, W8A16_OPS)  # steps of 30 and 2 rows: none
    got = _steps(r8)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert calls["fp8_linear_silu_and_mul"] == 0 and calls["silu_and_mul_fp8"] == 2 * r8.model.cfg.num_layers
