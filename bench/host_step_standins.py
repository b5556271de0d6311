"""The stand-ins of bench/host_step_cost.py: the model minus its work (`StandIn`: zero hidden states, logits that
pick `TOKEN`) and a worker's rings as byte lists (`WireIO`: every message encoded and decoded by msgspec, as the rings
carry them). Imports rapidserve at the top: bench/host_step_cost.py puts its `--tree` first on sys.path before
importing this.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from rapidserve.engine.worker_io import RING_TYPES

TOKEN = 7  # the stand-in's every sampled token (no EOS: 2)
VOCAB = 32  # the stand-in's logits' width


class StandIn:
    """The model, minus its work: hidden states of zeros and logits that pick `TOKEN` (greedy). The logits are
    `VOCAB` wide, so the sampler's argmax (device work on a GPU) costs next to nothing here."""

    def __init__(self, model: Any) -> None:
        self.ops, self.attn, self.cfg = model.ops, model.attn, model.cfg
        self.hidden, self.vocab = model.cfg.hidden_size, VOCAB

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, layers: Any, meta: Any) -> torch.Tensor:
        return torch.zeros(len(tokens), self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(hidden), self.vocab)
        logits[:, TOKEN] = 1.0
        return logits


class _Wire:
    def __init__(self, sink: list[bytes]) -> None:
        self.sink, self.encode = sink, msgspec.msgpack.Encoder().encode

    def send(self, msg: object, timeout: float | None = None) -> None:
        self.sink.append(self.encode(msg))

    def try_send(self, msg: object) -> bool:
        self.send(msg)
        return True


class WireIO:
    """A worker's channels as byte lists: what the rings would carry, encoded and decoded by msgspec."""

    def __init__(self) -> None:
        self.inbox: list[bytes] = []
        self.sent: list[bytes] = []
        self.decode = msgspec.msgpack.Decoder(RING_TYPES["r2d"].types).decode
        self.to_router = self.to_prefill = _Wire(self.sent)

    def drain(self) -> list[Any]:
        raw, self.inbox = self.inbox, []
        return [self.decode(b) for b in raw]

    def wait(self, timeout: float) -> bool:
        return bool(self.inbox)

    def others_alive(self, every_s: float = 0.25) -> bool:
        return True
