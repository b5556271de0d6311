"""A request never kills a worker: an exception while handling one request fails that request (with
its error) and the worker goes on serving the rest.

The real decode worker (rapid, and hybrid: every step fused) and prefill worker classes run in this process
on a real ModelRunner (a tiny preset on CPU) with their channels replaced by lists; a fault is injected into
the runner for one "poisoned" request (its seed), as a bad parameter reaching the device code would raise.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any

import pytest
import torch

from rapidserve import sampler
from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.engine.faults import is_fatal
from rapidserve.engine.prefill_worker import PrefillWorker
from rapidserve.loader import resolve_model
from rapidserve.partition.plan import PartitionPlan, open_streams, resolve_plan
from rapidserve.partition.profile import OVERALLOCATED, Configuration
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.step_policies import AlwaysFused
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import SamplingParams

POISON = 666  # the seed of the request whose sampling raises


def untimed(msg: Any) -> Any:
    """`msg` without its first tokens' PhaseTimes (clock stamps differ between two runs of the same work)."""
    import msgspec

    if isinstance(msg, m.PrefillDone) and msg.token.times is not None:
        return msgspec.structs.replace(msg, token=msgspec.structs.replace(msg.token, times=None))
    if isinstance(msg, m.TokenBatch):
        return m.TokenBatch([msgspec.structs.replace(t, times=None) for t in msg.tokens])
    return msg


class _Out:
    """A fake ring: records what is sent, less the clock stamps (`untimed`)."""

    def __init__(self, box: list[Any]) -> None:
        self.box = box

    def send(self, msg: Any) -> None:
        self.box.append(untimed(msg))

    def try_send(self, msg: Any) -> bool:
        self.box.append(untimed(msg))
        return True


class FakeIO:
    """A worker's channels as lists: `inbox` is drained by the worker, `sent[label]` collects what
    it sends on that ring. Decode and prefill share one FakeIO: `seat` says who is sending now."""

    def __init__(self) -> None:
        self.inbox: list[Any] = []
        self.sent: dict[str, list[Any]] = defaultdict(list)
        self.seat = "decode"

    @property
    def to_router(self) -> _Out:  # decode and hybrid write d2r, prefill p2r: one list per writer seat
        return _Out(self.sent["d2r" if self.seat == "decode" else "p2r"])

    @property
    def to_prefill(self) -> _Out:
        return _Out(self.sent["d2p"])

    @property
    def to_decode(self) -> _Out:
        return _Out(self.sent["p2d"])

    def drain(self) -> list[Any]:
        out, self.inbox = self.inbox, []
        return out

    def wait(self, timeout: float) -> bool:
        """As `WorkerIO.wait`: True at once when a message is waiting, else sleep `timeout` (nothing comes
        meanwhile). Idle loops wait only while a grammar compiles (a few ms: `GrammarBook.idle_wait`)."""
        if self.inbox:
            return True
        time.sleep(timeout)
        return False

    def others_alive(self, every_s: float = 0.25) -> bool:
        return True

    def of(self, label: str, kind: type) -> list[Any]:
        return [x for x in self.sent[label] if isinstance(x, kind)]


@pytest.fixture(scope="module")
def setup() -> tuple[Any, ModelRunner]:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=64,
                                 max_model_len=256)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return cfg, ModelRunner(cfg, source, show_progress=False)


@pytest.fixture
def poisoned(setup: tuple[Any, ModelRunner], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ModelRunner]:
    cfg, runner = setup
    real = runner.sample_next

    def sample_next(logits: torch.Tensor, params: Any, index: Any, eos: Any, *args: Any, **kw: Any) -> Any:
        if any(p.seed == POISON for p in params):
            raise RuntimeError("sampling blew up for this request")
        return real(logits, params, index, eos, *args, **kw)

    monkeypatch.setattr(runner, "sample_next", sample_next)
    return cfg, runner


def req(rid: str, seed: int | None = None, n: int = 4) -> m.NewRequest:
    return m.NewRequest(rid, [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                                  seed=seed), 0.0)


def arm_host_copy_failure(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """`SamplerOutput.to_host` raises once, the next time after the returned flag's "on" is set True."""
    real, armed = sampler.SamplerOutput.to_host, {"on": False}

    def to_host(self: Any) -> Any:
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("pinned allocation failed")
        return real(self)

    monkeypatch.setattr(sampler.SamplerOutput, "to_host", to_host)
    return armed


def test_prefill_isolates_the_request_that_raises(poisoned: tuple[Any, ModelRunner]) -> None:
    cfg, runner = poisoned
    io = FakeIO()
    io.seat = "prefill"
    w = _prefill_worker(cfg, runner, io)
    for rid, seed, blocks in (("good", None, [0]), ("bad", POISON, [1]), ("good2", 7, [2])):
        w.handle(m.KVReady(req(rid, seed), blocks))
    w.prefill_step()  # one batch of three: it raises, each runs alone, only "bad" fails
    done = {d.req_id for d in io.of("p2d", m.PrefillDone)}
    failed = io.of("p2d", m.PrefillFailed)
    assert done == {"good", "good2"}
    assert [f.req_id for f in failed] == ["bad"] and "sampling blew up" in failed[0].message
    assert not w.waiting_prefill
    w.handle(m.KVReady(req("later"), [3]))  # the worker goes on serving
    w.prefill_step()
    assert io.of("p2d", m.PrefillDone)[-1].req_id == "later"


def _decode_worker(cfg: Any, runner: ModelRunner, io: FakeIO) -> DecodeWorker:
    plan = resolve_plan(cfg, runner.device)
    return DecodeWorker(cfg, runner, io, DecodePartition(cfg.partition, plan),  # type: ignore[arg-type]
                        open_streams(plan.wire(), runner.device, ("decode",)))


def _prefill_worker(cfg: Any, runner: ModelRunner, io: FakeIO) -> PrefillWorker:
    backend = open_streams(resolve_plan(cfg, runner.device).wire(), runner.device, ("prefill",))
    return PrefillWorker(cfg, runner, io, backend, "overallocated")  # type: ignore[arg-type]


def _submit(cfg: Any, runner: ModelRunner, io: FakeIO, w: DecodeWorker, p: PrefillWorker,
            *reqs: m.NewRequest) -> None:
    """Requests in as the router sends them (to decode), admitted, prefilled, and decode's news published."""
    for r in reqs:
        w.handle(r)
    w.admit()
    _prefill_for_decode(cfg, runner, io, w, p)
    w.publish()


def _decode_steps(w: DecodeWorker, n: int) -> None:
    for _ in range(n):
        w.step()
        w.publish()


def _indices(io: FakeIO) -> dict[str, list[int]]:
    """The output indices each request streamed to the router, in order."""
    toks: dict[str, list[int]] = defaultdict(list)
    for b in io.of("d2r", m.TokenBatch):
        for t in b.tokens:
            toks[t.req_id].append(t.index)
    return toks


def _prefill_for_decode(cfg: Any, runner: ModelRunner, io: FakeIO, w: DecodeWorker, p: PrefillWorker) -> None:
    """Carry decode's KVReadys to the prefill worker and its answers back to decode."""
    for msg in [x for x in io.sent["d2p"] if isinstance(x, m.KVReady)]:
        io.sent["d2p"].remove(msg)
        p.handle(msg)
    io.seat = "prefill"
    while p.waiting_prefill:
        p.prefill_step()
    io.seat = "decode"
    for msg in list(io.sent["p2d"]):
        io.sent["p2d"].remove(msg)
        w.handle(msg)


def test_decode_frees_and_fails_a_request_that_prefill_failed(poisoned: tuple[Any, ModelRunner]) -> None:
    cfg, runner = poisoned
    io = FakeIO()
    w = _decode_worker(cfg, runner, io)
    p = _prefill_worker(cfg, runner, io)
    free0 = w.sched.blocks.num_free
    _submit(cfg, runner, io, w, p, req("ok", n=3), req("bad", POISON))
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason) for f in fin] == [("bad", "error")] and "sampling blew up" in fin[0].message
    _decode_steps(w, 10)  # "ok" decodes to its end
    toks = [t for b in io.of("d2r", m.TokenBatch) for t in b.tokens if t.req_id == "ok"]
    assert [t.index for t in toks] == [0, 1, 2] and toks[-1].finish_reason == "length"
    assert w.sched.blocks.num_free == free0 and not w.sched.reqs


def test_decode_step_that_raises_fails_its_batch_and_the_worker_goes_on(
        setup: tuple[Any, ModelRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, runner = setup
    io = FakeIO()
    w = _decode_worker(cfg, runner, io)
    p = _prefill_worker(cfg, runner, io)
    free0 = w.sched.blocks.num_free
    _submit(cfg, runner, io, w, p, req("a", n=8), req("b", n=8))
    real = runner.decode
    monkeypatch.setattr(runner, "decode", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("kernel failed")))
    w.step()
    w.publish()
    fin = io.of("d2r", m.Finished)
    assert sorted((f.req_id, f.reason) for f in fin) == [("a", "error"), ("b", "error")]
    assert "kernel failed" in fin[0].message and w.sched.blocks.num_free == free0 and not w.sched.reqs
    monkeypatch.setattr(runner, "decode", real)
    _submit(cfg, runner, io, w, p, req("c", n=2))
    _decode_steps(w, 4)
    assert _indices(io)["c"] == [0, 1] and w.sched.blocks.num_free == free0


def test_hybrid_fails_only_the_request_that_raises(poisoned: tuple[Any, ModelRunner]) -> None:
    cfg, runner = poisoned
    io = FakeIO()
    w = _fused_worker(cfg, runner, io, ahead=False)  # each step recorded before the next is planned
    io.inbox += [req("a", n=5), req("bad", POISON, n=5)]
    _read(w)
    io.inbox += [req("c", n=3)]
    _run_ahead(w, 30)
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason) for f in fin] == [("bad", "error")] and "sampling blew up" in fin[0].message
    toks = _indices(io)
    assert toks["a"] == list(range(5)) and toks["c"] == list(range(3)) and "bad" not in toks
    assert w.sched.blocks.num_free == w.sched.blocks.num_blocks


@pytest.mark.parametrize("err, fatal", [
    (RuntimeError("sampling blew up"), False),
    (ValueError("bad value"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("HIP error: an illegal memory access was encountered"), True),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (KeyboardInterrupt(), True),
])
def test_is_fatal(err: BaseException, fatal: bool) -> None:
    assert is_fatal(err) is fatal


def test_decode_sampling_that_raises_fails_only_that_request(
        setup: tuple[Any, ModelRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, runner = setup
    real = runner.sample_next

    def sample_next(logits: torch.Tensor, params: Any, index: Any, eos: Any, *args: Any, **kw: Any) -> Any:
        if any(p.seed == POISON and k >= 2 for p, k in zip(params, index, strict=True)):  # a later token
            raise RuntimeError("sampling blew up for this request")
        return real(logits, params, index, eos, *args, **kw)

    monkeypatch.setattr(runner, "sample_next", sample_next)
    io = FakeIO()
    w = _decode_worker(cfg, runner, io)
    p = _prefill_worker(cfg, runner, io)
    free0 = w.sched.blocks.num_free
    _submit(cfg, runner, io, w, p, req("a", n=6), req("bad", POISON, n=6), req("b", n=6))
    _decode_steps(w, 12)
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason) for f in fin] == [("bad", "error")] and "sampling blew up" in fin[0].message
    toks = _indices(io)
    # "bad" failed while its token 1 was in flight (decode runs one step ahead): that token is dropped
    assert toks["a"] == list(range(6)) and toks["b"] == list(range(6)) and toks["bad"] == [0]
    assert w.sched.blocks.num_free == free0 and not w.sched.reqs


def test_prefill_carry_feeds_the_leading_decode_rows(setup: tuple[Any, ModelRunner]) -> None:
    """A mixed step's decode rows take the previous step's tokens from the device (scheduling ahead):
    the same logits as with the tokens given on the host; rows that are not leading one-token items
    are refused."""
    from rapidserve.runner import Carry, PrefillItem

    _, runner = setup
    prompt = [5, 9, 17, 33, 70, 71, 72, 73, 74, 75]
    runner.prefill([PrefillItem(prompt, 0, [0])])  # the prompt's K/V in block 0
    chunk = PrefillItem([40, 41, 42], 0, [1])
    want = runner.prefill([PrefillItem([123], len(prompt), [0]), chunk])
    sampled = torch.tensor([7, 123, 9])  # the previous step's tokens; row 1 is this request's
    got = runner.prefill([PrefillItem([0], len(prompt), [0]), chunk], carry=Carry(sampled, [(0, 1)]))
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="leading one-token items"):
        runner.prefill([PrefillItem([0], len(prompt), [0]), chunk], carry=Carry(sampled, [(1, 1)]))


def _fused_worker(cfg: Any, runner: ModelRunner, io: FakeIO, ahead: bool = True) -> DecodeWorker:
    """Hybrid mode's worker: the decode worker alone, every step fused (worker_build.build_hybrid's)."""
    import dataclasses

    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, async_scheduling=ahead))
    plan = PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, "hybrid")
    return DecodeWorker(cfg, runner, io, DecodePartition(cfg.partition, plan), None, AlwaysFused())  # type: ignore[arg-type]


def _read(w: DecodeWorker) -> None:
    """The worker's inbox, handled now (as at the top of its loop)."""
    for msg in w.io.drain():
        w.handle(msg)


def _run_ahead(w: DecodeWorker, steps: int, before: Any = None, grace_s: float = 60.0) -> None:
    """Turn the worker's loop by hand (`before(i)` runs ahead of turn i) until every request has ended.
    Past `steps` turns it goes on, a millisecond apart, until `grace_s` seconds of wall clock from the
    start: work on other threads (a grammar compile on the pool) takes longer on a loaded machine, and a
    turn count alone failed there (CI did)."""
    deadline = time.monotonic() + grace_s
    for i in itertools.count():
        if before is not None:
            before(i)
        w.turn()
        if not w.inflight and not w.sched.reqs:
            return
        if i + 1 >= steps:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still running: {list(w.sched.reqs)}")
            time.sleep(0.001)


def test_hybrid_ahead_fails_only_the_request_that_raises(poisoned: tuple[Any, ModelRunner]) -> None:
    cfg, runner = poisoned
    io = FakeIO()
    w = _fused_worker(cfg, runner, io)
    io.inbox += [req("a", n=5), req("bad", POISON, n=5), req("c", n=3)]
    _run_ahead(w, 40)
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason) for f in fin] == [("bad", "error")] and "sampling blew up" in fin[0].message
    toks = _indices(io)
    assert toks["a"] == list(range(5)) and toks["c"] == list(range(3)) and "bad" not in toks
    assert w.sched.blocks.num_free == w.sched.blocks.num_blocks


def test_hybrid_ahead_launch_that_fails_late_leaves_no_placeholder(setup: tuple[Any, ModelRunner],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The host copy of a mixed step's tokens fails: the step's new prompt fails, the request decoding
    in that step goes on (its token is recomputed next step) and nothing is left half-advanced."""
    cfg, runner = setup
    io = FakeIO()
    w = _fused_worker(cfg, runner, io)
    io.inbox += [req("a", n=8)]
    _read(w)
    armed = arm_host_copy_failure(monkeypatch)

    def before(i: int) -> None:
        if i == 3:
            io.inbox.append(req("b", n=4))
            _read(w)
            armed["on"] = True
        if i == 4:  # after the failed step
            io.inbox.append(req("c", n=4))

    _run_ahead(w, 60, before)
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason) for f in fin] == [("b", "error")] and "pinned allocation" in fin[0].message
    toks = _indices(io)
    assert toks["a"] == list(range(8)) and toks["c"] == list(range(4)) and "b" not in toks
    assert w.sched.blocks.num_free == w.sched.blocks.num_blocks
