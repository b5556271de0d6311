"""The CPU cores each of bench/frontier_parallel.sh's groups runs on, so that groups side by side on one host (our
server and vLLM, each with its client) do not take each other's cores.

Both servers have host-bound loops (vLLM's engine core busy-loops in Python; ours runs a front end and two workers),
and unpinned they and the two clients share every core of the host. On 2 x H200 (2026-11-30) vLLM with
`--max-num-batched-tokens 1024` met the 50-ms bound for 70% of its requests at 9.11 req/s and 100% at 10.3; pinning
takes the other group's host load out of what each server's latency shows.

A group gets the cores local to its GPUs (`nvidia-smi topo -m`'s "CPU Affinity" column, the NUMA node's cores),
within the cores this process may use (`os.sched_getaffinity`); groups whose GPUs share a node share its cores out
in contiguous, equal parts by physical core (the first group the lower cores; a core's hardware threads, sysfs'
thread_siblings_list, stay in one group: Linux numbers a node's second threads apart, 0-47,96-143, and a split of
the numbers would give one group the sibling threads of the other's cores). Where the topology says nothing (no
nvidia-smi, no column, a GPU not listed), a group would be left with fewer than MIN_CORES, or groups' nodes overlap
(a TP group's GPUs on two nodes), every group gets an equal part of the allowed cores instead; with fewer allowed
cores than groups, none is pinned (no list). Pure functions, tested on CPU with recorded topologies; the command
line prints one `taskset -c` list a group, or nothing:

    python bench/cpu_slots.py --slots "0;1" [--topo-file FILE]     # FILE: `nvidia-smi topo -m` output (default: run it)
    python bench/cpu_slots.py --slots "0;1" --require-topology     # nothing unless the topology gives every GPU's cores
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

MIN_CORES = 4  # fewer a group: the topology's split is not used (a server and its client need several)
COLUMN = "CPU Affinity"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # nvidia-smi underlines the header row on a terminal: \x1b[4m ... \x1b[0m
CPU_SYSFS = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}; ValueError naming the text where it is not such a list."""
    out: set[int] = set()
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise ValueError(f"CPU list {text!r}: expected ranges like 0-47,96-143")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"CPU list {text!r}: range {part} runs backwards")
        out.update(range(lo, hi + 1))
    return out


def format_cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 3, 8} -> '0-3,8' (taskset -c's form)."""
    s, out, i = sorted(cpus), [], 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(f"{s[i]}" if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def parse_topo_affinity(text: str) -> dict[int, set[int]]:
    """{GPU index: its CPU affinity} from `nvidia-smi topo -m` (tab-separated; the header row names the columns, its
    first cell empty, underlined with terminal escapes where nvidia-smi wrote to a terminal); GPUs whose cell is not a
    CPU list (N/A) are left out; {} where there is no such column."""
    lines = [ln for ln in ANSI.sub("", text).splitlines() if ln.strip()]
    header = next((ln for ln in lines if COLUMN in ln), None)
    if header is None:
        return {}
    names = [c.strip() for c in re.split(r"\t+", header.rstrip())]
    if COLUMN not in names:
        return {}
    col = names.index(COLUMN)
    out: dict[int, set[int]] = {}
    for ln in lines:
        cells = [c.strip() for c in re.split(r"\t+", ln.rstrip())]
        m = re.fullmatch(r"GPU(\d+)", cells[0]) if cells else None
        if m is None or len(cells) <= col:
            continue
        try:
            out[int(m.group(1))] = parse_cpu_list(cells[col])
        except ValueError:
            continue
    return out


def read_siblings(cpus: set[int], root: Path = CPU_SYSFS) -> dict[int, set[int]]:
    """{CPU: the hardware threads of its physical core} from sysfs' cpuN/topology/thread_siblings_list; a CPU whose
    file is missing or unreadable is left out (its own core)."""
    out: dict[int, set[int]] = {}
    for c in cpus:
        try:
            out[c] = parse_cpu_list((root / f"cpu{c}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            continue
    return out


def equal_parts(cpus: set[int], n: int, siblings: Mapping[int, set[int]] | None = None) -> list[set[int]]:
    """`cpus` in n contiguous parts of physical cores (`siblings`: each CPU's hardware threads; a CPU not in it its own
    core), the parts' core counts differing by at most one (the first the lowest cores), a core's threads in one part;
    with fewer cores than parts, by CPU."""
    sib = siblings or {}
    cores: dict[int, list[int]] = {}
    for c in sorted(cpus):
        cores.setdefault(min(sib.get(c, set()) | {c}), []).append(c)
    units = [cores[k] for k in sorted(cores)]
    if len(units) < n:
        units = [[c] for c in sorted(cpus)]
    base, extra = divmod(len(units), n)
    out, at = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append({c for unit in units[at:at + size] for c in unit})
        at += size
    return out


def slot_cpus(slots: Sequence[Sequence[int]], affinity: Mapping[int, set[int]], allowed: set[int],
              siblings: Mapping[int, set[int]] | None = None) -> list[set[int]]:
    """Each slot's cores (module docstring): `slots` the GPU indices of each group, `affinity` the topology's (by GPU
    index), `allowed` the cores this process may use, `siblings` each core's hardware threads (read_siblings); []
    (no pinning) where there are fewer allowed cores than slots."""
    if not slots:
        return []
    fallback = equal_parts(allowed, len(slots), siblings)
    if any(not part for part in fallback):  # a group with no core: `taskset -c ''` fails
        return []
    local = []
    for gpus in slots:
        if not gpus or any(g not in affinity for g in gpus):
            return fallback
        local.append(frozenset(set().union(*(affinity[g] for g in gpus)) & allowed))
    out: list[set[int]] = [set() for _ in slots]
    for cpus in dict.fromkeys(local):  # each distinct core set, shared out among the slots that have it
        members = [i for i, c in enumerate(local) if c == cpus]
        for i, part in zip(members, equal_parts(set(cpus), len(members), siblings), strict=True):
            out[i] = part
    taken = [c for part in out for c in part]
    if any(len(p) < MIN_CORES for p in out) or len(taken) != len(set(taken)):  # too few, or nodes overlapping
        return fallback
    return out


def parse_slots(text: str) -> list[list[int]]:
    """'0,1;2,3' -> [[0, 1], [2, 3]]: the GPUs of each group, groups separated by ';'."""
    try:
        return [[int(g) for g in part.split(",") if g.strip()] for part in text.split(";")]
    except ValueError:
        raise ValueError(f"--slots {text!r}: expected GPU indices, e.g. '0;1' or '0,1;2,3'") from None


def topo_text() -> str:
    """`nvidia-smi topo -m`'s output, '' where it does not run."""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", required=True, help="each group's GPU indices, groups separated by ';' (e.g. '0;1')")
    ap.add_argument("--topo-file", help="`nvidia-smi topo -m` output saved in a file (default: run it)")
    ap.add_argument("--require-topology", action="store_true",
                    help="print nothing unless the topology gives every GPU of the slots its CPU affinity")
    ap.add_argument("--cpu-sysfs", type=Path, default=CPU_SYSFS, help="where cpuN/topology/ lies (tests)")
    args = ap.parse_args(argv)
    try:
        slots = parse_slots(args.slots)
    except ValueError as e:
        ap.error(str(e))
    text = Path(args.topo_file).read_text(encoding="utf-8") if args.topo_file else topo_text()
    affinity = parse_topo_affinity(text)
    if args.require_topology and not all(g in affinity for gpus in slots for g in gpus):
        return 0
    allowed = set(os.sched_getaffinity(0))
    for cpus in slot_cpus(slots, affinity, allowed, read_siblings(allowed, args.cpu_sysfs)):
        print(format_cpu_list(cpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
