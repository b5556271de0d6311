"""The `LaunchConfig` section of the config tree (`EngineConfig.launch`): which engine processes start and how.

Plain data: the engine mode (which workers start), MPS, the restart budget, heartbeats, the rings' sizes and the
workers' log level; each field checked alone when built (config_base.ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rapidserve.config_base import LOG_LEVELS, check

# rapid: decode and prefill workers sharing weights and KV; hybrid: one worker, chunked prefill
# mixed with decodes under the token budget (Sarathi-Serve / vLLM), the baseline; disagg: prefill on
# one GPU and decode on another, each with its own weights, KV moved between their pools (DistServe /
# Dynamo 1P1D, the disaggregated baseline; engine/disagg.py).
EngineMode = Literal["rapid", "hybrid", "disagg"]
ENGINE_MODES: tuple[str, ...] = ("rapid", "hybrid", "disagg")


@dataclass(frozen=True)
class LaunchConfig:
    """How the two-process engine starts, is supervised and talks (rapidserve.engine)."""

    mps: str = "auto"  # auto | on | off (NVIDIA only)
    on_worker_death: str = "restart"  # restart | shutdown
    # Restart budget: at most `max_restarts` restarts in any `restart_window_s` seconds; one more
    # death inside the window and the engine gives up (the server then exits non-zero, so its
    # supervisor, systemd / Kubernetes / Slurm, starts it afresh).
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # A worker that sends nothing (its loop publishes Stats or a Heartbeat every `stats_interval_s`)
    # for this long is taken as hung: killed and handled as a death. None: 60 s on a GPU, 600 s on
    # a CPU, where one prefill forward of a long prompt can take minutes.
    heartbeat_timeout_s: float | None = None
    startup_timeout_s: float = 900.0
    ring_slots: int = 1024
    ring_slot_size: int = 1024
    stats_interval_s: float = 0.25
    mode: EngineMode = "rapid"  # which workers start (ENGINE_MODES); hybrid and disagg use no MPS
    log_level: str = "info"  # the workers' logging (LOG_LEVELS): their start-up steps are logged at info
    step_trace: str | None = None  # --step-trace: the decode worker appends each landed step here (engine/step_trace)

    def __post_init__(self) -> None:
        check(self.mps in ("auto", "on", "off"), f"mps={self.mps!r}; use auto, on or off")
        check(self.log_level in LOG_LEVELS, f"log_level={self.log_level!r}; use one of {', '.join(LOG_LEVELS)}")
        check(self.mode in ENGINE_MODES, f"mode={self.mode!r}; use one of {list(ENGINE_MODES)}")
        check(self.step_trace is None or bool(self.step_trace), "step_trace='': give a file path, or None for none")
        check(self.on_worker_death in ("restart", "shutdown"),
               f"on_worker_death={self.on_worker_death!r}; use restart or shutdown")
        restarts = self.on_worker_death == "restart"
        check(restarts or self.max_restarts == LaunchConfig.max_restarts,
              f"--max-restarts {self.max_restarts} (max_restarts): the restart budget, read only with "
              "--on-worker-death restart; --on-worker-death shutdown restarts nothing: drop one of them")
        check((restarts and self.max_restarts > 0) or self.restart_window_s == LaunchConfig.restart_window_s,
              f"--restart-window-s {self.restart_window_s:g} (restart_window_s): the window of the restart budget, "
              "read only where workers are restarted (--on-worker-death restart, --max-restarts above 0): drop it")
        check(self.startup_timeout_s > 0, f"startup_timeout_s={self.startup_timeout_s} must be > 0")
        check(self.max_restarts >= 0, f"max_restarts={self.max_restarts} must be >= 0 (0: never restart)")
        check(self.restart_window_s > 0, f"restart_window_s={self.restart_window_s} must be > 0 seconds")
        check(self.heartbeat_timeout_s is None or self.heartbeat_timeout_s >= 10 * self.stats_interval_s,
               f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be at least 10 x stats_interval_s "
               f"({10 * self.stats_interval_s:g} s), or None for the default")
        check(self.ring_slots >= 8 and self.ring_slot_size >= 64 and self.ring_slot_size % 8 == 0,
               "ring_slots must be >= 8 and ring_slot_size >= 64 and a multiple of 8")
