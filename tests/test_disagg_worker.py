"""The disagg prefill worker (engine/disagg.py) in this process, on CPU, beside rapid mode's.

Two worlds see the same KVReadys: rapid mode's PrefillWorker computes in place into a pool R; the
disagg worker computes into its own staging pool and pushes into a pool D (its "decode pool", through
a DevicePeerConnector). D and R start equal (random: untouched blocks show); afterwards they are equal
block for block, and the first tokens are the same. Covered: chunked prompts (the budget is not a
multiple of the block size, so a chunk ends inside a block), a prompt whose prefix decode has cached
(pulled into staging first), a failing request, an abort mid-prefill, a full staging pool; after each,
no staging block is held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.engine.disagg import DisaggPrefillWorker
from rapidserve.engine.prefill_worker import PrefillWorker
from rapidserve.kv_pool import KVPool
from rapidserve.loader import resolve_model
from rapidserve.parallel.kv_connector import DevicePeerConnector
from rapidserve.partition.plan import open_streams, resolve_plan
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import SamplingParams
from tests.test_worker_faults import POISON, FakeIO

BS, BUDGET, STAGING, DECODE = 16, 40, 16, 24
P = [(7 * i + 3) % 1200 + 3 for i in range(100)]
Q = [(11 * i + 5) % 1200 + 3 for i in range(50)]


def req(rid: str, prompt: list[int], seed: int | None = None) -> m.NewRequest:
    return m.NewRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, seed=seed), 0.0)


@pytest.fixture(scope="module")
def base() -> tuple[EngineConfig, Any]:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=STAGING,
                                 max_model_len=256, max_num_batched_tokens=BUDGET)
    return cfg, resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)


class Worlds:
    """The rapid worker over R and the disagg worker over staging + D, fed the same messages."""

    def __init__(self, cfg: EngineConfig, source: Any, budget: int = BUDGET) -> None:
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, max_num_batched_tokens=budget))
        shape = (cfg.model_config.num_layers, 2, DECODE, cfg.model_config.num_kv_heads, BS, cfg.model_config.head_dim)
        self.D = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        self.R = self.D.clone()
        self.stage_runner = ModelRunner(cfg, source, show_progress=False)  # its pool: staging
        ref_runner = ModelRunner(cfg, source, kv_pool=KVPool(self.R, BS), show_progress=False)
        backend = open_streams(resolve_plan(cfg, torch.device("cpu")).wire(), torch.device("cpu"), ("prefill",))
        self.io_d, self.io_r = FakeIO(), FakeIO()
        self.io_d.seat = self.io_r.seat = "prefill"
        self.conn = DevicePeerConnector(self.stage_runner.kv_pool.tensor, self.D)
        self.d = DisaggPrefillWorker(cfg, self.stage_runner, self.io_d, backend, "overallocated",  # type: ignore[arg-type]
                                     self.conn, DECODE)
        self.r = PrefillWorker(cfg, ref_runner, self.io_r, backend, "overallocated")  # type: ignore[arg-type]
        # a prompt's last block, partly written: decode block -> its first unused slot. Staging pushes the
        # whole block, so its unused slots differ (nothing reads them: decode writes them as it goes).
        self.tails: dict[int, int] = {}

    def send(self, msg: Any) -> None:
        if isinstance(msg, m.KVReady) and len(msg.request.prompt_token_ids) % BS:
            self.tails[msg.block_ids[-1]] = len(msg.request.prompt_token_ids) % BS
        self.d.handle(msg)
        self.r.handle(msg)

    def step(self) -> None:
        self.d.prefill_step()
        self.r.prefill_step()

    def run(self) -> None:
        while self.d.waiting_prefill or self.r.waiting_prefill:
            self.step()

    def check(self) -> None:
        """Same messages to decode and the router, same decode pool, no staging held."""
        assert self.io_d.sent["p2d"] == self.io_r.sent["p2d"]
        assert self.io_d.sent["p2r"] == self.io_r.sent["p2r"]
        d, r = self.D.clone(), self.R.clone()
        for b, used in self.tails.items():
            d[:, :, b, :, used:] = r[:, :, b, :, used:] = 0
        assert torch.equal(d, r)
        if not self.d.waiting_prefill:
            assert self.d.staging.in_use == 0 and not self.d.staged and not self.d.staging.owners()


@pytest.fixture
def worlds(base: tuple[EngineConfig, Any]) -> Iterator[Worlds]:
    yield Worlds(*base)


def test_chunked_prompts_and_a_cached_prefix_land_in_decode_pool_as_in_place(worlds: Worlds) -> None:
    a_blocks = [3, 7, 1, 9, 12, 20, 2]  # 100 tokens: chunks of 40, 40, 20
    worlds.send(m.KVReady(req("a", P), a_blocks))
    worlds.step()  # chunk 1: tokens 0-39, so blocks 0-1 are full and pushed; block 2 is not
    s = worlds.d.staged[id(worlds.d.waiting_prefill[0])]
    assert (s.pushed, worlds.d.staging.in_use) == (2, 7)
    assert torch.equal(worlds.D[:, :, [3, 7]], worlds.R[:, :, [3, 7]])
    assert not torch.equal(worlds.D[:, :, 1], worlds.R[:, :, 1])  # block 2 (decode's 1) waits for its chunk
    worlds.run()
    worlds.check()
    done = worlds.io_d.of("p2d", m.PrefillDone)
    assert [d.req_id for d in done] == ["a"]
    # "b" shares a's first 64 tokens, which decode has cached in a's first four blocks: they are pulled,
    # the 50 new tokens computed (40 + 10) and pushed into new blocks; the shared blocks are not written
    shared = worlds.D[:, :, a_blocks[:4]].clone()
    worlds.send(m.KVReady(req("b", P[:64] + Q), a_blocks[:4] + [4, 5, 6, 8], cached_tokens=64))
    worlds.run()
    worlds.check()
    assert torch.equal(worlds.D[:, :, a_blocks[:4]], shared)
    assert [d.token.cached_tokens for d in worlds.io_d.of("p2d", m.PrefillDone)] == [0, 64]


def test_a_batch_that_raises_fails_only_its_request_and_frees_staging(worlds: Worlds,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for runner in (worlds.stage_runner, worlds.r.runner):
        real = runner.sample_next

        def sample_next(logits: Any, params: Any, *a: Any, real: Any = real, **kw: Any) -> Any:
            if any(p.seed == POISON for p in params):
                raise RuntimeError("sampling blew up for this request")
            return real(logits, params, *a, **kw)

        monkeypatch.setattr(runner, "sample_next", sample_next)
    # one batch of two whole prompts: it raises after its pushes; each is then run alone (the good one
    # re-pushes once the failed attempt's pushes have landed), and only the poisoned one fails
    pushes: list[list[int]] = []
    real_push = worlds.conn.push

    def push(local: list[int], remote: list[int]) -> Any:
        pushes.append(list(remote))
        return real_push(local, remote)

    monkeypatch.setattr(worlds.conn, "push", push)
    worlds.send(m.KVReady(req("good", P[:20]), [0, 1]))
    worlds.send(m.KVReady(req("bad", Q[:18], seed=POISON), [2, 3]))
    worlds.run()
    worlds.check()
    assert pushes == [[0, 1], [2, 3], [0, 1], [2, 3]]  # the batch's, then each job's own again
    assert [f.req_id for f in worlds.io_d.of("p2d", m.PrefillFailed)] == ["bad"]
    assert [d.req_id for d in worlds.io_d.of("p2d", m.PrefillDone)] == ["good"]


def test_abort_mid_prefill_frees_staging_before_dropped(worlds: Worlds) -> None:
    long = (P + Q + P)[:200]  # 13 blocks, 5 chunks
    worlds.send(m.KVReady(req("long", long), list(range(13))))
    worlds.step()
    worlds.step()
    assert worlds.d.staging.in_use == 13 and worlds.d.waiting_prefill
    worlds.send(m.Drop("long"))
    assert worlds.d.staging.in_use == 0 and not worlds.d.staged
    assert worlds.io_d.sent["p2d"] == [m.Dropped("long")] == worlds.io_r.sent["p2d"]
    assert torch.equal(worlds.D[:, :, 13:], worlds.R[:, :, 13:])  # nothing beyond its blocks was touched
    worlds.send(m.KVReady(req("next", long), list(range(13, 24)) + [0, 1]))  # staging is reused at once
    worlds.run()
    worlds.check()


def test_a_full_staging_pool_cuts_the_batch(base: tuple[EngineConfig, Any]) -> None:
    w = Worlds(*base, budget=256)  # 5 prompts of 50 tokens fit the budget, but need 5 x 4 blocks > 16
    for i in range(5):
        w.send(m.KVReady(req(f"r{i}", (P + Q)[10 * i: 10 * i + 50]), list(range(4 * i, 4 * i + 4))))
    w.d.prefill_step()
    assert [d.req_id for d in w.io_d.of("p2d", m.PrefillDone)] == ["r0", "r1", "r2", "r3"]
    assert w.d.staging.in_use == 0 and len(w.d.waiting_prefill) == 1  # r4 waited, holding nothing
    w.run()
    w.check()


def test_staging_must_hold_a_longest_request(base: tuple[EngineConfig, Any]) -> None:
    cfg, source = base
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, max_model_len=512))
    runner = ModelRunner(cfg, source, show_progress=False)
    backend = open_streams(resolve_plan(cfg, torch.device("cpu")).wire(), torch.device("cpu"), ("prefill",))
    conn = DevicePeerConnector(runner.kv_pool.tensor, torch.zeros_like(runner.kv_pool.tensor))
    with pytest.raises(ConfigError, match="staging KV pool on cpu has 16 blocks but one request may need 32"):
        DisaggPrefillWorker(cfg, runner, FakeIO(), backend, "overallocated", conn, 100)  # type: ignore[arg-type]
    w = DisaggPrefillWorker(cfg, runner, FakeIO(), backend, "overallocated", conn, 16)  # type: ignore[arg-type]
    assert w.context_cap == 256  # decode's pool, not max_model_len, caps the context


def test_max_model_len_auto_fits_the_context_to_a_smaller_staging_pool(base: tuple[EngineConfig, Any],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """--max-model-len auto (fit_max_model_len): staging (16 blocks) below decode's pool (60 blocks) caps the context
    at staging's 256 tokens, with a warning, instead of refusing to start; the router reads it from the Ready."""
    _, source = base
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=STAGING,
                                 max_model_len="auto", max_num_batched_tokens=BUDGET)
    assert cfg.scheduler.fit_max_model_len and cfg.max_model_len > 60 * BS  # the model's: more than decode holds
    runner = ModelRunner(cfg, source, show_progress=False)
    backend = open_streams(resolve_plan(cfg, torch.device("cpu")).wire(), torch.device("cpu"), ("prefill",))
    conn = DevicePeerConnector(runner.kv_pool.tensor, torch.zeros_like(runner.kv_pool.tensor))
    with caplog.at_level("WARNING", logger="rapidserve.engine.disagg"):
        w = DisaggPrefillWorker(cfg, runner, FakeIO(), backend, "overallocated", conn, 60)  # type: ignore[arg-type]
    assert w.context_cap == 16 * BS
    said = "staging KV pool on cpu holds 256 tokens, fewer than the 960 the model and decode's pool allow"
    assert said in caplog.text
