"""How many sequences run at once: the default `max_num_seqs` (and `LLM`'s `max_num_batched_tokens`) by device, as
vLLM 0.26 chooses them, the seats a decode worker gives (`seats`), and the decode graph buckets it captures
(`decode_graph_buckets`). Pure and torch-free: `config_builder.build_engine_config` reads the device's properties
and resolves the defaults once, where the tree is built; tested by table (tests/test_batch_limits.py).

vLLM's rule (its EngineArgs' batch defaults): a GPU with at least 70 GiB whose name does not contain "a100" (H100,
H200, MI300X) runs up to 1024 sequences, and `LLM` steps of 16384 tokens; any other device 256 and 8192. vLLM's
server also lowers its token budget to 2048 on those smaller GPUs: rapidserve's server keeps 8192 everywhere
(`SERVER_BATCHED_TOKENS`), a deliberate choice: its prompts are chunked within the budget, and a smaller one only
lengthens their time to first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rapidserve.config import EngineConfig

GIB = 1 << 30
LARGE_GPU_BYTES = 70 * GIB  # vLLM's threshold for its larger defaults
SMALL_MAX_NUM_SEQS = 256  # every other device's (the CPU's too), and SchedulerConfig's field default
LARGE_MAX_NUM_SEQS = 1024
SERVER_BATCHED_TOKENS = 8192  # the server's on every device (vLLM: 2048 below 70 GiB; we keep 8192, see above)
SMALL_OFFLINE_BATCHED_TOKENS = 8192  # `LLM` / `rapidserve generate` below 70 GiB, an A100, or the CPU (vLLM's LLM)
LARGE_OFFLINE_BATCHED_TOKENS = 16384  # `LLM` / `rapidserve generate` on a GPU >= 70 GiB but an A100 (vLLM's LLM)
OFFLINE_RUN = "offline"  # policy_spec's run of `LLM` and `rapidserve generate`


@dataclass(frozen=True)
class Device:
    """What the defaults read of the device: its type (torch's: "cuda" for CUDA and ROCm, "cpu"), its total memory
    in bytes (0 on the CPU) and its name (torch.cuda.get_device_properties' `name`; "cpu")."""

    type: str
    total_memory: int
    name: str

    def large(self) -> bool:
        """vLLM's test for its larger defaults: a GPU of >= 70 GiB that is not an A100 (whose throughput the larger
        token budget lowered: vLLM PR #17885)."""
        return self.type == "cuda" and self.total_memory >= LARGE_GPU_BYTES and "a100" not in self.name.lower()

    def describe(self) -> str:
        if self.type != "cuda":
            return self.type
        return f"{self.name}, {self.total_memory / GIB:.0f} GiB"


CPU = Device("cpu", 0, "cpu")


def default_max_num_seqs(device: Device) -> int:
    """vLLM 0.26's max_num_seqs when none is given (server and `LLM` alike): 1024 on a large GPU
    (`Device.large`), else 256."""
    return LARGE_MAX_NUM_SEQS if device.large() else SMALL_MAX_NUM_SEQS


def default_max_num_batched_tokens(device: Device, run: str) -> int:
    """The token budget of one step when none is given: `LLM`'s and `rapidserve generate`'s (run "offline") as vLLM's
    LLM (16384 on a large GPU, else 8192); every other run's SERVER_BATCHED_TOKENS."""
    if run != OFFLINE_RUN:
        return SERVER_BATCHED_TOKENS
    return LARGE_OFFLINE_BATCHED_TOKENS if device.large() else SMALL_OFFLINE_BATCHED_TOKENS


def why_default(device: Device) -> str:
    """Why `default_max_num_seqs(device)` is what it is, for the start-up log."""
    if device.large():
        return f"vLLM's default on this GPU ({device.describe()}: >= 70 GiB, not an A100)"
    if device.type != "cuda":
        return f"vLLM's default on the {device.type}"
    if "a100" in device.name.lower():
        return f"vLLM's default on an A100 ({device.describe()})"
    return f"vLLM's default on this GPU ({device.describe()}: < 70 GiB)"


def seats(max_num_seqs: int, graph_batch_sizes: tuple[int, ...], max_num_batched_tokens: int) -> int:
    """How many requests may hold a seat (run, be chunked or prefilled) at once: at most the largest decode graph,
    and at most one token each within a step's budget."""
    return min(max_num_seqs, max(graph_batch_sizes), max_num_batched_tokens)


def config_seats(cfg: EngineConfig) -> int:
    """`seats` of the tree's scheduler and decode graphs."""
    sc = cfg.scheduler
    return seats(sc.max_num_seqs, cfg.runner.graph_batch_sizes, sc.max_num_batched_tokens)


def decode_graph_buckets(graph_batch_sizes: tuple[int, ...], seats: int) -> tuple[int, ...]:
    """The decode graph buckets a worker of `seats` seats captures: those below `seats` and the first at or above
    it (a step of `seats` rows replays it); none beyond, which no step of that worker could use."""
    top = min((b for b in graph_batch_sizes if b >= seats), default=max(graph_batch_sizes))
    return tuple(b for b in graph_batch_sizes if b <= top)
