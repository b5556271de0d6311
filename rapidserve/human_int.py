"""vLLM 0.26's human-readable integers, parsed exactly as its `vllm/utils/argparse_utils.py` parses them
(`human_readable_int`, `human_readable_int_or_auto`), for rapidserve's flags that vLLM gives that type
(`--max-model-len`, `--max-num-batched-tokens`).

- a number with a lowercase suffix is decimal: k 10^3, m 10^6, g 10^9, t 10^12, and may have a fraction:
  '25.6k' -> 25600 (as vLLM: `int(float(number) * multiplier)`, truncated);
- with an uppercase suffix it is binary: K 2^10, M 2^20, G 2^30, T 2^40, whole numbers only ('1.5K' is refused
  with vLLM's hint to use the lowercase suffix);
- anything else is Python's `int(text)` (a plain integer, as before).

Pure and torch-free: the CLI's argument types (cli_args.py) add the bounds, and argparse names the flag.
"""

from __future__ import annotations

import re

AUTO = -1  # what human_readable_int_or_auto returns for auto / -1 (vLLM's value for "fit max_model_len")
DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
EXAMPLES = "e.g. 8192, 8k (8000), 8K (8192), 25.6k (25600), 2G (2^31)"


def human_readable_int(text: str) -> int:
    """`text` as vLLM 0.26's human_readable_int reads it (module docstring); ValueError saying why not."""
    value = text.strip()
    match = _SUFFIXED.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in DECIMAL:
            return int(float(number) * DECIMAL[suffix])
        try:
            return int(number) * BINARY[suffix]
        except ValueError:
            raise ValueError(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
                             f"{number}{suffix.lower()} instead?") from None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer ({EXAMPLES})") from None


def human_readable_int_or_auto(text: str) -> int:
    """`human_readable_int`, or AUTO (-1) for '-1' and 'auto' (any case), as vLLM 0.26's `--max-model-len`."""
    value = text.strip()
    if value == "-1" or value.lower() == "auto":
        return AUTO
    return human_readable_int(value)
