"""bench/gpu_suite.sh's argument checks (the runs themselves need a GPU machine): --part and --spread refuse what
they cannot do before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str, gpus: int = 0) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"  # lists `gpus` GPUs for `nvidia-smi -L`
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: Fake'\n" for i in range(gpus)))
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "gpus", "says"), [
    (("--part", "3/2"), 0, "--part must be K/N with 1 <= K <= N"),
    (("--part", "x"), 0, "--part must be K/N"),
    (("--spread", "--part", "1/2"), 2, "give --part or --spread, not both"),
    (("--spread",), 1, "--spread needs a machine of two or more GPUs (1 found)"),
    (("--bogus",), 0, "unknown argument --bogus"),
])
def test_bad_arguments_exit_2_with_the_reason(tmp_path: Path, args: tuple[str, ...], gpus: int, says: str) -> None:
    r = _run(tmp_path, *args, gpus=gpus)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr
    assert not (tmp_path / "out" / "part1").exists()  # nothing ran
