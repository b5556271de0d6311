"""JSON input that refuses a key written twice in one object, and the words for a key an object may not hold.

`json.loads` (and msgspec) keep the last of two values of one key without a word, so a hand-edited profile or
device table with a key written twice (two entries for one GPU, a field repeated) would be half ignored. rapidserve's
own JSON inputs (profiles, the device tables, MoE and fp8 tuning tables, `rapidserve bench`'s traces and results,
bench/'s earlier reports, JSON flag values) are read through `loads_unique` / `load_unique` instead, which parse
exactly as `json.loads` does but raise `DuplicateKeyError` (a ValueError) naming the source, the key and the JSON path
of the object that holds it twice (`entries[2]`, `"NVIDIA H200"`). Loaders that name their own fields
(`fail(path, field, problem)`) use its `where` and `problem`. Not read through it, on purpose: a model checkpoint's
own files (config.json and its siblings: transformers and vLLM keep the last value there, and the checkpoint's
authors tested that) and HTTP request bodies (as vLLM). Standard library only: the lowest layer.

A key that a loader of configuration (profiles, device and tuning tables, --kv-events-config) does not know is
refused too, never ignored (a misspelt optional field, `"quantisation"`, would otherwise leave its default in force
without a word): `unknown_key` finds the first in an object, `closest` the allowed key it likely misspells, and
`unknown_key_problem` says what is wrong (the key, the object's JSON path, the keys allowed there and the nearest),
for the loaders' own `fail(path, field, problem)`. Traces are data others publish: their other keys are read past.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class DuplicateKeyError(ValueError):
    """A JSON object of `source` holds `key` twice; `where`: that object's JSON path ("" for the top level)."""

    def __init__(self, source: str, key: str, where: str) -> None:
        self.source, self.key, self.where = source, key, where
        place = f"in the object at `{where}`" if where else "at the top level"
        super().__init__(f"{source}: {self._says(place)}")

    @property
    def problem(self) -> str:
        """What is wrong and what to do, without the source or the object (for loaders that name those)."""
        return self._says("in one object")

    def _says(self, place: str) -> str:
        return (f"the key {json.dumps(self.key)} is written twice {place}; JSON would keep only the last value and "
                "silently ignore the other: remove one of the two")


def _step(path: str, key: str | int) -> str:
    """`path` one level down: `[2]` for a list index, `.name` for a plain name, `."NVIDIA H200"` for any other."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    part = key if _NAME.match(key) else json.dumps(key)
    return f"{path}.{part}" if path else part


def _find(value: Any, found: dict[int, str], path: str = "") -> tuple[str, str] | None:
    """(JSON path, key) of the first object of `value` (in document order) whose id is in `found`."""
    if isinstance(value, dict):
        if id(value) in found:
            return path, found[id(value)]
        children: Any = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        return None
    for k, v in children:
        hit = _find(v, found, _step(path, k))
        if hit is not None:
            return hit
    return None


def loads_unique(text: str | bytes, source: str) -> Any:
    """`json.loads(text)`, except that an object holding a key twice raises DuplicateKeyError (`source`: how the
    message names the input, e.g. its path). Text that is not JSON raises json.JSONDecodeError, as json.loads."""
    dups: list[tuple[dict[str, Any], str]] = []  # (the object, its first repeated key); the object kept alive

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    dups.append((d, k))
                    break
                seen.add(k)
        return d

    value = json.loads(text, object_pairs_hook=hook)
    if dups:
        hit = _find(value, {id(d): k for d, k in dups})
        where, key = hit if hit is not None else ("", dups[0][1])
        raise DuplicateKeyError(source, key, where)
    return value


def load_unique(path: str | os.PathLike[str]) -> Any:
    """The JSON file at `path` (UTF-8) by `loads_unique`, named by its path; OSError where it cannot be read."""
    with open(path, encoding="utf-8") as f:
        return loads_unique(f.read(), os.fspath(path))


def unknown_key(d: Iterable[str], allowed: Collection[str]) -> str | None:
    """The first (in sorted order) of the keys of object `d` that is not in `allowed`; None when all are."""
    return min((k for k in d if k not in allowed), default=None)


def closest(key: str, allowed: Sequence[str]) -> str | None:
    """The one of `allowed` that `key` most likely misspells, letter case aside (difflib's nearest, if close enough:
    `split_k` -> `SPLIT_K`); None if none is."""
    by_lower = {a.lower(): a for a in reversed(allowed)}  # the first of two alike in all but case
    near = difflib.get_close_matches(key.lower(), list(by_lower), n=1)
    return by_lower[near[0]] if near else None


def unknown_key_problem(key: str, allowed: Sequence[str], where: str) -> str:
    """What is wrong with `key` in the object at JSON path `where` ("" or "$": the top level), which may hold only
    `allowed`: the key, the place, the keys allowed there and, where one is close (difflib), which was meant."""
    where = where.rstrip(".")
    place = f"in the object at `{where}`" if where not in ("", "$") else "at the top level (`$`)"
    near = closest(key, allowed)
    hint = f"; did you mean {json.dumps(near)}?" if near is not None else "; remove it, or correct its name"
    return f"unknown field {json.dumps(key)} {place} (allowed: {', '.join(allowed)}){hint}"


__all__ = ["DuplicateKeyError", "closest", "load_unique", "loads_unique", "unknown_key", "unknown_key_problem"]
