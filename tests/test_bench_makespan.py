"""bench/multiturn_makespan.py: a closed multi-turn run's makespan split into the first round and the tail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.multiturn_makespan import breakdown, main


def req(conv: int, turn: int, start: float, ttft: float, e2e: float, itl: list[float]) -> dict[str, object]:
    return {"success": True, "conversation": conv, "turn": turn, "start_s": start, "ttft_s": ttft, "e2e_s": e2e,
            "itl_s": itl}


# two conversations of two turns: c0 starts first; c1's first token comes last (1.5 s) and it ends last (4.0 s)
RUN = [
    req(0, 0, 10.0, 0.5, 1.0, [0.25, 0.25]),
    req(0, 1, 11.0, 0.1, 1.0, [0.45, 0.45]),
    req(1, 0, 10.0, 1.5, 2.0, [0.25, 0.25]),
    req(1, 1, 12.0, 0.3, 2.0, [0.85, 0.85]),
]


def test_breakdown() -> None:
    b = breakdown(RUN)
    assert b["requests"] == 4
    assert b["makespan_s"] == pytest.approx(4.0)
    assert b["first_round_end_s"] == pytest.approx(1.5)
    assert b["last_conversation_first_token_s"] == pytest.approx(1.5)
    assert b["last_conversation_itl_mean_ms"] == pytest.approx(550.0)
    assert b["last_conversation_later_ttft_mean_ms"] == pytest.approx(300.0)


def test_failed_requests_do_not_count() -> None:
    bad = {**RUN[3], "success": False}
    assert breakdown([*RUN[:3], bad])["makespan_s"] == pytest.approx(2.0)


def test_single_turn_runs_are_refused() -> None:
    with pytest.raises(ValueError, match="not a multi-turn run"):
        breakdown([{**RUN[0], "conversation": None}])
    with pytest.raises(ValueError, match="not a multi-turn run"):
        breakdown([{k: v for k, v in RUN[0].items() if k != "turn"}])
    with pytest.raises(ValueError, match="no first turn succeeded"):
        breakdown([RUN[1], RUN[3]])


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"label": "sys", "runs": [{"requests": RUN}]}))
    (tmp_path / "b.json").write_text(json.dumps({"label": "single", "runs": [{"requests": [{**RUN[0],
                                                                                            "conversation": None}]}]}))
    out = tmp_path / "rows.json"
    assert main([str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "| sys | 4.00 | 1.50 | 550.0 | 300 |" in printed.out and "skipping" in printed.err
    assert json.loads(out.read_text())[0]["label"] == "sys"
    assert main([str(tmp_path / "b.json")]) == 2
