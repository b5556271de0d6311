"""A tiny Qwen3-shaped model whose chat template is Qwen3's, for the tool-calling tests (issue 19).

`make_tool_model(folder)` writes a Hugging Face folder: the `tiny-qwen3` preset's shapes with its
deterministic random weights, but the embedded SmolLM2 tokenizer's vocabulary (49152 ids, ChatML
`<|im_start|>` / `<|im_end|>` like Qwen's), and `tests/data/qwen3_chat_template.jinja` as its chat
template, which renders `tools` and writes calls as hermes `<tool_call>` JSON. What matters is the
template and the tool-call format the server picks from it, not what the random model says.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from rapidserve.loader import ModelSource, expected_tensor_shapes, resolve_model
from rapidserve.loader.presets import preset_config, preset_tensor, save_as_hf_folder

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "qwen3_chat_template.jinja")


def qwen3_template() -> str:
    with open(TEMPLATE, encoding="utf-8") as f:
        return f.read()


def make_tool_model(folder: str) -> str:
    """Write the model into `folder` (created); returns `folder`."""
    smol = resolve_model(None)
    config = preset_config("tiny-qwen3").replace(vocab_size=smol.config.vocab_size, eos_token_ids=(2,),
                                                 bos_token_id=None, max_position_embeddings=4096)
    shapes = expected_tensor_shapes(config)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            yield name, preset_tensor("tiny-qwen3-tools", config, name, shape)

    source = ModelSource(config=config, weights=weights, num_tensors=len(shapes), tokenizer_dir=smol.tokenizer_dir,
                         tokenizer_file=smol.tokenizer_file, chat_template=None, description="tiny qwen3 tools",
                         tokenizer_cache_dir=smol.tokenizer_cache_dir)
    save_as_hf_folder(source, folder)
    with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(qwen3_template())
    return folder
