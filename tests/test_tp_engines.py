"""The rapid and hybrid engines at tensor-parallel size 2 on CPU (gloo): the decode and prefill workers
(or the hybrid worker) each lead a follower that replays their calls (parallel/mirror.py), and the
tokens are those of a one-process `LLM` — greedy, seeded random and penalized rows, preemptions (a small
pool) and an abort included; afterwards the pool is whole and no penalty slot is held."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import ParallelConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_logit_controls_engines import PROMPTS, _params
from tests.test_prefix_cache_engines import quiet_stats

MODEL = "preset:tiny-llama"
N = 8
KV_BLOCKS = 12


@pytest.fixture(scope="module")
def expected() -> tuple[list[SamplingParams], list[list[int]]]:
    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=256)
    base = dict(max_tokens=10, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, **base),
                                                          use_tqdm=False)]
    params = _params(plain)[:N]
    return params, [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:N], params, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_tp2_engine_gives_one_process_tokens(expected: tuple[list[SamplingParams], list[list[int]]],
                                             mode: str) -> None:
    params, want = expected
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300),  # type: ignore[arg-type]
                              parallel=ParallelConfig(tensor_parallel_size=2))

    async def main() -> tuple[list[list[int]], Any, list[str]]:
        engine = await AsyncEngine.start(cfg)
        try:
            procs = sorted(engine.workers.procs)  # type: ignore[union-attr]

            async def one(i: int) -> list[int]:
                return [t.token_id async for t in engine.generate(f"r{i}", PROMPTS[i], params[i])]

            async def aborted() -> None:
                gen = engine.generate("ab", PROMPTS[0], params[0].replace(max_tokens=200))
                for _ in range(2):
                    await gen.__anext__()
                await gen.aclose()

            got = await asyncio.gather(*(one(i) for i in range(N)), aborted())
            return list(got[:-1]), await quiet_stats(engine), procs
        finally:
            await engine.shutdown()

    got, stats, procs = asyncio.run(main())
    assert got == want
    assert stats.num_preemptions > 0
    assert stats.token_slots == 0
    assert procs == (["decode", "decode.1", "prefill", "prefill.1"] if mode == "rapid" else ["hybrid", "hybrid.1"])


# what a follower outliving its leader's TCP store logged at every stop (NCCL's watchdog: a c10d stack trace)
SHUTDOWN_NOISE = ("Traceback", "Exception raised from", "TCPStore", "heartbeat", "Connection reset")


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_followers_exit_before_their_leader(mode: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Shutdown in order: each leader (rank 0, whose process hosts the group's TCP store) exits only after its
    followers (tp_workers.stop_followers); nothing is logged. On CPU (gloo) no watchdog would report a lost
    store; test_tp2_on_two_gpus checks the NCCL workers' log."""
    from rapidserve.engine import messages as m
    from rapidserve.engine.launch import WorkerSet
    from rapidserve.ipc.ring import pid_alive

    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300),  # type: ignore[arg-type]
                              parallel=ParallelConfig(tensor_parallel_size=2))
    ws = WorkerSet.start(cfg, {})
    try:
        leaders = ["prefill", "decode"] if mode == "rapid" else ["hybrid"]
        for who in leaders:  # WorkerSet.stop's order, one leader at a time
            leader, follower = ws.procs[who], ws.procs[f"{who}.1"]
            if who == "prefill":
                leader.terminate()
            else:
                assert ws.to_engine.try_send(m.Shutdown("test"))
            leader.join(30)
            assert leader.exitcode == 0
            # gone or a zombie the moment its leader has exited (a worker's exit status reaches this process
            # through the fork server a little later: is_alive() could still say True here)
            assert not pid_alive(follower.pid), f"{who}.1 outlived its leader"
            follower.join(30)
            assert follower.exitcode == 0
    finally:
        ws.stop()
    err = capfd.readouterr().err
    assert not [w for w in SHUTDOWN_NOISE if w in err], err[-3000:]


def test_tp_size_that_does_not_divide_the_heads_fails_at_start() -> None:
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    with pytest.raises(ConfigError, match="tensor-parallel-size 3 must divide"):
        dataclasses.replace(cfg, parallel=ParallelConfig(tensor_parallel_size=3))


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_tp2_on_two_gpus(mode: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Two GPUs, NCCL, decode and piecewise prefill graphs with their all-reduces captured (every rank captures
    the same sets in the same order), rapid mode's partitions on each GPU:
    the tokens of one GPU (fp32, greedy and seeded rows; the sums' order differs, the tokens do not)."""
    if not _two_gpus():
        pytest.skip("needs two GPUs")
    base = dict(max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **base), SamplingParams(seed=3, temperature=0.8, **base),
              SamplingParams(temperature=0.0, presence_penalty=1.0, **base)] * 3
    llm = LLM(MODEL, dtype="float32", device="cuda", show_progress=False, max_model_len=256, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:9], params, use_tqdm=False)]
    del llm
    cfg, _ = build_engine_config(MODEL, device="cuda", dtype="float32", num_kv_blocks=64, max_model_len=256)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300),  # type: ignore[arg-type]
                              parallel=ParallelConfig(tensor_parallel_size=2))

    async def main() -> list[list[int]]:
        engine = await AsyncEngine.start(cfg)
        try:
            async def one(i: int) -> list[int]:
                return [t.token_id async for t in engine.generate(f"r{i}", PROMPTS[i], params[i])]

            return list(await asyncio.gather(*(one(i) for i in range(9))))
        finally:
            await engine.shutdown()

    capfd.readouterr()
    assert asyncio.run(main()) == want  # every worker has exited: what they logged is in
    err = capfd.readouterr().err  # the workers' stderr is this process's: followers outliving the store would log
    assert not [w for w in SHUTDOWN_NOISE if w in err], err[-3000:]


@pytest.mark.parametrize("victim", ["decode.1", "prefill.1", "decode"])
def test_a_dead_rank_is_a_dead_worker(victim: str) -> None:
    """Under tensor parallelism a follower's death (or a leader's) is handled as any worker's: the request in
    flight ends with an error naming it, the engine restarts every rank, and the next request is served."""
    import os
    import signal

    from rapidserve.engine.errors import EngineError
    from tests.test_supervision import collect, start_long, wait_for

    # start_long's 8000 tokens: past tiny-llama's 1024 positions (random weights: no text to spoil)
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=8192,
                                 allow_long_max_model_len=True)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps="off", startup_timeout_s=300),
                              parallel=ParallelConfig(tensor_parallel_size=2))

    async def main() -> None:
        engine = await AsyncEngine.start(cfg)
        try:
            task = await start_long(engine, "long")
            os.kill(engine.workers.procs[victim].pid, signal.SIGKILL)  # type: ignore[union-attr,arg-type]
            with pytest.raises(EngineError, match=f"the {victim} worker died"):
                await asyncio.wait_for(task, 10.0)
            await wait_for(lambda: engine.state == "ready", 120)
            assert sorted(engine.workers.procs) == ["decode", "decode.1", "prefill", "prefill.1"]  # type: ignore[union-attr]
            assert await collect(engine, "after", 3) == 3
            assert engine.deaths_total == 1 and engine.restarts_total == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(("tp", "device", "visible", "devices", "error"), [
    (2, "cuda", 1, None, "needs GPUs \\[0, 1\\] but 1 is visible"),
    (2, "auto", 2, (1, 3), "needs GPUs \\[1, 3\\] but 2 are visible"),
    (2, "auto", 0, None, None),  # auto on a machine without GPUs: the CPU
    (2, "cpu", 0, None, None),
    (2, "cuda", 2, None, None),
    (1, "cuda", 0, None, None),  # no tensor parallelism: the runner's own checks apply
])
def test_the_ranks_gpus_must_be_visible(tp: int, device: str, visible: int, devices: tuple[int, ...] | None,
                                        error: str | None) -> None:
    from rapidserve.engine.tp_workers import check_tp_gpus

    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    cfg = dataclasses.replace(cfg, runner=dataclasses.replace(cfg.runner, device=device),
                              parallel=ParallelConfig(tensor_parallel_size=tp, devices=devices))
    if error is None:
        check_tp_gpus(cfg, visible)
    else:
        with pytest.raises(ConfigError, match=error):
            check_tp_gpus(cfg, visible)


def test_one_gpu_device_with_several_gpus_is_refused_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    """`--device cuda:1 -tp 2`: one GPU named, two used; the CLI says so (exit 2) before any model loads."""
    from rapidserve.cli import main

    assert main(["serve", "--model", MODEL, "--device", "cuda:1", "-tp", "2"]) == 2
    assert "--device cuda:1 names one GPU but --tensor-parallel-size x --data-parallel-size uses 2" \
        in capsys.readouterr().err
