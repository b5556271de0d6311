"""The decode worker's record of one request, and the work of one step: pure data, no torch.

One record (`DecodeRequest`) serves a prompt handed to the prefill worker and a prompt computed in the
decode worker's own fused steps alike; `DecodeScheduler` (engine/decode_scheduler.py) moves it between
states: waiting (no blocks) -> prefilling (its blocks handed to the prefill worker in a KVReady) or
chunking (its blocks computed here, a chunk per fused step) -> running (decodes each step) -> done.

A step (`StepBatch`): the running requests that decode one token each, then prompt chunks (`Chunk`);
its logits rows, in order, are the decode rows and then the chunks that end a prompt (`sampled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rapidserve.engine import messages as m
from rapidserve.sampler import SampledRow
from rapidserve.sampling_params import SamplingParams

State = Literal["waiting", "prefilling", "chunking", "running", "done"]
Row = SampledRow  # a sampled token, its logprob, top logprobs, its rank (sampler.py)


@dataclass(eq=False)
class DecodeRequest:
    request: m.NewRequest
    order: int  # arrival order: preemption takes the latest admitted first
    outputs: list[int] = field(default_factory=list)
    state: State = "waiting"
    attempt: int = 0  # preemptions so far: a PrefillDone of an earlier attempt is stale
    inflight: int = 0  # launched steps not yet recorded that sample its next token (0 or 1 between steps)
    aborting: bool = False  # aborted while prefilling: waits for prefill to let go
    drop_pending: bool = False  # a Drop was sent and its Dropped has not come back: the id stays held
    cached: int = 0  # tokens found in the prefix cache at the last admission
    # Its prompt computed here (state chunking; a fused step's chunks):
    computed: int = 0  # tokens whose K/V are written or queued: the cached prefix, then the chunks launched
    chunks_inflight: int = 0  # launched steps not yet recorded that compute a chunk of it and sample nothing
    handed: bool = False  # chunked here, then handed to the prefill worker (a split step: DecodeScheduler.hand_over)
    admitted: float = 0.0  # when its blocks were allocated (PhaseTimes.admitted of its first token)
    started: float | None = None  # when its first chunk was queued (PhaseTimes.started)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def reads_cache(self) -> bool:
        """Its admission looks its tokens up in the prefix cache (not when its params say
        skip_reading_prefix_cache: it computes them all; its blocks are cached for others all the same)."""
        return self.request.params.skip_reading_prefix_cache is not True

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.outputs)

    @property
    def tokens(self) -> list[int]:
        """Prompt and outputs: what a prefill computes after a preemption, and what the cache hashes. Read only:
        without outputs it is the prompt's own list (no copy: a queue's prefix lookups ask it every step)."""
        return self.request.prompt_token_ids + self.outputs if self.outputs else self.request.prompt_token_ids

    @property
    def tokens_needed(self) -> int:
        """Tokens the block table must cover for the next step (the in-flight step's token included)."""
        return self.num_tokens + self.inflight

    @property
    def writing(self) -> bool:
        """A launched step that writes its blocks has not been recorded yet: they may not be freed."""
        return self.inflight > 0 or self.chunks_inflight > 0


@dataclass(frozen=True)
class Chunk:
    """`length` tokens of `req` from position `start` (tokens already in the cache or queued before)."""

    req: DecodeRequest
    start: int
    length: int
    samples: bool  # it ends the prompt: the step samples the request's next token

    @classmethod
    def of(cls, req: DecodeRequest, length: int) -> Chunk:
        """The next `length` tokens of `req` to compute."""
        return cls(req, req.computed, length, req.computed + length == req.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class StepBatch:
    """One step: `decode` (one token each, at position num_tokens - 1 + inflight) and prompt `chunks`."""

    decode: list[DecodeRequest] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def sampled(self) -> list[DecodeRequest]:
        """The requests that get a token, in logits row order: the decodes, then the chunks ending a prompt."""
        return self.decode + [c.req for c in self.chunks if c.samples]

    @property
    def chunk_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks)
