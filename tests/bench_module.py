"""Load a bench/ script as a module for its tests (bench/ is no package), registered in sys.modules under its own
name so its dataclasses and the scripts it imports from bench/ resolve."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as module `name` (loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
