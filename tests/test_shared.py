"""export_shared / attach_model: another process (a fork of the engine's fork server, as a worker starts:
tests/fork_context.py) computes with the exporter's weights and KV pool in place."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidserve.attention import AttentionMetadata, get_attention_backend
from rapidserve.config import EngineConfig, ModelConfig
from rapidserve.kv_pool import KVPool, KVPoolSpec
from rapidserve.llm import build_engine_config
from rapidserve.models.transformer import CausalLM
from rapidserve.ops import get_ops
from rapidserve.runner import ModelRunner, PrefillItem, resolve_dtype
from rapidserve.runner.model_sharing import SharedState, SharedStateError, attach_model, export_shared, shared_bytes
from tests.fork_context import child_context

PROMPT = [(7 * i + 3) % 1200 for i in range(20)]  # 20 tokens: one full block of 16 and a partial one
PARENT_BLOCKS, CHILD_BLOCKS = [0, 1], [5, 9]
MARKER = 1234.5
TIMEOUT_S = 120
RunnerState = tuple[EngineConfig, ModelRunner, SharedState]


def _prefill(model: CausalLM, pool: KVPool, ids: Sequence[int], blocks: Sequence[int]) -> torch.Tensor:
    """Logits of every position of one sequence computed from scratch into `blocks`."""
    dev, n, bs = model.device, len(ids), pool.block_size
    pos = torch.arange(n)
    table = torch.tensor([list(blocks)], dtype=torch.int32)
    meta = AttentionMetadata(True, (table[0, pos // bs].long() * bs + pos % bs).to(dev), table.to(dev),
                             torch.tensor([n], dtype=torch.int32, device=dev),
                             torch.tensor([0, n], dtype=torch.int32, device=dev), max_seqlen_q=n, max_context_len=n)
    hidden = model(torch.tensor(ids, device=dev), pos.to(dev), pool.layers, meta)
    return model.compute_logits(hidden)


def _mem_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def _attach_and_prefill(inbox: Any, outbox: Any) -> None:
    """Child: attach, prefill into the given blocks, write a marker into a weight, report."""
    try:
        cfg, dev_name, threads = inbox.get(timeout=TIMEOUT_S)
        torch.set_num_threads(threads)
        device = torch.device(dev_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        anon0 = _mem_kb("RssAnon")
        state: SharedState = inbox.get(timeout=TIMEOUT_S)
        ops, attn = get_ops(device), get_attention_backend(cfg.runner.attention_backend, device)
        dtype = resolve_dtype(cfg.runner.dtype, device)
        model, pool = attach_model(cfg.model_config, ops, attn, dtype, device, max(cfg.max_model_len, 1), state)
        gpu_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        logits = _prefill(model, pool, PROMPT, CHILD_BLOCKS)
        with torch.no_grad():
            model.norm[0] = MARKER
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        outbox.put(("ok", logits.cpu().numpy(), _mem_kb("RssAnon") - anon0, gpu_bytes, shared_bytes(state)))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
    inbox.get(timeout=TIMEOUT_S)  # stay until the parent has read the reply


def _touch_all(inbox: Any, outbox: Any) -> None:
    """Child: attach a large model and read every weight; report how much private memory that took."""
    try:
        cfg, max_pos = inbox.get(timeout=TIMEOUT_S)
        anon0, shm0 = _mem_kb("RssAnon"), _mem_kb("RssShmem")
        state: SharedState = inbox.get(timeout=TIMEOUT_S)
        cpu = torch.device("cpu")
        model, _ = attach_model(cfg, get_ops(cpu), get_attention_backend("torch", cpu), torch.float32, cpu,
                                max_pos, state)
        total = sum(float(p.sum()) for p in model.parameters())
        outbox.put(("ok", total, _mem_kb("RssAnon") - anon0, _mem_kb("RssShmem") - shm0))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
    inbox.get(timeout=TIMEOUT_S)


def _run_child(target: Any, first: Any, state: SharedState) -> tuple[Any, ...]:
    ctx = child_context()
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(inbox, outbox), daemon=True)
    proc.start()
    try:
        inbox.put(first)
        inbox.put(state)  # the one pickling of the state, as in the engine
        reply = outbox.get(timeout=TIMEOUT_S)
        inbox.put("bye")
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert reply[0] == "ok", reply[1]
    return tuple(reply[1:])


def _make_runner(device: str, dtype: str) -> tuple[EngineConfig, ModelRunner]:
    cfg, source = build_engine_config("preset:tiny-llama", device=device, dtype=dtype, num_kv_blocks=64,
                                      enforce_eager=True)
    return cfg, ModelRunner(cfg, source, show_progress=False)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cpu_runner() -> RunnerState:
    cfg, runner = _make_runner("cpu", "float32")
    return cfg, runner, export_shared(runner.model, runner.kv_pool)


def _check_child_prefill(cfg: EngineConfig, runner: ModelRunner, state: SharedState, exact: bool) -> tuple[Any, ...]:
    pool = runner.kv_pool.tensor
    pool[:, :, PARENT_BLOCKS + CHILD_BLOCKS] = 0  # (an index_put_: in place, unlike .zero_() of a copy)
    want = _prefill(runner.model, runner.kv_pool, PROMPT, PARENT_BLOCKS)
    ref = runner.prefill([PrefillItem(PROMPT, 0, PARENT_BLOCKS)])  # the helper agrees with the runner
    torch.testing.assert_close(want[-1:], ref, rtol=1e-5, atol=1e-5)
    saved = runner.model.norm[0].item()
    logits, anon_kb, gpu_bytes, child_bytes = _run_child(
        _attach_and_prefill, (cfg, str(runner.device), torch.get_num_threads()), state)
    try:
        # exact on CPU; on a GPU a tolerance only against library heuristics picking other kernels
        same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)
        assert same(torch.from_numpy(logits), want.cpu())
        assert child_bytes == shared_bytes(state)
        # the child's K and V landed in the parent's pool, through the per-layer views too
        assert pool[:, :, CHILD_BLOCKS].abs().sum() > 0
        assert same(pool[:, :, CHILD_BLOCKS], pool[:, :, PARENT_BLOCKS])
        k0_child, k0_parent = runner.kv_pool.layers[0][0][CHILD_BLOCKS[0]], runner.kv_pool.layers[0][0][0]
        assert same(k0_child, k0_parent)
        assert runner.model.norm[0].item() == MARKER  # the child wrote the parent's weight: no copy
    finally:
        with torch.no_grad():
            runner.model.norm[0] = saved
    return anon_kb, gpu_bytes


def test_spawned_child_shares_weights_and_kv_in_place(cpu_runner: RunnerState) -> None:
    cfg, runner, state = cpu_runner
    _check_child_prefill(cfg, runner, state, exact=True)


def test_attach_in_process_uses_the_same_memory(cpu_runner: RunnerState) -> None:
    cfg, runner, state = cpu_runner
    model, pool = attach_model(cfg.model_config, runner.ops, runner.attn, runner.dtype, runner.device,
                               max(cfg.max_model_len, 1), state)
    mine = dict(runner.model.named_parameters())
    for name, p in model.named_parameters():
        assert p.data_ptr() == mine[name].data_ptr() and not p.requires_grad, name
    assert model.lm_head is not None and pool.tensor.data_ptr() == runner.kv_pool.tensor.data_ptr()
    assert torch.equal(model.cos_sin, runner.model.cos_sin) and model.device == runner.device
    assert shared_bytes(state) == runner.model.weight_bytes() + runner.kv_pool.spec.nbytes
    a = _prefill(runner.model, runner.kv_pool, PROMPT, [2, 3])
    assert torch.equal(_prefill(model, pool, PROMPT, [7, 8]), a)


def test_mismatches_name_the_tensor(cpu_runner: RunnerState) -> None:
    cfg, runner, state = cpu_runner
    mcfg, params = cfg.model_config, state.params

    def attach(s: SharedState = state, m: ModelConfig = mcfg, dtype: torch.dtype = torch.float32) -> None:
        attach_model(m, runner.ops, runner.attn, dtype, runner.device, 64, s)

    with pytest.raises(SharedStateError, match=r"'layers\.0\.gate_up_proj' has shape \(320, 64\), expected"):
        attach(m=mcfg.replace(intermediate_size=mcfg.intermediate_size * 2))
    with pytest.raises(SharedStateError, match=r"unexpected \['lm_head'\]"):
        attach(m=mcfg.replace(tie_word_embeddings=True))
    with pytest.raises(SharedStateError, match=r"missing \['norm'\]"):
        attach(dataclasses.replace(state, params={k: v for k, v in params.items() if k != "norm"}))
    with pytest.raises(SharedStateError, match=r"'embed_tokens' has dtype torch.float16, expected torch.float32"):
        attach(dataclasses.replace(state, params={**params, "embed_tokens": params["embed_tokens"].half()}))
    with pytest.raises(SharedStateError, match=r"'layers\.1\.o_proj' is not in shared memory"):
        attach(dataclasses.replace(state, params={**params, "layers.1.o_proj": params["layers.1.o_proj"].clone()}))
    with pytest.raises(SharedStateError, match=r"has dtype torch.float32, expected torch.bfloat16"):
        attach(dtype=torch.bfloat16)
    with pytest.raises(SharedStateError, match=r"the KV pool has shape .*, expected \(3, 2, 64, 2, 32, 16\)"):
        attach(dataclasses.replace(state, block_size=32))
    with pytest.raises(SharedStateError, match=r"the KV pool is \(3, 2\), expected a 6-D tensor"):
        attach(dataclasses.replace(state, kv=state.kv[:, :, 0, 0, 0, 0]))


@pytest.mark.skipif(_mem_kb("RssAnon") < 0 or _mem_kb("RssShmem") < 0, reason="needs /proc/self/status RssAnon")
def test_child_does_not_copy_the_weights() -> None:
    """A 140 MB model: the child reads every weight, yet its private memory grows by far less."""
    mcfg = ModelConfig(arch="llama", vocab_size=65536, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    cpu = torch.device("cpu")
    model = CausalLM(mcfg, get_ops(cpu), get_attention_backend("torch", cpu), torch.float32, cpu)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    pool = KVPool.allocate(KVPoolSpec(2, 4, 2, 16, 64, torch.float32), cpu)
    state = export_shared(model, pool)
    weights_kb = model.weight_bytes() // 1024
    total, anon_kb, shm_kb = _run_child(_touch_all, (mcfg, 256), state)
    assert total == pytest.approx(0.5 * sum(p.numel() for p in model.parameters()))
    assert shm_kb > weights_kb * 0.9  # the reads really went through the shared mapping...
    assert anon_kb < weights_kb * 0.25  # ...and not through a private copy


@pytest.mark.gpu
def test_spawned_child_shares_weights_and_kv_on_gpu() -> None:
    """The same over CUDA/HIP IPC handles: logits, KV in place, weight write visible, no device copy."""
    cfg, runner = _make_runner("cuda", "float32")
    state = export_shared(runner.model, runner.kv_pool)
    assert state.kv.data_ptr() == runner.kv_pool.tensor.data_ptr()  # nothing moves on a GPU
    _, gpu_bytes = _check_child_prefill(cfg, runner, state, exact=False)
    # the child allocated only its RoPE table before the forward: IPC memory is not its own
    assert gpu_bytes < runner.model.weight_bytes() // 4, gpu_bytes
