"""How the runner sizes its KV pool (a part of ModelRunner): by what, in this order,

- `--num-kv-blocks` (cache.num_blocks): that many blocks;
- on a CPU, a fixed byte budget: `--kv-cache-memory-bytes`, else cache.cpu_kv_bytes ($VLLM_CPU_KVCACHE_SPACE, else
  512 MiB; config_builder.cpu_kv_space), known before the model is built;
- on a GPU with `--kv-cache-memory-bytes`: that many bytes, as vLLM 0.26 takes it (its gpu_worker: "reserved ... as
  specified by kv_cache_memory_bytes config and skipped memory profiling. This does not respect the
  gpu_memory_utilization config"): no profiling step, the share not read; refused by name where the GPU has not that
  much free once the weights are loaded;
- else the `--gpu-memory-utilization` share left after a profiling step (`_gpu_kv_budget`, runner/kv_budget.py).

Each byte budget must hold one `max_model_len` sequence, else a ConfigError whose remedy names what sized it
(kv_pool.num_blocks_for_budget); with `--max-model-len auto` (SchedulerConfig.fit_max_model_len, vLLM 0.26's) one
block, and where the pool holds less than the model's length the start-up log says what a request may reach (the
pool's tokens: `PromptLimits.context_cap`, which every path enforces, and the length the server reports). Under
tensor parallelism each rank sizes its own shard's pool from the same bytes per GPU, and the ranks agree on the
fewest blocks. `kv_sizing` says what sized the pool, for the start-up log line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rapidserve.batch_limits import config_seats
from rapidserve.config_base import ConfigError
from rapidserve.kv_pool import CPU, GIVEN, SHARE, KVPool, num_blocks_for_budget, pool_spec
from rapidserve.parallel.shard import shard_config
from rapidserve.runner.inputs import PrefillItem
from rapidserve.runner.kv_budget import GIB, KVBudget

if TYPE_CHECKING:
    from rapidserve.config import EngineConfig, ModelConfig
    from rapidserve.models.transformer import CausalLM
    from rapidserve.parallel.group import TPGroup

log = logging.getLogger(__name__)


class KVSizing:
    """The KV pool's sizing (module docstring): `_cpu_kv_blocks` before the model is built, `_allocate_kv_pool`
    after the weights are loaded."""

    cfg: EngineConfig
    mcfg: ModelConfig
    device: torch.device
    tp: TPGroup | None
    kv_dtype: torch.dtype
    block_size: int
    max_model_len: int
    model: CausalLM
    step_processes: int
    _baseline_used: int
    _baseline_reserved: int
    kv_budget: KVBudget | None = None  # how the GPU pool was sized from the share (runner/kv_budget.py)
    kv_sizing: str = "as handed to the runner"  # what sized the pool, for the start-up log line

    if TYPE_CHECKING:
        def _prefill_on(self, pool: KVPool, items: Sequence[PrefillItem]) -> torch.Tensor: ...  # ModelRunner's

    def _cpu_kv_blocks(self) -> int | None:
        """The CPU pool's blocks, from its byte budget alone (None on a GPU, or with cache.num_blocks): known
        before the model is built, so a max_model_len that one sequence cannot fit is refused at once (naming
        --max-model-len), not after the weights load and a RoPE table of that many rows is built."""
        cache = self.cfg.cache
        if cache.num_blocks is not None or self.device.type != "cpu":
            return None
        shard = self.mcfg if self.tp is None else shard_config(self.mcfg, self.tp.layout)  # this rank's KV heads
        given = cache.kv_cache_memory_bytes
        budget = cache.cpu_kv_bytes if given is None else given
        self.kv_sizing = (f"--kv-cache-memory-bytes {given} ({given / GIB:.2f} GiB)" if given is not None
                          else f"{budget / GIB:.2f} GiB, the CPU's KV cache space")
        return num_blocks_for_budget(budget, pool_spec(shard, cache, self.kv_dtype, 1).bytes_per_block,
                                     self.block_size, self._one_sequence, CPU if given is None else GIVEN)

    def _allocate_kv_pool(self, cpu_blocks: int | None) -> KVPool:
        cache = self.cfg.cache
        shard = self.model.cfg  # this rank's KV heads under tensor parallelism
        probe = pool_spec(shard, cache, self.kv_dtype, 1)
        if cache.num_blocks is not None:
            n = cache.num_blocks
            self.kv_sizing = f"--num-kv-blocks {n}"
        elif cpu_blocks is not None:
            n = cpu_blocks
        elif cache.kv_cache_memory_bytes is not None:
            n = num_blocks_for_budget(self._given_kv_bytes(), probe.bytes_per_block, self.block_size,
                                      self._one_sequence, GIVEN)
        else:
            n = num_blocks_for_budget(self._gpu_kv_budget(), probe.bytes_per_block, self.block_size,
                                      self._one_sequence, SHARE)
            self.kv_sizing = f"--gpu-memory-utilization {cache.gpu_memory_utilization:g}'s share"
        if self.tp is not None:
            n = self.tp.agree_min(n)  # the ranks' pools hold the same blocks: the leader's tables index all
        holds = n * self.block_size
        if self.cfg.scheduler.fit_max_model_len and holds < self.max_model_len:
            log.warning("--max-model-len auto: the KV cache holds %d tokens, fewer than the model's %d: a request's "
                        "prompt and output may reach %d tokens (max_model_len %d)", holds, self.max_model_len, holds,
                        holds)
        return KVPool.allocate(pool_spec(shard, cache, self.kv_dtype, n), self.device)

    @property
    def _one_sequence(self) -> int:
        """The tokens a byte budget must hold: one max_model_len sequence, or with --max-model-len auto one block."""
        return self.block_size if self.cfg.scheduler.fit_max_model_len else self.max_model_len

    def _given_kv_bytes(self) -> int:
        """--kv-cache-memory-bytes on a GPU: its bytes as given (module docstring), at most what is free now."""
        given = self.cfg.cache.kv_cache_memory_bytes
        assert given is not None
        free, total = torch.cuda.mem_get_info()
        if given > free:
            raise ConfigError(f"--kv-cache-memory-bytes {given} ({given / GIB:.2f} GiB): {self.device} has "
                              f"{free / GIB:.2f} of {total / GIB:.2f} GiB free once the weights are loaded; give less "
                              "(the steps' activations need room beside the pool), or drop it to size the pool "
                              "from --gpu-memory-utilization")
        self.kv_sizing = (f"--kv-cache-memory-bytes {given} ({given / GIB:.2f} GiB) as given: no memory profiling, "
                          f"--gpu-memory-utilization ({self.cfg.cache.gpu_memory_utilization:g}) not used, as vLLM; "
                          f"{free / GIB:.2f} of {total / GIB:.2f} GiB were free")
        return given

    def _gpu_kv_budget(self) -> int:
        """total * utilization - this engine's use - the activation peak of the largest step, per process that
        runs such steps here; at most what the device has free (runner/kv_budget.py)."""
        torch.cuda.synchronize()
        tokens = min(self.cfg.scheduler.max_num_batched_tokens, self.max_model_len)
        log.info("profiling memory: a %d-token dummy prefill measures the activation peak, to size the KV cache",
                 tokens)
        scratch = KVPool.allocate(pool_spec(self.model.cfg, self.cfg.cache, self.kv_dtype,
                                            -(-tokens // self.block_size)), self.device)
        torch.cuda.empty_cache()  # what the allocator holds now is tensors and holes only (kept after the step too)
        torch.cuda.reset_peak_memory_stats()
        base, held = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        item = PrefillItem([0] * tokens, 0, list(range(-(-tokens // self.block_size))))
        self._prefill_on(scratch, [item])
        torch.cuda.synchronize()
        allocated_peak = torch.cuda.max_memory_allocated() - base
        peak = max(0, torch.cuda.max_memory_reserved() - held)  # activations in the unused cache cost no more
        max_bs = config_seats(self.cfg)  # the largest decode step (not the largest bucket: buckets beyond go unused)
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = KVBudget(total, self.cfg.cache.gpu_memory_utilization, total - free, torch.cuda.memory_allocated(),
                          torch.cuda.memory_reserved(), tokens, peak,
                          max_bs * self.mcfg.vocab_size * 4 * 3,  # decode logits + sampling scratch
                          step_allocated=allocated_peak, baseline_used=self._baseline_used,
                          step_processes=self.step_processes, baseline_reserved=self._baseline_reserved)
        (log.warning if budget.short_of_share else log.info)("%s", budget.describe())
        self.kv_budget = budget
        return budget.kv_bytes
