"""bench/cpu_slots.py: each side-by-side group's CPU cores from `nvidia-smi topo -m` (recorded outputs), and
bench/frontier_parallel.sh's use of it (no pinning without a GPU topology)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile

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


# an 8-GPU host with NICs, written to a terminal (nvidia-smi underlines the header): CPU Affinity the last column
TOPO_ANSI_LAST = (
    "\t\x1b[4mGPU0\tGPU1\tNIC0\tCPU Affinity\x1b[0m\n"
    "GPU0\t X \tNV18\tPIX\t0-23,96-119\n"
    "GPU1\tNV18\t X \tSYS\t24-47,120-143\n"
    "NIC0\tPIX\tSYS\t X \t\n"
)


def test_a_header_underlined_by_the_terminal_is_read() -> None:
    assert slots.parse_topo_affinity(TOPO_ANSI_LAST) == {0: {*range(24), *range(96, 120)},
                                                         1: {*range(24, 48), *range(120, 144)}}


# Linux's numbering on a two-thread-a-core host: CPU i and i + 64 are one physical core's two threads
SMT = {c: {c % 64, c % 64 + 64} for c in range(128)}


@pytest.mark.parametrize(("topo", "spec", "allowed", "want"), [
    # two groups on a node share its physical cores out, each core's two threads in one group
    (TOPO_TWO_NODES, [[0], [1], [2], [3]], ALL, ["0-7,64-71", "8-15,72-79", "32-39,96-103", "40-47,104-111"]),
    (TOPO_TWO_NODES, [[0, 1], [2, 3]], ALL, ["0-15,64-79", "32-47,96-111"]),
    # no topology: equal parts of the allowed cores, by physical core too
    ("", [[0], [1]], {*range(8), *range(64, 72)}, ["0-3,64-67", "4-7,68-71"]),
])
def test_groups_on_one_node_do_not_share_a_physical_core(topo: str, spec: list[list[int]], allowed: set[int],
                                                         want: list[str]) -> None:
    got = slots.slot_cpus(spec, slots.parse_topo_affinity(topo), allowed, SMT)
    assert [slots.format_cpu_list(c) for c in got] == want
    cores = [{min(SMT[c]) for c in part} for part in got]
    assert all(not a & b for i, a in enumerate(cores) for b in cores[i + 1:])


def test_the_siblings_are_read_from_sysfs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for c in (0, 1, 64, 65):
        (tmp_path / f"cpu{c}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(f"{c % 64},{c % 64 + 64}\n")
    assert slots.read_siblings({0, 1, 64, 65, 2}, tmp_path) == {0: {0, 64}, 1: {1, 65}, 64: {0, 64}, 65: {1, 65}}


def test_fewer_cores_than_groups_pins_none() -> None:
    assert slots.slot_cpus([[0], [1]], {}, {5}) == []  # not [{5}, set()]: `taskset -c ''` fails
    assert slots.slot_cpus([[0], [1]], slots.parse_topo_affinity(TOPO_ONE_NODE), {5}) == []
    assert [slots.format_cpu_list(c) for c in slots.slot_cpus([[0], [1]], {}, {5, 6})] == ["5", "6"]


def _cli(*args: str, pin: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "bench/cpu_slots.py", *args]
    return subprocess.run(["taskset", "-c", pin, *argv] if pin else argv, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_the_command_line_prints_nothing_with_fewer_cores_than_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topo = tmp_path / "topo.txt"
    topo.write_text(TOPO_ONE_NODE)
    r = _cli("--slots", "0;1", "--topo-file", str(topo), pin="0")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_the_command_line_reads_the_siblings_and_requires_a_topology(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topo, na, sysfs = tmp_path / "topo.txt", tmp_path / "na.txt", tmp_path / "cpu"
    topo.write_text(TOPO_ONE_NODE)
    na.write_text(TOPO_ONE_NODE.replace("\t0-31\t", "\tN/A\t"))
    for c in os.sched_getaffinity(0):
        (sysfs / f"cpu{c}" / "topology").mkdir(parents=True)
        (sysfs / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(f"{c}\n")
    r = _cli("--slots", "0;1", "--topo-file", str(topo), "--require-topology", "--cpu-sysfs", str(sysfs))
    assert r.returncode == 0 and len(r.stdout.split()) == 2, r.stdout + r.stderr
    r = _cli("--slots", "0;1", "--topo-file", str(na), "--require-topology")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr  # every GPU's cell N/A: no topology
    r = _cli("--slots", "0;1", "--topo-file", str(na))
    assert r.returncode == 0 and len(r.stdout.split()) == 2, r.stdout + r.stderr  # PIN_CPUS=1: equal parts


# bench/frontier_parallel.sh --dry-run with a stand-in nvidia-smi (its `topo -m` prints TOPO; with SLOW=1 the header
# first and the rest after a pause, as a writer of more than a pipe's buffer) and a PYTHON that notes each group's
# CUDA_VISIBLE_DEVICES and the CPUs it may use (a group's run: NAME frontier_<group>); returns the setup log and
# {group: (CUDA_VISIBLE_DEVICES, CPU list)}
NVIDIA_SMI = """#!/usr/bin/env bash
[ "$1 $2" = "topo -m" ] || exit 9
[ -f "$TOPO" ] || { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"; exit 9; }
[ "${SLOW:-0}" = 1 ] || exec cat "$TOPO"
head -1 "$TOPO"
sleep 0.5
tail -n +2 "$TOPO"
"""
PYTHON = """#!/usr/bin/env bash
if [ -n "${GROUP:-}" ] && [ "${NAME:-}" = "frontier_$GROUP" ]; then
    cpus=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/$$/status)
    echo "$GROUP|${CUDA_VISIBLE_DEVICES:-}|$cpus" >>"$PIN_LOG"
fi
exec "$REAL_PY" "$@"
"""


def _dry_run(tmp_path, topo: str | None, **env: str) -> tuple[str, dict[str, tuple[str, str]]]:  # type: ignore[no-untyped-def]
    bin_dir, recipe = tmp_path / "bin", tmp_path / "recipe"
    bin_dir.mkdir()
    recipe.mkdir()
    for name, text in (("nvidia-smi", NVIDIA_SMI), ("python", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for name in ("serve_vllm.sh", "install.sh", "make_model.py"):
        (recipe / name).write_text("exit 1\n")
    if topo is not None:
        (tmp_path / "topo.txt").write_text(topo)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
            "REAL_PY": sys.executable, "PIN_LOG": str(tmp_path / "pins.txt"), "TOPO": str(tmp_path / "topo.txt"),
            "PEER_VLLM_DIR": str(recipe), "PEER_SITE": str(tmp_path / "site"), "PEER_STASH": str(tmp_path / "stash"),
            "PEER_MODEL": str(tmp_path / "pm"), "FA3_FROM_VLLM": "0", "OUT": str(tmp_path / "out"), "NGPU": "2",
            "GROUP": "ours,vllm-a", **env}
    for k in ("PIN_CPUS", "TOPO_FILE", "NAME", "CUDA_VISIBLE_DEVICES"):
        if k not in env:
            full.pop(k, None)
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--dry-run"], cwd=ROOT, env=full, capture_output=True,
                       text=True, timeout=120)
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as t:
        setup = t.extractfile("./setup.log").read().decode()  # type: ignore[union-attr]
    log = tmp_path / "pins.txt"
    seen = {tuple(ln.split("|")) for ln in log.read_text().splitlines()} if log.exists() else set()
    return setup + r.stderr, {g: (gpus, cpus) for g, gpus, cpus in seen}


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs")
def test_frontier_parallel_pins_each_group_where_nvidia_smi_gives_the_topology(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # nvidia-smi writes its header, then the rest after 0.5 s: a `grep -q` that stops reading at the header would
    # kill it (SIGPIPE), and under pipefail take the topology for absent
    setup, seen = _dry_run(tmp_path, TOPO_TWO_NODES, SLOW="1")
    pinned = dict(re.findall(r"frontier_parallel \[\d+ s\]: (\S+) on GPUs \d+, CPUs ([0-9,-]+)", setup))
    assert set(pinned) == {"ours", "vllm-a"}, setup
    assert not slots.parse_cpu_list(pinned["ours"]) & slots.parse_cpu_list(pinned["vllm-a"])
    # the group's own processes: under its CPU list, with its GPUs
    assert seen == {"ours": ("0", pinned["ours"]), "vllm-a": ("1", pinned["vllm-a"])}


@pytest.mark.parametrize(("topo", "env"), [
    (None, {}),  # nvidia-smi fails
    (TOPO_ONE_NODE.replace("\t0-31\t", "\tN/A\t"), {}),  # a topology, but no GPU's CPU affinity
    (TOPO_TWO_NODES, {"PIN_CPUS": "0"}),
])
def test_frontier_parallel_pins_nothing_without_a_gpu_topology(tmp_path, topo: str | None,  # type: ignore[no-untyped-def]
                                                               env: dict[str, str]) -> None:
    setup, seen = _dry_run(tmp_path, topo, **env)
    assert "CPU pinning: off" in setup and "ours on GPUs 0\n" in setup and "vllm-a on GPUs 1\n" in setup, setup
    assert {g: gpus for g, (gpus, _) in seen.items()} == {"ours": "0", "vllm-a": "1"}
    every = slots.format_cpu_list(os.sched_getaffinity(0))
    assert {cpus for _, cpus in seen.values()} == {every}


def test_frontier_parallel_refuses_an_unknown_pin_cpus() -> None:
    env = {**os.environ, "KIND_GPUS": "2", "GROUP": "ours", "PIN_CPUS": "yes"}
    r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "PIN_CPUS=yes: give auto" in r.stderr
