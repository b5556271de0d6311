"""The goodput frontier's system groups and the model arithmetic they need (bench/frontier_plan.py's; pure, tested
on CPU): which systems a group runs at a TP (`group_systems`), why disagg-npmd is dropped where it is (`disagg_note`),
a model's parameters and bf16 weights (`params`, `weights_gib`) and a prefill-bound guess of a system's closed-loop
peak (`peak_guess`). Runs where the bench client's packages are not installed: it imports rapidserve.config alone."""

from __future__ import annotations

import math

from rapidserve.config import ModelConfig, ParallelConfig

GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # name -> (our systems, vLLM's systems)
    "ours": (("duet", "always-fused", "always-split"), ()),
    "duet": (("duet",), ()),
    "duet-none": (("duet", "duet@none"), ()),
    "graphs-ab": (("duet", "duet-g512"), ()),
    "fill-ab": (("duet", "duet-g256"), ()),
    "g4096-ab": (("duet@100", "duet100-g4096"), ()),
    "lookup-ab": (("duet", "duet-roundup", "duet-interp"), ()),
    "margin-ab": (("duet", "duet-m90"), ()),
    "correction-ab": (("duet", "duet-perkind"), ()),
    "ours-slo": (("duet@25", "duet@50", "duet@100", "duet@200", "duet@none"), ()),
    "baselines": (("always-fused", "always-split"), ()),
    "vllm-a": ((), ("vllm:", "vllm:--max-num-batched-tokens 1024")),
    "vllm-b": ((), ("vllm:--max-num-batched-tokens 2048", "vllm:--performance-mode interactivity")),
    "ours-tp": (("rapidserve", "disagg-npmd"), ()),
    "hybrid-chunks": (("hybrid-512", "hybrid-1024", "hybrid-2048"), ()),
    "vllm-default": ((), ("vllm:",)),
    "vllm-1024": ((), ("vllm:--max-num-batched-tokens 1024",)),
    "vllm-2048": ((), ("vllm:--max-num-batched-tokens 2048",)),
}
TP_GROUPS: tuple[str, ...] = ("ours-tp", "hybrid-chunks", "vllm-default", "vllm-1024", "vllm-2048")

GIB = 1 << 30
H200_GIB = 140.0  # nvidia-smi's 143771 MiB
RESERVE_GIB = 10.0  # beside the weights: activations, graphs, communicators and a KV pool worth having
REF_PEAK = 8.5  # req/s: qwen3-8b, one H200, 4096:64 (bench/results/h200x2_1128)
REF_ACTIVE, REF_PROMPT = 8.19e9, 4096


def params(cfg: ModelConfig) -> tuple[float, float]:
    """(all parameters, those one token uses) of a model, from its shapes (the experts counted top_k of n)."""
    h, q, kv, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.vocab_size
    attn = h * (2 * q + 2 * kv)
    if cfg.moe is None:
        mlp = mlp_active = 3 * h * cfg.intermediate_size
    else:
        mlp = 3 * h * cfg.moe.intermediate_size * cfg.moe.num_experts + h * cfg.moe.num_experts
        mlp_active = 3 * h * cfg.moe.intermediate_size * cfg.moe.top_k
    head = v * h * (1 if cfg.tie_word_embeddings else 2)
    return float(cfg.num_layers * (attn + mlp) + head), float(cfg.num_layers * (attn + mlp_active) + v * h)


def weights_gib(cfg: ModelConfig, bytes_per_param: int = 2) -> float:
    return params(cfg)[0] * bytes_per_param / GIB


def disagg_note(cfg: ModelConfig, tp: int, gpu_gib: float = H200_GIB, gpu_mem: float = 0.8) -> str | None:
    """Why disagg-npmd cannot run beside the others at TP `tp` (None: it can): its two halves of the GPUs."""
    if tp < 2 or tp % 2:
        return f"disagg-npmd not run: it halves the TP {tp} GPUs (prefill, decode): give an even TP >= 2"
    half = tp // 2
    problem = ParallelConfig(tensor_parallel_size=half, prefill_tensor_parallel_size=half).disagg_problem(cfg)
    if problem is not None:
        return f"disagg-npmd not run: {problem}"
    per_gpu, room = weights_gib(cfg) / half, gpu_gib * gpu_mem
    if per_gpu + RESERVE_GIB > room:
        return (f"disagg-npmd not run: each side holds the whole model over {half} GPU(s): {per_gpu:.0f} GiB of bf16 "
                f"weights a GPU, + {RESERVE_GIB:.0f} GiB beside them > {gpu_mem:g} x {gpu_gib:.0f} GiB; needs TP >= "
                f"{2 * math.ceil(weights_gib(cfg) / (room - RESERVE_GIB))}")
    return None


def group_systems(group: str, cfg: ModelConfig, tp: int, gpu_gib: float = H200_GIB,
                  gpu_mem: float = 0.8) -> tuple[list[str], list[str], str]:
    """(our systems, vLLM's systems, a note: what was dropped and why, or '') of a group at TP `tp`.
    ValueError for an unknown group, or a TP the model cannot be split over."""
    names = group.split("+")  # several groups in one call: ours-tp+hybrid-chunks
    bad = [g for g in names if g not in GROUPS]
    if bad:
        raise ValueError(f"GROUP={group}: {', '.join(bad)}? give one of {', '.join(GROUPS)}, or several joined by +")
    problem = cfg.tp_problem(tp, "TP") if tp > 1 else None
    if problem is not None:
        raise ValueError(problem)
    ours = list(dict.fromkeys(s for g in names for s in GROUPS[g][0]))
    vllm = list(dict.fromkeys(s for g in names for s in GROUPS[g][1]))
    note = disagg_note(cfg, tp, gpu_gib, gpu_mem) if "disagg-npmd" in ours else None
    if note is not None:
        ours.remove("disagg-npmd")
    return ours, vllm, note or ""


def peak_guess(cfg: ModelConfig, tp: int, prompt: int) -> float:
    """A prefill-bound guess of a system's closed-loop peak, req/s (see the docstring)."""
    eff = 0.85 ** math.log2(tp) if tp > 1 else 1.0
    return REF_PEAK * (REF_ACTIVE * REF_PROMPT) / (params(cfg)[1] * prompt) * tp * eff
