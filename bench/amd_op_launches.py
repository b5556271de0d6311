"""The kernel variants bench/amd_launches.py's `capture` launches beside the layer forward: the skinny GEMMs
(`_skinny_launches`), the MoE experts' split-K, given-routing, TMA + persistent and tail-block launches
(`_moe_launches`), and per-row fp8 weights' launches (`_fp8_token_launches`: the per-token quantizer, the fused
norms and SiLU-and-mul, NVIDIA's skinny fp8 GEMM, its split-K form and the fold, and W8A16's, `_w8a16_launches`).
Each runs the engine's own op on meta tensors under `amd_launches.recording`, which records the launches.
"""

from __future__ import annotations

import torch

from rapidserve.models.decoder_layer import DecoderLayer

SPLIT_K = 4  # the K slices of the split-K launches captured beside each packaged table's (`_fp8_token_launches`)


def _skinny_launches(layer: DecoderLayer, dtype: torch.dtype) -> None:
    """The skinny GEMM launches of `triton_skinny.linear` / `linear_silu_and_mul` for this layer's weights, by
    `routed`'s rule (which also asks for a CUDA tensor, so meta tensors skip it there), at 1, 2 and MAX_ROWS rows:
    the JIT specialises the row count M on == 1 and % 16 == 0, so these three give every variant."""
    from rapidserve.ops import triton_skinny as sk
    if dtype not in (torch.bfloat16, torch.float16) or layer.moe is not None:  # experts: ops/triton_moe.py
        return
    for w, bias, gated in ((layer.qkv_proj, layer.qkv_bias, False), (layer.o_proj, None, False),
                           (layer.gate_up_proj, None, True), (layer.down_proj, None, False)):
        for rows in (1, 2, sk.MAX_ROWS):
            if sk.wide_enough(*w.shape, gated):
                sk.skinny_linear(torch.empty(rows, w.shape[1], dtype=dtype, device=w.device), w, bias, gated=gated)


def _moe_launches(layer: DecoderLayer, dtype: torch.dtype, device: torch.device) -> None:
    """The experts' kernel variants the engine's steps under the untuned rule do not reach: split K in both GEMMs
    (`GemmTiles.split_k` 2 on the rule's decode tiles: the SPLIT variants) at one token through `routed_moe`,
    `fused_moe` of a given routing at one token (the one-program alignment alone), and at a prefill of 1024 tokens
    on the rule's prefill tiles with the weights by TMA on a persistent grid (a tuned table may ask for both;
    ops/triton_moe_grid.py: NVIDIA takes the descriptors, ROCm the pointer loads whatever the tiles say); and the
    same prefill with a TAIL_BLOCK_M of 16 (`ops.moe.TailBlocks`), on the plain and the TMA + persistent tiles: the
    GEMMs' LISTS variants at BLOCK_M and at the tail block, and the alignment's scatter writing the lists (FULL_M),
    which no untuned step reaches and the interpreter's tests never compile."""
    from rapidserve.ops import triton_moe
    from rapidserve.ops.moe_tiles import rule_config
    moe = layer.moe
    assert moe is not None
    k = moe.moe.top_k
    rule = rule_config(k, moe.moe.num_experts, torch.version.hip is not None)
    split = rule._replace(gate_up=rule.gate_up._replace(split_k=2), down=rule.down._replace(split_k=2))
    x = torch.empty(1, moe.gate.shape[1], dtype=dtype, device=device)
    logits = torch.empty(1, moe.moe.num_experts, dtype=dtype, device=device)
    triton_moe.routed_moe(x, logits, moe.w13, moe.w2, k, moe.moe.renormalize, split)
    triton_moe.fused_moe(x, moe.w13, moe.w2, torch.empty(1, k, device=device),
                         torch.empty(1, k, dtype=torch.int32, device=device))
    t = 1024
    prefill = rule_config(t * k, moe.moe.num_experts, torch.version.hip is not None)
    prefill = prefill._replace(gate_up=prefill.gate_up._replace(tma=1, persistent=1),
                               down=prefill.down._replace(tma=1, persistent=1))
    tail = rule_config(t * k, moe.moe.num_experts, torch.version.hip is not None)._replace(tail_m=16)
    for cfg in (prefill, tail, prefill._replace(tail_m=16)):
        triton_moe.fused_moe(torch.empty(t, x.shape[1], dtype=dtype, device=device), moe.w13, moe.w2,
                             torch.empty(t, k, device=device), torch.empty(t, k, dtype=torch.int32, device=device), cfg)


def _w8a16_launches(x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                    gated: bool) -> None:
    """W8A16's launches of one projection (`_fp8_token_launches`): the tiles `triton_w8a16.plan` gives at 1, 16 and
    64 rows with W8A16 forced, by the untuned rule and by each packaged fp8 table (gated: gate|up's launch)."""
    from rapidserve.ops import triton_fp8_skinny as fsk
    from rapidserve.ops import triton_w8a16
    from rapidserve.ops.w8a16_table import W8a16Device, forced

    if not triton_w8a16.half_ok(x, w8, sw):
        return
    n, k = w8.shape
    for rows in (1, 16, 64):
        for tables, dev in [({}, "rule"), *(({d: t}, d) for d, t in fsk.TUNED.items())]:
            tiles = triton_w8a16.plan(rows, n, k, W8a16Device(dev, True), tables, forced(dev), gated)
            if tiles is None:
                continue
            if gated:
                triton_w8a16.w8a16_linear_silu_and_mul(x[:rows], w8, sw, config=tiles)
            else:
                triton_w8a16.w8a16_linear(x[:rows], w8, sw, bias, config=tiles)


def _fp8_token_launches(layer: DecoderLayer, dtype: torch.dtype, fp8: torch.dtype, hip: bool) -> None:
    """The launches of `ops.fp8_gpu.gpu_linear` for per-row fp8 weights of this layer's projections' shapes, with
    per-token activations: `triton_fp8.quantize_tokens` of each projection's input (the `torch._scaled_mm` path's
    quantizer, which asks for a CUDA tensor, so meta tensors skip it there; its variants depend on K and x's dtype
    only), and on NVIDIA the skinny fp8 kernel with the tiles `triton_fp8_skinny.plan` gives at 1, 2, 16, 24 and 64
    rows (the JIT's three specialisations of M) by the untuned rule and by each packaged table, and the split-K form
    (a table's `split_k`: the kernel's SPLIT variant, then the reduce kernel) of the rule's tiles at 1 and 64 rows,
    SPLIT_K slices, whether or not a packaged table names one yet. The fused producers
    of those inputs (`triton_fp8_fused`, which the model takes for these layers: `projections.fused_fp8`): the
    RMSNorm alone (the first layer) and after the residual add, and the MLP's SiLU-and-mul, at one row (cut into
    slices) and at 256 (one program a row); their variants depend on the row width, x's dtype and the slices only.
    On NVIDIA the add + RMSNorm of a split-K GEMM's unreduced sums (`triton_fp8_fold`, SPLIT_K slices), at one row
    (slices) and at 16 (one program a row), and W8A16 (`triton_w8a16`: the same kernel's A16 form on float rows, the
    gate|up launch with SiLU-and-mul in its epilogue) with the tiles `triton_w8a16.plan` gives at 1, 16 and 64 rows
    under a table forcing it, by the untuned rule and each packaged fp8 table.
    The experts of an MoE layer have no fp8 path (refused at load)."""
    from rapidserve.ops import triton_fp8, triton_fp8_fold, triton_fp8_fused
    from rapidserve.ops import triton_fp8_skinny as fsk
    from rapidserve.ops.fp8 import SplitSums
    from rapidserve.ops.fp8_tiles import MAX_ROWS
    projections = [(layer.qkv_proj, layer.qkv_bias), (layer.o_proj, None)]
    if layer.moe is None:
        projections += [(layer.gate_up_proj, None), (layer.down_proj, None)]
    for w, bias in projections:
        n, k = w.shape
        x = torch.empty(MAX_ROWS, k, dtype=dtype, device=w.device)
        w8 = torch.empty(n, k, dtype=fp8, device=w.device)
        sw = torch.empty(n, dtype=torch.float32, device=w.device)
        if not hip and fsk.fp8_ok(x, w8, sw):
            for rows in (1, 2, 16, 24, 64):
                for tables, dev in [({}, ""), *(({d: t}, d) for d, t in fsk.TUNED.items())]:
                    tiles = fsk.plan(rows, n, k, dev, tables)
                    if tiles is not None:
                        fsk.skinny_fp8_linear(x[:rows], w8, sw, bias, config=tiles)
            for rows in (1, 64):
                tiles = fsk.rule_tiles(rows, n, k)._replace(split_k=SPLIT_K)
                fsk.skinny_fp8_linear(x[:rows], w8, sw, bias, config=tiles)
            if fp8 == torch.float8_e4m3fn:
                _w8a16_launches(x, w8, sw, bias, gated=layer.moe is None and w is layer.gate_up_proj)
        triton_fp8.quantize_tokens(x, fp8)
    for rows in (1, 256):
        h = torch.empty(rows, layer.input_layernorm.shape[0], dtype=dtype, device=layer.input_layernorm.device)
        triton_fp8_fused.rms_norm_fp8(h, layer.input_layernorm, 1e-6, fp8)
        triton_fp8_fused.add_rms_norm_fp8(h, torch.empty_like(h), layer.input_layernorm, 1e-6, fp8)
        if layer.moe is None:
            n2 = layer.gate_up_proj.shape[0]
            triton_fp8_fused.silu_and_mul_fp8(torch.empty(rows, n2, dtype=dtype, device=h.device), fp8)
    if not hip:  # a split-K GEMM's sums folded into the next norm (ops/fold_table.py): one row, one program a row
        for rows, width in ((1, None), (16, 1 << 30)):
            h = layer.input_layernorm
            sums = SplitSums(torch.empty(SPLIT_K, rows, h.shape[0], dtype=torch.float32, device=h.device),
                             torch.empty(rows, 1, dtype=torch.float32, device=h.device),
                             torch.empty(h.shape[0], dtype=torch.float32, device=h.device), None, dtype)
            triton_fp8_fold.add_rms_norm_fp8_sums(sums, torch.empty(rows, h.shape[0], dtype=dtype, device=h.device),
                                                  h, 1e-6, fp8, slice_width=width)
