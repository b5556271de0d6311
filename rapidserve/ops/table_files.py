"""Reading the packaged kernel tables (ops/fp8_tiles.py, ops/moe_tiles.py, ops/pdl_table.py, ops/w8a16_table.py): one
JSON file, or every `*.json` of a folder, each handed to its module's validating `parse` (which names the field of a
bad one); and the by-device tables (pdl_table, w8a16_table: one JSON object of device name -> entry, each entry a
NamedTuple its module parses), read, written back and extended by one device the same way. Plain files, no torch."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from rapidserve.jsonfile import DuplicateKeyError, loads_unique, unknown_key, unknown_key_problem

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
E = TypeVar("E")  # an entry: its module's NamedTuple
DeviceTable = Mapping[str, Any]  # device name -> its module's entry (a NamedTuple), read-only


def read_table(path: Path, parse: Callable[[Any, str], T], fail: Callable[[str, str, str], Exception]) -> T:
    """`parse(the file's JSON, its path)`; a file that is not JSON raises `fail(path, "the file", why)`, one with a
    key written twice in an object `fail(path, that object's JSON path, why)`."""
    try:
        d = loads_unique(path.read_text(), str(path))
    except DuplicateKeyError as e:
        raise fail(str(path), e.where or "the file", e.problem) from None
    except json.JSONDecodeError as e:
        raise fail(str(path), "the file", f"is not JSON ({e})") from None
    return parse(d, str(path))


def read_tables(directory: Path, load: Callable[[Path], T], key: Callable[[T], K]) -> Mapping[K, T]:
    """Every `*.json` under `directory` (none if it does not exist), loaded in name order, by `key`; read-only."""
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    return MappingProxyType({key(t): t for t in map(load, files)})


def entry_fields(d: object, path: str, where: str, fields: tuple[str, ...],
                 fail: Callable[[str, str, str], Exception]) -> dict[str, Any]:
    """An entry's parsed JSON `d` as an object holding exactly `fields` (`where` names it in `fail`'s errors: not an
    object, an unknown field (named, with the allowed ones and the nearest), a missing one); each field's value is
    its module's to check."""
    if not isinstance(d, dict):
        raise fail(path, where, f"must be an object of {', '.join(fields)}, got {type(d).__name__}")
    extra = unknown_key(d, fields)
    if extra is not None:
        raise fail(path, f"{where}.{extra}", unknown_key_problem(extra, fields, where))
    missing = [f for f in fields if f not in d]
    if missing:
        raise fail(path, f"{where}.{missing[0]}", "missing")
    return d


def parse_device_table(d: object, path: str, parse_entry: Callable[[object, str, str], E],
                       fail: Callable[[str, str, str], Exception]) -> Mapping[str, E]:
    """A by-device table from its file's parsed JSON: an object of non-empty device names (torch.cuda.get_device_name)
    -> `parse_entry(entry, path, name)`; `fail(path, field, problem)` for what is wrong. Read-only."""
    if not isinstance(d, dict):
        raise fail(path, "the file", f"must be a JSON object of device name -> entry, got {type(d).__name__}")
    out: dict[str, E] = {}
    for name, entry in d.items():
        if not name.strip():
            raise fail(path, repr(name), "a device name (torch.cuda.get_device_name) must not be empty")
        out[name] = parse_entry(entry, path, name)
    return MappingProxyType(out)


def device_table_json(table: DeviceTable) -> dict[str, Any]:
    """The file's content of a by-device table (what `parse_device_table` reads back), by device name."""
    return {name: e._asdict() for name, e in sorted(table.items())}


def with_device_entry(table: Mapping[str, E], device_name: str, entry: E) -> Mapping[str, E]:
    """`table` with `entry` as `device_name`'s (the other devices' entries kept)."""
    if not device_name.strip():
        raise ValueError("a device name (torch.cuda.get_device_name) must not be empty")
    return MappingProxyType({**table, device_name: entry})


def write_device_table(path: Path, table: DeviceTable, load: Callable[[Path], T]) -> T:
    """`table` written as the file at `path`, checked by reading it back with `load` (what the engine will load, or
    raise here); returns what was read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(device_table_json(table), indent=1) + "\n")
    return load(path)


__all__ = ["DeviceTable", "device_table_json", "entry_fields", "parse_device_table", "read_table", "read_tables",
           "with_device_entry", "write_device_table"]
