"""bench/gpu_suite_parts.py: the GPU suite's parts, contiguous slices of the sorted files balanced by their seconds
(pure), the junit report's seconds per file, and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_module import load_bench

parts = load_bench("gpu_suite_parts")
FILES = [f"tests/test_{c}.py" for c in "abcdef"]


@pytest.mark.parametrize(("w", "n", "want"), [
    ([1, 1, 1, 1, 1, 1], 2, ["abc", "def"]),  # no times: halves by count, as before
    ([1, 1, 1, 1, 1, 1], 3, ["ab", "cd", "ef"]),
    ([10, 1, 1, 1, 1, 1], 2, ["a", "bcdef"]),  # one long file: its own part
    ([1, 1, 1, 1, 1, 10], 2, ["abcde", "f"]),
    ([1, 1, 1, 1, 1, 100], 3, ["abcd", "e", "f"]),  # every part keeps a file
    ([100, 1, 1, 1, 1, 1], 3, ["a", "bc", "def"]),  # the rest shared out after the long one
    ([3, 3, 1, 1, 1, 3], 2, ["ab", "cdef"]),
    ([1, 1, 1, 1, 1, 1], 1, ["abcdef"]),
])
def test_slices(w: list[float], n: int, want: list[str]) -> None:
    got = parts.slices(FILES, w, n)
    assert ["".join(f[len("tests/test_")] for f in s) for s in got] == want
    assert [f for s in got for f in s] == FILES  # every file once, in order


def test_slices_with_fewer_files_than_parts() -> None:
    assert parts.slices(FILES[:2], [1, 1], 3) == [[FILES[0]], [FILES[1]], []]
    with pytest.raises(ValueError, match="n=0"):
        parts.slices(FILES, [1] * 6, 0)


def test_weights_fill_unknown_files_with_the_median() -> None:
    assert parts.weights(FILES[:3], {FILES[0]: 10.0, FILES[1]: 30.0, "tests/other.py": 20.0}) == [10.0, 30.0, 20.0]
    assert parts.weights(FILES[:2], {}) == [1.0, 1.0]
    # a file known to take no time (its tests skip on one GPU) weighs nothing, not the median
    assert parts.weights(FILES[:3], {FILES[0]: 0.0, FILES[1]: 30.0, "tests/other.py": 20.0}) == [0.0, 30.0, 25.0]


def test_file_seconds_from_junit(tmp_path: Path) -> None:
    xml = tmp_path / "run1.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="t1" time="1.5"/>'
                   '<testcase classname="tests.test_a.TestX" name="t2" time="2.25"/>'
                   '<testcase classname="tests.test_b" name="t3" time="4"/><testcase classname="" name="x" time="9"/>'
                   '</testsuite></testsuites>')
    assert parts.file_seconds(xml) == {"tests/test_a.py": 3.75, "tests/test_b.py": 4.0}
    assert parts.slowest_tests(xml, 3) == [["::x", 9.0], ["tests.test_b::t3", 4.0], ["tests.test_a.TestX::t2", 2.25]]


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    times = tmp_path / "times.json"
    times.write_text(json.dumps({FILES[0]: 100.0, FILES[1]: 1.0}))
    assert parts.main(["--part", "1/2", "--times", str(times), *FILES[:3]]) == 0
    assert capsys.readouterr().out.split() == [FILES[0]]
    assert parts.main(["--part", "2/2", "--times", str(times), *FILES[:3]]) == 0
    assert capsys.readouterr().out.split() == FILES[1:3]
    s1, s2 = tmp_path / "p1.json", tmp_path / "p2.json"
    s1.write_text(json.dumps({"file_seconds": {FILES[1]: 2.0}}))
    s2.write_text(json.dumps({"file_seconds": {FILES[0]: 5.0}}))
    assert parts.main(["--merge", str(s1), str(s2)]) == 0
    assert json.loads(capsys.readouterr().out) == {FILES[0]: 5.0, FILES[1]: 2.0}
    times.write_text("[1, 2]")  # not a table: every file weighs 1, said on stderr
    assert parts.main(["--part", "1/2", "--times", str(times), *FILES[:2]]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [FILES[0]] and "not a table" in captured.err
    for bad in ("3/2", "x", "0/1"):
        with pytest.raises(SystemExit):
            parts.main(["--part", bad, *FILES])
