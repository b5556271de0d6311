"""A key a configuration file's loader does not know is refused by name, never ignored (rapidserve/jsonfile.py's
`unknown_key_problem`): the partition profiles (top level, configurations, entries), the device tables (PDL, W8A16:
an entry), the fp8 and MoE tile tables (top level, a config, a GEMM's tiles) and --kv-events-config. The message names
the file, the key, the JSON path of the object holding it, the keys allowed there and, where one is close, the key
meant. Every committed JSON input loads through its strict loader, and reads back as the file it came from. Traces
are data others publish: a Mooncake line's other keys are read past."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rapidserve.jsonfile import closest, unknown_key, unknown_key_problem
from rapidserve.kv_events_config import KVEventsConfig, KVEventsConfigError
from rapidserve.ops import fp8_tiles, moe_tiles, pdl_table, w8a16_table
from rapidserve.ops.table_files import device_table_json
from rapidserve.partition.profile import Profile, ProfileError, load_profile

REPO = Path(__file__).resolve().parent.parent
OPS = REPO / "rapidserve" / "ops"
PROFILE_FILE = REPO / "profiles" / "nvidia-h200__preset-qwen3-30b-a3b.json"
FP8_FILE = OPS / "fp8_configs" / "device_name=NVIDIA_H200.json"
MOE_FILE = OPS / "moe_configs" / "E=8,N=7168,K=4096,device_name=NVIDIA_H200,dtype=bfloat16.json"

JsonPath = tuple[str | int, ...]

# every committed JSON input of the engine: (its files, its strict loader, what writes a loaded one back as JSON)
COMMITTED: tuple[tuple[list[Path], Callable[[Path], Any], Callable[[Any], Any]], ...] = (
    (sorted((REPO / "profiles").glob("*.json")), load_profile, msgspec.to_builtins),
    ([pdl_table.TABLE_PATH], pdl_table.load_table, device_table_json),
    ([w8a16_table.TABLE_PATH], w8a16_table.load_table, device_table_json),
    (sorted((OPS / "fp8_configs").glob("*.json")), fp8_tiles.load_table, fp8_tiles.table_json),
    (sorted((OPS / "moe_configs").glob("*.json")), moe_tiles.load_table, moe_tiles.table_json),
)
CASES = [(path, load, dump) for paths, load, dump in COMMITTED for path in paths]


def test_every_json_file_of_the_package_has_a_strict_loader() -> None:
    assert {p for p, _, _ in CASES if OPS in p.parents} == set(OPS.rglob("*.json"))
    assert len([p for p, _, _ in CASES if p.parent.name == "profiles"]) >= 7


@pytest.mark.parametrize(("path", "load", "dump"), CASES, ids=[p.name for p, _, _ in CASES])
def test_every_committed_json_input_loads_strictly_and_as_written(path: Path, load: Callable[[Path], Any],
                                                                  dump: Callable[[Any], Any]) -> None:
    """Loaded by the strict loader, and nothing of the file is dropped: written back, it is the file (a profile: its
    every key, with the defaults of the fields it leaves out besides)."""
    raw, loaded = json.loads(path.read_text()), dump(load(path))
    if load is load_profile:
        assert {k: loaded[k] for k in raw} == raw
        assert load_profile(path) == msgspec.json.decode(path.read_bytes(), type=Profile)
    else:
        assert loaded == raw


def _at(d: Any, at: JsonPath) -> dict[str, Any]:
    for step in at:
        d = d[step]
    assert isinstance(d, dict)
    return d


# kind: (its file's content, the name it must have, its loader, its error)
KINDS: dict[str, tuple[Callable[[], Any], str, Callable[[Path], Any], type[Exception]]] = {
    "profile": (lambda: json.loads(PROFILE_FILE.read_text()), PROFILE_FILE.name, load_profile, ProfileError),
    "pdl": (lambda: json.loads(pdl_table.TABLE_PATH.read_text()), "pdl_table.json", pdl_table.load_table,
            pdl_table.PdlTableError),
    "w8a16": (lambda: {"NVIDIA H200": {"max_rows": 16, "source": "a test"}}, "w8a16_table.json",
              w8a16_table.load_table, w8a16_table.W8a16TableError),
    "fp8": (lambda: json.loads(FP8_FILE.read_text()), FP8_FILE.name, fp8_tiles.load_table, fp8_tiles.Fp8TableError),
    "moe": (lambda: json.loads(MOE_FILE.read_text()), MOE_FILE.name, moe_tiles.load_table, moe_tiles.MoeTableError),
}


@pytest.mark.parametrize(("kind", "at", "key", "field", "place", "meant"), [
    ("profile", (), "bogus_top", "field `bogus_top`", "at the top level (`$`)", None),
    ("profile", (), "quantisation", "field `quantisation`", "at the top level (`$`)", "quantization"),
    ("profile", (), "KV_cache_dtype", "field `KV_cache_dtype`", "at the top level (`$`)", "kv_cache_dtype"),
    ("profile", ("configurations", 1), "decode_unit", "field `configurations[1].decode_unit`",
     "in the object at `configurations[1]`", "decode_units"),
    ("profile", ("entries", 0), "prefill_tokens_per_sec", "field `entries[0].prefill_tokens_per_sec`",
     "in the object at `entries[0]`", "prefill_tokens_per_s"),
    ("profile", ("entries", 5), "comment", "field `entries[5].comment`", "in the object at `entries[5]`", None),
    ("pdl", ("NVIDIA H200",), "max_row", ": NVIDIA H200.max_row: ", "in the object at `NVIDIA H200`", "max_rows"),
    ("pdl", ("NVIDIA H200",), "measured_on", ": NVIDIA H200.measured_on: ", "in the object at `NVIDIA H200`",
     None),
    ("w8a16", ("NVIDIA H200",), "sorce", ": NVIDIA H200.sorce: ", "in the object at `NVIDIA H200`", "source"),
    ("fp8", (), "shape", ": shape: ", "at the top level (`$`)", "shapes"),
    ("fp8", (), "tuned_on", ": tuned_on: ", "at the top level (`$`)", None),
    ("fp8", ("shapes", "6144x4096", "16"), "SPLIT_K", ": shapes.6144x4096.16.SPLIT_K: ",
     "in the object at `shapes.6144x4096.16`", "split_k"),
    ("moe", (), "dtpye", ": dtpye: ", "at the top level (`$`)", "dtype"),
    ("moe", ("configs", "0.25"), "TAIL_BLOCK", ": configs.0.25.TAIL_BLOCK: ", "in the object at `configs.0.25`",
     "TAIL_BLOCK_M"),
    ("moe", ("configs", "0.25", "down"), "split_k", ": configs.0.25.down.split_k: ",
     "in the object at `configs.0.25.down`", "SPLIT_K"),
])
def test_each_loader_refuses_an_unknown_key_by_name(tmp_path: Path, kind: str, at: JsonPath, key: str, field: str,
                                                     place: str, meant: str | None) -> None:
    content, name, load, error = KINDS[kind]
    d = content()
    obj = _at(d, at)
    allowed = list(obj)
    obj[key] = 1
    path = tmp_path / name
    path.write_text(json.dumps(d))
    with pytest.raises(error) as info:
        load(path)
    msg = str(info.value)
    assert str(path) in msg and field in msg and f"unknown field {json.dumps(key)} {place} (allowed: " in msg, msg
    assert all(k in msg.split("(allowed: ")[1] for k in allowed), msg  # (the keys the file holds there, at least)
    assert msg.endswith(f"; did you mean {json.dumps(meant)}?" if meant else "; remove it, or correct its name"), msg
    del obj[key]
    path.write_text(json.dumps(d))
    assert load(path) is not None  # the same without it: loads


@pytest.mark.parametrize("kind", ["pdl", "w8a16"])
def test_a_device_tables_top_level_keys_are_device_names(tmp_path: Path, kind: str) -> None:
    """Any name is a device's (torch.cuda.get_device_name); an entry's field written at the top level is refused as
    an entry that is not an object."""
    content, name, load, error = KINDS[kind]
    path = tmp_path / name
    path.write_text(json.dumps({**content(), "source": "moved out of its entry"}))
    with pytest.raises(error, match=r": source: must be an object of max_rows, .*source, got str"):
        load(path)


def test_a_newer_profile_is_refused_for_its_version_before_its_keys(tmp_path: Path) -> None:
    d = json.loads(PROFILE_FILE.read_text())
    d.update(schema_version=2, a_field_of_version_2=1)
    path = tmp_path / PROFILE_FILE.name
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"field `schema_version`: unsupported version 2; supported versions: \[1\]"):
        load_profile(path)


def test_an_unknown_key_is_named_before_a_bad_value(tmp_path: Path) -> None:
    """A misspelt optional field beside a wrong type elsewhere: the key is named (the file's first problem to fix)."""
    d = json.loads(PROFILE_FILE.read_text())
    d.update(quantisation="fp8", num_compute_units="132")
    path = tmp_path / PROFILE_FILE.name
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match='did you mean "quantization"'):
        load_profile(path)


@pytest.mark.parametrize(("text", "says"), [
    ('{"enable_kv_cache_event": true}', "unknown key(s) 'enable_kv_cache_event'; the keys are enable_kv_cache_events, "
                                        "publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, "
                                        "topic (did you mean 'enable_kv_cache_events'?)"),
    ('{"topc": "x", "zzz": 1}', "unknown key(s) 'topc', 'zzz'; the keys are enable_kv_cache_events, publisher, "
                                "endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic (did you mean "
                                "'topic' for 'topc'?)"),
    ('{"port": 5557}', "unknown key(s) 'port'; the keys are enable_kv_cache_events, publisher, endpoint, "
                       "replay_endpoint, buffer_steps, hwm, max_queue_size, topic"),
])
def test_kv_events_config_names_an_unknown_key_and_the_one_meant(text: str, says: str) -> None:
    with pytest.raises(KVEventsConfigError) as info:
        KVEventsConfig.parse(text)
    assert str(info.value) == f"--kv-events-config: {says}"


def test_the_helpers() -> None:
    assert unknown_key({"b": 1, "z": 2, "c": 3}, ("b",)) == "c" and unknown_key({"b": 1}, ("b", "c")) is None
    assert closest("split_k", ("BLOCK_N", "SPLIT_K")) == "SPLIT_K" and closest("xyz", ("BLOCK_N",)) is None
    assert unknown_key_problem("x", ("a",), "") == unknown_key_problem("x", ("a",), "$")
    assert "`shapes.1`" in unknown_key_problem("x", ("a",), "shapes.1.")


def test_a_mooncake_trace_line_with_other_keys_still_loads(tmp_path: Path) -> None:
    """A trace is data others publish, not configuration: keys besides the four it reads are read past (the
    published Mooncake traces hold exactly timestamp, input_length, output_length and hash_ids)."""
    from rapidserve.benchmark.traces import load_trace

    line = {"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [0, 1], "session_id": "s"}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    trace = load_trace(str(path))
    assert [(r.input_len, r.output_len, r.hash_ids) for r in trace.requests] == [(600, 2, (0, 1))]
