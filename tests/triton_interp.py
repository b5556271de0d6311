"""Run a test module as a script under the Triton interpreter (TRITON_INTERPRET=1, in a subprocess: the
variable must be set before triton is imported), for the kernels' CPU checks.

A module with several named checks runs them all in one subprocess (`run_checks` is the script's main,
`interpreted_checks` the tests' side: a fresh interpreter with torch and triton costs about 4 CPU-s on 2 cores,
once per module rather than once per check); each check's test then asserts its own outcome."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
_BEGIN, _END = "@@interpreter check ", "@@interpreter check done "  # the script's lines around each check


def _env() -> dict[str, str]:
    """TRITON_INTERPRET=1, and on PYTHONPATH the repository and tests/interp_site (its sitecustomize makes the
    interpreter's device function calls cheaper: see there)."""
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO / "tests" / "interp_site"), str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def run_interpreted(script: str, *args: str, timeout: float = 300) -> str:
    """`python script args...` with TRITON_INTERPRET=1 and the repository on PYTHONPATH; fails the calling
    test with the script's output unless it exits 0; returns its stdout."""
    proc = subprocess.run([sys.executable, script, *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def exit_passed() -> NoReturn:
    """The end of a script whose checks all passed (an assertion that failed raised before this, exit code 1):
    stdout and stderr flushed, then the process ends with code 0 without the interpreter's teardown (see
    `run_checks`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_checks(checks: Mapping[str, Callable[[], None]], names: Iterable[str]) -> NoReturn:
    """A script's main: each named check in turn (every one when none is named), each between a line that
    begins it and one that says `ok` or `FAILED` (after its traceback, on stdout), so one failing check leaves
    the others their own outcome. Ends the process (exit code 1 if any failed, else 0) once stdout and stderr are
    flushed, without the interpreter's teardown: its last garbage collection over torch's and Triton's objects
    (and nanobind's leak report) cost about 1 CPU-s a script and checked nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    failed = False
    for name in list(names) or sorted(checks):
        print(f"{_BEGIN}{name}", flush=True)
        try:
            checks[name]()
        except Exception:  # noqa: BLE001 - reported as this check's outcome; the next check still runs
            traceback.print_exc(file=sys.stdout)
            print(f"{_END}{name}: FAILED", flush=True)
            failed = True
        else:
            print(f"{name}: ok", flush=True)
            print(f"{_END}{name}: ok", flush=True)
    if not failed:
        exit_passed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def interpreted_checks(script: str, names: Iterable[str], timeout: float = 600) -> dict[str, str]:
    """Run `script`'s checks `names` in one subprocess (run_checks as its main): each name's outcome, "" when
    it passed, else what it printed (its traceback), with the process's stderr and exit code for a check that
    did not finish."""
    names = sorted(set(names))
    proc = subprocess.run([sys.executable, script, *names], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    out: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []
    for line in proc.stdout.splitlines():
        if line.startswith(_END):
            name, _, verdict = line.removeprefix(_END).rpartition(": ")
            out[name] = "" if verdict == "ok" else "\n".join(lines) or "FAILED"
            current, lines = None, []
        elif line.startswith(_BEGIN):
            current, lines = line.removeprefix(_BEGIN), []
        elif current is not None:
            lines.append(line)
    for name in names:
        if name not in out:
            out[name] = (f"did not finish (exit code {proc.returncode}):\n" + "\n".join(lines) + "\n"
                         + proc.stderr[-5000:])
    if proc.returncode != 0 and not any(out.values()):  # a failure outside the checks (the script's own start)
        out = {name: f"exit code {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}" for name in names}
    return out


def selected(request: Any, argname: str) -> list[str]:
    """The values of the parameter `argname` among this session's tests of the requesting module (those left
    after -k/-m selection): the checks its module fixture runs."""
    return sorted({item.callspec.params[argname] for item in request.session.items
                   if item.module is request.module and hasattr(item, "callspec")
                   and argname in item.callspec.params})


def selected_by_test(request: Any, tests: Mapping[str, str]) -> list[str]:
    """The checks (keys of `tests`, check -> the name of the test that asserts it) whose test is among this
    session's tests of the requesting module."""
    names = {item.name for item in request.session.items if item.module is request.module}
    return sorted(check for check, test in tests.items() if test in names)
