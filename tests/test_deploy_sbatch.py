"""deploy/slurm/rapidserve.sbatch run directly with bash (no Slurm) against a stand-in server.

The stand-in records its argv and device environment, answers /health, and exits on SIGTERM, so
these tests check the script's own logic quickly: GPU detection and pinning per vendor, ports,
flag pass-through, readiness, endpoints, shutdown and failure handling. The real server under a
real Slurm is exercised by tests/test_deploy_slurm.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "slurm" / "rapidserve.sbatch"
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")

FAKE_SERVER = r'''
import http.server, json, os, signal, sys, threading
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
host = args[args.index("--host") + 1]
mode = os.environ.get("FAKE_MODE", "ok")
out = os.path.join(os.environ["FAKE_RECORD_DIR"], f"{port}.json")
rec = {"argv": args, "pid": os.getpid(), "env": {k: os.environ.get(k) for k in @DEVICE_VARS@},
       "api_key": os.environ.get("RAPIDSERVE_API_KEY")}
json.dump(rec, open(out, "w"))
if mode == "fail" and port == int(os.environ.get("FAKE_FAIL_PORT", port)):
    print("fake: failing on purpose", flush=True)
    sys.exit(3)
if mode == "stuck":  # leaves a ring behind and ignores SIGTERM, like a hung server
    open(f"/dev/shm/rapidserve-{os.getpid()}-fake-ring", "w").close()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and mode != "unready"
        self.send_response(200 if ok else 503)
        self.end_headers()
    def log_message(self, *a):
        pass

srv = http.server.ThreadingHTTPServer((host, port), H)
def stop(*a):
    rec["stopped"] = True
    json.dump(rec, open(out, "w"))
    threading.Thread(target=srv.shutdown).start()
if mode != "stuck":
    signal.signal(signal.SIGTERM, stop)
srv.serve_forever()
print("fake: stopped", flush=True)
'''.replace("@DEVICE_VARS@", repr(DEVICE_VARS))


def free_port_block(n: int) -> int:
    """A base port with n free consecutive ports after it (checked, not reserved)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


class Run:
    def __init__(self, proc: subprocess.Popen[str], log_root: Path, record_dir: Path, base_port: int) -> None:
        self.proc, self.log_root, self.record_dir, self.base_port = proc, log_root, record_dir, base_port
        self.job_dir = log_root / f"local-{proc.pid}"

    def wait_ready(self, timeout: float = 30.0) -> list[str]:
        endpoints = self.job_dir / "endpoints"
        deadline = time.monotonic() + timeout
        while not endpoints.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"script exited {self.proc.returncode} before ready:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready after {timeout} s:\n{self.output()}")
            time.sleep(0.1)
        return endpoints.read_text().split()

    def finish(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stdout is not None
        return self.proc.stdout.read()

    def record(self, replica: int) -> dict[str, Any]:
        return json.loads((self.record_dir / f"{self.base_port + replica}.json").read_text())


@pytest.fixture()
def run_script(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)

    def start(args: list[str], env: dict[str, str], replicas: int = 1, nvidia_gpus: int = 0,
              fail_replica: int | None = None) -> Run:
        if nvidia_gpus:
            smi = bin_dir / "nvidia-smi"
            lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(nvidia_gpus))
            smi.write_text("#!/bin/sh\n" + lines)
            smi.chmod(0o755)
        record_dir = tmp_path / f"records-{len(runs)}"
        record_dir.mkdir()
        base = free_port_block(replicas)
        full = {k: v for k, v in os.environ.items()
                if k not in DEVICE_VARS and not k.startswith(("SLURM_", "RAPIDSERVE_"))}
        full.update({
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "RAPIDSERVE_BIN": f"{sys.executable} {fake}",
            "RAPIDSERVE_HOST": "127.0.0.1",
            "RAPIDSERVE_BASE_PORT": str(base),
            "RAPIDSERVE_LOG_DIR": str(tmp_path / "logs"),
            "FAKE_RECORD_DIR": str(record_dir),
        })
        full.update(env)
        if fail_replica is not None:
            full["FAKE_FAIL_PORT"] = str(base + fail_replica)
        proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=full, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        run = Run(proc, tmp_path / "logs", record_dir, base)
        runs.append(run)
        return run

    yield start
    for r in runs:
        if r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()


def stop(run: Run) -> tuple[int, str]:
    run.proc.send_signal(signal.SIGTERM)
    code = run.finish()
    return code, run.output()


def test_nvidia_one_replica_per_gpu_each_pinned_and_stopped_cleanly(run_script: Callable[..., Run]) -> None:
    run = run_script(["--max-num-seqs", "8"], {"ROCR_VISIBLE_DEVICES": "7"}, replicas=2, nvidia_gpus=2)
    endpoints = run.wait_ready()
    assert endpoints == [f"http://127.0.0.1:{run.base_port}", f"http://127.0.0.1:{run.base_port + 1}"]
    for i in range(2):
        rec = run.record(i)
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == str(i)
        assert rec["env"]["ROCR_VISIBLE_DEVICES"] is None and rec["env"]["HIP_VISIBLE_DEVICES"] is None
        assert rec["argv"] == ["serve", "--host", "127.0.0.1", "--port", str(run.base_port + i), "--mps", "auto",
                               "--max-num-seqs", "8"]
        assert (run.job_dir / f"replica-{i}.log").exists()
    code, out = stop(run)
    assert code == 0, out
    for i in range(2):
        assert run.record(i).get("stopped"), out
        assert f"replica {i} exited with code 0" in out
        assert "fake: stopped" in (run.job_dir / f"replica-{i}.log").read_text()


def test_nvidia_uses_the_gpus_slurm_assigned_and_passes_mps(run_script: Callable[..., Run]) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "4,6", "RAPIDSERVE_MPS": "on"}
    run = run_script([], env, replicas=2, nvidia_gpus=8)
    run.wait_ready()
    assert [run.record(i)["env"]["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["4", "6"]
    assert run.record(0)["argv"][-2:] == ["--mps", "on"]
    assert stop(run)[0] == 0


def test_amd_pins_rocr_and_makes_hip_relative(run_script: Callable[..., Run]) -> None:
    env = {"RAPIDSERVE_GPU_VENDOR": "amd", "ROCR_VISIBLE_DEVICES": "2,5", "GPU_DEVICE_ORDINAL": "2,5",
           "HIP_VISIBLE_DEVICES": "2,5"}
    run = run_script([], env, replicas=2)
    run.wait_ready()
    for i, dev in enumerate(("2", "5")):
        e = run.record(i)["env"]
        assert (e["ROCR_VISIBLE_DEVICES"], e["HIP_VISIBLE_DEVICES"], e["CUDA_VISIBLE_DEVICES"]) == (dev, "0", "0")
        assert e["GPU_DEVICE_ORDINAL"] is None
    assert stop(run)[0] == 0


def test_cpu_serves_one_replica_with_gpus_hidden(run_script: Callable[..., Run]) -> None:
    run = run_script(["--model", "preset:tiny"], {"RAPIDSERVE_GPU_VENDOR": "none"})
    assert len(run.wait_ready()) == 1
    e = run.record(0)["env"]
    assert e["CUDA_VISIBLE_DEVICES"] == "" and e["HIP_VISIBLE_DEVICES"] == ""
    code, out = stop(run)
    assert code == 0 and "vendor none" in out


def test_replica_that_dies_during_start_fails_the_job_and_stops_the_others(run_script: Callable[..., Run]) -> None:
    run = run_script([], {"RAPIDSERVE_GPU_VENDOR": "none", "RAPIDSERVE_REPLICAS": "2", "FAKE_MODE": "fail"},
                     replicas=2, fail_replica=1)
    assert run.finish() == 1
    out = run.output()
    assert "replica 1 exited with code 3 before it was ready" in out and "fake: failing on purpose" in out, out
    assert run.record(0).get("stopped"), out  # replica 0 was healthy or starting: it got SIGTERM
    assert "replica 0 exited with code 0" in out
    assert not (run.job_dir / "endpoints").exists()


def test_not_ready_in_time(run_script: Callable[..., Run]) -> None:
    run = run_script([], {"RAPIDSERVE_GPU_VENDOR": "none", "FAKE_MODE": "unready", "RAPIDSERVE_READY_TIMEOUT": "2"})
    run.proc.wait(timeout=30)
    out = run.output()
    assert run.proc.returncode == 1 and "not healthy after 2s" in out, out
    assert run.record(0).get("stopped"), out


def test_cancel_while_starting_stops_the_replicas(run_script: Callable[..., Run]) -> None:
    run = run_script([], {"RAPIDSERVE_GPU_VENDOR": "none", "FAKE_MODE": "unready"})
    deadline = time.monotonic() + 30
    while not (run.record_dir / f"{run.base_port}.json").exists():
        assert time.monotonic() < deadline and run.proc.poll() is None
        time.sleep(0.1)
    time.sleep(0.5)  # the fake is serving 503s: the script is in its readiness loop
    code, out = stop(run)
    assert code == 0, out
    assert run.record(0).get("stopped") and "replica 0 exited with code 0" in out, out
    assert not (run.job_dir / "endpoints").exists()


def test_hung_replica_is_killed_and_its_shared_memory_removed(run_script: Callable[..., Run]) -> None:
    run = run_script([], {"RAPIDSERVE_GPU_VENDOR": "none", "FAKE_MODE": "stuck", "RAPIDSERVE_STOP_TIMEOUT": "1"})
    run.wait_ready()
    ring = Path(f"/dev/shm/rapidserve-{run.record(0)['pid']}-fake-ring")
    assert ring.exists()
    code, out = stop(run)
    assert code == 1, out
    assert "did not stop within 1s: SIGKILL" in out and "exited with code 137" in out
    assert not ring.exists()


@pytest.mark.parametrize(("env", "message"), [
    ({"RAPIDSERVE_GPU_VENDOR": "amd", "ROCR_VISIBLE_DEVICES": "0", "RAPIDSERVE_REPLICAS": "2"}, "only 1 GPUs"),
    ({"RAPIDSERVE_MPS": "maybe"}, "RAPIDSERVE_MPS must be auto, on or off"),
    ({"RAPIDSERVE_BASE_PORT": "80x"}, "RAPIDSERVE_BASE_PORT must be a whole number"),
    ({"RAPIDSERVE_GPU_VENDOR": "intel"}, "RAPIDSERVE_GPU_VENDOR must be"),
])
def test_bad_settings_are_refused(run_script: Callable[..., Run], env: dict[str, str], message: str) -> None:
    run = run_script([], env)
    assert run.finish() == 2
    assert message in run.output()


NO_KEY = "NO API KEY"


def test_all_interfaces_without_a_key_warns(run_script: Callable[..., Run]) -> None:
    run = run_script([], {"RAPIDSERVE_GPU_VENDOR": "none", "RAPIDSERVE_HOST": "0.0.0.0"})
    run.wait_ready()
    code, out = stop(run)
    assert code == 0 and NO_KEY in out, out
    assert run.record(0)["api_key"] is None and "--api-key-file" not in run.record(0)["argv"]


def test_api_key_reaches_the_servers_through_the_environment_only(run_script: Callable[..., Run]) -> None:
    run = run_script([], {"RAPIDSERVE_GPU_VENDOR": "none", "RAPIDSERVE_HOST": "0.0.0.0",
                          "RAPIDSERVE_API_KEY": "s3cret"})
    run.wait_ready()
    rec = run.record(0)
    assert rec["api_key"] == "s3cret" and not any("s3cret" in a for a in rec["argv"])
    code, out = stop(run)
    assert code == 0 and NO_KEY not in out, out


def test_api_key_file_is_passed_as_a_flag(run_script: Callable[..., Run], tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret\n")
    run = run_script(["--max-num-seqs", "2"], {"RAPIDSERVE_GPU_VENDOR": "none", "RAPIDSERVE_HOST": "0.0.0.0",
                                               "RAPIDSERVE_API_KEY_FILE": str(key_file)})
    run.wait_ready()
    argv = run.record(0)["argv"]
    assert argv[argv.index("--api-key-file") + 1] == str(key_file) and argv[-2:] == ["--max-num-seqs", "2"]
    code, out = stop(run)
    assert code == 0 and NO_KEY not in out, out


def test_unreadable_api_key_file_is_refused(run_script: Callable[..., Run], tmp_path: Path) -> None:
    run = run_script([], {"RAPIDSERVE_API_KEY_FILE": str(tmp_path / "missing")})
    assert run.finish() == 2
    out = run.output()
    assert "RAPIDSERVE_API_KEY_FILE=" in out and "readable, non-empty" in out, out


# --- several GPUs per replica: -tp / -dp / --mode disagg in the serve flags -----------------------------

EIGHT = ",".join(map(str, range(8)))


def dry_run(args: list[str], env: dict[str, str]) -> tuple[int, str, list[tuple[dict[str, str | None], list[str]]]]:
    """The script with RAPIDSERVE_DRY_RUN=1: exit code, output, and per replica the device environment
    and argv it would start (parsed back from its `env -u VAR VAR=value command ...` line)."""
    full = {k: v for k, v in os.environ.items()
            if k not in DEVICE_VARS and not k.startswith(("SLURM_", "RAPIDSERVE_"))}
    full.update({"PATH": "/usr/bin:/bin", "RAPIDSERVE_DRY_RUN": "1", "RAPIDSERVE_HOST": "127.0.0.1",
                 "RAPIDSERVE_BIN": "rapidserve"})
    full.update(env)
    done = subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=30)
    out = done.stdout + done.stderr
    replicas = []
    for line in done.stdout.splitlines():
        head, sep, cmd = line.partition(f"dry run: replica {len(replicas)}: ")
        if not sep:
            continue
        words = shlex.split(cmd)
        assert words.pop(0) == "env", line
        seen: dict[str, str | None] = {}
        while words[0] == "-u" or "=" in words[0]:
            w = words.pop(0)
            if w == "-u":
                seen[words.pop(0)] = None
            else:
                k, _, v = w.partition("=")
                seen[k] = v
        assert set(seen) == set(DEVICE_VARS), line
        replicas.append((seen, words))
    return done.returncode, out, replicas


NV8 = {"RAPIDSERVE_GPU_VENDOR": "nvidia", "CUDA_VISIBLE_DEVICES": EIGHT}
AMD8 = {"RAPIDSERVE_GPU_VENDOR": "amd", "ROCR_VISIBLE_DEVICES": EIGHT, "GPU_DEVICE_ORDINAL": EIGHT}


@pytest.mark.parametrize(("args", "env", "groups"), [
    ([], NV8, [str(i) for i in range(8)]),
    (["-tp", "2"], NV8, ["0,1", "2,3", "4,5", "6,7"]),
    (["--model", "/m", "--tensor-parallel-size=4"], NV8, ["0,1,2,3", "4,5,6,7"]),
    (["-tp", "2", "-dp", "2"], NV8, ["0,1,2,3", "4,5,6,7"]),
    (["--te", "2", "--da=2"], NV8, ["0,1,2,3", "4,5,6,7"]),  # argparse's abbreviations
    (["-tp", "8", "-tp", "2"], NV8, ["0,1", "2,3", "4,5", "6,7"]),  # the last one wins, as in argparse
    (["-dp", "4"], NV8, ["0,1,2,3", "4,5,6,7"]),
    (["--mode", "disagg"], NV8, ["0,1", "2,3", "4,5", "6,7"]),
    (["--mode=disagg", "-tp", "1"], NV8, ["0,1", "2,3", "4,5", "6,7"]),
    (["--mode", "hybrid", "-tp", "2"], NV8, ["0,1", "2,3", "4,5", "6,7"]),
    (["--mode", "disagg", "-tp", "2"], NV8, ["0,1,2,3", "4,5,6,7"]),  # 2P2D
    (["--mode", "disagg", "--prefill-tp", "1", "-tp", "2"], {**NV8, "RAPIDSERVE_REPLICAS": "2"},
     ["0,1,2", "3,4,5"]),  # 1P2D
    (["--mode", "disagg", "--prefill-tensor=2"], {**NV8, "RAPIDSERVE_REPLICAS": "2"},
     ["0,1,2", "3,4,5"]),  # 2P1D, argparse's abbreviation
    (["-tp", "2"], {"RAPIDSERVE_GPU_VENDOR": "nvidia", "CUDA_VISIBLE_DEVICES": "1,3,5,7"}, ["1,3", "5,7"]),
    (["-tp", "2"], {**NV8, "RAPIDSERVE_GPUS": "4,5,6,7"}, ["4,5", "6,7"]),
    (["-tp", "3"], {**NV8, "RAPIDSERVE_REPLICAS": "2"}, ["0,1,2", "3,4,5"]),  # the first 2 x 3 of 8
    (["-tp", "2", "-dp", "2"], AMD8, ["0,1,2,3", "4,5,6,7"]),
    (["-tp", "2"], {**AMD8, "RAPIDSERVE_GPUS": "2,3,6,7"}, ["2,3", "6,7"]),
])
def test_each_replica_gets_tp_x_dp_consecutive_gpus(args: list[str], env: dict[str, str], groups: list[str]) -> None:
    from rapidserve.cli import build_parser

    code, out, replicas = dry_run(args, env)
    assert code == 0, out
    assert len(replicas) == len(groups), out
    amd = env["RAPIDSERVE_GPU_VENDOR"] == "amd"
    for i, ((seen, argv), group) in enumerate(zip(replicas, groups, strict=True)):
        if amd:  # ROCr picks the physical GPUs; HIP/CUDA count from 0 among them
            rel = ",".join(map(str, range(group.count(",") + 1)))
            assert seen == {"ROCR_VISIBLE_DEVICES": group, "HIP_VISIBLE_DEVICES": rel, "CUDA_VISIBLE_DEVICES": rel,
                            "GPU_DEVICE_ORDINAL": None}, out
        else:
            assert seen == {"CUDA_VISIBLE_DEVICES": group, "HIP_VISIBLE_DEVICES": None,
                            "ROCR_VISIBLE_DEVICES": None, "GPU_DEVICE_ORDINAL": None}, out
        assert argv == ["rapidserve", "serve", "--host", "127.0.0.1", "--port", str(8000 + i), "--mps", "auto",
                        *args], out
        # the server, parsing the same flags, uses exactly the GPUs the script gave the replica
        a = build_parser().parse_args(argv[1:])
        tp = a.tensor_parallel_size
        need = (a.prefill_tensor_parallel_size or tp) + tp if a.mode == "disagg" else tp * a.data_parallel_size
        assert need == group.count(",") + 1, (argv, group)
    assert f"devices {' '.join(groups)}" in out


def test_cpu_ignores_the_gpu_grouping() -> None:
    code, out, replicas = dry_run(["-tp", "2"], {"RAPIDSERVE_GPU_VENDOR": "none"})
    assert code == 0 and len(replicas) == 1, out
    seen, argv = replicas[0]
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["HIP_VISIBLE_DEVICES"] == "" and argv[-2:] == ["-tp", "2"]


@pytest.mark.parametrize(("args", "env", "message"), [
    (["-tp", "3"], NV8, "this job has 8 GPUs (0 1 2 3 4 5 6 7), not a multiple of the 3 GPUs each replica uses "
                        "(-tp 3); request a multiple (--gres=gpu:6 or 9)"),
    (["-tp", "2", "-dp", "3"], NV8, "not a multiple of the 6 GPUs each replica uses (-tp 2 x -dp 3)"),
    (["--mode", "disagg"], {"RAPIDSERVE_GPU_VENDOR": "nvidia", "CUDA_VISIBLE_DEVICES": "0,1,2"},
     "not a multiple of the 2 GPUs each replica uses (--mode disagg)"),
    (["-tp", "2"], {"RAPIDSERVE_GPU_VENDOR": "amd", "ROCR_VISIBLE_DEVICES": "5"},
     "each replica needs 2 GPUs (-tp 2) but this job has only 1 (5)"),
    (["-tp", "3"], {**NV8, "RAPIDSERVE_REPLICAS": "3"},
     "RAPIDSERVE_REPLICAS=3 replicas of 3 GPUs (-tp 3) need 9 GPUs but only 8 GPUs"),
    (["-tp", "0"], NV8, "-tp/--tensor-parallel-size must be a positive whole number (1, 2, ...), not '0'"),
    (["--tensor-parallel-size=two"], NV8, "-tp/--tensor-parallel-size must be a positive whole number"),
    (["-dp", "-1"], NV8, "-dp/--data-parallel-size must be a positive whole number (1, 2, ...), not '-1'"),
    (["--data-parallel-size="], NV8, "-dp/--data-parallel-size must be a positive whole number"),
    (["--model", "/m", "-tp"], NV8, "-tp/--tensor-parallel-size needs a value"),
    (["--mode"], NV8, "--mode needs a value: rapid, hybrid or disagg"),
    (["--mode", "disagg", "-dp", "2"], NV8, "--mode disagg takes no -dp (got -dp 2)"),
    (["--mode", "disagg", "--prefill-tp", "2"], NV8,
     "not a multiple of the 3 GPUs each replica uses (--mode disagg with 2 prefill + 1 decode GPUs)"),
    (["--prefill-tp", "0"], NV8, "--prefill-tensor-parallel-size must be a positive whole number"),
    (["-tp", "0"], {"RAPIDSERVE_GPU_VENDOR": "none"}, "-tp/--tensor-parallel-size must be"),  # on CPU too
    ([], {**NV8, "RAPIDSERVE_DRY_RUN": "yes"}, "RAPIDSERVE_DRY_RUN must be 0 or 1"),
])
def test_gpu_grouping_errors_name_the_flag(args: list[str], env: dict[str, str], message: str) -> None:
    code, out, replicas = dry_run(args, env)
    assert code == 2 and message in out and not replicas, out


def test_tp2_replicas_start_pinned_to_their_gpu_pairs(run_script: Callable[..., Run]) -> None:
    run = run_script(["-tp", "2"], {}, replicas=2, nvidia_gpus=4)
    assert len(run.wait_ready()) == 2
    assert [run.record(i)["env"]["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0,1", "2,3"]
    assert run.record(1)["argv"][-2:] == ["-tp", "2"]
    code, out = stop(run)
    assert code == 0, out
    assert "2 replica(s) of 2 GPUs (-tp 2), vendor nvidia, devices 0,1 2,3" in out
    assert "replica 1: pid" in out and "devices 2,3, port" in out
