"""What every module of the config tree shares: `ConfigError`, the check that raises it, the log levels and
`divisors` (for messages).

The tree's sections live in their own modules (config.py: the root `EngineConfig`, re-exporting the model, KV cache,
scheduler, runner and parallelism sections of model_config.py, cache_config.py, scheduler_config.py, runner_config.py
and parallel_config.py; launch_config.py, partition_config.py, server_config.py, generation_config.py,
kv_events_config.py); each checks its fields alone when built and raises `ConfigError`, whose message names the field,
the value and what is allowed, so the user can fix it. Imports nothing of rapidserve.
"""

from __future__ import annotations

LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which field and what is allowed."""



def check(cond: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `cond`."""
    if not cond:
        raise ConfigError(msg)


def divisors(n: int) -> str:
    """The divisors of `n` up to 16, for messages ("1, 2, 4, 8")."""
    return ", ".join(str(d) for d in range(1, min(n, 16) + 1) if n % d == 0)
