"""bench/memory_peak.py on CPU: replaying a hand-made allocator trace finds the phase's peak and the sites alive
there, leaves out the skipped scratch and what other phases allocated, and tables them."""

from __future__ import annotations

from typing import Any

from bench_module import load_bench

mp = load_bench("memory_peak")
MIB = 1 << 20


def frames(*names: tuple[str, str, int]) -> list[dict[str, Any]]:
    """Innermost first: (file, function, line)."""
    return [{"filename": f, "name": n, "line": line} for f, n, line in names]


RUNNER = ("/x/rapidserve/runner/model_runner.py", "_gpu_kv_budget", 230)
LOAD = ("/x/rapidserve/runner/model_runner.py", "_load", 190)
SCRATCH = ("/x/rapidserve/kv_pool.py", "allocate", 130)
GATE_UP = ("/x/rapidserve/models/decoder_layer.py", "mlp", 88)
QUANT = ("/x/rapidserve/ops/fp8.py", "quantize_input", 190)
TORCH = ("/usr/lib/torch/nn/functional.py", "linear", 100)


def ev(action: str, addr: int, mib: int, *fr: tuple[str, str, int]) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": mib * MIB, "frames": frames(*fr)}


TRACE = [
    ev("alloc", 1, 500, LOAD),  # a weight: another phase
    ev("alloc", 2, 300, SCRATCH, RUNNER),  # the scratch pool: skipped
    ev("alloc", 3, 896, GATE_UP, RUNNER),
    ev("alloc", 4, 64, QUANT, RUNNER),
    ev("alloc", 5, 100, TORCH, GATE_UP, RUNNER),  # a torch frame inside our mlp: the mlp's site
    ev("free_requested", 3, 896, GATE_UP, RUNNER),  # not yet freed
    ev("free_completed", 4, 64, QUANT, RUNNER),
    ev("alloc", 6, 32, QUANT, RUNNER),  # below the peak (896 + 100 + 32 < 896 + 64 + 100)
    ev("free_completed", 3, 896, GATE_UP, RUNNER),
    ev("free_completed", 5, 100, TORCH, GATE_UP, RUNNER),
    ev("free_completed", 1, 500, LOAD),
    ev("segment_alloc", 7, 2048, GATE_UP, RUNNER),  # segments are not blocks
]


def test_the_peak_and_its_sites() -> None:
    peak, sites = mp.peak_sites(TRACE, "_gpu_kv_budget", skip=("kv_pool.py:allocate",))
    assert peak == (896 + 64 + 100) * MIB
    assert [(s.where, s.bytes // MIB, s.blocks) for s in sites] == [
        ("rapidserve/models/decoder_layer.py:88 mlp", 996, 2),
        ("rapidserve/ops/fp8.py:190 quantize_input", 64, 1),
    ]


def test_without_skip_the_scratch_counts_and_a_bare_name_skips_too() -> None:
    peak, sites = mp.peak_sites(TRACE, "_gpu_kv_budget")
    assert peak == (300 + 896 + 64 + 100) * MIB
    assert sites[1].where == "rapidserve/kv_pool.py:130 allocate"
    assert mp.peak_sites(TRACE, "_gpu_kv_budget", skip=("allocate",))[0] == (896 + 64 + 100) * MIB
    # a skip naming another file's `allocate` leaves the scratch in
    assert mp.peak_sites(TRACE, "_gpu_kv_budget", skip=("other.py:allocate",))[0] == (300 + 896 + 64 + 100) * MIB
    assert mp.peak_sites(TRACE, "no_such_phase") == (0, [])
    assert mp.peak_sites(TRACE, "_gpu_kv_budget", top=1)[1][0].bytes == 996 * MIB


def test_site_outside_the_package_and_without_frames() -> None:
    assert mp.site_of(ev("alloc", 1, 1, TORCH)) == "/usr/lib/torch/nn/functional.py:100 linear"
    assert mp.site_of({"action": "alloc", "addr": 1, "size": 1}) == "(no frames)"


def test_table() -> None:
    peak, sites = mp.peak_sites(TRACE, "_gpu_kv_budget", skip=("kv_pool.py:allocate",))
    lines = mp.table(peak, sites).splitlines()
    assert lines[0] == "Live at the step's peak: 1,060 MiB"
    assert lines[4] == "| `rapidserve/models/decoder_layer.py:88 mlp` | 996.0 | 94% | 2 |"
    assert lines[5] == "| `rapidserve/ops/fp8.py:190 quantize_input` | 64.0 | 6% | 1 |"
