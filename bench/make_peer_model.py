"""A Hugging Face model folder of one of rapidserve's presets for vLLM's dummy loader (no weights): its
config.json (`loader.presets.hf_config_dict`, bf16) and a word-level tokenizer with one word per token id,
so any generated id detokenizes. The same shape as `--model preset:NAME` for rapidserve.

    python bench/make_peer_model.py qwen3-14b /root/peermodel-qwen3-14b
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(preset: str, out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rapidserve.loader.presets import hf_config_dict, preset_config

    cfg = preset_config(preset)
    os.makedirs(out, exist_ok=True)
    hf = hf_config_dict(cfg, torch.bfloat16)
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
    print(f"{out}: {preset} ({cfg.arch}, vocab {cfg.vocab_size}), tokenizer of {len(fast)} ids")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
