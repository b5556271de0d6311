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
* the same profile and an ITL SLO of `DUET_SLO_MS` (20 ms) for `--policy duet`. The decode worker runs
  `DuetPolicy` (partition/policies.py) on `ProfileCosts` of this measured profile (partition/step_costs.py),
  so the peaks measured at start-up do not enter, and the online correction (partition/correction.py)
  multiplies each prediction by a ratio clamped to [lo, hi] = [0.5, 4]. Under the profile:
  - decode beside the prefill worker on any split is BESIDE_MS = 2 ms at any batch, context and prefill
    batch (`beside_prefill_ms`: min(2, 1 + 1 + prefill work) = 2), at most 2 x 4 = 8 ms corrected, within
    the limit margin x SLO = 18 ms: every split meets the SLO;
  - a fused step of B >= 1 decode rows and C >= 1 prompt tokens is alone + (B + C) / R - base (its
    composition) with R the whole GPU's prefill rate, WHOLE_PREFILL_RATE = 1 token/s: >= 2000 ms, at least
    1000 ms corrected, 55x the limit: no fused chunk fits, not even one token of a prefix-cached prompt.
  So beside a running decode with prompts pending and the prefill worker idle, `decide_adaptive` finds no fused
  chunk (0 tokens, "too small"), and a split meets the SLO: Split, certainly; with the prefill worker busy,
  a split too (kept, or the best one from the whole GPU); with nothing pending and the prefill worker idle,
  decode alone on the whole GPU (`hysteresis_steps=0`: no split is held); with nothing pending and the prefill
  worker still busy, decode stays on a split ("a split kept for the batch it launched") until it is done,
  which it is once every prompt has its first token. With no decode running, prompts are fused on the whole
  GPU (no switch). Hence the holders: a chain of long greedy requests (tests/test_engine_gpu.py) keeps decode
  running from before the prompts are sent until after they all finished, so each round has a step boundary
  with decode running and prompts pending (a switch into a split) and, at the latest once the last holder is
  aborted (the worker asks its policy at every turn, idle too), one with nothing pending (the switch back).
  `test_forced_switch.py` checks these decisions over a table of states, with the correction at both clamps.
"""

from __future__ import annotations

from collections.abc import Sequence

from rapidserve.partition.profile import OVERALLOCATED, Configuration, Entry, Profile, model_label

DUET_SLO_MS = 20.0  # duet's ITL SLO: within it every split, far beyond it every fused step (above)
BATCHES = [1, 8, 16]
CONTEXTS = [256, 1024]
ALONE_MS = 1.0
BESIDE_MS = 2.0
WHOLE_PREFILL_RATE = 1.0  # overallocated's prefill tokens/s: what makes every fused step far too slow for duet


def prefill_rate(c: Configuration, num_units: int) -> float:
    """Tokens/s the forcing profile gives prefill under `c`: overallocated the least (WHOLE_PREFILL_RATE), then
    more the more units prefill holds (so the split with the fewest decode units is the manager's target)."""
    return WHOLE_PREFILL_RATE if c.name == OVERALLOCATED else 1e3 * (2 + c.prefill_units / num_units)


def forcing_profile(gpu: str, model: str, configs: Sequence[Configuration], num_units: int,
                    prefill_tokens: int) -> Profile:
    """A valid profile for `gpu` and `model` over `configs` (the device's own: `plan_configurations` of its
    granularity) under which the rapid manager's choice depends only on whether prefill has work, and duet's
    (at `DUET_SLO_MS`) on whether decode runs beside pending prompts (module docstring)."""
    entries = [Entry(c.name, b, x, ALONE_MS, ALONE_MS, BESIDE_MS, BESIDE_MS, prefill_rate(c, num_units))
               for c in configs for b in BATCHES for x in CONTEXTS]
    return Profile(gpu=gpu, model=model_label(model), num_compute_units=num_units, configurations=list(configs),
                   batch_buckets=list(BATCHES), context_buckets=list(CONTEXTS), entries=entries,
                   created="written by tests/forced_switch.py", source="measured", prefill_tokens=prefill_tokens)


def split_for_prefill(configs: Sequence[Configuration]) -> str:
    """The configuration the forcing profile makes the manager pick while prefill has work."""
    return max((c for c in configs if c.decode_units), key=lambda c: c.prefill_units).name
