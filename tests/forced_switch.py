"""What makes tests/test_engine_gpu.py's adaptive runs switch partitions on any GPU, whatever its speed.

The GPU test must see a partition switch. Left to the roofline (no committed profile for the tiny test
model) or to a measured profile, whether one happens depends on the GPU's timings: on an H200 none did.
Two levers take the timings out:

* `forcing_profile`, written by the test and given as `--profile`, for `--policy rapid`: every
  configuration's decode step is 1 ms alone and 2 ms beside prefill (within the 50 ms SLO at any batch
  and context, buckets or beyond), and every split gives prefill more tokens/s than overallocated. So
  `manager.decide` targets the split with the most prefill units whenever prefill has work (waiting or
  prefilling: `DecodeScheduler.has_pending`), with or without decode running, and overallocated whenever
  it has none; with `hysteresis_steps=0` each change of target is a switch at the next step boundary.
  The first request of a round reaches decode while it is idle, is waiting at that step boundary (the
  boundary decides before admitting), so the switch to the split is certain.
* a holder request for `--policy duet`: decode's roofline decision only splits while decode runs AND
  prefill has work, and with an SLO of `DUET_SLO_MS` (1e-9 ms, a picosecond) a split is certain then: the
  roofline puts the tiny model's shared step at ~0.4 us with H100 peaks, and still at ~0.4 ns with peaks a
  thousand times higher (`test_forced_switch.py`). The holder (a long greedy request, aborted at the end)
  is decoding (its first token came from decode) when the other prompts are sent, and is asserted still
  running after they all finished, so at the step boundary after each of them reaches decode, decode runs
  and prefill has work. The same holder runs under the rapid policy, where it adds switches mid-decode.
"""

from __future__ import annotations

from collections.abc import Sequence

from rapidserve.partition.profile import OVERALLOCATED, Configuration, Entry, Profile, model_label

DUET_SLO_MS = 1e-9
BATCHES = [1, 8, 16]
CONTEXTS = [256, 1024]
ALONE_MS = 1.0
BESIDE_MS = 2.0


def prefill_rate(c: Configuration, num_units: int) -> float:
    """Tokens/s the forcing profile gives prefill under `c`: overallocated the least, then more the more
    units prefill holds (so the split with the fewest decode units is the manager's target)."""
    return 1e3 if c.name == OVERALLOCATED else 1e3 * (2 + c.prefill_units / num_units)


def forcing_profile(gpu: str, model: str, configs: Sequence[Configuration], num_units: int,
                    prefill_tokens: int) -> Profile:
    """A valid profile for `gpu` and `model` over `configs` (the device's own: `plan_configurations` of its
    granularity) under which the rapid manager's choice depends only on whether prefill has work."""
    entries = [Entry(c.name, b, x, ALONE_MS, ALONE_MS, BESIDE_MS, BESIDE_MS, prefill_rate(c, num_units))
               for c in configs for b in BATCHES for x in CONTEXTS]
    return Profile(gpu=gpu, model=model_label(model), num_compute_units=num_units, configurations=list(configs),
                   batch_buckets=list(BATCHES), context_buckets=list(CONTEXTS), entries=entries,
                   created="written by tests/forced_switch.py", source="measured", prefill_tokens=prefill_tokens)


def split_for_prefill(configs: Sequence[Configuration]) -> str:
    """The configuration the forcing profile makes the manager pick while prefill has work."""
    return max((c for c in configs if c.decode_units), key=lambda c: c.prefill_units).name
