"""The timed walk of bench/structured_host_overhead.py: `Run`, one walk of B grammar rows through the hybrid step's
structured path (the engine's own GrammarBook, its masks filled and applied, ended requests released), and the
instruments that time it by phase (`Clock`, `TimedExecutor` around llguidance's executor, `time_methods`) and count
the ops `apply_grammar_mask` dispatches (`count_ops`). rapidserve is imported inside the functions, so a
`--tree DIR` put first on sys.path is the one measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BODY = Path(__file__).resolve().parent / "structured_outputs_body.json"
MAX_TOKENS = 256
PHASES = ("advance", "fill", "mask_other", "apply_host", "release")


@dataclasses.dataclass
class Clock:
    """Seconds spent per phase, over the timed steps."""

    spent: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    total_mask: float = 0.0
    on: bool = False


class TimedExecutor:
    """llguidance's executor, timing its fills (the native part of `fill`)."""

    def __init__(self, inner: Any, clock: Clock) -> None:
        self.inner, self.clock = inner, clock

    def unsafe_compute_mask_ptr(self, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.inner.unsafe_compute_mask_ptr(*args)
        finally:
            self.clock.spent["fill"] += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def time_methods(cls: type, names: tuple[str, ...], clock: Clock, phase: str) -> Callable[[], None]:
    """Time every call of `cls.<name>` (outermost call only) into `phase`; returns the undo."""
    depth = [0]
    saved: dict[str, Any] = {}
    for name in names:
        fn = cls.__dict__.get(name)
        if fn is None:
            continue
        saved[name] = fn

        def timed(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            depth[0] += 1
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    clock.spent[phase] += time.perf_counter() - t

        setattr(cls, name, timed)

    def undo() -> None:
        for name, fn in saved.items():
            setattr(cls, name, fn)

    return undo


def count_ops(fn: Callable[[], Any]) -> int:
    """Tensor ops `fn` dispatches that would run on a device (kernels, copies), views excluded. On the CPU
    the mask's host-to-device copy is not made: a GPU adds that one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "slice", "alias", "detach", "unsqueeze", "select", "expand", "as_strided", "t", "transpose",
             "_unsafe_view", "lift_fresh"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket.__name__ not in views:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


class Run:
    """One timed walk of B rows through the hybrid worker's structured path."""

    def __init__(self, hf: Any, llg_tok: Any, vocab: int, eos: tuple[int, ...], batch: int, threads: int,
                 seed: int, probed: bool, lexers: int = 1) -> None:
        import llguidance
        import torch

        from rapidserve.sampling_params import SamplingParams, StructuredOutputs
        from rapidserve.structured import GrammarBook

        self.torch, self.vocab, self.batch, self.eos = torch, vocab, batch, eos
        schema = json.loads(BODY.read_text())["structured_outputs"]["json"]
        so = StructuredOutputs(json=json.dumps(schema))
        self.params = SamplingParams(structured_outputs=so, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                     ignore_eos=True, temperature=0.0)
        self.clock = Clock()
        sharded = "lexers" in inspect.signature(GrammarBook).parameters  # a --tree from before the shards: not
        if lexers > 1 and not sharded:
            raise SystemExit("--lexers > 1 needs a tree with lexer shards (rapidserve/structured/lexers.py)")
        self.book = GrammarBook(lambda: hf, vocab, eos, threads=threads, **({"lexers": lexers} if sharded else {}))
        self.book._tok = llg_tok  # the tokenizer view, loaded once per vocabulary (seconds at 152K)
        executor = llguidance.LLExecutor(threads)
        self.book._executor = TimedExecutor(executor, self.clock) if probed else executor
        # compiled once, as for a served schema; requests copy it. The engine compiles it again in the
        # background once popular (up to `lexers` compiles, lexers.py); here all of them are made before
        # timing, so every step sees the same shards
        shards = self.book.cache.compile(so)
        if sharded:
            while len(shards.shards) < lexers:
                shards.shards.append(shards._compile_one())  # the engine's own compiler of it
            shards.limit = lexers
        self.one_engine = importlib.util.find_spec("rapidserve.engine.step_launch") is not None
        if not self.one_engine:  # a --tree from before the one engine: the hybrid worker's own method
            from rapidserve.engine.hybrid_worker import HybridWorker  # type: ignore[import-not-found]

            self.worker = object.__new__(HybridWorker)  # only what `_grammar_mask` reads
            self.worker.grammar = self.book
            self.worker.runner = type("Runner", (), {"device": torch.device("cpu")})()
        self.rng = random.Random(seed)
        self.arrivals = 0
        # staggered lengths: about batch/256 requests end per step, new ones take their seats
        self.seqs = [self._new(1 + (i * MAX_TOKENS) // batch) for i in range(batch)]
        self.prev: Any = None
        self.in_flight: list[int] | None = None
        self.digest = hashlib.sha1()
        self.steps = 0

    def _new(self, target: int) -> Any:
        self.arrivals += 1
        params = self.params.replace(max_tokens=target, min_tokens=target)
        if self.one_engine:
            from rapidserve.engine import messages as m
            from rapidserve.engine.decode_request import DecodeRequest

            return DecodeRequest(m.NewRequest(f"r{self.arrivals}", [1, 2, 3], params, 0.0), self.arrivals,
                                 state="running")
        from rapidserve.sequence import Sequence

        return Sequence(f"r{self.arrivals}", [1, 2, 3], params)

    def _mask(self) -> Any:
        """The step's mask, as the worker makes it (the timed code)."""
        if not self.one_engine:
            return self.worker._grammar_mask(self.seqs, self.prev)
        from rapidserve.engine.step_launch import grammar_rows

        mask, failed = self.book.fill(grammar_rows(self.seqs, self.prev), pin=False)
        assert not failed, failed
        return mask

    def _launched(self, host: Any) -> Any:
        """This step's tokens in flight; the previous step's recorded (outside the timed code)."""
        rows = {id(s): i for i, s in enumerate(self.seqs)}
        if not self.one_engine:
            from rapidserve.engine.hybrid_worker import PLACEHOLDER, Launched  # type: ignore[import-not-found]

            launched = Launched(None, list(self.seqs), host, None, rows=rows,
                                index=[len(s.output_token_ids) for s in self.seqs])
            for s in self.seqs:
                s.output_token_ids.append(PLACEHOLDER)
            if self.prev is not None:  # its tokens over their placeholders
                for s, idx, t in zip(self.prev.seqs, self.prev.index, self.prev.host.token_ids.tolist(),
                                     strict=True):
                    s.output_token_ids[idx] = t
            return launched
        from rapidserve.engine.decode_request import StepBatch
        from rapidserve.engine.step_launch import InFlight, StepClock
        from rapidserve.partition.shape import Fused

        if self.prev is not None:
            for r, t in zip(self.prev.sampled, self.prev.host.token_ids.tolist(), strict=True):
                r.outputs.append(t)
                r.inflight -= 1
        for r in self.seqs:
            r.inflight += 1
        return InFlight(StepBatch(list(self.seqs)), list(self.seqs), None, host, None, Fused(0), StepClock(), rows)

    def _out(self, s: Any) -> int:
        """Outputs recorded or in flight."""
        return len(s.outputs) + s.inflight if self.one_engine else len(s.output_token_ids)

    def _id(self, s: Any) -> str:
        return s.req_id if self.one_engine else s.seq_id

    def _pick(self, mask: Any) -> list[int]:
        """A seeded allowed token per row (any token for a row the mask leaves out)."""
        words = mask.words.numpy()
        where = dict(zip(mask.rows, range(mask.num_rows), strict=True))
        toks = []
        for i in range(self.batch):
            j = where.get(i)
            if j is None:
                toks.append(self.rng.randrange(self.vocab))
                continue
            w = words[j]
            for _ in range(256):
                t = self.rng.randrange(self.vocab)
                if (int(w[t >> 5]) >> (t & 31)) & 1:
                    break
            else:  # few allowed: pick among them
                import numpy as np

                bits = np.unpackbits(w.view(np.uint8), bitorder="little")[: self.vocab]
                allowed = np.flatnonzero(bits)
                t = int(allowed[self.rng.randrange(len(allowed))])
            toks.append(t)
        return toks

    def step(self, timed: bool) -> None:
        from rapidserve.sampler import SamplerOutput
        from rapidserve.structured import GrammarMask, apply_grammar_mask

        torch, clock = self.torch, self.clock
        clock.on = timed
        # seats of requests whose last token is out (recorded or in flight) go to new requests
        self.seqs = [s if self._out(s) < s.params.max_tokens else self._new(MAX_TOKENS) for s in self.seqs]
        before = dict(clock.spent)
        t0 = time.perf_counter()
        mask = self._mask()
        t1 = time.perf_counter()
        # the host side of applying it: tiny logits, a 1-word mask of the same rows
        tiny = GrammarMask.new(mask.num_rows, 32, pin=False)
        tiny.row_ids.copy_(mask.row_ids)
        if hasattr(mask, "row_start"):
            tiny = dataclasses.replace(tiny, row_start=mask.row_start)
        logits = torch.zeros(self.batch, 32)
        t2 = time.perf_counter()
        apply_grammar_mask(logits, tiny)
        t3 = time.perf_counter()
        if not timed:
            self.apply_ops = count_ops(lambda: apply_grammar_mask(logits, tiny))
        self.digest.update(mask.words.numpy().tobytes())
        self.digest.update(mask.row_ids.numpy().tobytes())
        toks = self._pick(mask)
        host = SamplerOutput(torch.tensor(toks, dtype=torch.int64))
        self.prev = self._launched(host)  # and the previous step recorded
        # publish: matchers of requests no longer running go; schedule asks what still compiles
        running = [self._id(s) for s in self.seqs if self._out(s) < s.params.max_tokens]
        t4 = time.perf_counter()
        self.book.retain(running, known=running)
        self.book.compiling()
        t5 = time.perf_counter()
        if timed:
            self.steps += 1
            total = t1 - t0
            clock.total_mask += total
            inner = sum(clock.spent[p] - before[p] for p in ("advance", "fill"))
            clock.spent["mask_other"] += total - inner
            clock.spent["apply_host"] += t3 - t2
            clock.spent["release"] += t5 - t4

    def result(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {p: 1e3 * self.clock.spent[p] / n for p in PHASES}
        out["total"] = sum(out[p] for p in PHASES)
        out["mask"] = 1e3 * self.clock.total_mask / n
        return out
