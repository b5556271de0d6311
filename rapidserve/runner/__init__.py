"""Running the model on batches: the `ModelRunner` and its parts.

Modules, each one concept (imports point down this list only; none imports this `__init__`):
- `model_runner`: `ModelRunner` (start-up, the prefill and decode forwards, stream ordering), composed of
  the parts below; `load_runner`.
- `decode_graphs`: decode CUDA/HIP graphs per batch bucket and stream key, their capture and replay.
- `sampling`: the runner's sampling entry points and the penalty-slot bookkeeping.
- `tp`: the tensor-parallel mirroring hooks (publish, broadcast the sampled tokens, a follower's replay).
- `kv_sizing`: what sizes the KV pool (--num-kv-blocks, --kv-cache-memory-bytes, a CPU's bytes, the GPU share).
- `kv_budget`: the GPU share's byte budget and its logged terms.
- `inputs`: `PrefillItem`, `DecodeItem`, `Carry`, and building the flat token batch and attention metadata.
- `prefill_graphs`: piecewise CUDA graphs of the prefill forward.
- `prefill_task`: a prefill launched a layer block at a time (DRIFT's block-wise prefill).
- `model_sharing`: zero-copy sharing of the weights and the KV pool between the decode and prefill workers.
- `device`: the config's device and dtype names resolved to torch's (`resolve_device`, `resolve_dtype`, `DTYPES`).

The names the rest of rapidserve uses are re-exported here: `from rapidserve.runner import ModelRunner`.
"""

from rapidserve.runner.device import DTYPES, resolve_device, resolve_dtype
from rapidserve.runner.inputs import Carry, DecodeItem, PrefillItem
from rapidserve.runner.model_runner import ModelRunner, load_runner
from rapidserve.runner.tp import RanksDiverged

__all__ = ["DTYPES", "Carry", "DecodeItem", "ModelRunner", "PrefillItem", "RanksDiverged", "load_runner",
           "resolve_device", "resolve_dtype"]
