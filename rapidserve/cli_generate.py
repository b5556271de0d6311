"""`rapidserve generate`: completions offline, in this process (`LLM`), one JSON line per prompt."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rapidserve.cli_args import add_model_args, engine_kwargs, positive_int
from rapidserve.config_base import ConfigError


def add_generate_parser(sub: Any) -> None:
    """Add `generate` to the `rapidserve` subcommands (`sub` from ArgumentParser.add_subparsers)."""
    g = sub.add_parser("generate", help="generate completions offline (single process)")
    add_model_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="the sampling seed (with --temperature above 0)")
    g.set_defaults(func=cmd_generate)


def cmd_generate(a: argparse.Namespace) -> int:
    if a.sample_seed is not None and a.temperature == 0:  # before the model loads
        raise ConfigError(f"--sample-seed {a.sample_seed}: --temperature 0 decodes greedily and draws nothing; give a "
                          "--temperature above 0, or drop --sample-seed")
    from rapidserve.llm import LLM
    from rapidserve.sampling_params import SamplingParams

    llm = LLM(a.model, **engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.sample_seed)
    prompts = list(a.prompt)
    tok = llm.get_tokenizer()
    if a.chat and tok is not None:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": c.text, "num_tokens": len(c.token_ids),
                          "finish_reason": c.finish_reason}))
    return 0
