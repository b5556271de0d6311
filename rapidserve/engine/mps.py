"""CUDA MPS (Multi-Process Service) for the decode and prefill workers.

The two workers are separate processes on one GPU. Without MPS the GPU time-slices between them, so
prefill and decode kernels never overlap; under MPS they run at the same time (and each worker can
keep to its own green-context SM partition). `MpsController.start` finds a reachable control daemon
or starts a private one under the engine's work folder, and says how the workers must be started
(`MpsPlan.worker_env`). `stop` quits only a daemon it started. Call it after the workers exited: the
daemon waits for its clients before it quits.

Never set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (it overrides green-context SM counts) and never change
the GPU compute mode here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from rapidserve.ipc.ring import pid_alive

MpsMode = Literal["auto", "on", "off"]

CONTROL = "nvidia-cuda-mps-control"
PIPE_VAR = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VAR = "CUDA_MPS_LOG_DIRECTORY"
PERCENT_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
TIME_SLICE = "workers will time-slice the GPU; prefill and decode kernels will not overlap"
MAX_PIPE_DIR_LEN = 70  # the daemon's unix sockets live in the pipe folder (sun_path holds 107 bytes)


class MpsError(RuntimeError):
    """MPS was required (mode "on") but could not be used."""


@dataclass(frozen=True)
class MpsPlan:
    mode: MpsMode
    active: bool  # the workers will run under MPS
    started_by_us: bool
    pipe_dir: str | None
    log_dir: str | None
    reason: str  # one sentence for the log

    def worker_env(self) -> dict[str, str | None]:
        """Variables for the worker processes; None means remove the variable."""
        env: dict[str, str | None] = {PERCENT_VAR: None}
        if self.active and self.pipe_dir is not None:
            env[PIPE_VAR] = self.pipe_dir
            if self.log_dir is not None:
                env[LOG_VAR] = self.log_dir
        return env


class MpsController:
    """Finds or starts the MPS control daemon; usable as a context manager (exit calls `stop`)."""

    def __init__(
        self,
        control_binary: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        probe_timeout: float = 2.0,
        start_timeout: float = 5.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.control_binary = shutil.which(control_binary or CONTROL)  # resolved once
        self._environ = dict(os.environ if environ is None else environ)
        self.probe_timeout = probe_timeout
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._ours: tuple[str, str, str] | None = None  # (root folder, pipe dir, log dir) we created
        self._daemon_pid: int | None = None

    def __enter__(self) -> MpsController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, mode: MpsMode, platform: str, workdir: str) -> MpsPlan:
        if mode not in get_args(MpsMode):
            raise ValueError(f"MPS mode must be one of {get_args(MpsMode)}, got {mode!r}")
        if self._ours is not None:
            raise RuntimeError("MpsController.start called twice; call stop() first")
        if platform != "cuda":
            if mode == "on":
                raise ValueError(f"MPS mode 'on' needs an NVIDIA GPU (platform 'cuda'), not {platform!r}")
            why = ("ROCm needs no daemon: AMD GPUs run kernels of several processes concurrently"
                   if platform == "rocm" else f"platform {platform!r} has no CUDA GPU to share")
            return MpsPlan(mode, False, False, None, None, f"MPS not used: {why}")
        if mode == "off":
            return MpsPlan(mode, False, False, None, None, f"MPS off: {TIME_SLICE}")

        pipe_dir = self._environ.get(PIPE_VAR) or DEFAULT_PIPE_DIR
        if self._reachable(pipe_dir, self._environ.get(LOG_VAR) or DEFAULT_LOG_DIR, self.probe_timeout):
            return MpsPlan(mode, True, False, pipe_dir, self._environ.get(LOG_VAR),
                           f"MPS on: using the running control daemon at {pipe_dir}")
        if self.control_binary is None:
            why = f"no reachable daemon at {pipe_dir} and {CONTROL} is not on PATH"
        else:
            why = self._start_private(workdir)
            if why is None:
                assert self._ours is not None
                _, pipe_dir, log_dir = self._ours
                return MpsPlan(mode, True, True, pipe_dir, log_dir,
                               f"MPS on: started a private control daemon (pipes in {pipe_dir})")
        if mode == "on":
            raise MpsError(
                f"MPS mode 'on' but MPS is unavailable: {why}. Start the daemon (as root: "
                f"'{CONTROL} -d') and export {PIPE_VAR} if it is not {DEFAULT_PIPE_DIR}, install the "
                "NVIDIA compute utilities, or use MPS mode 'auto' or 'off'")
        return MpsPlan(mode, False, False, None, None, f"MPS unavailable ({why}): {TIME_SLICE}")

    def stop(self) -> None:
        """Quit the daemon we started (bounded wait) and remove its folders. Idempotent."""
        if self._ours is None:
            return
        root, pipe_dir, log_dir = self._ours
        pid = self._daemon_pid or _read_pid(pipe_dir)
        self._query("quit", pipe_dir, log_dir, self.probe_timeout)
        deadline = time.monotonic() + self.stop_timeout
        while not _gone(pid, pipe_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is not None and pid_alive(pid):  # it ignored quit: it is ours, so end it
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + 2.0
            while pid_alive(pid) and time.monotonic() < end:
                time.sleep(0.05)
        shutil.rmtree(root, ignore_errors=True)
        self._ours = None
        self._daemon_pid = None

    # --- helpers ---------------------------------------------------------------------------

    def _env(self, pipe_dir: str, log_dir: str) -> dict[str, str]:
        # A daemon started with CUDA_VISIBLE_DEVICES=N renumbers its one GPU as 0, and a client that then
        # asks for GPU N (its own CUDA_VISIBLE_DEVICES) finds no GPU at all (measured on 2 x H200: "Client
        # requested 1 which is not a valid GPU ID in the MPS visible set"). Our daemon sees every GPU; each
        # worker keeps its own CUDA_VISIBLE_DEVICES.
        env = {k: v for k, v in self._environ.items() if k not in (PERCENT_VAR, VISIBLE_VAR)}
        env[PIPE_VAR] = pipe_dir
        env[LOG_VAR] = log_dir
        return env

    def _query(self, command: str, pipe_dir: str, log_dir: str, timeout: float) -> bool:
        """Send one command to the control daemon; True if the client exited 0 in time."""
        if self.control_binary is None:
            return False
        try:
            done = subprocess.run([self.control_binary], input=command + "\n", capture_output=True, text=True,
                                  env=self._env(pipe_dir, log_dir), timeout=max(timeout, 0.01))
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0

    def _reachable(self, pipe_dir: str, log_dir: str, timeout: float) -> bool:
        return os.path.exists(os.path.join(pipe_dir, "control")) and self._query(
            "get_server_list", pipe_dir, log_dir, timeout)

    def _start_private(self, workdir: str) -> str | None:
        """Start a daemon with private folders; None on success, else why not."""
        assert self.control_binary is not None
        base = os.path.abspath(workdir)
        if len(base) + len("/mps-12345678/pipe") > MAX_PIPE_DIR_LEN:  # too long for the sockets
            base = tempfile.gettempdir()
        try:
            os.makedirs(base, exist_ok=True)
            root = tempfile.mkdtemp(prefix="mps-", dir=base)  # mode 0700
        except OSError as e:
            return f"cannot create the daemon's folders under {base}: {e}"
        pipe_dir, log_dir = os.path.join(root, "pipe"), os.path.join(root, "log")
        self._ours = (root, pipe_dir, log_dir)
        os.mkdir(pipe_dir, 0o700)
        os.mkdir(log_dir, 0o700)
        why: str | None = None
        with tempfile.TemporaryFile("w+") as err:
            try:
                done = subprocess.run([self.control_binary, "-d"], env=self._env(pipe_dir, log_dir),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                      timeout=self.start_timeout)
                if done.returncode != 0:
                    err.seek(0)
                    why = f"'{CONTROL} -d' exited {done.returncode}: {err.read().strip()[:300] or 'no message'}"
            except subprocess.TimeoutExpired:
                why = f"'{CONTROL} -d' did not return within {self.start_timeout:g} s"
            except OSError as e:
                why = f"could not run {self.control_binary}: {e}"
        if why is None:
            deadline = time.monotonic() + self.start_timeout
            while not self._reachable(pipe_dir, log_dir, min(self.probe_timeout, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    why = f"the daemon started in {pipe_dir} did not answer within {self.start_timeout:g} s"
                    break
                time.sleep(0.05)
        if why is None:
            self._daemon_pid = _read_pid(pipe_dir)
        else:
            self.stop()
        return why


def _read_pid(pipe_dir: str) -> int | None:
    try:
        with open(os.path.join(pipe_dir, f"{CONTROL}.pid")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _gone(pid: int | None, pipe_dir: str) -> bool:
    if pid is not None:
        return not pid_alive(pid)
    return not os.path.exists(os.path.join(pipe_dir, "control"))
