"""Running the model on batches: the `ModelRunner` (model_runner.py), piecewise prefill graphs
(prefill_graphs.py), a prefill launched a layer block at a time (prefill_task.py), zero-copy sharing of the
weights and the KV pool between the decode and prefill workers (model_sharing.py).

The names the rest of rapidserve uses are re-exported here: `from rapidserve.runner import ModelRunner`.
"""

from rapidserve.runner.model_runner import (
    DTYPES,
    Carry,
    DecodeItem,
    ModelRunner,
    PrefillItem,
    RanksDiverged,
    load_runner,
    resolve_device,
    resolve_dtype,
)

__all__ = ["DTYPES", "Carry", "DecodeItem", "ModelRunner", "PrefillItem", "RanksDiverged", "load_runner",
           "resolve_device", "resolve_dtype"]
