"""Data parallelism without workers: the dispatch choice (a table), the per-engine configs, the combined
Stats, and `DataParallelEngine` over stand-in engines (least-loaded dispatch, aborts to the owner, an
engine that dies or restarts, one that gives up, /health); the flag's usage errors."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from rapidserve.config import EngineConfig, ParallelConfig, RunnerConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine.data_parallel import DataParallelEngine, engine_configs, pick_engine
from rapidserve.engine.dp_stats import CounterCarry, combine_stats
from rapidserve.engine.errors import EngineError
from rapidserve.engine.messages import Stats, TokenOut
from rapidserve.sampling_params import SamplingParams
from tests.server_fakes import ECFG, MODEL, running_server


@pytest.mark.parametrize("in_flight,running,want", [
    ([0], [True], 0),
    ([0, 0], [True, True], 0),  # a tie: the lowest index
    ([1, 0], [True, True], 1),
    ([3, 1, 1], [True, True, True], 1),  # the tie among the least loaded: lowest index
    ([5, 2, 7, 2], [True, True, True, True], 1),
    ([0, 4], [False, True], 1),  # a dead or restarting engine is skipped, however idle
    ([2, 0, 1], [True, False, True], 2),
    ([0, 0], [False, False], None),  # none running: no engine
    ([], [], None),
])
def test_pick_engine(in_flight: list[int], running: list[bool], want: int | None) -> None:
    assert pick_engine(in_flight, running) == want


def cfg(device: str = "cpu", dp: int = 2, tp: int = 1, devices: tuple[int, ...] | None = None) -> EngineConfig:
    return EngineConfig(model="preset:fake", model_config=MODEL, runner=RunnerConfig(device=device),
                        parallel=ParallelConfig(tp, dp, devices))


@pytest.mark.parametrize("device,dp,devices,visible,want", [
    ("cpu", 3, None, 8, ["cpu"] * 3),  # device cpu: every engine on the CPU, GPUs or not
    ("auto", 2, None, 0, ["cpu", "cpu"]),  # auto without a GPU: the CPU
    ("auto", 2, None, 2, ["cuda:0", "cuda:1"]),
    ("cuda", 3, None, 4, ["cuda:0", "cuda:1", "cuda:2"]),
    ("cuda", 2, (3, 1), 4, ["cuda:3", "cuda:1"]),  # ParallelConfig.devices picks the GPUs
])
def test_engine_configs_place_engine_i_on_gpu_i(device: str, dp: int, devices: tuple[int, ...] | None,
                                                 visible: int, want: list[str]) -> None:
    got = engine_configs(cfg(device, dp, devices=devices), visible)
    assert [c.runner.device for c in got] == want
    for i, c in enumerate(got):  # below the router each engine is a single replica, on its own GPU
        assert c.parallel.data_parallel_size == 1 and c.parallel.world_size == 1
        assert c.parallel.devices == (None if c.runner.device == "cpu" else (int(c.runner.device[5:]),))
        assert c.kv_events.data_parallel_rank == i  # its KV events' rank (and port offset)
        assert dataclasses.replace(c, runner=got[0].runner, parallel=got[0].parallel, kv_events=got[0].kv_events) \
            == got[0]


@pytest.mark.parametrize("device,devices,visible,want", [
    ("cuda", None, 4, [("cuda:0", (0, 1)), ("cuda:2", (2, 3))]),  # engine i's rank r on gpus()[i * tp + r]
    ("auto", (4, 5, 0, 1), 6, [("cuda:4", (4, 5)), ("cuda:0", (0, 1))]),
    ("cpu", None, 4, [("cpu", None), ("cpu", None)]),
])
def test_engine_configs_with_tensor_parallelism_give_each_engine_its_ranks_gpus(
        device: str, devices: tuple[int, ...] | None, visible: int,
        want: list[tuple[str, tuple[int, ...] | None]]) -> None:
    got = engine_configs(cfg(device, 2, tp=2, devices=devices), visible)
    assert [(c.runner.device, c.parallel.devices) for c in got] == want
    assert all((c.parallel.tensor_parallel_size, c.parallel.data_parallel_size) == (2, 1) for c in got)


@pytest.mark.parametrize("config,visible,needle", [
    (cfg("cuda", 2, tp=2), 3, "data_parallel_size=2 x tensor_parallel_size=2 needs GPUs [0, 1, 2, 3] but 3 are"),
    (cfg("cuda", 4), 2, "needs GPUs [0, 1, 2, 3] but 2 are visible"),
    (cfg("cuda", 2, devices=(0, 5)), 4, "needs GPUs [0, 5]"),
])
def test_engine_configs_refuse_what_cannot_run(config: EngineConfig, visible: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        engine_configs(config, visible)


def stats(**kw: object) -> Stats:
    base: dict[str, object] = {"num_running": 1, "num_waiting": 2, "num_prefilling": 0, "kv_blocks_total": 100,
                               "kv_blocks_free": 40, "num_preemptions": 0}
    return Stats(**{**base, **kw})  # type: ignore[arg-type]


def test_combined_stats_sum_counters_across_a_restart_and_gauges_of_running_engines() -> None:
    a = stats(num_preemptions=3, prefix_cache_queries=10, prefix_cache_hits=4, partition_steps={"off": 5},
              num_hand_overs=2)
    b = stats(num_running=2, num_preemptions=1, prefix_cache_queries=6, partition="d25", num_hand_overs=1)
    carries = [CounterCarry().advance(a), CounterCarry().advance(b)]
    s = combine_stats([a, b], [True, True], carries)
    assert s is not None
    assert (s.num_running, s.num_waiting, s.kv_blocks_total, s.kv_blocks_free) == (3, 4, 200, 80)
    assert (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits, s.num_hand_overs) == (4, 16, 4, 3)
    assert s.partition_steps == {"off": 5} and s.partition == "none+d25"
    # engine 0 restarts: while it is down its gauges are left out, its counts stay
    s = combine_stats([a, b], [False, True], carries)
    assert s is not None and (s.num_running, s.kv_blocks_total, s.num_preemptions, s.partition) == (2, 100, 4, "d25")
    # its new workers count from 0: the sum never goes down, and grows with what they count
    a2 = stats(num_preemptions=1, prefix_cache_queries=2, partition_steps={"off": 1}, num_hand_overs=1)
    carries[0] = carries[0].advance(a2)
    s = combine_stats([a2, b], [True, True], carries)
    assert s is not None
    assert (s.num_preemptions, s.prefix_cache_queries, s.partition_steps) == (5, 18, {"off": 6})
    assert s.num_hand_overs == 4  # the dead generation's 2, the new one's 1, engine 1's 1
    assert combine_stats([None, None], [True, True], [CounterCarry(), CounterCarry()]) is None


class Member:
    """A stand-in engine: each request yields a token whenever the test releases it (`step`)."""

    def __init__(self) -> None:
        self.state = "ready"
        self.dead_reason: str | None = None
        self.stats: Stats | None = None
        self.restarts_total = self.deaths_total = 0
        self.fatal = asyncio.Event()
        self.events = ["workers ready"]
        self.queues: dict[str, asyncio.Queue[TokenOut | BaseException]] = {}
        self.aborted: list[str] = []
        self.served: list[str] = []
        self.stopped = False

    @property
    def running(self) -> bool:
        return self.state == "ready"

    async def generate(self, req_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenOut]:
        if self.state != "ready":
            raise EngineError(f"the engine is not running ({self.state})")
        q: asyncio.Queue[TokenOut | BaseException] = asyncio.Queue()
        self.queues[req_id] = q
        self.served.append(req_id)
        done = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    done = True
                    return
        finally:
            self.queues.pop(req_id, None)
            if not done:  # as AsyncEngine: a consumer that leaves early aborts
                await self.abort(req_id)

    def step(self, req_id: str, index: int, last: bool = False) -> None:
        self.queues[req_id].put_nowait(TokenOut(req_id, index, 7, finish_reason="length" if last else None))

    def die(self, reason: str) -> None:
        """A worker death: every request in flight ends with EngineError; the engine restarts."""
        self.state, self.dead_reason, self.deaths_total = "restarting", reason, self.deaths_total + 1
        for q in self.queues.values():
            q.put_nowait(EngineError(reason))

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    async def shutdown(self) -> None:
        self.stopped = True
        self.state = "down"


async def first_token(dp: DataParallelEngine, rid: str) -> tuple[AsyncIterator[TokenOut], TokenOut]:
    """Start request `rid` and take its first token (index 0)."""
    gen = dp.generate(rid, [1, 2], SamplingParams(max_tokens=4))
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    i = dp.owner(rid)
    assert i is not None
    dp.engines[i].step(rid, 0)  # type: ignore[attr-defined]
    return gen, await task


def test_least_loaded_dispatch_abort_to_the_owner_and_a_death_in_one_engine() -> None:
    async def main() -> None:
        members = [Member(), Member(), Member()]
        dp = DataParallelEngine(ECFG, members)  # type: ignore[arg-type]
        gens = {}
        for rid in ("a", "b", "c", "d"):  # 0, 1, 2, then back to 0 (all hold one: the lowest index)
            gens[rid], tok = await first_token(dp, rid)
            assert tok.req_id == rid
        assert [dp.owner(r) for r in "abcd"] == [0, 1, 2, 0] and dp.in_flight == [2, 1, 1]
        # an abort goes to the engine that holds the request, and only there
        await dp.abort("c")
        assert members[2].aborted == ["c"] and members[0].aborted == members[1].aborted == []
        await dp.abort("nobody")  # an unknown id: nothing happens
        # a finished request leaves its engine's count
        members[1].step("b", 1, last=True)
        assert [t.finish_reason async for t in gens["b"]] == ["length"]
        assert dp.in_flight == [2, 0, 1] and dp.owner("b") is None
        # engine 0 dies: its requests end with its error, the others' go on
        members[0].die("the decode worker died (killed by SIGKILL, pid 9)")
        for rid in ("a", "d"):
            with pytest.raises(EngineError, match="decode worker died"):
                await gens[rid].__anext__()
        assert dp.in_flight == [0, 0, 1] and dp.state == "ready"
        assert dp.dead_reason == "engine 0 restarting: the decode worker died (killed by SIGKILL, pid 9)"
        members[2].step("c", 1)
        assert (await gens["c"].__anext__()).index == 1
        # while engine 0 restarts, new requests skip it though it holds none
        gens["e"], _ = await first_token(dp, "e")
        gens["f"], _ = await first_token(dp, "f")
        assert (dp.owner("e"), dp.owner("f")) == (1, 1)  # 1 holds 0 then 1; 2 holds "c" (ties: lowest)
        # a consumer that leaves early: the request is aborted on its engine at once
        await gens["e"].aclose()
        assert members[1].aborted == ["e"] and dp.owner("e") is None
        with pytest.raises(EngineError, match="already in flight"):
            await dp.generate("f", [1], SamplingParams()).__anext__()
        members[0].state = "ready"  # back
        gens["g"], _ = await first_token(dp, "g")
        assert dp.owner("g") == 0 and dp.deaths_total == 1
        for m in members:
            m.state = "restarting"
        assert dp.state == "restarting" and not dp.running
        with pytest.raises(EngineError, match="no engine is running"):
            await dp.generate("h", [1], SamplingParams()).__anext__()
        for g in gens.values():
            await g.aclose()
        assert dp.in_flight == [0, 0, 0] and dp.dispatched == [3, 3, 1]
        await dp.shutdown()
        assert all(m.stopped for m in members)

    asyncio.run(main())


def test_each_engines_stats_by_index_and_placed_told_before_the_hand_over() -> None:
    """/metrics labels each engine's vLLM series by its index: `engine_stats` gives each one's own Stats (None
    while it is not running), and `placed` names the engine a request goes to before it is handed over."""
    async def main() -> None:
        members = [Member(), Member()]
        dp = DataParallelEngine(ECFG, members)  # type: ignore[arg-type]
        assert dp.engine_stats == [None, None]
        members[0].stats, members[1].stats = stats(kv_blocks_total=64), stats(kv_blocks_total=128, num_running=5)
        assert [s.kv_blocks_total if s else None for s in dp.engine_stats] == [64, 128]
        members[1].state = "restarting"
        assert dp.engine_stats == [members[0].stats, None]
        members[1].state = "ready"
        told: list[tuple[str, int, bool]] = []
        gens = []
        for rid in ("a", "b", "c"):
            gen = dp.generate(rid, [1], SamplingParams(), placed=lambda i, rid=rid: told.append(
                (rid, i, rid in members[i].served or dp.owner(rid) is not None)))
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)
            members[dp.owner(rid)].step(rid, 0)  # type: ignore[index]
            await task
            gens.append(gen)
        assert told == [("a", 0, False), ("b", 1, False), ("c", 0, False)]
        for g in gens:
            await g.aclose()
        await dp.shutdown()

    asyncio.run(main())


def test_one_engine_giving_up_is_the_engine_giving_up_and_health_lists_every_engine() -> None:
    async def main() -> None:
        import aiohttp

        members = [Member(), Member()]
        dp = DataParallelEngine(ECFG, members)  # type: ignore[arg-type]
        async with running_server(dp) as (_, url), aiohttp.ClientSession() as http:  # type: ignore[arg-type]
            async with http.get(url + "/health") as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "ok"
                assert [e["state"] for e in body["engines"]] == ["ready", "ready"]
            members[1].die("the hybrid worker died (exit code 1, pid 7)")
            async with http.get(url + "/health") as r:  # the server still serves: 200, degraded, and why
                body = await r.json()
                assert r.status == 200 and body["status"] == "degraded" and "engine 1 restarting" in body["reason"]
                assert body["engines"][1]["reason"] == "the hybrid worker died (exit code 1, pid 7)"
            members[1].state, members[1].dead_reason = "down", "giving up: restart budget used up"
            members[1].fatal.set()
            await asyncio.wait_for(dp.fatal.wait(), 1)
            assert dp.state == "down" and dp.dead_reason == "engine 1: giving up: restart budget used up"
            async with http.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "down"
        await dp.shutdown()

    asyncio.run(main())


def test_an_engine_that_fails_to_start_stops_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Member] = []

    async def start(c: EngineConfig, mps_plan: object = None, profile: object = None) -> Member:
        assert c.runner.device == "cpu" and mps_plan is None  # the CPU: no MPS daemon
        member = Member()
        made.append(member)
        if len(made) == 2:
            raise RuntimeError("the decode worker failed to start: out of memory")
        await asyncio.sleep(0.01)
        return member

    monkeypatch.setattr("rapidserve.engine.data_parallel.AsyncEngine.start", start)
    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(DataParallelEngine.start(cfg("cpu", 3)))
    assert [m.stopped for m in made] == [True, False, True]


def test_on_gpus_each_engine_gets_its_device_and_all_share_one_mps_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidserve.engine.mps import MpsController, MpsPlan

    plan = MpsPlan("auto", True, True, "/tmp/mps-x/pipe", "/tmp/mps-x/log", "MPS on: started a private daemon")
    starts: list[tuple[str, object]] = []
    daemons: list[str] = []

    async def start(c: EngineConfig, mps_plan: object = None, profile: object = None) -> Member:
        starts.append((c.runner.device, mps_plan))
        return Member()

    def mps_start(self: MpsController, mode: str, platform: str, workdir: str) -> MpsPlan:
        daemons.append(platform)
        return plan

    monkeypatch.setattr("rapidserve.engine.data_parallel.AsyncEngine.start", start)
    monkeypatch.setattr("rapidserve.engine.data_parallel.gpu_platform", lambda: "cuda")
    monkeypatch.setattr("rapidserve.engine.data_parallel._gpu_count", lambda: 2)
    monkeypatch.setattr(MpsController, "start", mps_start)
    monkeypatch.setattr(MpsController, "stop", lambda self: None)

    async def main() -> None:
        dp = await DataParallelEngine.start(cfg("cuda", 2))
        assert starts == [("cuda:0", plan), ("cuda:1", plan)] and daemons == ["cuda"]
        assert dp.events[0] == plan.reason and dp.events[1] == "engine 0: workers ready"
        await dp.shutdown()

    asyncio.run(main())


def test_data_parallel_size_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_cli import usage_error

    for args, needle in ((["--data-parallel-size", "0"], "--data-parallel-size/-dp: 0 must be an integer >= 1"),
                         (["-dp", "two"], "'two' is not an integer"),
                         (["--model", "preset:tiny-llama", "--device", "cpu", "-dp", "2", "-tp", "3"],
                          "--tensor-parallel-size 3 must divide")):
        assert needle in usage_error(capsys, "serve", "--port", "0", *args)
