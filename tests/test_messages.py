"""Every cross-process message type survives a msgpack round trip unchanged (and as the union)."""

from __future__ import annotations

import msgspec
import pytest

from rapidserve.engine import messages as m
from rapidserve.engine.worker_io import RING_TYPES
from rapidserve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from rapidserve.sampling_params import SamplingParams

P = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, max_tokens=20, stop=("x",), logprobs=2)
NEW = m.NewRequest("r1", [1, 2, 3], P, 12.5)
SAMPLES = [
    NEW,
    m.Abort("r1"),
    m.Shutdown("bye"),
    m.KVReady(NEW, [4, 9, 2]),
    m.KVReady(NEW, [4, 9], [7, 8], 2),
    m.Drop("r1"),
    m.SetPartition("split-32"),
    m.SetPartition("split-32", 12.5),
    m.PrefillDone("r1", 0, m.TokenOut("r1", 0, 7, -0.5, [(7, -0.5)], None)),
    m.PrefillDone("r2", 1, m.TokenOut("r2", 3, 2, None, None, "stop")),
    m.Dropped("r1"),
    m.PrefillFailed("r1", 0, "RuntimeError: boom"),
    m.Heartbeat("prefill", 3),
    m.Heartbeat("prefill", 3, preemptions=2),
    m.TokenBatch([m.TokenOut("r1", 0, 7, -0.5, [(7, -0.5), (9, -1.25)], None),
                  m.TokenOut("r2", 3, 2, None, None, "length")]),
    m.Finished("r1", "abort"),
    m.Finished("r3", "error", "prompt too long"),
    m.Stats(3, 1, 2, 100, 40, 5, "none"),
    m.Stats(3, 1, 2, 100, 40, 5, "none", step_kinds={"fused": m.StepKindStats(3, 120.5, 1, 110.0, 120.5)},
            step_correction={"fused": 1.1, "split": 0.9, "decode": 1.0}),
    m.KVEvents([BlockStored([2**64 - 1, 7], None, list(range(32)), 16, None, "GPU", None),
                BlockRemoved([5, 2**63], "GPU"), AllBlocksCleared()]),
    m.Ready("decode", 1234, {"kv_blocks": "100"}),
    m.WorkerError("prefill", "boom"),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(m.ALL_MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(data, type=type(msg)) == msg
    rings = [label for label, w in RING_TYPES.items() if type(msg) in getattr(w.types, "__args__", (w.types,))]
    assert rings, f"{type(msg).__name__} travels on no ring"
    for label in rings:  # decoded through the ring's declared union, as the receiver does
        assert msgspec.msgpack.decode(data, type=RING_TYPES[label].types) == msg


def test_wrong_type_is_refused() -> None:
    data = msgspec.msgpack.encode(m.Abort("x"))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(data, type=RING_TYPES["d2r"].types)
