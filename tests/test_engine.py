"""The two-process RAPID engine on CPU: same greedy tokens as LLM.generate, aborts, preemption, faults."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.errors import EngineError
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config

NEW = 32


def shm_entries(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f"rapidserve-{pid}-" in f]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    assert tok is not None
    topics = ["the sea", "a cat", "Paris", "prime numbers", "bread", "the moon", "music", "rain"]
    out = []
    for i in range(n):
        words = " and ".join(topics[: 1 + i % len(topics)]) * (1 + i % 3)
        out.append(tok.apply_chat_template([{"role": "user", "content": f"Write about {words}."}]))
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(dtype="float32", device="cpu", show_progress=False)
    prompts = chat_prompts(llm, 16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def engine_config(policy: str = "rapid", slo_itl_ms: float | None = 50.0, **launch: object) -> object:
    cfg, _ = build_engine_config(None, device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=512,
                                 max_num_batched_tokens=256)
    return dataclasses.replace(cfg, launch=LaunchConfig(mps="off", startup_timeout_s=300, **launch),  # type: ignore[arg-type]
                               partition=dataclasses.replace(cfg.partition, policy=policy, slo_itl_ms=slo_itl_ms))


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t.token_id async for t in engine.generate(rid, prompt, params)]


async def wait_blocks_free(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Until a Stats sent after this call shows every block free and nothing running: Stats come every
    stats_interval_s, so the one at hand when the caller's requests ended may predate them (a short round),
    and the counters read after this call (switches, preemptions) are then a round behind."""
    stale = engine.stats
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats
        if s is not None and s is not stale and s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 \
                and s.num_prefilling == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"KV blocks not all free: {engine.stats}")


def test_engine_matches_llm_with_preemption_and_aborts(reference: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config())  # type: ignore[arg-type]
        try:
            params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
            tasks = [asyncio.create_task(collect(engine, f"r{i}", p, params)) for i, p in enumerate(prompts)]

            # one request aborted while its prompt is still with prefill ...
            long_prompt = prompts[-1] * 3
            gen = engine.generate("abort-prefill", long_prompt, params)
            first = asyncio.create_task(gen.__anext__())
            await asyncio.sleep(0)
            await engine.abort("abort-prefill")
            with pytest.raises(StopAsyncIteration):
                await first
            # ... and one during decode, after a few tokens
            got = []
            async for t in engine.generate("abort-decode", prompts[0], params):
                got.append(t.token_id)
                if len(got) == 3:
                    await engine.abort("abort-decode")
            assert len(got) == 3  # nothing after the abort

            results = await asyncio.gather(*tasks)
            for i, (g, w) in enumerate(zip(results, want, strict=True)):
                assert g == w, f"request {i} (prompt of {len(prompts[i])} tokens) diverged"
            # A first token that ends its request comes from prefill; otherwise decode streams it ahead of
            # the second: both orders give the reference tokens, each once.
            for n in (1, 2, 3):
                short = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                assert await collect(engine, f"short{n}", prompts[1], short) == want[1][:n]
            await wait_blocks_free(engine)
            assert engine.stats is not None and engine.stats.num_preemptions > 0  # the pool was too small
        finally:
            await engine.shutdown()
        assert shm_entries(os.getpid()) == []

    asyncio.run(main())


def test_duet_policy_engine_matches_llm(reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """--policy duet: the decode worker feeds the policy its contexts and pending prefill work every step
    (on CPU there is no partition to switch, so the plan is not adaptive), and the tokens are the reference's."""
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(policy="duet"))  # type: ignore[arg-type]
        try:
            params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
            got = await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts[:6])))
            assert got == want[:6]
            await wait_blocks_free(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_duet_policy_without_an_slo_matches_llm(reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """--policy duet --slo-itl-ms none in rapid mode: the decode worker fuses every step with the whole token budget
    (tests/test_step_shapes.py shows it hands the prefill worker nothing), the start-up log line of the plan says so,
    and the tokens are the reference's."""
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(policy="duet", slo_itl_ms=None))  # type: ignore[arg-type]
        try:
            assert engine.cfg.launch.mode == "rapid" and sorted(engine.workers.procs) == ["decode", "prefill"]  # type: ignore[union-attr]
            line = next(e for e in engine.events if e.startswith("decode partition:"))
            assert "no ITL SLO (--slo-itl-ms none): every step fused with the whole token budget" in line, line
            params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
            got = await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts[:6])))
            assert got == want[:6]
            await wait_blocks_free(engine)
            assert engine.stats is not None and engine.stats.partition_switches == 0
        finally:
            await engine.shutdown()
        assert shm_entries(os.getpid()) == []

    asyncio.run(main())


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_killed_worker_fails_requests_and_engine_restarts(victim: str) -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(on_worker_death="restart"))  # type: ignore[arg-type]
        try:
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            tasks = [asyncio.create_task(collect(engine, f"k{i}", [1, 2, 3, 4 + i] * 20, params)) for i in range(4)]
            # forced: the kill lands while every request is in flight (decoding has begun, none has ended: 400 tokens
            # each, through a pool too small for the four at once), not after a fixed sleep they might outlast
            deadline = time.monotonic() + 30
            while not any(s.next_index > 0 for s in engine.streams.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert len(engine.streams) == 4 and not any(s.finished for s in engine.streams.values())
            pid = engine.workers.procs[victim].pid  # type: ignore[union-attr]
            others = [p.pid for p in engine.workers.procs.values()]  # type: ignore[union-attr]
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            for t in tasks:
                with pytest.raises(EngineError, match=f"{victim} worker died"):
                    await asyncio.wait_for(t, 5.0)
            assert time.monotonic() - t0 < 2.0
            deadline = time.monotonic() + 5
            while any(_alive(p) for p in others) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not any(_alive(p) for p in others)
            # a new pair of workers comes up and serves
            deadline = time.monotonic() + 120
            while not engine.running and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            toks = await collect(engine, "after", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4,
                                                                              ignore_eos=True))
            assert len(toks) == 4
        finally:
            await engine.shutdown()
        assert shm_entries(os.getpid()) == []

    asyncio.run(main())


def test_shutdown_policy_stays_down_and_refuses() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(on_worker_death="shutdown"))  # type: ignore[arg-type]
        try:
            os.kill(engine.workers.procs["decode"].pid, signal.SIGKILL)  # type: ignore[union-attr]
            deadline = time.monotonic() + 3
            while engine.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not engine.running
            with pytest.raises(EngineError, match="decode worker died"):
                await collect(engine, "x", [1, 2, 3], SamplingParams(max_tokens=2))
        finally:
            await engine.shutdown()
        assert shm_entries(os.getpid()) == []

    asyncio.run(main())


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


SCRIPT = """
import asyncio, dataclasses, os, signal, sys
from rapidserve.launch_config import LaunchConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.llm import build_engine_config

async def main():
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=32)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps="off"))
    engine = await AsyncEngine.start(cfg)
    print(" ".join(str(p.pid) for p in engine.workers.procs.values()), flush=True)
    await asyncio.sleep(60)

if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even where pytest itself was started with SIGINT ignored
    # (a background job of a non-interactive shell: its children inherit the ignore and the signal did nothing)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_leaves_no_process_or_segment(tmp_path, sig: int) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and shm_entries(p.pid)
        p.send_signal(sig)
        p.wait(30)
        deadline = time.monotonic() + 5
        while (any(_alive(x) for x in pids) or shm_entries(p.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(x) for x in pids)
        assert shm_entries(p.pid) == []
    finally:
        p.kill()
