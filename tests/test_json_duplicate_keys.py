"""A key written twice in one object of a JSON input is refused by name (rapidserve/jsonfile.py), by every loader of
one: the partition profiles, the device tables (PDL, W8A16, fp8 tiles, MoE tiles), `rapidserve bench`'s traces,
results and --extra-body, --kv-events-config, --default-chat-template-kwargs and bench/'s earlier reports; the message
names the file (or flag), the key and the object holding it. Valid files load as they did (json.loads / msgspec)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rapidserve.jsonfile import DuplicateKeyError, load_unique, loads_unique
from rapidserve.ops import fp8_tiles, moe_tiles, pdl_table, w8a16_table
from rapidserve.partition.profile import Profile, ProfileError, load_profile
from tests.bench_module import load_bench

REPO = Path(__file__).resolve().parent.parent
OPS = REPO / "rapidserve" / "ops"
FP8_FILE = OPS / "fp8_configs" / "device_name=NVIDIA_H200.json"
MOE_FILE = OPS / "moe_configs" / "E=8,N=7168,K=4096,device_name=NVIDIA_H200,dtype=bfloat16.json"
PROFILE_FILE = REPO / "profiles" / "nvidia-h200__preset-qwen3-8b.json"
W8A16_ONE = {"NVIDIA H200": {"max_rows": 16, "source": "a test"}}
TWICE = "is written twice"

JsonPath = tuple[str | int, ...]


def dumps_twice(v: Any, at: JsonPath) -> str:
    """`v` as JSON text, the object at path `at` holding its first key twice (the same value both times)."""
    if not at:
        assert isinstance(v, dict) and v
        first = next(iter(v))
        return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(x)}" for k, x in [(first, v[first]), *v.items()]) + "}"
    head, rest = at[0], at[1:]
    if isinstance(v, list):
        return "[" + ", ".join(dumps_twice(x, rest) if i == head else json.dumps(x) for i, x in enumerate(v)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)}: {dumps_twice(x, rest) if k == head else json.dumps(x)}"
                           for k, x in v.items()) + "}"


def first_key(v: Any, at: JsonPath) -> str:
    for step in at:
        v = v[step]
    return str(next(iter(v)))


# ---------------------------------------------------------------- the helper


@pytest.mark.parametrize(("text", "key", "where"), [
    ('{"a": 1, "a": 2}', "a", ""),
    ('{"a": 1, "b": {"c": 1, "c": 1}}', "c", "b"),
    ('{"gpus": {"NVIDIA H200": {"x": 1, "y": 2, "x": 3}}}', "x", 'gpus."NVIDIA H200"'),
    ('{"entries": [{}, [], {"b": 1, "b": 1}]}', "b", "entries[2]"),
    ('[[{"k": {"q\\"uote": 1, "q\\"uote": 2}}]]', 'q"uote', '[0][0].k'),
    ('{"x": {"a": 1, "a": 2}, "y": {"b": 1, "b": 2}}', "a", "x"),  # the first in the file is named
])
def test_a_key_written_twice_is_named_with_its_object(text: str, key: str, where: str) -> None:
    with pytest.raises(DuplicateKeyError) as info:
        loads_unique(text, "some/file.json")
    e = info.value
    assert (e.source, e.key, e.where) == ("some/file.json", key, where)
    msg = str(e)
    assert msg.startswith("some/file.json: ") and json.dumps(key) in msg and "remove one of the two" in msg
    assert (f"`{where}`" in msg) if where else ("at the top level" in msg)
    assert isinstance(e, ValueError) and json.dumps(key) in e.problem and "some/file.json" not in e.problem


@pytest.mark.parametrize("text", [
    '{"a": 1, "b": [1, 2.5, null, true], "c": {"d": "e", "A": 1}}', "[]", "3", '"s"', '{"x": NaN, "y": -Infinity}',
    '{"a": {"k": 1}, "b": {"k": 1}}',  # the same key in two objects is no duplicate
])
def test_valid_json_parses_as_json_loads(text: str) -> None:
    got, want = loads_unique(text, "f"), json.loads(text)
    assert json.dumps(got) == json.dumps(want)  # (NaN != NaN: compared as text)
    assert json.dumps(loads_unique(text.encode(), "f")) == json.dumps(want)


def test_text_that_is_not_json_raises_as_json_loads(tmp_path: Path) -> None:
    with pytest.raises(json.JSONDecodeError):
        loads_unique('{"a": ', "f")
    path = tmp_path / "t.json"
    path.write_text('{"a": {"n": 1, "n": 2}}')
    with pytest.raises(DuplicateKeyError, match=f"{path}: .*\"n\".*`a`"):
        load_unique(path)
    with pytest.raises(OSError):
        load_unique(tmp_path / "missing.json")


def test_the_repos_json_inputs_hold_no_key_twice() -> None:
    files = [*(REPO / "profiles").glob("*.json"), *OPS.glob("*.json"), *(OPS / "fp8_configs").glob("*.json"),
             *(OPS / "moe_configs").glob("*.json"), REPO / "bench" / "gpu_suite_times.json",
             REPO / "bench" / "structured_outputs_body.json"]
    assert len(files) > 10
    for f in files:
        load_unique(f)


# ---------------------------------------------------------------- the profile and the device tables


def _copy(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# kind: (its file's content, the name it must have, its loader, its error)
KINDS: dict[str, tuple[Callable[[], Any], str, Callable[[Path], Any], type[Exception]]] = {
    "profile": (lambda: json.loads(PROFILE_FILE.read_text()), PROFILE_FILE.name, load_profile, ProfileError),
    "pdl": (lambda: json.loads(pdl_table.TABLE_PATH.read_text()), "pdl_table.json", pdl_table.load_table,
            pdl_table.PdlTableError),
    "w8a16": (lambda: W8A16_ONE, "w8a16_table.json", w8a16_table.load_table, w8a16_table.W8a16TableError),
    "fp8": (lambda: json.loads(FP8_FILE.read_text()), FP8_FILE.name, fp8_tiles.load_table, fp8_tiles.Fp8TableError),
    "moe": (lambda: json.loads(MOE_FILE.read_text()), MOE_FILE.name, moe_tiles.load_table, moe_tiles.MoeTableError),
}


@pytest.mark.parametrize(("kind", "at", "where"), [
    ("profile", (), "field `$`"),
    ("profile", ("configurations", 1), "field `configurations[1]`"),
    ("profile", ("entries", 3), "field `entries[3]`"),
    ("pdl", (), ": the file: "),
    ("pdl", ("NVIDIA H200",), ': "NVIDIA H200": '),
    ("w8a16", (), ": the file: "),
    ("w8a16", ("NVIDIA H200",), ': "NVIDIA H200": '),
    ("fp8", (), ": the file: "),
    ("fp8", ("shapes", "6144x4096", "16"), ': shapes."6144x4096"."16": '),
    ("moe", (), ": the file: "),
    ("moe", ("configs", "0.25", "gate_up"), ': configs."0.25".gate_up: '),
])
def test_each_loader_refuses_a_key_written_twice(tmp_path: Path, kind: str, at: JsonPath, where: str) -> None:
    content, name, load, error = KINDS[kind]
    d = content()
    path = _copy(tmp_path, name, dumps_twice(d, at))
    with pytest.raises(error) as info:
        load(path)
    msg = str(info.value)
    assert str(path) in msg and where in msg, msg
    assert f"the key {json.dumps(first_key(d, at))} {TWICE}" in msg and "remove one of the two" in msg, msg
    assert load(_copy(tmp_path, name, json.dumps(d))) is not None  # the same, each key once: loads


@pytest.mark.parametrize("kind", ["pdl", "w8a16", "fp8", "moe"])
def test_valid_tables_load_as_before(tmp_path: Path, kind: str) -> None:
    """What the loader returns is what its parse made of json.loads' reading (the loader before), packaged files and
    one-entry copies alike."""
    content, name, load, _ = KINDS[kind]
    mod, packaged = {"pdl": (pdl_table, pdl_table.TABLE_PATH), "w8a16": (w8a16_table, w8a16_table.TABLE_PATH),
                     "fp8": (fp8_tiles, FP8_FILE), "moe": (moe_tiles, MOE_FILE)}[kind]
    for path in (_copy(tmp_path, name, json.dumps(content(), indent=1)), packaged):
        assert load(path) == mod.parse_table(json.loads(path.read_text()), str(path))


def test_valid_profiles_load_as_before() -> None:
    for path in sorted((REPO / "profiles").glob("*.json")):
        assert load_profile(path) == msgspec.json.decode(path.read_bytes(), type=Profile)


def test_a_profile_that_is_not_json_is_still_invalid_json(tmp_path: Path) -> None:
    for text in ('{"gpu": ', '{"gpu": NaN}'):  # (json.loads takes NaN; msgspec, which reads profiles, does not)
        with pytest.raises(ProfileError, match="invalid JSON"):
            load_profile(_copy(tmp_path, "p.json", text))


# ---------------------------------------------------------------- bench's inputs and the JSON flags


def _trace(tmp_path: Path) -> None:
    from rapidserve.benchmark.traces import load_trace

    ok = '{"timestamp": 0, "input_length": 8, "output_length": 2}'
    load_trace(str(_copy(tmp_path, "t.jsonl", ok + "\n" + ok + "\n")))
    load_trace(str(_copy(tmp_path, "dup.jsonl", ok + '\n{"timestamp": 1, "input_length": 8, "output_length": 2, '
                                                      '"x": {"input_length": 1, "input_length": 1}}\n')))


def _result(tmp_path: Path) -> None:
    from rapidserve.benchmark.results import load_result

    assert load_result(str(_copy(tmp_path, "ok.json", '{"runs": [{"a": 1}]}'))) == {"runs": [{"a": 1}]}
    load_result(str(_copy(tmp_path, "r.json", '{"runs": [{"input_length": 1, "input_length": 2}]}')))


def _extra_body_inline(tmp_path: Path) -> None:
    from rapidserve.benchmark.flags import extra_body_arg

    assert extra_body_arg('{"guided_json": {"input_length": 1}}') == {"guided_json": {"input_length": 1}}
    extra_body_arg('{"guided_json": {"input_length": 1, "input_length": 2}}')


def _extra_body_file(tmp_path: Path) -> None:
    from rapidserve.benchmark.flags import extra_body_arg

    extra_body_arg("@" + str(_copy(tmp_path, "body.json", '{"input_length": 1, "input_length": 1}')))


def _kv_events(tmp_path: Path) -> None:
    from rapidserve.kv_events_config import KVEventsConfig

    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').enable_kv_cache_events
    KVEventsConfig.parse('{"input_length": 1, "enable_kv_cache_events": true, "input_length": 1}')


def _template_kwargs(tmp_path: Path) -> None:
    from rapidserve.cli import build_parser

    parser = build_parser()
    ns = parser.parse_args(["serve", "preset:tiny-llama", "--default-chat-template-kwargs", '{"enable_thinking": 1}'])
    assert ns.default_chat_template_kwargs == {"enable_thinking": 1}
    parser.parse_args(["serve", "preset:tiny-llama", "--default-chat-template-kwargs",
                       '{"input_length": true, "input_length": false}'])


def _search_start_from(tmp_path: Path) -> None:
    path = _copy(tmp_path, "prior.json", '{"frontiers": [], "input_length": 1, "input_length": 2}')
    load_bench("compare_prior").load_hints([str(path)])


def _continue_from(tmp_path: Path) -> None:
    path = _copy(tmp_path, "prior.json", '{"rows": [], "sweeps": {"input_length": 1, "input_length": 2}}')
    load_bench("compare_continue").load_prior(str(path), {})


@pytest.mark.parametrize(("load", "error", "names"), [
    (_trace, "TraceError", ("--trace ", "dup.jsonl", "line 2", "`x`")),
    (_result, "DuplicateKeyError", ("r.json", "`runs[0]`")),
    (_extra_body_inline, "ArgumentTypeError", ("--extra-body: ", "`guided_json`")),
    (_extra_body_file, "ArgumentTypeError", ("--extra-body ", "body.json", "at the top level")),
    (_kv_events, "KVEventsConfigError", ("--kv-events-config: ", "at the top level")),
    (_template_kwargs, "SystemExit", ()),
    (_search_start_from, "ValueError", ("--search-start-from ", "prior.json", "at the top level")),
    (_continue_from, "ValueError", ("--continue-from ", "prior.json", "`sweeps`")),
])
def test_bench_inputs_and_json_flags_refuse_a_key_written_twice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], load: Callable[[Path], None], error: str,
        names: tuple[str, ...]) -> None:
    with pytest.raises((ValueError, argparse.ArgumentTypeError, SystemExit)) as info:
        load(tmp_path)
    assert type(info.value).__name__ == error
    msg = capsys.readouterr().err if error == "SystemExit" else str(info.value)
    if error == "SystemExit":
        names = ("--default-chat-template-kwargs", "at the top level")
    assert f'the key "input_length" {TWICE}' in msg and "remove one of the two" in msg, msg
    for name in names:
        assert name in msg, msg


def test_json_flags_still_take_nan_as_before() -> None:
    """json.loads' own reading is kept (NaN included): only a key written twice is new."""
    from rapidserve.benchmark.flags import extra_body_arg

    assert math.isnan(extra_body_arg('{"temperature": NaN}')["temperature"])


def _report_tools(name: str, path: Path) -> Any:
    """bench/'s report readers on `path`: what each returns or raises (its usage error: SystemExit)."""
    if name == "compare_merge":
        return load_bench(name).merge_reports([str(path)])
    if name == "gpu_suite_parts --times":
        return load_bench("gpu_suite_parts").main(["--times", str(path), "--part", "1/1", "tests/test_a.py"])
    if name == "gpu_suite_parts --merge":
        return load_bench("gpu_suite_parts").main(["--merge", str(path)])
    return load_bench(name).main([str(path)])


@pytest.mark.parametrize(("name", "raises", "out"), [
    ("compare_merge", ValueError, ""),  # no report could be read, and why
    ("gap_report", SystemExit, "err"),
    ("vs_vllm_summary", SystemExit, "err"),
    ("multiturn_makespan", None, "err"),  # skipped, saying why
    ("gpu_suite_parts --times", None, "err"),  # a warning: every file weighs 1
    ("gpu_suite_parts --merge", DuplicateKeyError, ""),
])
def test_bench_report_readers_name_a_key_written_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                                       raises: type[BaseException] | None, out: str) -> None:
    path = _copy(tmp_path, "report.json", '{"runs": [], "input_length": 1, "input_length": 2}')
    if raises is None:
        _report_tools(name, path)
    else:
        with pytest.raises(raises) as info:
            _report_tools(name, path)
    msg = capsys.readouterr().err if out else str(info.value)
    assert str(path) in msg and f'the key "input_length" {TWICE}' in msg, msg
