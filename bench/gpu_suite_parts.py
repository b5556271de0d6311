"""The slices of the GPU suite's files that `bench/gpu_suite.sh --part K/N` (and `--spread`) runs, balanced by time.

    python bench/gpu_suite_parts.py --part 2/2 tests/test_a.py tests/test_b.py ...   # the files of part 2, a line each
    python bench/gpu_suite_parts.py --merge OUT/part1/gpu_suite.json OUT/part2/gpu_suite.json  # a new times table

Each part is a contiguous run of the sorted file list (so the parts, run one after another, run every file once in
pytest's default order), cut where the files' seconds add up to about a K/N share of the whole. The seconds are
`bench/gpu_suite_times.json` (file -> seconds of its tests on one GPU, from a run's junit report: gpu_suite.sh writes
them into its summary as `file_seconds`; `--merge` joins the parts' summaries into a new table); a file the table
does not hold weighs the median of those it does, and with no table every file weighs 1 (the slices of equal file
counts gpu_suite.sh cut before). Why: on 2 x H200 (2026-11-30) the two halves of equal file counts took 239 s and
354 s side by side, so the suite waited ~60 s on the longer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rapidserve.jsonfile import load_unique  # noqa: E402

TIMES = Path(__file__).resolve().parent / "gpu_suite_times.json"


def weights(files: Sequence[str], seconds: Mapping[str, float]) -> list[float]:
    """Each file's weight: its seconds (0 too: a file whose tests all skip on one GPU, the two-GPU ones), else the
    median of the non-zero ones among `seconds`, else 1."""
    known = [float(s) for s in seconds.values() if s > 0]
    fill = statistics.median(known) if known else 1.0
    return [float(seconds[f]) if f in seconds else fill for f in files]


def slices(files: Sequence[str], w: Sequence[float], n: int) -> list[list[str]]:
    """`files` (in order) cut into `n` contiguous slices of about equal weight: each slice ends where its weight comes
    nearest an equal share of what the earlier slices left, a file whole, each holding at least one file where there
    are enough (the earlier ones first where there are not); pure."""
    if n < 1:
        raise ValueError(f"n={n}: need at least one part")
    total, out, start, run = sum(w), [], 0, 0.0
    for k in range(1, n):
        end, goal = start, run + (total - run) / (n - k + 1)  # an equal share of what is left
        limit = len(files) - (n - k)  # each later slice keeps a file ...
        if limit <= start:
            limit = min(start + 1, len(files))  # ... unless there are too few: the earlier ones get one first
        while end < limit and (end == start or run + w[end] / 2 < goal):  # nearest the goal, a file whole
            run += w[end]
            end += 1
        out.append(list(files[start:end]))
        start = end
    out.append(list(files[start:]))
    return out


def file_seconds(junit: str | Path) -> dict[str, float]:
    """Seconds per test file in a pytest junit report (`classname` tests.test_x[.Class] -> tests/test_x.py)."""
    import xml.etree.ElementTree as ET

    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        mod = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
        if mod is None:
            continue
        path = "/".join(parts[:mod + 1]) + ".py"
        out[path] = round(out.get(path, 0.0) + float(case.get("time") or 0.0), 2)
    return out


def slowest_tests(junit: str | Path, n: int = 20) -> list[list[object]]:
    """The `n` slowest tests of a pytest junit report, slowest first, as [classname::name, seconds]: where a part's
    time goes (on 2026-12-02 the MoE files took 393 of part 2's 510 s on one H200, most of it compiling Triton
    kernels, and no file-level figure says which tests)."""
    import xml.etree.ElementTree as ET

    cases = [(f"{c.get('classname', '')}::{c.get('name', '')}", round(float(c.get("time") or 0.0), 2))
             for c in ET.parse(junit).getroot().iter("testcase")]
    return [[name, t] for name, t in sorted(cases, key=lambda x: -x[1])[:n]]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", help="K/N: print the files of part K of N")
    ap.add_argument("--times", default=str(TIMES), help="file -> seconds (default: bench/gpu_suite_times.json)")
    ap.add_argument("--merge", nargs="+", metavar="SUMMARY", help="gpu_suite.json files: print their file_seconds "
                                                                    "joined, as a new times table")
    ap.add_argument("--junit", help="print a junit report's seconds per file (gpu_suite.sh's summary)")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args(argv)
    if a.junit:
        print(json.dumps(file_seconds(a.junit), sort_keys=True))
        return 0
    if a.merge:
        joined: dict[str, float] = {}
        for path in a.merge:
            joined.update(load_unique(path).get("file_seconds", {}))
        print(json.dumps(dict(sorted(joined.items())), indent=1))
        return 0
    try:
        k, n = (int(x) for x in (a.part or "").split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        ap.error(f"--part must be K/N with 1 <= K <= N (got {a.part!r})")
    seconds: dict[str, float] = {}
    if Path(a.times).is_file():
        try:
            seconds = {str(f): float(s) for f, s in load_unique(a.times).items()}
        except (ValueError, AttributeError) as e:
            print(f"gpu_suite_parts: {a.times}: not a table of file -> seconds ({e}); weighing every file 1",
                  file=sys.stderr)
    print("\n".join(slices(a.files, weights(a.files, seconds), n)[k - 1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
