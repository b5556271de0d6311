"""Reading the packaged kernel tables (ops/fp8_tiles.py, ops/moe_tiles.py, ops/pdl_table.py): one JSON file, or every
`*.json` of a folder, each handed to its module's validating `parse` (which names the field of a bad one). Plain
files, no torch."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def read_table(path: Path, parse: Callable[[Any, str], T], fail: Callable[[str, str, str], Exception]) -> T:
    """`parse(the file's JSON, its path)`; a file that is not JSON raises `fail(path, "the file", why)`."""
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise fail(str(path), "the file", f"is not JSON ({e})") from None
    return parse(d, str(path))


def read_tables(directory: Path, load: Callable[[Path], T], key: Callable[[T], K]) -> Mapping[K, T]:
    """Every `*.json` under `directory` (none if it does not exist), loaded in name order, by `key`; read-only."""
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    return MappingProxyType({key(t): t for t in map(load, files)})


__all__ = ["read_table", "read_tables"]
