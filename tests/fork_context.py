"""The multiprocessing context for a test's child processes that import torch: the engine's own fork server
(`engine.launch.worker_context`: a fresh interpreter that imported torch and the workers' modules once, as the
engine's workers start), where "spawn" gave each child a fresh interpreter importing torch again (3-4 CPU-s on 2
cores; a child that runs a test module's function imports that module, and with it tests/conftest.py).

A child of the fork server starts with the fork server's environment, from when it began: `with_env` wraps a
target to run in the test process's environment of now, where the child reads one."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rapidserve.engine.launch import worker_context
from rapidserve.engine.worker_io import apply_env


def child_context() -> Any:
    """The fork server's multiprocessing context (Process, Pipe, Queue, Event, Value...)."""
    return worker_context()


def with_env(target: Callable[..., None], *args: Any) -> tuple[Callable[..., None], tuple[Any, ...]]:
    """(target, args) for `Process` that run `target(*args)` in this process's environment as it is now."""
    return _in_env, (dict(os.environ), target, args)


def _in_env(env: dict[str, str], target: Callable[..., None], args: tuple[Any, ...]) -> None:
    apply_env(dict(env))
    target(*args)
