"""Model-core benchmark and GPU correctness check, in one run (issue 2).

    python bench/model_runner.py [--out bench/results] [--model preset:llama-3-8b] [--quick]

On the GPU it is given, it measures:
  ceilings   the bf16 GEMM rate (cuBLAS through torch) and the device-to-device copy bandwidth
  check      a 2-layer slice of the model: our bf16 logits vs transformers' implementation with the
             same weights (relative error), and 64 greedy steps in fp32 through the engine vs
             transformers' own greedy loop (tokens must be identical)
  prefill    forward of 8x1024 and 2x4096 prompt tokens: model FLOPs (linear layers, attention,
             LM head of the last tokens) per second, over the GEMM rate
  decode     one decode step (CUDA graph replay) at batch 1, 16, 64, 256 with 2048-token contexts:
             bytes (weights read once + every context token's K and V) per second, over the copy
             bandwidth; and the graph's replay alone (no host input building), over the read bandwidth
             (a reduction over 1 GiB)
Medians over repeats, with min/max. Writes <out>/model_runner.json and .md; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import time_ms  # noqa: E402

from rapidserve.attention.triton_paged_prefill import prefill_flops  # noqa: E402
from rapidserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from rapidserve.core import EngineCore  # noqa: E402
from rapidserve.loader import ModelSource, expected_tensor_shapes  # noqa: E402
from rapidserve.loader.presets import hf_config_dict, preset_config, preset_tensor  # noqa: E402
from rapidserve.quant_config import ONLINE_FP8  # noqa: E402
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem  # noqa: E402
from rapidserve.sampling_params import SamplingParams  # noqa: E402


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ceilings() -> dict[str, object]:
    dev = "cuda"
    m, k, n = 8192, 4096, 14336
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    gemm = time_ms(lambda: (a @ b) @ c, reps=20)
    flops = 2 * m * k * n * 2
    src = torch.randn(2**29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy = time_ms(lambda: dst.copy_(src), reps=20)
    nbytes = 2 * src.numel() * src.element_size()
    acc = torch.empty((), device=dev, dtype=torch.float32)
    read = time_ms(lambda: torch.sum(src, 0, dtype=torch.float32, out=acc), reps=20)  # reads only, as decode
    return {
        "read_tbps": src.numel() * src.element_size() / (statistics.median(read) * 1e-3) / 1e12,
        "read_ms": stats(read),
        "gemm_tflops": flops / (statistics.median(gemm) * 1e-3) / 1e12,
        "gemm_ms": stats(gemm), "gemm_shape": f"({m}x{k} @ {k}x{n}) @ {n}x{k} bf16",
        "copy_tbps": nbytes / (statistics.median(copy) * 1e-3) / 1e12,
        "copy_ms": stats(copy), "copy_bytes": nbytes,
    }


def preset_source(name: str, cfg: ModelConfig, device: str, dtype: torch.dtype) -> ModelSource:
    shapes = expected_tensor_shapes(cfg)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t, shape in shapes.items():
            yield t, preset_tensor(name, cfg, t, shape, device=device, dtype=dtype)

    return ModelSource(cfg, weights, len(shapes), None, None, None, f"{name} ({cfg.num_layers} layers)")


def engine_config(name: str, mcfg: ModelConfig, dtype: str, graph_sizes: tuple[int, ...],
                  max_len: int, util: float, num_blocks: int | None = None, device: str = "cuda",
                  fp8: bool = False, kv_cache_dtype: str = "auto") -> EngineConfig:
    """A bench runner's config; `fp8`: the weights quantized at load as `serve --quantization fp8` does
    (`quant_config.ONLINE_FP8`: per-channel weights, dynamic per-token activations)."""
    return EngineConfig(
        model=name, model_config=mcfg,
        cache=CacheConfig(gpu_memory_utilization=util, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max(graph_sizes), max_num_batched_tokens=8192,
                                  max_model_len=max_len),
        runner=RunnerConfig(device=device, dtype=dtype, graph_batch_sizes=graph_sizes),
        **({"quantization": ONLINE_FP8} if fp8 else {}),
    )


def hf_model(mcfg: ModelConfig, source: ModelSource, dtype: torch.dtype, device: str) -> torch.nn.Module:
    import transformers

    d = dict(hf_config_dict(mcfg, dtype))
    d.pop("architectures", None)
    conf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    conf._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(conf, dtype=dtype).to(device).eval()
    missing, unexpected = model.load_state_dict(dict(source.weights()), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def check(name: str, base: ModelConfig, dev: str = "cuda") -> dict[str, object]:
    """2-layer slice: bf16 logits vs transformers; 64 greedy fp32 steps through the engine."""
    mcfg = base.replace(num_layers=2, max_position_embeddings=4096)
    res: dict[str, object] = {}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, mcfg.vocab_size, (n,), generator=g).tolist() for n in (100, 37, 300)]

    src = preset_source(name, mcfg, dev, torch.bfloat16)
    ecfg = engine_config(name, mcfg, "bfloat16", (1, 4), 4096, 0.3, 512, dev)
    runner = ModelRunner(ecfg, src, show_progress=False)
    ref = hf_model(mcfg, src, torch.bfloat16, dev)
    errs = []
    table, nb = [], 0
    for p in prompts:
        nblk = -(-len(p) // 16)
        table.append(list(range(nb, nb + nblk)))
        nb += nblk
    ours = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(prompts, table, strict=True)])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = ref(torch.tensor([p], device=dev)).logits[0, -1].float()
            errs.append(float((ours[i] - want).norm() / want.norm()))
    res["bf16_logits_rel_err"] = errs
    res["bf16_ok"] = max(errs) < 2e-2
    del runner, ref
    if dev == "cuda":
        torch.cuda.empty_cache()

    src32 = preset_source(name, mcfg, dev, torch.float32)
    core = EngineCore(engine_config(name, mcfg, "float32", (1, 2, 4), 4096, 0.3, 512, dev), src32,
                      show_progress=False)
    ref32 = hf_model(mcfg, src32, torch.float32, dev)
    steps = 64
    seqs = [core.add(str(i), p, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while core.has_work:
        core.step()
    mism = []
    with torch.no_grad():
        for s, p in zip(seqs, prompts, strict=True):
            ids, past, want = torch.tensor([p], device=dev), None, []
            for _ in range(steps):
                out = ref32(ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = int(out.logits[0, -1].argmax())
                want.append(nxt)
                ids = torch.tensor([[nxt]], device=dev)
            mism.append(next((i for i, (a, b) in enumerate(zip(s.output_token_ids, want, strict=True))
                              if a != b), -1))
    res["fp32_greedy_first_mismatch"] = mism  # -1: all 64 tokens equal
    res["fp32_greedy_ok"] = all(m == -1 for m in mism)
    del core, ref32
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


def perf(name: str, mcfg: ModelConfig, ceil: dict[str, object], quick: bool) -> dict[str, object]:
    batches = (1, 16, 64, 256)
    ctx = 2048
    src = preset_source(name, mcfg, "cuda", torch.bfloat16)
    t0 = time.perf_counter()
    runner = ModelRunner(engine_config(name, mcfg, "bfloat16", batches, 8192, 0.95), src, show_progress=True)
    load_s = time.perf_counter() - t0
    pool = runner.kv_pool
    for layer in range(pool.tensor.shape[0]):  # never time on zeros
        pool.tensor[layer].normal_()
    t0 = time.perf_counter()
    runner.capture_decode_graphs(key="full")
    capture_s = time.perf_counter() - t0
    bs, nblocks = runner.block_size, pool.num_blocks
    out: dict[str, object] = {"load_s": load_s, "graph_capture_s": capture_s, "kv_blocks": nblocks}
    el = 2  # bf16 bytes
    n_params = mcfg.num_params()
    emb = mcfg.vocab_size * mcfg.hidden_size
    linear_params = n_params - emb - (0 if mcfg.tie_word_embeddings else emb)  # excludes lm_head
    reps = 5 if quick else 10

    rows = []
    g = torch.Generator().manual_seed(1)
    for nseq, qlen in ((8, 1024), (2, 4096)):
        per = -(-qlen // bs)
        items = [PrefillItem(torch.randint(0, mcfg.vocab_size, (qlen,), generator=g).tolist(), 0,
                             list(range(i * per, (i + 1) * per))) for i in range(nseq)]
        ms = time_ms(lambda items=items: runner.prefill(items), reps=reps)
        tokens = nseq * qlen
        flops = (2 * linear_params * tokens + 2 * mcfg.hidden_size * mcfg.vocab_size * nseq
                 + mcfg.num_layers * prefill_flops([qlen] * nseq, [0] * nseq, mcfg.num_heads, mcfg.head_dim))
        tf = flops / (statistics.median(ms) * 1e-3) / 1e12
        rows.append({"shape": f"{nseq}x{qlen}", "ms": stats(ms), "tflops": tf,
                     "frac_of_gemm": tf / float(ceil["gemm_tflops"])})  # type: ignore[arg-type]
    out["prefill"] = rows

    rows = []
    per = ctx // bs
    for b in batches:
        need = b * per
        # 256 x 2048 tokens of Llama-3-8B KV (64 GiB) plus its weights exceed an 80 GB H100: when the
        # pool is smaller, later sequences reuse earlier sequences' blocks. The reuse distance is
        # gigabytes, far beyond the 50 MB L2, so every byte still comes from HBM.
        items = [DecodeItem(1, ctx - 1, [(i * per + j) % nblocks for j in range(per)]) for i in range(b)]
        ms = time_ms(lambda items=items: runner.decode(items, graph_key="full"), reps=3 * reps)
        # the graph alone: its inputs are in place after the call above, so a replay repeats that step
        # without the host building and copying them (which the engine overlaps with the step in flight)
        graph = runner.decode_graph(b, "full")
        replay = time_ms(graph.replay, reps=3 * reps) if graph is not None else ms
        nbytes = (linear_params + mcfg.vocab_size * mcfg.hidden_size) * el + b * mcfg.hidden_size * el \
            + b * ctx * mcfg.kv_bytes_per_token(el)
        tbps = nbytes / (statistics.median(ms) * 1e-3) / 1e12
        replay_tbps = nbytes / (statistics.median(replay) * 1e-3) / 1e12
        rows.append({"batch": b, "ctx": ctx, "ms": stats(ms), "bytes": nbytes, "tbps": tbps,
                     "frac_of_copy": tbps / float(ceil["copy_tbps"]),  # type: ignore[arg-type]
                     "replay_ms": stats(replay), "replay_tbps": replay_tbps,
                     "replay_frac_of_read": replay_tbps / float(ceil["read_tbps"]),  # type: ignore[arg-type]
                     "kv_blocks_shared": max(0, need - nblocks)})
    out["decode"] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:llama-3-8b")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("model_runner bench needs a GPU", file=sys.stderr)
        return 2
    name = a.model.removeprefix("preset:")
    base = preset_config(name)
    res: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "model": a.model,
        "command": "python bench/model_runner.py " + " ".join(sys.argv[1:]),
    }
    res["ceilings"] = ceil = ceilings()
    torch.cuda.empty_cache()
    print("ceilings", json.dumps(ceil), flush=True)
    if not a.skip_check:
        res["check"] = check(name, base)
        print("check", json.dumps(res["check"]), flush=True)
    res["perf"] = p = perf(name, base, ceil, a.quick)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "model_runner.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"# Model runner: {a.model} bf16 on {res['gpu']} ({res['date']})", "",
             f"Command: `{res['command']}`", "",
             f"Ceilings: GEMM {ceil['gemm_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s, "
             f"read {ceil['read_tbps']:.2f} TB/s", "",
             "Targets: issue 16's (prefill >= 85% of the GEMM rate, decode >= 90% of the memory roofline). "
             "A decode row \"step\" is `runner.decode` (the host building and copying the inputs, then the "
             "replay); \"replay\" is the graph alone, over the read ceiling.", "",
             "| phase | shape | median ms (min-max) | rate | fraction of ceiling | target |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in p["prefill"]:  # type: ignore[index]
        m = r["ms"]
        lines.append(f"| prefill | {r['shape']} | {m['median']:.2f} ({m['min']:.2f}-{m['max']:.2f}) | "
                     f"{r['tflops']:.0f} TFLOP/s | {r['frac_of_gemm']:.1%} of GEMM | >= 85% |")
    for r in p["decode"]:  # type: ignore[index]
        m = r["ms"]
        lines.append(f"| decode step | b={r['batch']} ctx={r['ctx']} | {m['median']:.3f} ({m['min']:.3f}-"
                     f"{m['max']:.3f}) | {r['tbps']:.2f} TB/s | {r['frac_of_copy']:.1%} of copy | >= 90% |")
        m = r["replay_ms"]
        lines.append(f"| decode replay | b={r['batch']} ctx={r['ctx']} | {m['median']:.3f} ({m['min']:.3f}-"
                     f"{m['max']:.3f}) | {r['replay_tbps']:.2f} TB/s | {r['replay_frac_of_read']:.1%} of read "
                     "| >= 90% |")
    if "check" in res:
        c = res["check"]
        lines += ["", f"Check (2-layer slice): bf16 logits rel. error {max(c['bf16_logits_rel_err']):.2e} "  # type: ignore[index]
                  f"(ok={c['bf16_ok']}); fp32 greedy 64 steps identical: {c['fp32_greedy_ok']} "  # type: ignore[index]
                  f"(first mismatch per prompt: {c['fp32_greedy_first_mismatch']})"]  # type: ignore[index]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "model_runner.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
