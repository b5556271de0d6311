"""Workers start from a fork server (engine/launch.py `worker_context`): what it imports once must leave
no GPU initialised, no thread started and no Triton kernel defined, and a worker's environment is the
router's when it started that worker, not the fork server's from when it began."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest

from rapidserve.engine.launch import FORKSERVER_PRELOAD, worker_context, worker_env
from rapidserve.engine.worker_io import apply_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_preload_initialises_no_gpu_starts_no_thread_and_defines_no_kernel() -> None:
    code = ("import importlib, sys, threading\n"
            f"for m in {list(FORKSERVER_PRELOAD)!r}: importlib.import_module(m)\n"
            "import torch\n"
            "print(torch.cuda.is_initialized(), 'triton' in sys.modules, threading.active_count())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert out == ["False", "False", "1"], out


def _report_env(tx: Connection, env: dict[str, str | None]) -> None:
    apply_env(env)
    tx.send(dict(os.environ))


def _env_of_a_worker(overrides: dict[str, str | None]) -> dict[str, str]:
    ctx = worker_context()
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_report_env, args=(tx, worker_env(overrides)), daemon=True)
    p.start()
    got = rx.recv()
    p.join(60)
    assert p.exitcode == 0
    return got


def test_a_worker_gets_the_routers_environment_of_when_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPIDSERVE_TEST_OLD", "1")
    first = _env_of_a_worker({})  # the fork server exists from here on, with RAPIDSERVE_TEST_OLD in its environment
    assert first["RAPIDSERVE_TEST_OLD"] == "1"
    monkeypatch.delenv("RAPIDSERVE_TEST_OLD")
    monkeypatch.setenv("RAPIDSERVE_TEST_NEW", "2")
    monkeypatch.setenv("RAPIDSERVE_TEST_DROPPED", "3")
    second = _env_of_a_worker({"RAPIDSERVE_TEST_CHOSEN": "4", "RAPIDSERVE_TEST_DROPPED": None})
    want = {k: v for k, v in os.environ.items() if k != "RAPIDSERVE_TEST_DROPPED"} | {"RAPIDSERVE_TEST_CHOSEN": "4"}
    assert second == want
