"""bench/client_clock.py: the bench client against a fake engine of fixed steps. Structure only (no timing is
asserted here: that is the script's table, read on the machine that runs a frontier)."""

from __future__ import annotations

import pytest

from bench.client_clock import gaps, main


def test_gaps_reads_each_requests_p95_and_the_largest_gap() -> None:
    run = {"requests": [{"itl_s": [0.04] * 19 + [0.09]}, {"itl_s": [0.04, 0.041, 0.05]}, {"itl_s": []}]}
    n, p95, top = gaps(run)
    assert n == 2 and p95 == pytest.approx(41.0) and top == pytest.approx(90.0)  # the first p95 40, the second 41


def test_the_script_runs_the_client_and_prints_its_table(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--step-ms", "5", "--rates", "40", "--input-len", "8", "--output-len", "4", "--num-prompts", "6",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3].startswith("| rate (req/s) | requests |") and out[-1].startswith("| 40 | 6 | ")
    p95, top = (float(x) for x in out[-1].split("|")[3:5])
    assert 0 < p95 <= top  # the gaps exist and are ordered (their size is the machine's: not checked here)


@pytest.mark.parametrize("bad", [["--step-ms", "0"], ["--output-len", "1"]])
def test_bad_settings_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(bad)
