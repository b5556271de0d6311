"""The roofline's operators of a mixture-of-experts layer (issue 40; rapidserve/moe_config.py), and how many
experts a step reads.

A step reads an expert's weights only when some token chose it. With B tokens each choosing k distinct experts
of E, uniformly (the router's load balancing is trained towards it), one token leaves a given expert out with
probability 1 - k/E, so

    expected unique experts = E * (1 - (1 - k/E)^B)

(`expected_unique_experts`): 2 of 8 at batch 1, 3.5 at 2, 7.8 at 16 for Mixtral; 8 of 128 at 1, 52 at 8, 127 at
64 for Qwen3-30B-A3B. A decode step of B sequences reads that many (`roofline.decode_operators`); a prefill chunk
reads every expert (`roofline.prefill_operators`: hundreds of tokens choose all of them, and real routing is not
uniform); a mixed step the expectation for all its tokens. The FLOPs are the k experts each token uses.

Per sparse layer of one tensor-parallel rank (I' = the rank's slice of an expert's features, b bytes a value):
router 2*T*h*E flops, h*E*b bytes of weight; gate|up 4*T*k*h*I' flops, read*2*h*I'*b weight bytes; down
2*T*k*I'*h flops, read*I'*h*b; activations: x gathered per pair, the pairs' SwiGLU and outputs, the k-way sum.
"""

from __future__ import annotations

from rapidserve.config import ModelConfig


def expected_unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts `tokens` tokens choose, each `top_k` of `num_experts` uniformly."""
    if num_experts < 1 or not 1 <= top_k <= num_experts or tokens < 0:
        raise ValueError(f"num_experts={num_experts}, top_k={top_k}, tokens={tokens}: need 1 <= top_k <= "
                         "num_experts and tokens >= 0")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def experts_read(cfg: ModelConfig, tokens: int, every: bool = False) -> float:
    """Experts whose weights a step of `tokens` tokens reads per sparse layer: all of them when `every` (prefill),
    else the expectation. 0 for a dense model."""
    if cfg.moe is None:
        return 0.0
    if every:
        return float(cfg.moe.num_experts)
    return expected_unique_experts(cfg.moe.num_experts, cfg.moe.top_k, tokens)


def moe_operator_terms(cfg: ModelConfig, tokens: int, read: float, tp: int,
                       b: int) -> list[tuple[str, float, float, float, int]]:
    """(name, flops, weight bytes, activation bytes, count) of the sparse layers' operators of a step over
    `tokens` tokens reading `read` experts per layer, on one rank of `tp` (module docstring); [] for a dense
    model. roofline.py makes them `Operator`s (it imports this module)."""
    moe = cfg.moe
    if moe is None:
        return []
    h, e, k, t = cfg.hidden_size, moe.num_experts, moe.top_k, tokens
    i = moe.intermediate_size // tp
    n = moe.num_sparse(cfg.num_layers)
    return [
        ("moe_router", 2 * t * h * e, h * e * b, t * (h + e) * b, n),
        ("moe_gate_up", 4 * t * k * h * i, read * 2 * h * i * b, t * k * (h + i) * b, n),
        ("moe_down", 2 * t * k * i * h, read * i * h * b, (t * k * (i + h) + t * h) * b, n),
    ]
