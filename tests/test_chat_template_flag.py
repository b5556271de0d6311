"""`--chat-template` (a file or the template itself, as vLLM reads it) and `--trust-request-chat-template`:
read and checked at start-up, before any model loads; a missing file or a template that does not parse
is a clear error (exit 2). The served template over HTTP on every engine path: tests/test_request_fields.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidserve.cli import build_parser, main
from rapidserve.cli_serve import server_config
from rapidserve.config_base import ConfigError
from rapidserve.tokenizer import ChatTemplateError, check_chat_template, load_chat_template

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>" \
           "{% endif %}"


def test_a_file_or_the_template_itself(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE + "\n", encoding="utf-8")
    assert load_chat_template(str(f)) == TEMPLATE + "\n"
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # inline: backslash escapes are decoded as vLLM does (a shell gives "\n" as two characters)
    assert load_chat_template("{{ 'a' }}\\n{{ 'b' }}") == "{{ 'a' }}\n{{ 'b' }}"
    assert load_chat_template("{{ '世界' }}") == "{{ '世界' }}"
    check_chat_template("{% generation %}{{ x }}{% endgeneration %}{% for i in [1] %}{% break %}{% endfor %}")


@pytest.mark.parametrize(("value", "says"), [
    ("missing.jinja", "looks like a file path but cannot be read"),
    ("/no/such/dir/template", "cannot be read"),
    ("{% for m in messages %}", "does not parse"),
    ("{{ 1 + }}", "does not parse"),
    ("{% if x %}\n\n{% endfi %}", "line 3"),
    (" \n ", "empty"),
])
def test_bad_templates_say_why(value: str, says: str) -> None:
    with pytest.raises(ChatTemplateError) as ei:
        load_chat_template(value)
    assert says in str(ei.value) and "--chat-template" in str(ei.value)


def test_a_folder_is_not_a_template(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="cannot be read"):
        load_chat_template(str(tmp_path))


def test_flags_map_to_the_server_config(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE, encoding="utf-8")
    cfg = server_config(build_parser().parse_args(["serve", "--chat-template", str(f),
                                                   "--trust-request-chat-template"]), {})
    assert (cfg.chat_template, cfg.trust_request_chat_template) == (TEMPLATE, True)
    cfg = server_config(build_parser().parse_args(["serve"]), {})
    assert (cfg.chat_template, cfg.trust_request_chat_template) == (None, False)
    with pytest.raises(ConfigError, match="does not parse"):
        server_config(build_parser().parse_args(["serve", "--chat-template", "{% if %}"]), {})


def test_serve_stops_before_binding_its_port(capsys: pytest.CaptureFixture[str]) -> None:
    # a model that does not exist: the template error comes first, before the port is bound and anything loads
    from unittest import mock

    with mock.patch("rapidserve.server.serve.run", side_effect=AssertionError("bound the port")):
        assert main(["serve", "--model", "/no/such/model", "--chat-template", "missing.jinja"]) == 2
        err = capsys.readouterr().err
        assert "--chat-template 'missing.jinja' looks like a file path but cannot be read" in err
        assert main(["serve", "--model", "/no/such/model", "--chat-template", "{{ x "]) == 2
        assert "does not parse" in capsys.readouterr().err


def test_a_model_without_tokenizer_takes_no_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    # found once the port is bound (it answers 503 meanwhile) and the model is resolved: exit 2 all the same
    assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", "--port", "0", "--chat-template",
                 TEMPLATE]) == 2
    assert "has no tokenizer to render chats with" in capsys.readouterr().err


def test_the_served_tokenizer_takes_the_template_and_keeps_the_eos_ids() -> None:
    import dataclasses

    from rapidserve.config import EngineConfig
    from rapidserve.loader import resolve_model
    from rapidserve.server.serve import serving_tokenizer
    from rapidserve.server_config import ServerConfig

    source = resolve_model(None)
    source = dataclasses.replace(source, config=source.config.replace(eos_token_ids=(7,)))
    ecfg = EngineConfig(model="default", model_config=source.config)
    for template in (None, TEMPLATE):
        got, tokenizer = serving_tokenizer(ecfg, ServerConfig(chat_template=template), source)
        assert tokenizer is not None and got.model_config.eos_token_ids == (7, 2)  # + the tokenizer's <|im_end|>
        assert (tokenizer.chat_template == TEMPLATE) == (template is not None)
