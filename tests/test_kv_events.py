"""--kv-events-config: vLLM-compatible KV events (rapidserve/kv_events.py, engine/kv_publisher.py), published from
the decode worker's one step loop in every mode (rapid with each policy, disagg, hybrid) and refused by `LLM`.

The block hashes are checked against an implementation of vLLM's written here from its definition
(vllm/v1/core/kv_cache_utils.py `hash_block_tokens` with the default `sha256` hash of vllm/utils/hashing.py:
sha256 over pickle protocol 5 of (parent hash or NONE_HASH, tuple of the block's tokens, None); NONE_HASH =
sha256 of the pickled $PYTHONHASHSEED; an event names a block by the low 64 bits, unsigned), using the real
`pickle` module, and the wire is read with plain msgpack (not msgspec) from a ZMQ SUB socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import pickle
import random
import time
from pathlib import Path
from typing import Any

import pytest

from rapidserve.block_manager import BlockManager
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config, resolve_kv_events
from rapidserve.engine_settings import engine_sections
from rapidserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    make_none_hash,
    pickle5,
    split_events,
)
from rapidserve.kv_events_config import KVEventsConfig, KVEventsConfigError
from rapidserve.launch_config import LaunchConfig
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import conflicts

SEED = "1234"  # $PYTHONHASHSEED of the tests
BS = 16


# ---- vLLM's hash, written from its definition -----------------------------------------------------------------
def vllm_none_hash(seed: str) -> bytes:
    return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_hashes(tokens: list[int], seed: str = SEED, block_size: int = BS) -> list[int]:
    """The event names (low 64 bits) of every full block of `tokens`, chained as vLLM chains them."""
    parent: bytes | None = None
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size:(i + 1) * block_size])
        h = hashlib.sha256(pickle.dumps((parent or vllm_none_hash(seed), block, None),
                                        protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(int.from_bytes(h, "big") & ((1 << 64) - 1))
        parent = h
    return out


def test_pickle5_is_cpython_pickle_byte_for_byte() -> None:
    rng = random.Random(5)
    ints = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -128, -129, -(2**31), -(2**31) - 1, 2**63, 2**64 + 3,
            -(2**70), 151_935, 128_000]
    samples: list[object] = [None, "", "0", "1234", "é" * 200, "x" * 300, b"", b"\x00" * 255, b"\xff" * 256, (),
                             (1,), (1, 2), (1, 2, 3), tuple(ints), (b"a" * 32, tuple(range(16)), None)]
    for _ in range(300):
        block = tuple(rng.choice(ints) if rng.random() < 0.2 else rng.randrange(0, 200_000)
                      for _ in range(rng.choice((8, 16, 32, 64, 128))))
        samples.append((rng.randbytes(32), block, None))
    for obj in samples:
        assert pickle5(obj) == pickle.dumps(obj, protocol=5), obj
    assert pickle.HIGHEST_PROTOCOL == 5  # vLLM pickles with HIGHEST_PROTOCOL: the two agree on this Python
    with pytest.raises(TypeError):
        pickle5([1, 2])


def test_none_hash() -> None:
    assert make_none_hash(SEED) == vllm_none_hash(SEED)
    a, b = make_none_hash(None), make_none_hash(None)
    assert len(a) == 32 and a != b  # unset: random, as vLLM's


# ---- the BlockManager's hooks -------------------------------------------------------------------------------------
def bm(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BS, watermark=0.0, enable_caching=True, salt=b"m",
                        events=KVEventLog(BS, make_none_hash(SEED)))


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def test_prompt_blocks_are_stored_with_vllm_hashes_and_parents() -> None:
    m = bm()
    assert m.events is not None
    prompt = list(range(100, 100 + 3 * BS + 5))  # three full blocks and a partial one
    m.allocate_cached("a", prompt)
    m.commit("a", prompt, len(prompt))
    (ev,) = m.events.drain()
    want = vllm_hashes(prompt)
    assert ev == BlockStored(want, None, prompt[:3 * BS], BS, None, "GPU", None)
    # decode fills the fourth block: stored alone, its parent the third
    tokens = prompt + list(range(11))
    m.grow("a", len(tokens))
    m.commit("a", tokens, len(tokens))
    (ev,) = m.events.drain()
    assert ev.block_hashes == vllm_hashes(tokens)[3:] and ev.parent_block_hash == want[2]
    assert ev.token_ids == tokens[3 * BS:4 * BS]
    # another prompt sharing two blocks: only its new blocks, the parent the last shared one
    other = prompt[:2 * BS] + list(range(900, 900 + 2 * BS))
    table, cached = m.allocate_cached("b", other)
    assert cached == 2 * BS
    m.commit("b", other, len(other))
    (ev,) = m.events.drain()
    assert ev.block_hashes == vllm_hashes(other)[2:] and ev.parent_block_hash == want[1]
    # the same content computed twice at once is announced once
    m.allocate_cached("c", other)  # (b's blocks are registered: c shares them)
    m.commit("c", other, len(other))
    assert m.events.drain() == []
    m.check()


def test_evicted_and_forgotten_blocks_are_removed() -> None:
    m = bm(num_blocks=6)
    assert m.events is not None
    a = list(range(2 * BS))
    m.allocate_cached("a", a + [1])
    m.commit("a", a + [1], len(a) + 1)
    m.events.drain()
    m.free("a")  # its two blocks stay cached on the free list
    ha = vllm_hashes(a)
    b = list(range(5000, 5000 + 5 * BS))
    m.allocate_cached("b", b)  # 5 blocks of 6: one of a's is evicted
    events = m.events.drain()
    assert events == [BlockRemoved([ha[1]], "GPU")]  # the tail of a prefix goes first
    m.commit("b", b, len(b))
    m.free("b")
    m.events.drain()
    m.reset_cache()  # forgets every cached block no one uses
    (ev,) = m.events.drain()
    assert isinstance(ev, BlockRemoved) and sorted(ev.block_hashes) == sorted([ha[0], *vllm_hashes(b)])
    m.check()


def test_a_parent_no_longer_cached_is_recomputed() -> None:
    m = bm(num_blocks=4)
    assert m.events is not None
    a = list(range(3 * BS))
    m.allocate_cached("a", a + [7])
    m.commit("a", a + [7], 2 * BS)  # only the first two blocks are written so far
    assert stored(m.events.drain())[0].block_hashes == vllm_hashes(a)[:2]
    m.events._vllm.clear()  # as if both were evicted meanwhile: the third block's parent is recomputed
    m.commit("a", a + [7], 3 * BS)
    (ev,) = stored(m.events.drain())
    assert ev.block_hashes == vllm_hashes(a)[2:] and ev.parent_block_hash == vllm_hashes(a)[1]


@pytest.mark.parametrize(("max_items", "want"), [
    (1000, [[("S", 4, None), ("R", 3), ("C",)]]),  # everything in one message
    (40, [[("S", 2, None)], [("S", 2, "h1"), ("R", 3), ("C",)]]),  # 2 blocks a piece (35 items), then 4 + 1
    (3, [[("S", 1, None)], [("S", 1, "h0")], [("S", 1, "h1")], [("S", 1, "h2")], [("R", 2)], [("R", 1), ("C",)]]),
])
def test_split_events_keeps_order_and_chains_parents(max_items: int, want: list[list[tuple[Any, ...]]]) -> None:
    hashes = [10, 11, 12, 13]
    events: list[Any] = [BlockStored(hashes, None, list(range(4 * 16)), 16, None, "GPU", None),
                         BlockRemoved([1, 2, 3], "GPU"), AllBlocksCleared()]
    got = split_events(events, max_items)
    names = {10: "h0", 11: "h1", 12: "h2"}

    def shape(e: Any) -> tuple[Any, ...]:
        if isinstance(e, BlockStored):
            return ("S", len(e.block_hashes), names.get(e.parent_block_hash) if e.parent_block_hash else None)
        return ("R", len(e.block_hashes)) if isinstance(e, BlockRemoved) else ("C",)

    assert [[shape(e) for e in g] for g in got] == want
    flat = [h for g in got for e in g if isinstance(e, BlockStored) for h in e.block_hashes]
    assert flat == hashes
    tokens = [t for g in got for e in g if isinstance(e, BlockStored) for t in e.token_ids]
    assert tokens == list(range(64))


# ---- the flag -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [
    ('{"enable_kv_cache_events": true}', {"publisher": "zmq", "endpoint": "tcp://*:5557"}),
    ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "kv-events", '
     '"replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "hwm": 10, "max_queue_size": 7}',
     {"topic": "kv-events", "replay_endpoint": "tcp://*:6001", "buffer_steps": 5}),
    ('{"enable_kv_cache_events": false}', {"publisher": "null"}),
    ('{"enable_kv_cache_events": true, "publisher": "null"}', {"publisher": "null"}),
])
def test_parse(text: str, want: dict[str, object]) -> None:
    cfg = KVEventsConfig.parse(text)
    for k, v in want.items():
        assert getattr(cfg, k) == v


@pytest.mark.parametrize(("text", "error"), [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"enable_kv_cache_events": true, "port": 5}', "unknown key(s) 'port'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events='yes' has the wrong type"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher='kafka'"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost"}', "endpoint='localhost'"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm=0"),
    ('{"enable_kv_cache_events": true, "buffer_steps": true}', "buffer_steps=True has the wrong type"),
])
def test_parse_refuses_by_name(text: str, error: str) -> None:
    with pytest.raises(KVEventsConfigError) as e:
        KVEventsConfig.parse(text)
    assert error in str(e.value)
    with pytest.raises(ConfigError) as e2:  # through the settings' check (the CLI's, before the port is bound)
        engine_sections(kv_events_config=text)
    assert error in str(e2.value)


def test_resolve_seed_prefix_caching_and_pyzmq(monkeypatch: pytest.MonkeyPatch) -> None:
    on = '{"enable_kv_cache_events": true}'
    assert resolve_kv_events(on, enable_prefix_caching=True, hash_seed=SEED).none_hash == vllm_none_hash(SEED)
    assert resolve_kv_events(None, enable_prefix_caching=False, hash_seed=None) == KVEventsConfig()
    with pytest.raises(ConfigError, match="--no-enable-prefix-caching"):
        resolve_kv_events(on, enable_prefix_caching=False, hash_seed=SEED)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs pyzmq: pip install 'rapidserve\[kv-events\]'"):
        resolve_kv_events(on, enable_prefix_caching=True, hash_seed=SEED)


def test_only_a_server_reads_the_flag() -> None:
    given = {"kv_events.enable_kv_cache_events": True}
    for run, policy in (("rapid", "rapid"), ("hybrid", "fused"), ("disagg", "rapid")):
        assert conflicts(run, policy, given) == []
    (msg,) = conflicts("offline", "rapid", given)
    assert msg.startswith("kv_events_config=True (--kv-events-config): not read by LLM") and "--mode rapid" in msg
    with pytest.raises(ConfigError, match="kv_events_config"):
        build_engine_config("preset:tiny-llama", device="cpu", run="offline",
                            kv_events_config={"enable_kv_cache_events": True})


def test_endpoints_per_rank() -> None:
    from rapidserve.engine.kv_publisher import binds, endpoint_for_rank

    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 2) == "tcp://*:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert endpoint_for_rank(None, 3) is None
    with pytest.raises(ConfigError):
        endpoint_for_rank("tcp://host", 1)
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")


# ---- over ZMQ, from a running engine -----------------------------------------------------------------------------
def engine_config(mode: str, endpoint: str, replay: str, policy: str | None = None) -> Any:
    kv = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
    partition = None if policy is None else PartitionConfig(policy=policy)
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=14,
                                 max_model_len=512, block_size=BS, kv_events_config=kv, env={"PYTHONHASHSEED": SEED},
                                 launch=LaunchConfig(mode=mode, mps="off"), partition=partition)  # type: ignore[arg-type]
    return cfg


def probe_prompt(k: int) -> list[int]:
    """The k-th probe: one full block of its own token (no prefix shared with any other prompt here), so computing it
    publishes one BlockStored."""
    return [1100 + k] * (BS + 1)


async def subscribed(probe: Any, events_so_far: Any) -> int:
    """Returns once the subscriber has received an event: ZMQ drops what a publisher sends before a subscription
    reaches it, however long that takes, so rather than sleep and hope, this runs probe prompts (`probe(k)`, k = 0,
    1, ...) until one's BlockStored comes through; the number of probes run."""
    deadline = time.monotonic() + 60
    k = 0
    while not events_so_far():
        assert time.monotonic() < deadline, f"no event reached the subscriber after {k} probe prompts"
        await probe(k)
        k += 1
        for _ in range(20):  # its events, published as its blocks were stored, may still be on their way
            if events_so_far():
                break
            await asyncio.sleep(0.01)
    return k


def test_the_hash_seed_is_the_runs_pythonhashseed(tmp_path: Path) -> None:
    cfg = engine_config("rapid", f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/r")
    assert cfg.kv_events.publishing and cfg.kv_events.none_hash == vllm_none_hash(SEED)


# Every mode and policy: the decode worker's one step loop (engine/decode_worker.py) owns the BlockManager and
# sends its events, whether prompts are computed beside it (rapid, disagg) or in its fused steps (hybrid).
MODES = [("rapid", None), ("rapid", "duet"), ("rapid", "drift"), ("hybrid", None), ("disagg", None)]


@pytest.mark.parametrize(("mode", "policy"), MODES)
def test_a_subscriber_sees_stored_then_removed_blocks(mode: str, policy: str | None, tmp_path: Path) -> None:
    """A prompt's full blocks arrive as BlockStored with vLLM's hashes; later prompts evict them (a pool of 14
    blocks): BlockRemoved names them. A replay from the first sequence received returns the same batches."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    from rapidserve.engine.client import AsyncEngine
    from rapidserve.sampling_params import SamplingParams

    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    cfg = engine_config(mode, endpoint, replay, policy)
    assert cfg.launch.mode == mode and cfg.partition.policy == (policy or cfg.partition.policy)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    frames: list[list[bytes]] = []

    def events_so_far() -> list[list[Any]]:
        while sub.poll(0):
            frames.append(sub.recv_multipart())
        return [e for f in frames for e in msgpack.unpackb(f[2], raw=False)[1]]

    async def until(pred: Any, what: str) -> None:
        deadline = time.monotonic() + 30
        while not pred(events_so_far()):
            assert time.monotonic() < deadline, f"no {what}: {events_so_far()}"
            await asyncio.sleep(0.05)

    async def run(engine: AsyncEngine, rid: str, prompt: list[int]) -> None:
        async for _ in engine.generate(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)):
            pass

    async def main() -> None:
        engine = await AsyncEngine.start(cfg)
        try:
            sub.connect(endpoint)
            probes = await subscribed(lambda k: run(engine, f"probe{k}", probe_prompt(k)), events_so_far)
            prompt = list(range(10, 10 + 3 * BS + 5))
            await run(engine, "a", prompt)
            want = vllm_hashes(prompt)
            await until(lambda ev: [h for e in ev if e[0] == "BlockStored" for h in e[1] if h in want] == want,
                        "BlockStored")
            first = next(e for e in events_so_far() if e[0] == "BlockStored" and e[1][0] in want)
            assert first[2] is None and first[4] == BS and first[5] is None and first[6] == "GPU"
            assert first[3] == prompt[:len(first[1]) * BS]
            chains = [want, *(vllm_hashes(probe_prompt(k)) for k in range(probes))]
            for i in range(4):  # distinct prompts of 8 blocks each: the pool of 14 must evict a's blocks
                b = [3 + (200 * (i + 1) + t) % 1270 for t in range(8 * BS)]  # (the vocabulary: 1280 ids)
                chains.append(vllm_hashes(b))
                await run(engine, f"b{i}", b)
                if {h for e in events_so_far() if e[0] == "BlockRemoved" for h in e[1]} >= set(want):
                    break
            await until(lambda ev: {h for e in ev if e[0] == "BlockRemoved" for h in e[1]} >= set(want),
                        "BlockRemoved")
            # every stored run is a stretch of one prompt's vLLM chain, its parent the hash before it
            for e in (e for e in events_so_far() if e[0] == "BlockStored"):
                (chain,) = [c for c in chains if e[1][0] in c]
                k = chain.index(e[1][0])
                assert e[1] == chain[k:k + len(e[1])] and e[2] == (chain[k - 1] if k else None), e
            req = ctx.socket(zmq.DEALER)
            req.connect(replay)
            start = int.from_bytes(frames[0][1], "big")  # the first batch this subscriber received (0 but for probes
            req.send_multipart([b"", start.to_bytes(8, "big")])  # published before its subscription took)
            replayed = []
            while True:
                assert req.poll(10_000)
                _, seq, payload = req.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                replayed.append(payload)
            assert replayed[:len(frames)] == [f[2] for f in frames]
            assert [int.from_bytes(f[1], "big") for f in frames] == list(range(start, start + len(frames)))
            req.close(0)
            assert all(msgpack.unpackb(f[2], raw=False)[2] == 0 for f in frames)  # data_parallel_rank
        finally:
            await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        sub.close(0)
        ctx.term()


def test_a_worker_death_publishes_all_blocks_cleared(tmp_path: Path) -> None:
    """The router's publisher outlives the workers: a death is AllBlocksCleared on the same stream."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    import os
    import signal

    from rapidserve.engine.client import AsyncEngine
    from rapidserve.sampling_params import SamplingParams

    endpoint = f"ipc://{tmp_path}/kv"
    cfg = dataclasses.replace(engine_config("hybrid", endpoint, f"ipc://{tmp_path}/r"),
                              launch=LaunchConfig(mode="hybrid", mps="off", max_restarts=1))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    got: list[list[Any]] = []

    def events_so_far() -> list[list[Any]]:
        while sub.poll(0):
            got.extend(msgpack.unpackb(sub.recv_multipart()[2], raw=False)[1])
        return got

    async def run(engine: AsyncEngine, rid: str, prompt: list[int]) -> None:
        async for _ in engine.generate(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)):
            pass

    async def main() -> None:
        engine = await AsyncEngine.start(cfg)
        try:
            sub.connect(endpoint)
            await subscribed(lambda k: run(engine, f"probe{k}", probe_prompt(k)), events_so_far)
            assert engine.workers is not None
            seen = len(events_so_far())
            os.kill(engine.workers.procs["hybrid"].pid, signal.SIGKILL)  # type: ignore[arg-type]
            deadline = time.monotonic() + 20
            while ["AllBlocksCleared"] not in events_so_far()[seen:]:  # the event loop must run: it handles the death
                assert time.monotonic() < deadline, f"no AllBlocksCleared: {got[seen:]}"
                await asyncio.sleep(0.05)
        finally:
            await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        sub.close(0)
        ctx.term()
