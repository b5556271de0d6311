"""rapidserve: prefill and decode on one GPU, in two processes sharing weights and one paged KV cache.

Top-level names are imported lazily, so `import rapidserve.ipc` (in a worker, or a light test)
does not pull in torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

_LAZY = {
    "LLM": "rapidserve.llm",
    "SamplingParams": "rapidserve.sampling_params",
    "RequestOutput": "rapidserve.outputs",
    "CompletionOutput": "rapidserve.outputs",
    "Logprob": "rapidserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rapidserve' has no attribute {name!r}")
