"""Tensor parallelism on CPU (issue 17): N ranks under gloo give the greedy tokens of one process (fp32).

Each rank is a spawned process with a `TPGroup` and a `ModelRunner` over its shard; every rank makes the
same runner calls (prefill, then decode steps, some through `Carry`), the leader's tokens are compared
with a TP-1 runner's. The models cover a plain Llama (KV heads split at TP 2, replicated at TP 4), Qwen2's
q/k/v biases and a tied embedding / LM head.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.ipc import Receiver, Sender, ShmRing
from rapidserve.parallel.group import TPGroup
from rapidserve.parallel.mirror import Leader, MirrorMessage, follow
from rapidserve.runner import Carry, DecodeItem, ModelRunner, PrefillItem
from rapidserve.sampling_params import SamplingParams
from tests.tp_harness import run_ranks

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7, 7, 300, 12]]
STEPS = 6
BLOCK = 16


def _greedy(runner: ModelRunner) -> list[list[int]]:
    """Prefill both prompts in one batch, then STEPS decode steps; odd steps take their input tokens from
    the device (Carry), as the engine's one-step-ahead loop does."""
    tables = [[0, 1], [2, 3]]
    logits = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(PROMPTS, tables, strict=True)])
    last = logits.argmax(-1)
    out = [[int(t)] for t in last]
    lens = [len(p) for p in PROMPTS]
    for step in range(STEPS):
        items = [DecodeItem(out[i][-1], lens[i] + step, tables[i]) for i in range(2)]
        carry = Carry(last, [(0, 0), (1, 1)]) if step % 2 else None
        last = runner.decode(items, carry=carry).argmax(-1)
        for i in range(2):
            out[i].append(int(last[i]))
    return out


def _greedy_sampled(runner: ModelRunner, graph_key: str = "default") -> list[list[int]]:
    """As `_greedy`, but sampled with `sample_next` (the leader's path) and every decode step fed its
    tokens from the device: the followers replay the calls and receive the broadcast tokens."""
    tables = [[0, 1], [2, 3]]
    params = [SamplingParams(temperature=0.0)] * 2
    logits = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(PROMPTS, tables, strict=True)], graph_key=graph_key)
    last = runner.sample_next(logits, params, [0, 0], (2,)).token_ids
    out = [[int(t)] for t in last]
    lens = [len(p) for p in PROMPTS]
    for step in range(STEPS):
        items = [DecodeItem(0, lens[i] + step, tables[i]) for i in range(2)]  # ids: placeholders
        logits = runner.decode(items, carry=Carry(last, [(0, 0), (1, 1)]))
        last = runner.sample_next(logits, params, [step + 1] * 2, (2,)).token_ids
        for i in range(2):
            out[i].append(int(last[i]))
    return out


def _config(model: str):  # noqa: ANN202 - (EngineConfig, ModelSource)
    return build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
                               block_size=BLOCK)


def _rank(model: str, spec: object, rings: list[str], q: mp.Queue) -> None:
    torch.set_num_threads(1)
    cfg, source = _config(model)
    tp = TPGroup(spec, cfg.model_config, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        runner = ModelRunner(cfg, source, show_progress=False, tp=tp)
        q.put((tp.rank, _greedy(runner), runner.kv_pool.num_blocks, tuple(runner.kv_pool.tensor.shape)))
    finally:
        tp.close()


def _mirrored_rank(model: str, spec: object, rings: list[str], q: mp.Queue) -> None:
    """Rank 0 leads (publishes its calls on the rings), the others follow them."""
    torch.set_num_threads(1)
    cfg, source = _config(model)
    tp = TPGroup(spec, cfg.model_config, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        runner = ModelRunner(cfg, source, show_progress=False, tp=tp)
        if tp.rank == 0:
            runner.leader = Leader(tp, [Sender(ShmRing.attach(n), MirrorMessage) for n in rings], {})
            q.put((0, _greedy_sampled(runner), 0, ()))
            runner.leader.stop("done")
        else:
            why = follow(runner, Receiver(ShmRing.attach(rings[tp.rank - 1]), MirrorMessage), lambda name: None,
                         lambda: True)
            q.put((tp.rank, why, 0, ()))
    finally:
        tp.close()


def _mirrored_pieces_rank(model: str, spec: object, rings: list[str], q: mp.Queue) -> None:
    """As `_mirrored_rank`, with every rank's piecewise prefill pieces captured first (plain calls on CPU, in
    the same order: their collectives pair up) under the key "split": the leader's prefill replays them and
    the followers replay the leader's key. Each rank reports how many forwards went through its pieces."""
    torch.set_num_threads(1)
    cfg, source = _config(model)
    tp = TPGroup(spec, cfg.model_config, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        runner = ModelRunner(cfg, source, show_progress=False, tp=tp)
        runner.capture_prefill_graphs(key="split", show_progress=False, eager=True)
        graphs = runner._prefill_graphs
        assert graphs is not None
        runs: list[int] = []
        real_run = graphs.run
        graphs.run = lambda *a, **k: runs.append(a[1]) or real_run(*a, **k)  # type: ignore[method-assign]
        if tp.rank == 0:
            runner.leader = Leader(tp, [Sender(ShmRing.attach(n), MirrorMessage) for n in rings], {})
            q.put((0, _greedy_sampled(runner, graph_key="split"), runs, ()))
            runner.leader.stop("done")
        else:
            why = follow(runner, Receiver(ShmRing.attach(rings[tp.rank - 1]), MirrorMessage), lambda name: None,
                         lambda: True)
            q.put((tp.rank, why, runs, ()))
    finally:
        tp.close()


def _run_tp(model: str, tp: int, mirrored: bool = False) -> dict[int, tuple]:
    return run_ranks(_mirrored_rank if mirrored else _rank, tp, before=(model,))


@pytest.mark.parametrize(("model", "tp"), [("preset:tiny-llama", 2), ("preset:tiny-qwen2", 2),
                                           ("preset:tiny-llama-tied", 2), ("preset:tiny-llama", 4)])
def test_tp_matches_one_process(model: str, tp: int) -> None:
    cfg, source = _config(model)
    want = _greedy(ModelRunner(cfg, source, show_progress=False))
    got = _run_tp(model, tp)
    mcfg = cfg.model_config
    kv_heads = max(1, mcfg.num_kv_heads // tp)
    for rank, (tokens, blocks, shape) in got.items():
        assert tokens == want, f"rank {rank}"
        assert blocks == 8
        assert shape == (mcfg.num_layers, 2, 8, kv_heads, BLOCK, mcfg.head_dim)  # the rank's KV heads only


@pytest.mark.parametrize(("model", "tp"), [("preset:tiny-llama", 2), ("preset:tiny-qwen3", 2)])
def test_followers_replay_the_leader(model: str, tp: int) -> None:
    """Only the leader is driven; the followers replay its published calls and sampled tokens
    (parallel/mirror.py), and the leader's tokens equal one process's."""
    cfg, source = _config(model)
    want = _greedy_sampled(ModelRunner(cfg, source, show_progress=False))
    got = _run_tp(model, tp, mirrored=True)
    assert got[0][0] == want
    assert all(got[r][0] == "done" for r in range(1, tp))


@pytest.mark.parametrize(("model", "tp"), [("preset:tiny-llama", 2), ("preset:tiny-qwen3", 2)])
def test_followers_replay_the_leaders_piecewise_prefill_graphs(model: str, tp: int) -> None:
    """Prefill graphs under tensor parallelism (rapidserve/runner/prefill_graphs.py): every rank captures the pieces
    (their all-reduces run on every rank), the leader's prefill and the followers' replays of it go through
    them (the 11-token batch: bucket 16), and the tokens equal one process's, eager."""
    cfg, source = _config(model)
    want = _greedy_sampled(ModelRunner(cfg, source, show_progress=False))
    got = run_ranks(_mirrored_pieces_rank, tp, before=(model,))
    assert got[0][0] == want
    assert all(got[r][0] == "done" for r in range(1, tp))
    assert all(got[r][1] == [16] for r in range(tp)), got


class _Recorder:
    """A stand-in Leader: records what would be published."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward(self, kind: str, arrays: object, graph_key: str, carry: object) -> None:
        self.calls.append(kind)

    def sampled(self, token_ids: torch.Tensor) -> None:
        self.calls.append(f"sampled {len(token_ids)}")


def test_a_leader_forward_failing_after_publication_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the followers were told of a call, a failure on the leader alone leaves the ranks' collectives
    unpaired: the worker must die (engine/faults.is_fatal), while a failure before publication (bad inputs)
    stays a failure of the request."""
    from rapidserve.engine.faults import is_fatal
    from rapidserve.runner import RanksDiverged

    cfg, source = _config("preset:tiny-llama")
    runner = ModelRunner(cfg, source, show_progress=False)
    rec = _Recorder()
    runner.leader = rec  # type: ignore[assignment]
    runner.decode([DecodeItem(5, 0, [0])])
    assert rec.calls == ["decode"]

    def boom(*a: object) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(runner, "_decode_run", boom)
    with pytest.raises(RanksDiverged) as e:
        runner.decode([DecodeItem(5, 1, [0])])
    assert is_fatal(e.value) and rec.calls == ["decode", "decode"]
    with pytest.raises(ValueError, match="carry rows"):  # refused before publication: nothing sent
        runner.prefill([PrefillItem([1, 2], 0, [0])], carry=Carry(torch.zeros(1, dtype=torch.int64), [(0, 0)]))
    assert rec.calls == ["decode", "decode"]


def test_blamed_retries_are_not_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample_or_blame's one-row retries belong to a step that is not taken: never broadcast (a follower
    keeps only the last few samples for a Carry)."""
    from rapidserve.engine.faults import RequestsFailed, sample_or_blame

    cfg, source = _config("preset:tiny-llama")
    runner = ModelRunner(cfg, source, show_progress=False)
    rec = _Recorder()
    runner.leader = rec  # type: ignore[assignment]
    logits = torch.zeros(2, cfg.model_config.vocab_size)
    good = SamplingParams(temperature=0.0)
    out = sample_or_blame(runner, logits, [good, good], [0, 0], (2,))
    assert rec.calls == ["sampled 2"] and len(out.token_ids) == 2
    whole = runner.sample

    def batch_fails(logits: torch.Tensor, params: list, gens: list) -> object:
        if len(params) > 1:
            raise RuntimeError("the batch fails, each row alone works")
        return whole(logits, params, gens)

    monkeypatch.setattr(runner, "sample", batch_fails)
    with pytest.raises(RequestsFailed):
        sample_or_blame(runner, logits, [good, good], [0, 0], (2,))
    assert rec.calls == ["sampled 2"]  # the two one-row retries sampled, and were not broadcast


class _CaptureLog:
    """A runner and a partition backend that record the graph captures asked of them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        from types import SimpleNamespace

        self.calls: list[tuple[str, object, object]] = []
        self.configurations = [SimpleNamespace(name=n, decode_whole=n == "overallocated") for n in names]

    def stream(self, name: str, role: str) -> str:
        return f"{role}:{name}"

    def capture_decode_graphs(self, stream: object = None, key: str = "default", **kw: object) -> None:
        self.calls.append(("decode", stream, key))

    def capture_prefill_graphs(self, stream: object = None, key: str = "default", max_bucket: int | None = None,
                               **kw: object) -> None:
        self.calls.append(("prefill", stream, key) if max_bucket is None else ("prefill", stream, key, max_bucket))


@pytest.mark.parametrize(("role", "policy", "want"), [
    ("decode", "rapid", [("decode", "decode:split16", "split16"), ("decode", "decode:overallocated", "overallocated")]),
    # duet's fused steps (PlanWire.fused_graphs): their piecewise prefill graphs after the decode graphs, every bucket
    ("decode-fused", "duet", [("decode", "decode:split16", "split16"),
                              ("decode", "decode:overallocated", "overallocated"),
                              ("prefill", "decode:overallocated", "overallocated")]),
    ("prefill", "rapid", [("prefill", "prefill:split16", "split16", 512),
                          ("prefill", "prefill:overallocated", "overallocated", 512)]),
    ("prefill", "drift", []),  # block-wise prefill captures nothing
    ("hybrid", "rapid", [("decode", None, "overallocated"), ("prefill", None, "overallocated")]),
])
def test_every_rank_captures_the_same_graphs_in_the_plans_order(role: str, policy: str,
                                                                 want: list[tuple[object, ...]]) -> None:
    """Leader (engine/worker_build.py) and followers (tp_workers.run_follower) capture through these three
    functions, so the captures' collectives pair up: one set per configuration, in the plan's order, on that
    configuration's stream of the role."""
    from types import SimpleNamespace

    from rapidserve.engine import tp_workers

    log = _CaptureLog(("split16", "overallocated"))
    if role == "decode":
        tp_workers.capture_decode(log, log)  # type: ignore[arg-type]
    elif role == "decode-fused":
        tp_workers.capture_decode(log, log, "overallocated")  # type: ignore[arg-type]
    elif role == "prefill":
        cfg = SimpleNamespace(partition=SimpleNamespace(policy=policy))
        tp_workers.capture_prefill(cfg, log, log)  # type: ignore[arg-type]
    else:
        tp_workers.capture_hybrid(log)  # type: ignore[arg-type]
    assert log.calls == want
