"""The vocabulary of the sampling parameters' checks: their error, and the tests and renderings they share.

`SamplingParams` (sampling_params.py), `StructuredOutputs` (structured_outputs.py) and vLLM's fields that rapidserve
carries without serving (vllm_sampling_fields.py) raise `SamplingParamsError`, a `ValueError` whose message names
the field, the value and what is allowed. Pure.
"""

from __future__ import annotations

import math


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; the message says which field and what is allowed."""


def check(cond: bool, msg: str) -> None:
    """Raise `SamplingParamsError(msg)` unless `cond`."""
    if not cond:
        raise SamplingParamsError(msg)


def is_int(v: object) -> bool:
    """An int and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    """A finite int or float, not a bool."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def short(v: object, limit: int = 120) -> str:
    """`repr(v)`, cut to `limit` characters for a message."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "...]"


def unsupported(name: str, value: object, allowed: str, why: str) -> SamplingParamsError:
    """The error for vLLM's field `name` given a `value` that asks for what rapidserve does not do: it names the
    field, says why (vllm_reasons.WHY's reason, where the HTTP API shares the field) and what is accepted."""
    return SamplingParamsError(f"{name}={short(value)} is not supported by rapidserve ({why}): leave it out, or "
                               f"give {allowed}")
