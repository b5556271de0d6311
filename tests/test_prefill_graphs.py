"""Piecewise prefill graphs (rapidserve/runner/prefill_graphs.py) on CPU, in fp32, with the pieces recorded as plain
calls (`eager=True`): the same pieces, static buffers, padding and attention between pieces that the GPU replays
as CUDA graphs. Against the one-shot eager forward: the same logits and the same K/V in the pool, nothing
written outside the items' slots (padding rows write nothing), mixed steps with carried tokens, and the cases
that stay eager (no bucket fits, another key, another pool). Buckets, config and CLI checks as tables."""

from __future__ import annotations

import argparse

import pytest
import torch

from rapidserve import cli, cli_args
from rapidserve.config import ParallelConfig, RunnerConfig
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.kv_pool import KVPool
from rapidserve.loader import resolve_model
from rapidserve.runner import Carry, ModelRunner, PrefillItem
from rapidserve.runner.prefill_graphs import (
    PREFILL_WORKER_MAX_BUCKET,
    PrefillGraphs,
    bucket_for,
    check_buckets,
    usable_buckets,
)
from tests.test_prefill_task import PREFIX, _tokens

BS = 16
BUCKETS = (8, 32, 128)


def runner_for(model: str, buckets: tuple[int, ...] = BUCKETS) -> ModelRunner:
    cfg, _ = build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256,
                                 block_size=BS, prefill_graph_tokens=buckets)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return ModelRunner(cfg, source, show_progress=False)


@pytest.fixture(scope="module", params=["preset:tiny-llama", "preset:tiny-qwen3", "preset:tiny-qwen2"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    return runner_for(request.param)


# PREFIX: 32 tokens in blocks 4, 5, which the third item of BATCHES[0] attends to
BATCHES = [
    [PrefillItem(_tokens(40, 2), 0, [0, 1, 2]), PrefillItem(_tokens(7, 3), 0, [3]),
     PrefillItem(_tokens(20, 4), 32, [4, 5, 6, 7]), PrefillItem(_tokens(33, 5), 0, [8, 9, 10], need_logits=False)],
    [PrefillItem(_tokens(5, 6), 0, [12])],  # bucket 8
    [PrefillItem(_tokens(8, 7), 0, [13])],  # exactly a bucket
    [PrefillItem(_tokens(19, 8), 0, [14, 15]), PrefillItem(_tokens(1, 9), 0, [16])],  # bucket 32
]


def _run_batches(runner: ModelRunner) -> tuple[list[torch.Tensor], torch.Tensor]:
    runner.kv_pool.tensor.zero_()
    runner.prefill([PrefillItem(PREFIX, 0, [4, 5], need_logits=False)])
    logits = [runner.prefill(b).clone() for b in BATCHES]
    return logits, runner.kv_pool.tensor.clone()


def _with_graphs(runner: ModelRunner, key: str = "default") -> None:
    runner._prefill_graphs = None
    runner.capture_prefill_graphs(key=key, show_progress=False, eager=True)


def _without_graphs(runner: ModelRunner) -> None:
    runner._prefill_graphs = None


def test_piecewise_forward_matches_the_eager_one(runner: ModelRunner) -> None:
    _without_graphs(runner)
    want_logits, want_pool = _run_batches(runner)
    _with_graphs(runner)
    calls = []
    graphs = runner._prefill_graphs
    assert graphs is not None
    real_run = graphs.run
    graphs.run = lambda *a, **k: calls.append(a[1]) or real_run(*a, **k)  # type: ignore[method-assign]
    got_logits, got_pool = _run_batches(runner)
    assert calls == [32, 128, 8, 8, 32]  # the 32-token prefix, then each batch's bucket (100, 5, 8, 20 tokens)
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)
    used = {b for batch in BATCHES for it in batch for b in it.block_table} | {4, 5}
    untouched = [b for b in range(runner.kv_pool.num_blocks) if b not in used]
    for layer in runner.kv_pool.layers:  # padding rows (slot -1) wrote nothing
        for cache in layer:
            assert not cache[untouched].any()
    _without_graphs(runner)


def test_a_mixed_step_with_carried_tokens_matches_the_eager_one(runner: ModelRunner) -> None:
    """Hybrid's mixed step: two one-token decode rows whose tokens come from the device, then a chunk."""
    items = [PrefillItem([0], 5, [20]), PrefillItem([0], 9, [21]), PrefillItem(_tokens(12, 11), 0, [22])]
    sampled = torch.tensor([71, 5, 900])
    out = []
    for graphs in (False, True):
        _with_graphs(runner) if graphs else _without_graphs(runner)
        runner.kv_pool.tensor.zero_()
        runner.prefill([PrefillItem(_tokens(5, 12), 0, [20], need_logits=False),
                        PrefillItem(_tokens(9, 13), 0, [21], need_logits=False)])
        logits = runner.prefill(items, carry=Carry(sampled, [(0, 2), (1, 0)])).clone()
        out.append((logits, runner.kv_pool.tensor.clone()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-5)
    _without_graphs(runner)


def test_capture_writes_nothing_into_the_pool(runner: ModelRunner) -> None:
    """Capture ends with a warm-up forward through the pieces and attention: every slot -1, so a pool another
    process is using (a restarted prefill worker's) is left as it was."""
    runner.kv_pool.tensor.normal_()
    before = runner.kv_pool.tensor.clone()
    _with_graphs(runner, key="again")
    assert torch.equal(runner.kv_pool.tensor, before)
    _without_graphs(runner)


def test_forwards_no_graph_covers_run_eager() -> None:
    runner = runner_for("preset:tiny-llama", buckets=(8,))
    _with_graphs(runner, key="split16")
    graphs = runner._prefill_graphs
    assert graphs is not None
    calls = []
    real_run = graphs.run
    graphs.run = lambda *a, **k: calls.append((a[0], a[1])) or real_run(*a, **k)  # type: ignore[method-assign]
    small = [PrefillItem(_tokens(6, 20), 0, [0])]
    runner.prefill([PrefillItem(_tokens(9, 21), 0, [1])], graph_key="split16")  # 9 tokens: no bucket
    runner.prefill(small)  # the key "default" was not captured
    other = KVPool.allocate(runner.kv_pool.spec, torch.device("cpu"))  # as the KV-budget probe's scratch pool
    runner._prefill_on(other, small, None, "split16")  # the graphs write into the pool they were captured on
    assert other.tensor.any()
    assert calls == []
    runner.prefill(small, graph_key="split16")
    assert calls == [("split16", 8)]


@pytest.mark.parametrize(("sizes", "tokens", "want"), [
    ((16, 32, 1024), 1, 16), ((16, 32, 1024), 16, 16), ((16, 32, 1024), 17, 32), ((16, 32, 1024), 1024, 1024),
    ((16, 32, 1024), 1025, None), ((), 5, None), ((8,), 8, 8),
])
def test_bucket_for(sizes: tuple[int, ...], tokens: int, want: int | None) -> None:
    assert bucket_for(sizes, tokens) == want


@pytest.mark.parametrize(("sizes", "budget", "want"), [
    ((16, 64, 256, 512), 8192, (16, 64, 256, 512)), ((16, 64, 256, 512), 256, (16, 64, 256)),
    ((16, 64, 256, 512), 300, (16, 64, 256, 512)), ((16, 64, 256, 512), 10, (16,)), ((), 64, ()),
])
def test_usable_buckets(sizes: tuple[int, ...], budget: int, want: tuple[int, ...]) -> None:
    assert usable_buckets(sizes, budget) == want


def test_buckets_past_the_step_budget_are_not_captured() -> None:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=8,
                                 max_model_len=64, max_num_batched_tokens=20, prefill_graph_tokens=(8, 16, 32, 64))
    runner = ModelRunner(cfg, resolve_model(cfg.model, preset_device=torch.device("cpu"),
                                            preset_dtype=torch.float32), show_progress=False)
    runner.capture_prefill_graphs(show_progress=False, eager=True)
    assert runner._prefill_graphs is not None and runner._prefill_graphs.sizes == (8, 16, 32)
    assert tuple(runner._prefill_graphs.sets["default"]) == (8, 16, 32)


@pytest.mark.parametrize("sizes", [(32, 16), (16, 16), (0, 8), (-4,)])
def test_bad_buckets_are_refused(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="positive integers, unique and ascending"):
        check_buckets(sizes)
    with pytest.raises(ConfigError, match="prefill_graph_tokens"):
        RunnerConfig(prefill_graph_tokens=sizes)


def test_the_prefill_workers_cap_leaves_out_the_larger_buckets() -> None:
    """The prefill worker captures up to PREFILL_WORKER_MAX_BUCKET (its larger forwards' launches hide behind its
    GPU work); the decode worker's fused steps every bucket the step budget can use (runner/prefill_graphs.py)."""
    def runner_of(budget: int) -> ModelRunner:
        cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=8,
                                     max_model_len=64, max_num_batched_tokens=budget,
                                     prefill_graph_tokens=(8, 16, 32, 64))
        return ModelRunner(cfg, resolve_model(cfg.model, preset_device=torch.device("cpu"),
                                              preset_dtype=torch.float32), show_progress=False)

    capped = runner_of(64)
    capped.capture_prefill_graphs(show_progress=False, eager=True, max_bucket=16)
    assert capped._prefill_graphs is not None and capped._prefill_graphs.sizes == (8, 16)
    every = runner_of(64)
    every.capture_prefill_graphs(show_progress=False, eager=True)
    assert every._prefill_graphs is not None and every._prefill_graphs.sizes == (8, 16, 32, 64)
    none = runner_of(64)
    none.capture_prefill_graphs(show_progress=False, eager=True, max_bucket=4)  # no bucket that small
    assert none._prefill_graphs is None
    assert PREFILL_WORKER_MAX_BUCKET == 512 and 512 in RunnerConfig().prefill_graph_tokens
    assert max(RunnerConfig().prefill_graph_tokens) == 2048  # the default's larger buckets: fused steps only
    # above 1024 the default's buckets lie 128 apart: a fused chunk ends on one or pads to the next (on_bucket)
    big = [b for b in RunnerConfig().prefill_graph_tokens if b >= 1024]
    assert big == list(range(1024, 2049, 128))


def test_no_buckets_or_enforce_eager_capture_nothing() -> None:
    for kwargs in ({"prefill_graph_tokens": ()}, {"enforce_eager": True}):
        cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=8,
                                     max_model_len=64, **kwargs)  # type: ignore[arg-type]
        runner = ModelRunner(cfg, resolve_model(cfg.model, preset_device=torch.device("cpu"),
                                                preset_dtype=torch.float32), show_progress=False)
        runner.capture_prefill_graphs(show_progress=False)
        assert runner._prefill_graphs is None
    runner.capture_prefill_graphs(show_progress=False)  # CPU and not eager: nothing to capture either
    assert runner._prefill_graphs is None
    with pytest.raises(ValueError, match="at least one"):
        PrefillGraphs(runner.model, runner.kv_pool.layers, ())


@pytest.mark.parametrize(("text", "want"), [
    ("none", ()), ("NONE", ()), ("16", (16,)), ("16,64,1024", (16, 64, 1024)),
])
def test_cli_prefill_graph_tokens(text: str, want: tuple[int, ...]) -> None:
    assert cli_args._token_buckets(text) == want


@pytest.mark.parametrize("text", ["", "16,", "a,b", "64,16", "16,16", "0,16", "-8"])
def test_cli_prefill_graph_tokens_refuses_bad_lists(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="16"):
        cli_args._token_buckets(text)


@pytest.mark.parametrize(("argv", "want"), [
    ([], RunnerConfig().prefill_graph_tokens),
    (["--prefill-graph-tokens", "none"], ()),
    (["--prefill-graph-tokens", "32,256"], (32, 256)),
])
def test_serve_flag_reaches_the_config(argv: list[str], want: tuple[int, ...]) -> None:
    a = cli.build_parser().parse_args(["serve", "--model", "preset:tiny-llama", "--device", "cpu", *argv])
    cfg, _ = build_engine_config(a.model, **cli_args.engine_kwargs(a, env={}))  # type: ignore[arg-type]
    assert cfg.runner.prefill_graph_tokens == want


def test_serve_refuses_a_bad_bucket_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", "--prefill-graph-tokens", "512,64"])
    assert e.value.code == 2
    assert "--prefill-graph-tokens" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "why"), [
    (["serve", "--enforce-eager"], "not read with --enforce-eager (it turns off every CUDA graph"),
    (["serve", "--mode", "disagg"], "not read by --mode disagg (its prefill worker computes without graphs"),
    (["serve", "--policy", "drift"], "not read by --policy drift (it launches prefill a layer block at a time"),
    (["generate", "--enforce-eager", "--prompt", "hi"], "not read with --enforce-eager"),
])
def test_the_flag_is_refused_where_no_graph_is_captured(argv: list[str], why: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Given explicitly where nothing captures prefill graphs: refused by the flag check (policy_spec) before the
    model loads (the model path here does not exist), naming the flag and why."""
    assert cli.main([*argv, "--model", "/nonexistent", "--prefill-graph-tokens", "16,64"]) == 2
    err = capsys.readouterr().err
    assert "--prefill-graph-tokens" in err and why in err and "drop it" in err, err  # generate: LLM's keyword too
    a = cli.build_parser().parse_args([*argv, "--prefill-graph-tokens", "none"])
    assert a.prefill_graph_tokens == ()


def test_the_flag_is_accepted_under_tensor_parallelism() -> None:
    """-tp N captures prefill graphs on every rank (engine/tp_workers.py): the bucket list is not refused."""
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", prefill_graph_tokens=(16, 64),
                                 parallel=ParallelConfig(tensor_parallel_size=2))
    assert cfg.runner.prefill_graph_tokens == (16, 64) and cfg.parallel.tensor_parallel_size == 2


@pytest.mark.parametrize("bad", [(16.5,), ("16",), (True,)])
def test_runner_config_takes_integer_buckets_only(bad: tuple[object, ...]) -> None:
    with pytest.raises(ConfigError, match="prefill_graph_tokens"):
        RunnerConfig(prefill_graph_tokens=bad)  # type: ignore[arg-type]


def test_warm_up_forward_fits_a_short_max_model_len() -> None:
    """The capture's warm-up forward stays inside RoPE's table when max_model_len is below the smallest bucket."""
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=8,
                                 max_model_len=8, prefill_graph_tokens=(16,))
    runner = ModelRunner(cfg, resolve_model(cfg.model, preset_device=torch.device("cpu"),
                                            preset_dtype=torch.float32), show_progress=False)
    runner.capture_prefill_graphs(show_progress=False, eager=True)
    assert runner._prefill_graphs is not None and "default" in runner._prefill_graphs.sets
