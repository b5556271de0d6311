"""bench/cpu_slots.py: each side-by-side group's CPU cores from `nvidia-smi topo -m` (recorded outputs), and
bench/frontier_parallel.sh's use of it (no pinning without a GPU topology)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_bench_compare import _load
from tests.test_server import ROOT

slots = _load("cpu_slots")

# two GPUs on one NUMA node (an x2 lease), the way nvidia-smi prints it: tab-separated, the header's first cell empty
TOPO_ONE_NODE = (
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tSYS\t0-31\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\t0-31\t0\t\tN/A\n"
    "NIC0\tSYS\tSYS\t X \t\t\t\n"
    "\nLegend:\n\n  X    = Self\n"
)
# four GPUs on two nodes, each node's cores in two ranges (hyperthreads)
TOPO_TWO_NODES = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tNV18\tNV18\t0-15,64-79\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tNV18\tNV18\t0-15,64-79\t0\t\tN/A\n"
    "GPU2\tNV18\tNV18\t X \tNV18\t32-47,96-111\t1\t\tN/A\n"
    "GPU3\tNV18\tNV18\tNV18\t X \t32-47,96-111\t1\t\tN/A\n"
)


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3", {0, 1, 2, 3}),
    ("0-1,8,10-11", {0, 1, 8, 10, 11}),
    ("5", {5}),
])
def test_parse_and_format_cpu_list(text: str, cpus: set[int]) -> None:
    assert slots.parse_cpu_list(text) == cpus
    assert slots.parse_cpu_list(slots.format_cpu_list(cpus)) == cpus
    assert slots.format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


@pytest.mark.parametrize("bad", ["", "a-b", "3-1", "0-3;4"])
def test_a_bad_cpu_list_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        slots.parse_cpu_list(bad)


def test_parse_topo_affinity() -> None:
    assert slots.parse_topo_affinity(TOPO_ONE_NODE) == {0: set(range(32)), 1: set(range(32))}
    two = slots.parse_topo_affinity(TOPO_TWO_NODES)
    assert two[0] == two[1] == {*range(16), *range(64, 80)} and two[3] == {*range(32, 48), *range(96, 112)}
    assert slots.parse_topo_affinity("") == {} and slots.parse_topo_affinity("GPU0\tX\n") == {}
    na = TOPO_ONE_NODE.replace("GPU1\tNV18\t X \tSYS\t0-31", "GPU1\tNV18\t X \tSYS\tN/A")
    assert set(slots.parse_topo_affinity(na)) == {0}  # a cell that is no CPU list: that GPU left out


ALL = set(range(128))


@pytest.mark.parametrize(("topo", "spec", "allowed", "want"), [
    # x2, one node: the node's 32 cores in two halves
    (TOPO_ONE_NODE, [[0], [1]], ALL, ["0-15", "16-31"]),
    # x4 at TP 1 on two nodes: each node's cores shared by its two GPUs' groups
    (TOPO_TWO_NODES, [[0], [1], [2], [3]], ALL, ["0-15", "64-79", "32-47", "96-111"]),
    # x4 at TP 2: a group a node
    (TOPO_TWO_NODES, [[0, 1], [2, 3]], ALL, ["0-15,64-79", "32-47,96-111"]),
    # the node's cores outside what this process may use are not given
    (TOPO_ONE_NODE, [[0], [1]], set(range(8, 24)), ["8-15", "16-23"]),
    # a GPU the topology does not list: equal parts of the allowed cores
    (TOPO_ONE_NODE, [[0], [2]], set(range(16)), ["0-7", "8-15"]),
    # too few cores a group on the node (< MIN_CORES): equal parts of everything allowed
    (TOPO_ONE_NODE, [[0], [1]], {0, 1, 2, 3, 40, 41, 42, 43}, ["0-3", "40-43"]),
])
def test_slot_cpus(topo: str, spec: list[list[int]], allowed: set[int], want: list[str]) -> None:
    got = slots.slot_cpus(spec, slots.parse_topo_affinity(topo), allowed)
    assert [slots.format_cpu_list(c) for c in got] == want
    flat = [c for part in got for c in part]
    assert len(flat) == len(set(flat)) and set(flat) <= allowed  # disjoint, within what is allowed


def test_parse_slots_names_the_flag() -> None:
    assert slots.parse_slots("0,1;2,3") == [[0, 1], [2, 3]] and slots.parse_slots("0;1") == [[0], [1]]
    with pytest.raises(ValueError, match="--slots"):
        slots.parse_slots("0;x")


def test_the_command_line_prints_one_list_a_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topo = tmp_path / "topo.txt"
    topo.write_text(TOPO_ONE_NODE)
    r = subprocess.run([sys.executable, "bench/cpu_slots.py", "--slots", "0;1", "--topo-file", str(topo)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert len(lines) == 2 and not set(slots.parse_cpu_list(lines[0])) & slots.parse_cpu_list(lines[1])
    bad = subprocess.run([sys.executable, "bench/cpu_slots.py", "--slots", "0;x"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--slots" in bad.stderr
