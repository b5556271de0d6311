"""The servers of bench/compare.py's systems: a free port, the health probe and wait, starting, stopping (vLLM's
whole process group) and logging each system's server (`make_server`: ours as a child, vLLM as a child or through
serve_vllm.sh, an external server only probed). The systems themselves are bench/compare_systems.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import IO

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_systems import EXT, RAPIDSERVE, VLLM_ENV, System, serve_command, vllm_command  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(url: str) -> bool:
    """GET /health answers 200 (or, on a server without /health (404), GET /v1/models does)."""
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(url + path, timeout=5) as r:
                return bool(r.status == 200)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
    return False


def wait_healthy(proc: subprocess.Popen[bytes] | None, url: str, timeout_s: float) -> str | None:
    """None once the server answers (see probe); else why not (the process exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"the server exited with code {proc.returncode} before it was healthy"
        if probe(url):
            return None
        time.sleep(1.0)
    return f"not healthy after {timeout_s:g} s"


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 120.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process of process group `pgid` is still running (zombies count as gone)."""
    if os.path.isdir("/proc/self"):
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, pgrp, ...
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float = 60.0) -> None:
    """SIGTERM process group `pgid` (a server and its workers), wait until none of it runs; SIGKILL what
    is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if not group_alive(pgid):
                return
            time.sleep(0.25)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Server:
    """A system's server: `start` (log to an open file), `wait_ready`, `stop` (its exit code where known).
    This base is an external server: never started nor stopped, only probed."""

    cmd: list[str] | None = None

    def start(self, log: IO[bytes]) -> None:
        pass

    def wait_ready(self, url: str, timeout_s: float) -> str | None:
        why = wait_healthy(None, url, min(timeout_s, 30.0))
        return None if why is None else f"the external server does not answer: {why}"

    def stop(self) -> int | None:
        return None

    def extra_log(self) -> str | None:
        """A log the server wrote elsewhere, to append to ours after the stop."""
        return None


class ChildServer(Server):
    """A server this script runs as its child: rapidserve (SIGTERM to it, which stops its workers) or vLLM
    launched directly (its own session: SIGTERM to the whole group, vLLM's engine processes included)."""

    def __init__(self, cmd: list[str], env: Mapping[str, str] | None = None, own_group: bool = False) -> None:
        self.cmd, self.argv, self.env, self.own_group = cmd, cmd, env, own_group
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log: IO[bytes]) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env=None if self.env is None else dict(self.env), start_new_session=self.own_group)

    def wait_ready(self, url: str, timeout_s: float) -> str | None:
        return wait_healthy(self.proc, url, timeout_s)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if not self.own_group:
            return stop_server(self.proc)
        stop_group(self.proc.pid)
        return self.proc.wait()


class ScriptVllm(Server):
    """vLLM through serve_vllm.sh: the script starts vLLM in a session of its own (pid in
    <run_dir>/vllm_PORT.pid, log in <run_dir>/vllm_PORT.log) and exits 0 once /health is 200."""

    def __init__(self, cmd: list[str], port: int, run_dir: str) -> None:
        self.cmd = self.argv = cmd
        self.pid_file = os.path.join(run_dir, f"vllm_{port}.pid")
        self.log_file = os.path.join(run_dir, f"vllm_{port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log: IO[bytes]) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.pid_file)  # an older run's: never end a process this run did not start
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, url: str, timeout_s: float) -> str | None:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return f"serve_vllm.sh did not return in {timeout_s:g} s"
        if rc != 0:
            return f"serve_vllm.sh exited with code {rc}"
        why = wait_healthy(None, url, 30.0)
        return None if why is None else f"serve_vllm.sh returned but vLLM is {why}"

    def server_pid(self) -> int | None:
        try:
            with open(self.pid_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        pid = self.server_pid()
        if pid is None:
            return None
        try:
            leader = os.getpgid(pid) == pid  # setsid made it its group's leader
        except ProcessLookupError:
            return None
        if leader:
            stop_group(pid)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return None

    def extra_log(self) -> str | None:
        return self.log_file


def make_server(a: argparse.Namespace, system: System, port: int, step_trace: str | None = None) -> Server:
    """How `system` is started; a rapidserve server with `step_trace` appends its decode worker's steps there."""
    if system.kind == EXT:
        return Server()
    if system.kind == RAPIDSERVE:
        trace = ["--step-trace", step_trace] if step_trace else []
        return ChildServer([*serve_command(a.model, port, a.serve_args, system.flags), *trace])
    cmd = vllm_command(a.vllm_model, port, a.serve_args, system.flags, a.vllm_serve_path)
    if a.vllm_serve_path:
        return ScriptVllm(cmd, port, a.vllm_run_dir)
    env = {**os.environ, **VLLM_ENV}
    if a.vllm_site and os.path.isdir(a.vllm_site):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (a.vllm_site, os.environ.get("PYTHONPATH")) if p)
    return ChildServer(cmd, env, own_group=True)


def _append_log(log_path: str, other: str | None, limit: int = 4 << 20) -> None:
    if not other or not os.path.isfile(other):
        return
    with open(log_path, "ab") as log:
        log.write(f"\n---- {other} (the server's own log) ----\n".encode())
        log.write(_tail(other, limit).encode())
