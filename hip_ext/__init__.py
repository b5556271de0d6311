"""AMD (HIP) layer of rapidserve: CU masks and CU-masked streams.

Nothing here has run on a real AMD GPU; see README.md.
"""

from __future__ import annotations

from hip_ext.cumask import (
    cu_mask_words,
    decode_mask,
    mask_to_cu_ids,
    prefill_mask,
    round_to_granularity,
    xcd_balance,
)

__all__ = [
    "cu_mask_words",
    "decode_mask",
    "mask_to_cu_ids",
    "prefill_mask",
    "round_to_granularity",
    "xcd_balance",
]
