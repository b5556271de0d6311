"""Prefix caching (issue 15) in every engine, on CPU: `LLM`, the hybrid engine and the RAPID engine,
each with the cache on and off, give the same greedy tokens as a cache-off `LLM` with a large pool.

One scenario per engine and setting (run once, shared by the tests below), on a tiny preset model with a
small KV pool (preemptions happen) and a small token budget (long prompts are chunked):
1. aborts mid-prefill, alone: three long prompts aborted right after submission (LLM: after two steps, one
   32-token chunk of the first recorded and the next in flight), then the same three re-sent at once; engines
   then sweep the abort's delay over the prefill of an 8-chunk prompt (each attempt re-sent), so some abort
   does land mid-prefill;
2. wave 1, all at once: prompts that fill the pool (someone is preempted), mixed lengths (below one block
   of 16 tokens, exact multiples of it, many blocks), unshared prompts, a "system prompt" shared by several,
   one prompt sent twice, a prompt that is a prefix of another; ahead of them two prompts sharing blocks
   with the wave, aborted right after submission (LLM: after one step);
3. a warm-up request with the system prompt, alone, then wave 2 at once: new tails on the system prompt,
   prompts of wave 1 again, and wave 1's aborted prompts re-sent;
4. probes, each two requests one after the other and alone, so what the second finds cached is exact: an
   identical prompt of L tokens finds the largest multiple of 16 below L; a prompt extending another, or a
   prefix of another, finds their common full blocks; a follow-up turn (prompt + answer + more) finds the
   blocks that decode wrote (the newest output's K/V is never computed, so not its block).
After all that every block is free again (cached blocks stay registered, on the free list).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config

MODEL = "preset:tiny-llama"  # deterministic random weights, vocabulary of 1280
BS = 16  # the block size (the default)
NEW = 6
BUDGET = 32  # max_num_batched_tokens: prompts longer than this are chunked
KV_BLOCKS = 16  # 256 tokens for wave 1's ~1300: preemptions happen
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
KINDS = ("llm", "hybrid", "rapid")

_rng = random.Random(15)


def _rand(n: int) -> list[int]:
    return [_rng.randrange(3, 1280) for _ in range(n)]


SYS = _rand(72)  # a system prompt of 4.5 blocks: its 4 full blocks can be shared
SYS2 = _rand(48)  # one of exactly 3 blocks
BASE = _rand(48)  # a prompt that is a prefix of another in the same wave
DUP = _rand(40)  # sent twice at once
U150 = _rand(150)
U64 = _rand(64)
WAVE1: dict[str, list[int]] = {
    # first, 8 unshared prompts of 2 blocks each: together they fill the pool, and each needs a third block
    # for its first decode step, so someone is preempted (in every engine, whatever the timing)
    **{f"fill{i}": _rand(32) for i in range(8)},
    "u5": _rand(5), "u12": _rand(12), "u16": _rand(16), "u32": _rand(32), "u64": U64, "u100": _rand(100),
    "u150": U150, "sys+3": SYS + _rand(3), "sys+20": SYS + _rand(20), "sys2+9": SYS2 + _rand(9),
    "base": BASE, "base+30": BASE + _rand(30), "dup-a": DUP, "dup-b": DUP, "u47": _rand(47),
}
# Step 1: aborted right after submission, alone, then re-sent at once ("<name>-resent").
ABORTED: dict[str, list[int]] = {"ab-long": _rand(180), "ab-sys": SYS + _rand(100), "ab-u150": list(U150)}
ABORT_DELAYS = (0.0, 0.002, 0.01)
# Step 2: submitted ahead of wave 1 and aborted at once (they share blocks with the wave), re-sent in wave 2.
W1_ABORTED: dict[str, list[int]] = {"ab-sys-w1": SYS + _rand(100), "ab-dup-w1": DUP + _rand(60)}
W1_ABORT_DELAYS = (0.0, 0.005)
# Engines, after step 1: one fresh prompt of 8 chunks at a time, alone, aborted after a delay that grows 1.4x
# per attempt until a token comes first, each re-sent at once: some abort lands mid-prefill (the hybrid
# worker has computed and registered some chunks, which the re-sent prompt finds).
SWEEP = [_rand(240) for _ in range(28)]
SWEEP_DELAYS = tuple(0.0005 * 1.4**i for i in range(len(SWEEP)))
SWEEP_FULL = (len(SWEEP[0]) - 1) // BS * BS  # what a re-sent prompt finds after a whole prefill
WARM = SYS + _rand(6)  # alone, right before wave 2: its blocks are the most recently freed
WAVE2: dict[str, list[int]] = {
    "sys+11": SYS + _rand(11),  # first of the wave: finds the warm-up's 4 full system-prompt blocks
    "sys+40": SYS + _rand(40), "sys2+1": SYS2 + _rand(1), "u150-again": list(U150), "u64-again": list(U64),
    "dup-c": list(DUP), "base+30+10": WAVE1["base+30"] + _rand(10), "u70": _rand(70),
    **{f"{k}-again": list(v) for k, v in W1_ABORTED.items()},
}
_P48, _Q100, _TURN1 = _rand(48), _rand(100), _rand(28)
# Probes: (name, first prompt, second prompt or None for a follow-up turn, what the second finds cached).
PROBES: list[tuple[str, list[int], list[int] | None, int]] = [
    ("same-5", (p := _rand(5)), list(p), 0),  # below one block: nothing to share
    ("same-16", (p := _rand(16)), list(p), 0),  # one full block, but one token must be computed
    ("same-17", (p := _rand(17)), list(p), 16),
    ("same-64", (p := _rand(64)), list(p), 48),
    ("same-150", (p := _rand(150)), list(p), 144),
    ("extends-48", _P48, _P48 + _rand(20), 48),  # the first is a prefix of the second
    ("prefix-of-100", _Q100, _Q100[:50], 48),  # the second is a prefix of the first
    ("sys-tails", SYS + _rand(5), SYS + _rand(30), 64),
    ("turn-2", _TURN1, None, 32),  # prompt + its 6 outputs + 10 more: block 2 holds decode-written K/V
]
TURN2_TAIL = _rand(10)


def probe_second(first: list[int], second: list[int] | None, first_out: list[int]) -> list[int]:
    return second if second is not None else first + first_out + TURN2_TAIL


@dataclass
class Run:
    """What one engine did with the scenario."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int | None] = field(default_factory=dict)  # first token's cached_tokens / num_cached_tokens
    prompts: dict[str, list[int]] = field(default_factory=dict)
    preemptions: int = 0
    queries: int = 0
    hits: int = 0
    blocks_free: int = -1
    blocks_total: int = 0
    cached_blocks: int | None = None  # registered blocks (LLM only: the workers' managers are out of reach)
    sweep: list[tuple[float, bool, int | None]] = field(default_factory=list)  # engines: (delay, late, cached)
    seconds: float = 0.0

    def add(self, name: str, prompt: list[int], tokens: list[int], cached: int | None) -> None:
        assert name not in self.tokens, name
        self.prompts[name], self.tokens[name], self.cached[name] = prompt, tokens, cached


# ---------------------------------------------------------------- the reference: LLM, cache off, a large pool


@pytest.fixture(scope="module")
def reference() -> Callable[[list[int]], list[int]]:
    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=512,
              enable_prefix_caching=False)
    prompts = [*ABORTED.values(), *WAVE1.values(), WARM, *WAVE2.values()]
    prompts += [p for _, first, second, _ in PROBES for p in (first, second) if p is not None] + SWEEP
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    table = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}
    turn2 = probe_second(_TURN1, None, table[tuple(_TURN1)])
    table[tuple(turn2)] = llm.generate([turn2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.blocks.hits == 0 and llm.engine.num_preemptions == 0

    def ref(prompt: list[int]) -> list[int]:
        return table[tuple(prompt)]

    return ref


# ---------------------------------------------------------------- LLM


def run_llm(caching: bool) -> Run:
    t0 = time.monotonic()
    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=512,
              num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=BUDGET, enable_prefix_caching=caching)
    eng, blocks, run = llm.engine, llm.engine.blocks, Run()
    assert blocks.enable_caching is caching

    def generate(named: dict[str, list[int]]) -> None:
        outs = llm.generate(list(named.values()), GREEDY, use_tqdm=False)
        for (name, prompt), o in zip(named.items(), outs, strict=True):
            run.add(name, prompt, o.outputs[0].token_ids, o.num_cached_tokens)

    def stepped(named: dict[str, list[int]], aborted: dict[str, list[int]], steps: int) -> None:
        """`aborted` then `named` added at once; after `steps` steps `aborted` are aborted (the first
        mid-prefill: some of its prompt computed, no token yet), the rest run to the end."""
        seqs = {name: eng.add(f"{name}-stepped", p, GREEDY) for name, p in {**aborted, **named}.items()}
        for _ in range(steps):
            eng.step()
        first = seqs[next(iter(aborted))]
        assert 0 < first.num_computed < first.num_tokens and not first.output_token_ids
        for name in aborted:
            eng.abort(seqs[name])
        while eng.has_work:
            eng.step()
        for name, p in named.items():
            run.add(name, p, seqs[name].output_token_ids, seqs[name].num_cached_tokens)
        blocks.check()
        assert blocks.num_free == blocks.num_blocks

    # 1. two steps: the first prompt's first chunk is recorded and its second is in flight (steps are launched one
    # ahead), then all three are aborted; re-sent at once
    stepped({}, ABORTED, 2)
    generate({f"{name}-resent": p for name, p in ABORTED.items()})
    # 2. wave 1, behind two prompts aborted after one step
    stepped(WAVE1, W1_ABORTED, 1)
    # 3. the warm-up alone, then wave 2
    generate({"warm": WARM})
    generate(WAVE2)
    # 4. probes
    for name, first, second, _ in PROBES:
        generate({f"{name}/1": first})
        generate({f"{name}/2": probe_second(first, second, run.tokens[f"{name}/1"])})

    blocks.check()
    run.preemptions, run.queries, run.hits = eng.num_preemptions, blocks.queries, blocks.hits
    run.blocks_free, run.blocks_total, run.cached_blocks = blocks.num_free, blocks.num_blocks, blocks.num_cached_blocks
    run.seconds = time.monotonic() - t0
    return run


# ---------------------------------------------------------------- the hybrid and RAPID engines (AsyncEngine)


def engine_config(mode: str, caching: bool) -> EngineConfig:
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=512,
                                 max_num_batched_tokens=BUDGET, enable_prefix_caching=caching)
    assert cfg.cache.enable_prefix_caching is caching
    return dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300))  # type: ignore[arg-type]


async def collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> tuple[list[int], int | None]:
    """The request's tokens and its first token's cached_tokens (only the first token carries one)."""
    toks = [t async for t in engine.generate(rid, prompt, GREEDY)]
    assert [t.index for t in toks] == list(range(len(toks)))
    assert all(t.cached_tokens is None for t in toks[1:]), toks
    return [t.token_id for t in toks], toks[0].cached_tokens if toks else None


async def submit_and_abort(engine: AsyncEngine, rid: str, prompt: list[int], delay: float) -> bool:
    """Submit, abort `delay` s later; whether a token came first (the abort was not mid-prefill)."""
    gen = engine.generate(rid, prompt, GREEDY)
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(delay)
    await engine.abort(rid)
    try:
        await first
        late = True
    except StopAsyncIteration:  # the abort came before any token
        late = False
    await gen.aclose()
    return late


async def quiet_stats(engine: AsyncEngine, timeout: float = 20.0) -> m.Stats:
    """Stats sent after this call (so after every token received so far) that show an idle engine
    with every block free."""
    before = engine.stats
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats
        if s is not None and s is not before and s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 \
                and s.num_prefilling == 0 and s.num_waiting == 0:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"KV blocks not all free: {engine.stats}")


def run_engine(mode: str, caching: bool) -> Run:
    async def main() -> Run:
        t0 = time.monotonic()
        engine = await AsyncEngine.start(engine_config(mode, caching))
        run = Run()

        async def wave(named: dict[str, list[int]], prefix: str) -> None:
            tasks = [asyncio.create_task(collect(engine, f"{prefix}{name}", p)) for name, p in named.items()]
            for (name, prompt), (toks, cached) in zip(named.items(), await asyncio.gather(*tasks), strict=True):
                run.add(name, prompt, toks, cached)

        async def aborted(named: dict[str, list[int]], delays: tuple[float, ...]) -> list[asyncio.Task[bool]]:
            tasks = [asyncio.create_task(submit_and_abort(engine, f"{name}-aborted", p, d))
                     for (name, p), d in zip(named.items(), delays, strict=True)]
            await asyncio.sleep(0)  # submitted
            return tasks

        try:
            # 1. aborted right after submission, alone; then re-sent at once
            late = await asyncio.gather(*await aborted(ABORTED, ABORT_DELAYS))
            assert not late[0], "the abort sent at once came after a token"
            await quiet_stats(engine)
            await wave({f"{name}-resent": p for name, p in ABORTED.items()}, "r-")
            # the sweep: an abort mid-prefill, whatever the speed of this machine
            for i, (p, d) in enumerate(zip(SWEEP, SWEEP_DELAYS, strict=True)):
                late = await submit_and_abort(engine, f"sweep{i}", p, d)
                toks, cached = await collect(engine, f"sweep{i}-resent", p)
                run.add(f"sweep{i}-resent", p, toks, cached)
                run.sweep.append((d, late, cached))
                if late or (not late and 0 < (cached or 0) < SWEEP_FULL):
                    break  # the prefill is crossed, or an abort mid-prefill left chunks that were found
            await quiet_stats(engine)
            # 2. wave 1, behind two prompts aborted right after submission
            aborts = await aborted(W1_ABORTED, W1_ABORT_DELAYS)
            await wave(WAVE1, "1-")
            assert not (await asyncio.gather(*aborts))[0], "the abort sent at once came after a token"
            await quiet_stats(engine)
            # 3. the warm-up alone, then wave 2
            await wave({"warm": WARM}, "w-")
            await wave(WAVE2, "2-")
            # 4. probes
            for name, first, second, _ in PROBES:
                await wave({f"{name}/1": first}, "p-")
                await wave({f"{name}/2": probe_second(first, second, run.tokens[f"{name}/1"])}, "p-")
            s = await quiet_stats(engine)
            run.preemptions, run.queries, run.hits = s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits
            run.blocks_free, run.blocks_total = s.kv_blocks_free, s.kv_blocks_total
        finally:
            await engine.shutdown()
        run.seconds = time.monotonic() - t0
        return run

    return asyncio.run(main())


# ---------------------------------------------------------------- one run per engine and setting, shared


@pytest.fixture(scope="module")
def runs() -> Callable[[str, bool], Run]:
    done: dict[tuple[str, bool], Run] = {}

    def get(kind: str, caching: bool) -> Run:
        if (kind, caching) not in done:
            done[kind, caching] = run_llm(caching) if kind == "llm" else run_engine(kind, caching)
        return done[kind, caching]

    return get


SETTINGS = [(k, c) for k in KINDS for c in (True, False)]
EXPECTED_NAMES = {f"{n}-resent" for n in ABORTED} | set(WAVE1) | {"warm"} | set(WAVE2) | {
    f"{n}/{i}" for n, *_ in PROBES for i in (1, 2)}


def _ids(x: tuple[str, bool]) -> str:
    return f"{x[0]}-cache-{'on' if x[1] else 'off'}"


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_outputs_equal_the_cache_off_reference(runs: Callable[[str, bool], Run],
                                               reference: Callable[[list[int]], list[int]],
                                               setting: tuple[str, bool]) -> None:
    run = runs(*setting)
    sweep = {f"sweep{i}-resent" for i in range(len(run.sweep))}
    assert set(run.tokens) == EXPECTED_NAMES | sweep
    bad = [f"{name} ({len(run.prompts[name])} tokens, cached {run.cached[name]})"
           for name in run.tokens if run.tokens[name] != reference(run.prompts[name])]
    assert not bad, f"diverged from the reference: {bad}"
    assert all(len(t) == NEW for t in run.tokens.values())


@pytest.mark.parametrize("kind", KINDS)
def test_cache_on_and_off_give_the_same_tokens(runs: Callable[[str, bool], Run], kind: str) -> None:
    on, off = runs(kind, True), runs(kind, False)
    common = set(on.tokens) & set(off.tokens)  # all but the sweep's last attempts (it stops where it stops)
    assert common >= EXPECTED_NAMES
    assert {n: on.prompts[n] for n in common} == {n: off.prompts[n] for n in common}
    assert {n: on.tokens[n] for n in common} == {n: off.tokens[n] for n in common}


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_the_small_pool_preempts(runs: Callable[[str, bool], Run], setting: tuple[str, bool]) -> None:
    assert runs(*setting).preemptions > 0


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_every_block_is_free_at_the_end(runs: Callable[[str, bool], Run], setting: tuple[str, bool]) -> None:
    run = runs(*setting)
    assert run.blocks_total == KV_BLOCKS
    assert run.blocks_free == run.blocks_total
    if setting[0] == "llm":  # cached blocks stay registered, on the free list
        assert (run.cached_blocks or 0) > 0 if setting[1] else run.cached_blocks == 0


@pytest.mark.parametrize("kind", KINDS)
def test_probes_find_exactly_their_shared_full_blocks(runs: Callable[[str, bool], Run], kind: str) -> None:
    run = runs(kind, True)
    got = {name: run.cached[f"{name}/2"] for name, *_ in PROBES}
    assert got == {name: want for name, _, _, want in PROBES}
    for name, *_ in PROBES:  # the second prompt's length: the largest multiple of 16 below it, at most
        assert (got[name] or 0) <= (len(run.prompts[f"{name}/2"]) - 1) // BS * BS


@pytest.mark.parametrize("kind", KINDS)
def test_the_second_wave_hits(runs: Callable[[str, bool], Run], kind: str) -> None:
    run = runs(kind, True)
    assert run.cached["sys+11"] == 64  # the warm-up's 4 full system-prompt blocks
    assert sum(run.cached[name] or 0 for name in WAVE2) > 64
    assert 0 < run.hits < run.queries
    assert run.hits >= sum(c or 0 for c in run.cached.values())
    if kind == "llm":  # the chunk recorded before the abort is cached; the one in flight then registers nothing
        assert run.cached["ab-long-resent"] == BUDGET


@pytest.mark.parametrize("kind", KINDS)
def test_cache_off_never_hits(runs: Callable[[str, bool], Run], kind: str) -> None:
    run = runs(kind, False)
    assert run.hits == 0 and run.queries == 0
    assert set(run.cached.values()) == {0}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s[0] != "llm"], ids=_ids)
def test_an_abort_lands_mid_prefill(runs: Callable[[str, bool], Run], setting: tuple[str, bool]) -> None:
    """The sweep crossed the prefill. In the hybrid worker with the cache on, some abort came after a chunk
    was registered and before the last one: the re-sent prompt found part of the prompt (and still gave
    the reference tokens: the first test); elsewhere the sweep went on until a token came first."""
    run = runs(*setting)
    assert not run.sweep[0][1], run.sweep  # the first abort came before any token
    partial = [c for _, late, c in run.sweep if not late and 0 < (c or 0) < SWEEP_FULL]
    if setting == ("hybrid", True):
        assert partial, run.sweep
    else:  # the RAPID decode worker registers a prompt's blocks only at PrefillDone: all or nothing
        assert run.sweep[-1][1] and not partial, run.sweep
    if not setting[1]:
        assert all(c == 0 for *_, c in run.sweep)
