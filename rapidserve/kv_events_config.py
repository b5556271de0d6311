"""vLLM's `--kv-events-config`: the `KVEventsConfig` section of the config tree (`EngineConfig.kv_events`).

The section says whether and where the prefix cache's block events (rapidserve/kv_events.py) are published for
a KV-aware router (engine/kv_publisher.py; docs/architecture.md, "KV events"). `KVEventsConfig.parse` reads
the flag's JSON, or a mapping of the same keys, refusing an unknown key or a wrong type by name. The checks
that involve other settings (the prefix cache must be on, pyzmq installed, only a server reads the flag) are
`engine_settings.kv_events_section`'s, which turns a `KVEventsConfigError` into a ConfigError; the seed of the
first block's hash (`none_hash`) is set by `config_builder.resolve_kv_events`, once, where the run starts.

Plain data: imports nothing of rapidserve (config.py imports it), so its errors are its own
`KVEventsConfigError` (a ValueError), as generation_config.py's are.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.jsonfile import DuplicateKeyError, closest, loads_unique

KV_EVENT_PUBLISHERS = ("null", "zmq")
KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
        "max_queue_size", "topic")  # the JSON keys vLLM's flag takes
_TYPES: dict[str, type | tuple[type, ...]] = {
    "enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": (str, type(None)),
    "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
EXAMPLE = '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\''


class KVEventsConfigError(ValueError):
    """A --kv-events-config that cannot be honoured; the message names the key and what is allowed."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise KVEventsConfigError(msg)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config: publish the prefix cache's block events (rapidserve/kv_events.py) for a router.

    The JSON keys are vLLM's (`parse`): `enable_kv_cache_events`, `publisher` ("zmq", or "null": nothing is
    published; left out: "zmq" when enabled), `endpoint` (a ZMQ PUB address: one with `*`, `::`, ipc:// or
    inproc:// is bound, another is connected to), `replay_endpoint` (a ROUTER address bound for replay requests;
    None: no replay), `buffer_steps` (event batches kept for replay), `hwm` (the PUB socket's high-water mark),
    `max_queue_size` (batches queued for the publisher thread), `topic` (the first frame of each message).
    With several engines behind one server (--data-parallel-size), engine i publishes on the endpoint's port + i
    (ipc/inproc: the address + `_dp<i>`) with `data_parallel_rank` i, as vLLM's data-parallel ranks do.
    `none_hash` is the seed of the first block's hash (vLLM's NONE_HASH): sha256 of $PYTHONHASHSEED, or 32 random
    bytes when it is unset, picked once where the run starts (config_builder) so that every engine and every
    restart hashes alike.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: int = 0
    none_hash: bytes = b""

    def __post_init__(self) -> None:
        _check(self.publisher in KV_EVENT_PUBLISHERS,
               f"kv_events_config.publisher={self.publisher!r}; use one of {', '.join(KV_EVENT_PUBLISHERS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                   f"kv_events_config.{name}={v!r} must be a positive integer")
        _check(self.data_parallel_rank >= 0, f"data_parallel_rank={self.data_parallel_rank} must be >= 0")
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            _check((v is None and name == "replay_endpoint") or (isinstance(v, str) and "://" in v),
                   f"kv_events_config.{name}={v!r}: give a ZMQ address such as tcp://*:5557 or ipc:///tmp/kv"
                   + (", or null" if name == "replay_endpoint" else ""))

    @property
    def publishing(self) -> bool:
        """Whether events are collected and published (enabled, to a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: object) -> KVEventsConfig:
        """--kv-events-config's JSON text, or a mapping of the same keys, or a KVEventsConfig (None: the default,
        off). Unknown keys and wrong types are refused by name (KVEventsConfigError)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = loads_unique(value, "--kv-events-config")
            except DuplicateKeyError as e:
                raise KVEventsConfigError(str(e)) from None
            except ValueError as e:
                raise KVEventsConfigError(f"--kv-events-config is not valid JSON ({e}); give e.g. {EXAMPLE}") from None
        if not isinstance(value, dict):
            raise KVEventsConfigError(f"--kv-events-config must be a JSON object, got {type(value).__name__}; give "
                                      f"e.g. {EXAMPLE}")
        unknown = sorted(map(str, set(value) - set(KEYS)))
        near = [f"{m!r}" + (f" for {k!r}" if len(unknown) > 1 else "") for k in unknown
                if (m := closest(k, KEYS)) is not None]
        _check(not unknown, f"--kv-events-config: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                            f"{', '.join(KEYS)}" + (f" (did you mean {', '.join(near)}?)" if near else ""))
        for k, v in value.items():
            _check(isinstance(v, _TYPES[k]) and not (_TYPES[k] is int and isinstance(v, bool)),
                   f"--kv-events-config: {k}={v!r} has the wrong type")
        kw = dict(value)
        if "publisher" not in kw:  # as vLLM: enabled without a publisher publishes over ZMQ
            kw["publisher"] = "zmq" if kw.get("enable_kv_cache_events") else "null"
        return cls(**kw)
