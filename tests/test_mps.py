"""MpsController against a fake `nvidia-cuda-mps-control` (no GPU, no NVIDIA driver needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rapidserve.engine.mps import MpsController, MpsError, MpsPlan

# `-d` starts a stand-in daemon process (a detached `sleep`), writes its pid file, a control pipe file and a
# state file, then returns. Commands on stdin succeed only while the state file exists; `quit` ends the stand-in
# and removes the files. With HANG set every command on stdin hangs (a daemon that never answers).
FAKE = '''#!{python}
import os, signal, subprocess, sys, time
HANG = {hang}
PID_LOG = {pid_log!r}
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
state, control = os.path.join(pipe, "fake_state"), os.path.join(pipe, "control")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
if sys.argv[1:] == ["-d"]:
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    os.makedirs(pipe, exist_ok=True)
    d = subprocess.Popen(["sleep", "120"], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    visible = os.path.join(pipe, "visible_devices")  # the real daemon renumbers what it sees from 0
    for path, text in ((pid_file, str(d.pid)), (control, ""), (state, "running"), (PID_LOG, str(d.pid)),
                       (visible, os.environ.get("CUDA_VISIBLE_DEVICES", "every GPU"))):
        with open(path, "w") as f:
            f.write(text)
    sys.exit(0)
command = sys.stdin.read().strip()
if HANG:
    time.sleep(60)
if not os.path.exists(state):
    sys.exit("cannot connect to the MPS control daemon")
if command == "quit":
    with open(pid_file) as f:
        os.kill(int(f.read()), signal.SIGTERM)
    for path in (state, control, pid_file, os.path.join(pipe, "visible_devices")):
        os.remove(path)
sys.exit(0 if command in ("quit", "get_server_list") else 2)
'''


def write_fake(tmp_path: Path, hang: bool = False) -> str:
    path = tmp_path / ("hanging-mps-control" if hang else "nvidia-cuda-mps-control")
    path.write_text(FAKE.format(python=sys.executable, hang=hang, pid_log=str(tmp_path / "last-daemon.pid")))
    path.chmod(0o755)
    return str(path)


def query(binary: str, pipe_dir: Path, command: str) -> int:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    done = subprocess.run([binary], input=command + "\n", env=env, capture_output=True, text=True, timeout=10)
    return done.returncode


def daemon_pid(pipe_dir: Path) -> int:
    return int((pipe_dir / "nvidia-cuda-mps-control.pid").read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def fake(tmp_path: Path) -> str:
    return write_fake(tmp_path)


@pytest.fixture
def work() -> Iterator[Path]:
    """A short work folder: the daemon's sockets need short paths, and pytest's tmp_path can be long."""
    path = Path(tempfile.mkdtemp(prefix="rs-mps-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def empty_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose pipe folder holds no daemon, and a thread percentage that must not leak."""
    (tmp_path / "no-daemon").mkdir()
    return {"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "no-daemon"),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}


@pytest.fixture
def running_daemon(tmp_path: Path, fake: str) -> Iterator[Path]:
    pipe_dir = tmp_path / "system-mps"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    subprocess.run([fake, "-d"], env=env, check=True, timeout=10)
    yield pipe_dir
    if (pipe_dir / "fake_state").exists():
        query(fake, pipe_dir, "quit")


def test_auto_starts_private_daemon_and_stop_quits_it(work: Path, fake: str, empty_env: dict[str, str]) -> None:
    with MpsController(fake, environ=empty_env) as ctl:
        plan = ctl.start("auto", "cuda", str(work))
        assert plan.active and plan.started_by_us and plan.mode == "auto"
        assert plan.pipe_dir is not None and plan.log_dir is not None
        pipe_dir, root = Path(plan.pipe_dir), Path(plan.pipe_dir).parent
        assert root.parent == work and root.stat().st_mode & 0o777 == 0o700
        assert pipe_dir.stat().st_mode & 0o777 == 0o700 and Path(plan.log_dir).is_dir()
        assert query(fake, pipe_dir, "get_server_list") == 0
        pid = daemon_pid(pipe_dir)
        assert "private" in plan.reason
    assert not pid_alive(pid)
    assert not root.exists()
    ctl.stop()  # idempotent


def test_auto_uses_reachable_daemon_and_leaves_it_running(work: Path, fake: str, running_daemon: Path) -> None:
    environ = {"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(running_daemon)}
    ctl = MpsController(fake, environ=environ)
    plan = ctl.start("auto", "cuda", str(work))
    assert plan.active and not plan.started_by_us and plan.pipe_dir == str(running_daemon)
    ctl.stop()
    ctl.stop()
    assert query(fake, running_daemon, "get_server_list") == 0
    assert pid_alive(daemon_pid(running_daemon))
    assert list(work.iterdir()) == []


def test_auto_without_binary_runs_time_sliced(tmp_path: Path, empty_env: dict[str, str]) -> None:
    plan = MpsController(str(tmp_path / "missing"), environ=empty_env).start("auto", "cuda", str(tmp_path / "w"))
    assert not plan.active and not plan.started_by_us
    assert "time-slice" in plan.reason and "not on PATH" in plan.reason


def test_default_lookup_uses_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert MpsController().control_binary is None
    fake = write_fake(tmp_path)
    assert MpsController().control_binary == fake


def test_on_without_binary_raises(tmp_path: Path, empty_env: dict[str, str]) -> None:
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control -d"):
        MpsController(str(tmp_path / "missing"), environ=empty_env).start("on", "cuda", str(tmp_path / "w"))


def test_on_with_binary_starts_daemon(work: Path, fake: str, empty_env: dict[str, str]) -> None:
    with MpsController(fake, environ=empty_env) as ctl:
        plan = ctl.start("on", "cuda", str(work))
        assert plan.active and plan.started_by_us and plan.worker_env()["CUDA_MPS_PIPE_DIRECTORY"] == plan.pipe_dir
    assert list(work.iterdir()) == []


def test_off_is_inactive(tmp_path: Path, fake: str) -> None:
    plan = MpsController(fake).start("off", "cuda", str(tmp_path / "w"))
    assert not plan.active and not plan.started_by_us and "time-slice" in plan.reason
    assert plan.worker_env() == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None}


@pytest.mark.parametrize("platform", ["cpu", "rocm"])
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_non_cuda_platforms_are_inactive(tmp_path: Path, fake: str, platform: str, mode: str) -> None:
    plan = MpsController(fake).start(mode, platform, str(tmp_path / "w"))  # type: ignore[arg-type]
    assert not plan.active and plan.reason
    assert not (tmp_path / "w").exists()
    if platform == "rocm":
        assert "ROCm" in plan.reason


@pytest.mark.parametrize("platform", ["cpu", "rocm"])
def test_on_for_non_cuda_platform_is_a_value_error(tmp_path: Path, fake: str, platform: str) -> None:
    with pytest.raises(ValueError, match="NVIDIA"):
        MpsController(fake).start("on", platform, str(tmp_path))


def test_bad_mode_is_a_value_error(tmp_path: Path, fake: str) -> None:
    with pytest.raises(ValueError, match="mode"):
        MpsController(fake).start("maybe", "cuda", str(tmp_path))  # type: ignore[arg-type]


def test_worker_env() -> None:
    on = MpsPlan("auto", True, True, "/w/mps-x/pipe", "/w/mps-x/log", "MPS on")
    assert on.worker_env() == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None,
                               "CUDA_MPS_PIPE_DIRECTORY": "/w/mps-x/pipe", "CUDA_MPS_LOG_DIRECTORY": "/w/mps-x/log"}
    off = MpsPlan("auto", False, False, None, None, "MPS off")
    assert off.worker_env() == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None}


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_daemon_that_never_answers_is_bounded(
    tmp_path: Path, work: Path, empty_env: dict[str, str], mode: str
) -> None:
    hanging = write_fake(tmp_path, hang=True)
    ctl = MpsController(hanging, environ=empty_env, probe_timeout=0.3, start_timeout=1.0, stop_timeout=0.5)
    t0 = time.monotonic()
    if mode == "on":
        with pytest.raises(MpsError, match="did not answer"):
            ctl.start(mode, "cuda", str(work))
    else:
        plan = ctl.start(mode, "cuda", str(work))
        assert not plan.active and "did not answer" in plan.reason and "time-slice" in plan.reason
    assert time.monotonic() - t0 < 8.0
    assert list(work.iterdir()) == []  # private folders removed
    assert not pid_alive(int((tmp_path / "last-daemon.pid").read_text()))  # the stand-in daemon was ended
    ctl.stop()


def test_long_workdir_falls_back_to_short_pipe_path(tmp_path: Path, fake: str, empty_env: dict[str, str]) -> None:
    with MpsController(fake, environ=empty_env) as ctl:
        plan = ctl.start("auto", "cuda", str(tmp_path / ("x" * 100)))
        assert plan.active and plan.pipe_dir is not None and len(plan.pipe_dir) <= 70
        assert Path(plan.pipe_dir).parent.parent == Path(tempfile.gettempdir())
        root = Path(plan.pipe_dir).parent
    assert not root.exists()


def test_unwritable_workdir_is_inactive_in_auto(work: Path, fake: str, empty_env: dict[str, str]) -> None:
    blocker = work / "file"
    blocker.write_text("not a folder")
    with MpsController(fake, environ=empty_env) as ctl:
        plan = ctl.start("auto", "cuda", str(blocker / "w"))
        assert not plan.active and "cannot create" in plan.reason


def test_private_daemon_sees_every_gpu_whatever_the_server_was_given(work: Path, fake: str,
                                                                    empty_env: dict[str, str]) -> None:
    """A server pinned with CUDA_VISIBLE_DEVICES=1 (a user's second GPU, or a benchmark's) must not pass it to
    its daemon: the real daemon renumbers its one GPU as 0, and the workers, still asking for GPU 1, then see no
    GPU at all (2 x H200, 2026-11-29: the decode worker fell back to the CPU). The workers keep the variable."""
    env = {**empty_env, "CUDA_VISIBLE_DEVICES": "1"}
    with MpsController(fake, environ=env) as ctl:
        plan = ctl.start("auto", "cuda", str(work))
        assert plan.active and plan.started_by_us and plan.pipe_dir is not None
        assert (Path(plan.pipe_dir) / "visible_devices").read_text() == "every GPU"
        assert "CUDA_VISIBLE_DEVICES" not in plan.worker_env()  # the workers inherit the server's "1"
