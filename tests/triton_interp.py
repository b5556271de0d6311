"""Run a test module as a script under the Triton interpreter (TRITON_INTERPRET=1, in a subprocess: the
variable must be set before triton is imported), for the kernels' CPU checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str, timeout: float = 300) -> str:
    """`python script args...` with TRITON_INTERPRET=1 and the repository on PYTHONPATH; fails the calling
    test with the script's output unless it exits 0; returns its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
