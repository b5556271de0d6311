"""What every module of the config tree shares: `ConfigError`, the check that raises it, and the log levels.

The tree's sections live in their own modules (config.py: the model, KV cache, scheduler, runner, parallelism and the
root `EngineConfig`; launch_config.py, partition_config.py, server_config.py, generation_config.py,
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
