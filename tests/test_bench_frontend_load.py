"""bench/frontend_load.py: the real server over its stand-in engine streams every token of every request, and the
table and files say so (the figures themselves are the benchmark's, not asserted here)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "frontend_load.py"


def load():
    """The script as a module its spawned server process can import again (bench/ on sys.path, which spawn passes)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("frontend_load")


def test_every_token_streams_and_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = load()
    assert mod.main(["--rates", "50", "--requests", "8", "--input-len", "16", "--output-len", "5", "--step-ms", "2",
                     "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "frontend_load.json").read_text())["rows"]
    assert len(rows) == 1
    r = rows[0]
    assert r["requests"] == 8 and r["tokens"] == 8 * 5 and r["short_streams"] == 0
    assert r["server_us_per_token"] > 0 and r["ttft_first_quarter_ms"] > 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[0].startswith("| rate | requests | tokens |")
    assert "| 50.0 | 8 | 40 |" in out


@pytest.mark.parametrize("args", [["--rates", "ten"], ["--rates", "0"], ["--requests", "2"], ["--step-ms", "0"]])
def test_bad_flags_are_refused_by_name(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load().main(args)
    assert e.value.code == 2
    assert "--" in capsys.readouterr().err
