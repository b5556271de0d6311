"""A step's MLP by row slices (models/projections.py `by_row_chunks`, `MLP_ROW_CHUNK`): a step of more rows than the
chunk runs its MLP on slices, so the intermediate rows (gate|up's [T, 2I], SiLU-and-mul's [T, I]) are the chunk's,
not the step's, and the KV pool's budget keeps a smaller activation peak (runner/kv_budget.py). On CPU:

- `by_row_chunks` as a table of row counts around the chunk: each slice at most the chunk, in order, covering every
  row once; the output the function's on the whole rows, for float, quantized (fp8 rows and their scales) and fp16
  rows;
- `mlp` of float and fp8 (per-token) projections: the chunked output equals the whole one (float32: to rounding of
  the GEMM's blocking), and the largest gate|up output has the chunk's rows; an fp8 projection with one dynamic
  activation scale over all rows ("tensor") is not sliced (a slice's scale would differ);
- a tiny Llama and a tiny Gemma 3 give the same greedy logits with the chunk at 5 rows as without slicing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rapidserve.models import projections
from rapidserve.models.projections import by_row_chunks, mlp, row_count, row_slice, row_wise
from rapidserve.ops import fp8, torch_ops_bundle

CPU = torch.device("cpu")
FN = torch.float8_e4m3fn


def _rows(kind: str, t: int, k: int = 16) -> projections.Rows:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=g)
    if kind == "float":
        return x
    if kind == "quantized":
        q, s = fp8.quantize_input(x, "token", FN)
        return fp8.QuantizedRows(q, s, torch.float32)
    return fp8.HalfRows(x.half(), torch.float32)


def _as_float(x: projections.Rows) -> torch.Tensor:
    if isinstance(x, fp8.QuantizedRows):
        return x.q.float() * x.scale
    if isinstance(x, fp8.HalfRows):
        return x.x.float()
    return x


@pytest.mark.parametrize("kind", ["float", "quantized", "half"])
@pytest.mark.parametrize(("rows", "chunk", "slices"), [
    (7, 8, [7]),  # under the chunk: one call on the rows as given
    (8, 8, [8]),  # at it
    (9, 8, [8, 1]),  # one over
    (24, 8, [8, 8, 8]),
    (21, 8, [8, 8, 5]),
])
def test_slices_cover_every_row_once_in_order(kind: str, rows: int, chunk: int, slices: list[int]) -> None:
    x = _rows(kind, rows)
    seen: list[int] = []

    def fn(part: projections.Rows) -> torch.Tensor:
        assert type(part) is type(x)
        seen.append(row_count(part))
        return _as_float(part) * 2 + 1

    out = by_row_chunks(x, fn, chunk)
    assert seen == slices
    assert torch.equal(out, _as_float(x) * 2 + 1)


def test_row_slice_keeps_each_rows_scale() -> None:
    x = _rows("quantized", 10)
    assert isinstance(x, fp8.QuantizedRows)
    part = row_slice(x, 3, 7)
    assert isinstance(part, fp8.QuantizedRows)
    assert torch.equal(part.q.float(), x.q[3:7].float()) and torch.equal(part.scale, x.scale[3:7])
    assert part.dtype == x.dtype


def _fp8_layer(n: int, k: int, acts: str) -> fp8.Fp8Linear:
    g = torch.Generator().manual_seed(n * 7 + k)
    layer = fp8.Fp8Linear(n, k, FN, acts, None, CPU)
    w8, s = fp8.quantize_weight(torch.randn(n, k, generator=g) / k**0.5, "channel", None, FN)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    return layer


class _Recording:
    """The torch bundle, noting the rows of every gate|up output (the intermediate the slices bound)."""

    def __init__(self) -> None:
        ops = torch_ops_bundle()
        self.gate_up_rows: list[int] = []
        names = ("linear_silu_and_mul", "silu_and_mul", "silu_and_mul_fp8")
        self.ops = dataclasses.replace(ops, **{n: self._noting(getattr(ops, n)) for n in names})

    def _noting(self, inner):  # type: ignore[no-untyped-def]
        def call(h, *args, **kw):  # type: ignore[no-untyped-def]
            self.gate_up_rows.append(row_count(h))
            return inner(h, *args, **kw)
        return call


@pytest.mark.parametrize("weights", ["float", "fp8-token", "fp8-tensor"])
def test_mlp_by_slices_equals_the_whole_and_bounds_the_intermediate(weights: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    t, h, i = 37, 32, 48
    g = torch.Generator().manual_seed(5)
    if weights == "float":
        gate_up: projections.Weight = torch.nn.Parameter(torch.randn(2 * i, h, generator=g) / h**0.5)
        down: projections.Weight = torch.nn.Parameter(torch.randn(h, i, generator=g) / i**0.5)
    else:
        acts = weights.split("-")[1]
        gate_up, down = _fp8_layer(2 * i, h, acts), _fp8_layer(h, i, acts)
    x = torch.randn(t, h, generator=g)
    whole = _Recording()
    ref = mlp(whole.ops, x, gate_up, down)
    assert whole.gate_up_rows == [t]
    monkeypatch.setattr(projections, "MLP_ROW_CHUNK", 8)
    sliced = _Recording()
    out = mlp(sliced.ops, x, gate_up, down)
    if weights == "fp8-tensor":  # one scale over all rows: never sliced
        assert not row_wise(gate_up)
        assert sliced.gate_up_rows == [t]
        assert torch.equal(out, ref)
        return
    assert sliced.gate_up_rows == [8, 8, 8, 8, 5]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _tiny_runner(preset: str, quantization: str | None):  # type: ignore[no-untyped-def]
    from rapidserve.config_builder import build_engine_config
    from rapidserve.runner import ModelRunner

    cfg, source = build_engine_config(f"preset:{preset}", device="cpu", dtype="float32", quantization=quantization,
                                      num_kv_blocks=16, enforce_eager=True)
    return ModelRunner(cfg, source, show_progress=False)


@pytest.mark.parametrize(("preset", "quantization"), [("tiny-llama", None), ("tiny-llama", "fp8"),
                                                      ("tiny-gemma3", None), ("tiny-gemma3", "fp8")])
def test_a_tiny_model_gives_the_same_logits_with_its_mlp_sliced(preset: str, quantization: str | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A 21-token prompt, the MLP whole (21 rows under MLP_ROW_CHUNK) and in slices of 5 rows: the same logits (to
    float32 GEMM rounding) and the same greedy token, into the same KV blocks."""
    from rapidserve.runner import PrefillItem

    runner = _tiny_runner(preset, quantization)
    prompt = [(7 * i + 3) % 500 + 3 for i in range(21)]
    whole = runner.prefill([PrefillItem(prompt, 0, [0, 1])])
    monkeypatch.setattr(projections, "MLP_ROW_CHUNK", 5)
    slices: list[int] = []

    def noting(x: projections.Rows, a: int, b: int) -> projections.Rows:
        slices.append(b - a)
        return row_slice(x, a, b)

    monkeypatch.setattr(projections, "row_slice", noting)
    sliced = runner.prefill([PrefillItem(prompt, 0, [0, 1])])
    layers = runner.cfg.model_config.num_layers
    assert slices == [5, 5, 5, 5, 1] * layers
    torch.testing.assert_close(sliced, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(sliced.argmax(-1), whole.argmax(-1))
