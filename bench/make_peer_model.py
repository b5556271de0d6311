"""A Hugging Face model folder of one of rapidserve's presets for vLLM's dummy loader (no weights): its
config.json (`loader.presets.hf_config_dict`, bf16) and a word-level tokenizer with one word per token id,
so any generated id detokenizes. The same shape as `--model preset:NAME` for rapidserve.

    python bench/make_peer_model.py qwen3-14b /root/peermodel-qwen3-14b
    python bench/make_peer_model.py llama-3.1-70b /root/peermodel-llama-3.1-70b-fp8 --fp8

`--fp8`: the folder declares an FP8 checkpoint (`FP8_DYNAMIC`, compressed-tensors `float-quantized`: per-channel
e4m3 weight scales, dynamic per-token activations, the LM head left in bf16: the scheme of llm-compressor's
FP8_DYNAMIC checkpoints, and the one `rapidserve serve --quantization fp8` applies), so vLLM's dummy loader
allocates fp8 weights directly, as for a real FP8 checkpoint (what users of a 70B in fp8 serve). vLLM's online
`--quantization fp8` has in several releases loaded the bf16 model before quantizing it (vLLM issue 4387, PRs 19967
and 32773), which for the 70B shape on one GPU (141 GB of bf16) would not fit. vLLM then reads the
scheme from the folder and must not get `--quantization` too (it refuses a flag that differs from the folder's
method): `vllm_quantization_flags` drops it where the folder declares the same scheme (bench/compare_systems.py).
A mixture-of-experts preset is refused with --fp8 (rapidserve serves no fp8 MoE: the comparison would not be one).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# llm-compressor's FP8_DYNAMIC scheme as compressed-tensors writes it in config.json
FP8_DYNAMIC: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}},
    "ignore": ["lm_head"]}


def folder_quantization(folder: str) -> str | None:
    """The quantization method `folder`'s config.json declares ("fp8-dynamic" for `FP8_DYNAMIC`'s scheme, else its
    quant_method), None where it declares none or has no readable config.json."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            q = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(q, dict):
        return None
    if {k: q.get(k) for k in FP8_DYNAMIC} == FP8_DYNAMIC:
        return "fp8-dynamic"
    return str(q.get("quant_method"))


def vllm_quantization_flags(flags: list[str], folder: str) -> list[str]:
    """`flags` (vLLM's, from our --serve-args) without `--quantization fp8` where vLLM's model folder already
    declares `FP8_DYNAMIC` (the same scheme as our `--quantization fp8`: vLLM reads it from the folder and refuses
    a --quantization beside it); ValueError where the folder declares another method than the flag asks. Unchanged
    where the folder declares none."""
    declared = folder_quantization(folder)
    if declared is None:
        return flags
    out: list[str] = []
    i = 0
    while i < len(flags):
        name, eq, value = flags[i].partition("=")
        if name == "--quantization":
            if not eq:
                value = flags[i + 1] if i + 1 < len(flags) else ""
                i += 1
            if not (value == "fp8" and declared == "fp8-dynamic"):
                raise ValueError(f"--quantization {value}: vLLM's model folder {folder} declares {declared}; give "
                                 "the folder's scheme (--quantization fp8 with a folder from make_peer_model.py "
                                 "--fp8) or a folder without one")
        else:
            out.append(flags[i])
        i += 1
    return out


def main(preset: str, out: str, fp8: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rapidserve.loader.presets import hf_config_dict, preset_config

    cfg = preset_config(preset)
    if fp8 and cfg.moe is not None:
        raise SystemExit(f"make_peer_model: --fp8 with {preset} ({cfg.arch}): rapidserve serves no fp8 "
                         "mixture-of-experts model, so there is nothing to compare; drop --fp8")
    os.makedirs(out, exist_ok=True)
    hf = hf_config_dict(cfg, torch.bfloat16)
    if fp8:
        hf["quantization_config"] = FP8_DYNAMIC
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.vocab_size - 1
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else eos
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", bos_token=f"t{bos}", unk_token="t0")
    fast.save_pretrained(out)
    print(f"{out}: {preset} ({cfg.arch}, vocab {cfg.vocab_size}{', FP8_DYNAMIC' if fp8 else ''}), tokenizer of "
          f"{len(fast)} ids")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--fp8"]
    if len(args) != 2:
        raise SystemExit("usage: python bench/make_peer_model.py PRESET OUT_FOLDER [--fp8]")
    main(args[0], args[1], fp8="--fp8" in sys.argv[1:])
