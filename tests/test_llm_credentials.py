"""`LLM(hf_token=...)` (the offline API) never shows the token: not in a repr of the LLM or its config, not in a log
line, not in an error message (a model that cannot be loaded, a ConfigError, an argument refused by name); and a
credential inside another argument (hf_overrides' "token", model_loader_extra_config's S3 key) is redacted where a
refusal shows that argument. `rapidserve serve --hf-token`: tests/test_server_credentials.py. On CPU."""

from __future__ import annotations

import logging

import pytest

from rapidserve import LLM, llm_args
from rapidserve.config_base import ConfigError
from rapidserve.llm_args import LLMArgumentError
from rapidserve.loader import ModelLoadError

SECRET = "hf_CredsTest0123456789abcdefXYZ"
CPU = {"device": "cpu", "num_kv_blocks": 64, "use_tqdm_on_load": False}


def test_the_token_is_in_no_repr_and_no_log_line(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET + "env")  # never read (rapidserve never downloads), never logged
    with caplog.at_level(logging.DEBUG):
        llm = LLM("preset:tiny-llama", hf_token=SECRET, **CPU)
        out = llm.generate([[1, 2, 3]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    for text in (repr(llm), str(llm), repr(vars(llm)), repr(llm.config), str(llm.config), caplog.text):
        assert SECRET not in text


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"model": "/no/such/model/dir"}, ModelLoadError, "no such file or folder"),
    ({"model": "no-such-org/no-such-model"}, ModelLoadError, "rapidserve does not download models"),
    ({"model": "preset:tiny-llama", "max_model_len": -5}, ConfigError, "max_model_len=-5"),
    ({"model": "preset:tiny-llama", "tensor_parallel_size": 2}, LLMArgumentError, r"LLM\(tensor_parallel_size=2\)"),
    ({"model": "preset:tiny-llama", "no_such_argument": 1}, TypeError, "'no_such_argument'"),
])
def test_no_error_message_shows_the_token(kwargs: dict[str, object], error: type[Exception], match: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG), pytest.raises(error, match=match) as e:
        LLM(**kwargs, hf_token=SECRET, **{k: v for k, v in CPU.items() if k not in kwargs})  # type: ignore[arg-type]
    assert SECRET not in str(e.value) and SECRET not in repr(e.value.args) and SECRET not in caplog.text


@pytest.mark.parametrize(("name", "value"), [
    ("hf_overrides", {"token": SECRET}),
    ("model_loader_extra_config", {"s3_secret_access_key": SECRET, "s3_endpoint": "http://s3:9000"}),
    # long: the message cuts the value, and was cutting it before redacting (a cut leaves part of the secret)
    ("model_loader_extra_config", {"padding": "p" * 60, "s3_secret_access_key": SECRET}),
])
def test_a_refused_argument_is_shown_without_the_credentials_it_holds(name: str, value: dict[str, str]) -> None:
    with pytest.raises(LLMArgumentError) as e:
        LLM("preset:tiny-llama", **{name: value}, **CPU)  # type: ignore[arg-type]
    text = str(e.value)
    assert text.startswith(f"LLM({name}=") and "is not supported by rapidserve" in text
    assert SECRET not in text and SECRET[:12] not in text


def test_hf_token_takes_vllms_types_and_a_wrong_one_is_named_not_shown() -> None:
    # vLLM's hf_token: a str (the token), True (the one `huggingface-cli login` stored) or False/None (none); all are
    # accepted and ask for nothing here (never a download). hf_token=False was refused as if it asked for one.
    for v in (SECRET, True, False, None):
        assert llm_args.resolve({"hf_token": v}, {}) == {}
    for v in (123, SECRET.encode()):
        with pytest.raises(TypeError, match=r"LLM\(hf_token=\.\.\.\) must be str or bool") as e:
            llm_args.resolve({"hf_token": v}, {})
        assert SECRET not in str(e.value) and "123" not in str(e.value)
    assert llm_args.shown("hf_token", SECRET) == "***" and llm_args.shown("hf_token", True) == "True"
