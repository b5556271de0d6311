"""bench/engine_memory.py on CPU: nvidia-smi's CSV (numbers, [N/A], empty), a process tree's memory, both servers'
start-up log lines, the table rows, the systems and the flags (the measurement itself needs a GPU)."""

from __future__ import annotations

import time

import pytest
from bench_module import load_bench

from rapidserve.runner.kv_budget import GIB, KVBudget

em = load_bench("engine_memory")
G = int(GIB)

OURS_BUDGET = ("2026-12-01 10:51:42,548 INFO rapidserve.runner.model_runner [decode worker 701]: KV budget 40.52 GiB "
               "= 0.8 x 139.80 GiB - this engine's use 17.53 (this process's tensors 15.42, its allocator's unused "
               "cache 0.05, outside torch 2.06: library workspaces, the prefill worker's CUDA context) - activation "
               "peak of a 8192-token step 2.34, and 1 more for the prefill worker's steps; not charged: 0.52 in use "
               "before it started (other processes, this process's CUDA context)")
OURS_BLOCKS = ("2026-12-01 10:51:43,101 INFO rapidserve.runner.model_runner [decode worker 701]: KV cache: 8297 blocks "
               "of 16 tokens, torch.bfloat16")
VLLM_LOG = """\
(APIServer pid=4101) INFO 12-01 10:53:10 [api_server.py:1012] vLLM API server version 0.26.0
(EngineCore_DP0 pid=4123) INFO 12-01 10:55:02 [gpu_worker.py:561] Available KV cache memory: 41.59 GiB
(EngineCore_DP0 pid=4123) INFO 12-01 10:55:03 [kv_cache_utils.py:2177] GPU KV cache size: 302,848 tokens
(EngineCore_DP0 pid=4123) INFO 12-01 10:55:03 [kv_cache_utils.py:2181] Maximum concurrency for 8,192 tokens per \
request: 36.97x
(EngineCore_DP0 pid=4123) INFO 12-01 10:55:40 [gpu_worker.py:794] CUDA graph pool memory: 0.62 GiB (actual), 0.66 GiB \
(estimated), difference: 0.04 GiB (6.5%).
"""


def test_gpu_csv() -> None:
    assert em.parse_gpu_csv("143771, 96210\n") == (143771, 96210)
    assert em.parse_gpu_csv("143771, 512\n81559, 70000\n") == (143771, 512)  # the first GPU
    assert em.parse_gpu_csv("") is None and em.parse_gpu_csv(None) is None
    assert em.parse_gpu_csv("[N/A], [N/A]\n") is None
    assert em.parse_gpu_csv("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.") is None


def test_apps_csv() -> None:
    text = "701, /usr/bin/python3, 61320\n702, python3, 3110\n9001, nvidia-cuda-mps-server, 30\n"
    assert em.parse_apps_csv(text) == [em.App(701, "/usr/bin/python3", 61320), em.App(702, "python3", 3110),
                                       em.App(9001, "nvidia-cuda-mps-server", 30)]
    assert em.parse_apps_csv("701, python3, [N/A]\n") == [em.App(701, "python3", None)]
    assert em.parse_apps_csv("") == [] and em.parse_apps_csv(None) == []
    assert em.parse_apps_csv("No running processes found\n") == []
    assert em.parse_apps_csv("55, a, b, 7\n") == [em.App(55, "a,b", 7)]  # a comma in the name


def test_tree_pids() -> None:
    children = {100: [101, 102], 101: [103], 103: [], 200: [201], 102: [100]}  # 102 -> 100: a loop is walked once
    assert em.tree_pids(100, children) == {100, 101, 102, 103}
    assert em.tree_pids(101, children) == {101, 103}
    assert em.tree_pids(999, children) == {999}
    assert em.tree_pids(None, children) == set()


def test_held_per_process_and_fallbacks() -> None:
    pids = em.tree_pids(100, {100: [101, 102], 101: [], 102: []})
    apps = [em.App(101, "python3", 60000), em.App(102, "python3", 3000), em.App(500, "python3", 9000),
            em.App(9001, em.MPS_SERVER, 30), em.App(8000, em.MPS_SERVER, 40)]
    # the tree's two workers and the MPS server that came up with it; not another process nor an older MPS server
    assert em.held_mib(apps, pids, {500, 8000}, 80000, 10000) == (63030, em.PER_PROCESS)
    held, method = em.held_mib([], pids, set(), 80000, 10000)
    assert held == 70000 and method.startswith(em.DEVICE_DELTA) and "empty" in method
    held, method = em.held_mib([em.App(101, "python3", None), em.App(102, "python3", 3000)], pids, set(), 80000, 9000)
    assert held == 71000 and method.startswith(em.DEVICE_DELTA) and "[N/A]" in method
    held, method = em.held_mib([em.App(4242, "python3", 50000)], pids, set(), 80000, 9000)  # another pid namespace
    assert held == 71000 and "no pid" in method
    assert em.held_mib([], pids, set(), 5000, 9000)[0] == 0  # never below zero


def test_server_logs() -> None:
    prefill = OURS_BLOCKS.replace("decode worker 701", "prefill worker 702")
    ours = em.parse_server_log("\n".join(["starting", prefill, OURS_BUDGET, OURS_BLOCKS, "Uvicorn running"]))
    assert ours["kv_gib"] == 40.52 and ours["kv_tokens"] == 8297 * 16
    assert ours["kv_line"].startswith("KV budget 40.52 GiB = 0.8 x 139.80 GiB - this engine's use 17.53")
    # the line as the runner writes it (hybrid worker: one process)
    budget = KVBudget(140 * G, 0.8, 20 * G, 16 * G, 17 * G, 8192, 2 * G, G // 2, baseline_used=G // 2)
    line = f"2026-12-01 11:00:00,001 INFO rapidserve.runner.model_runner [hybrid worker 9]: {budget.describe()}"
    hybrid = em.parse_server_log(line + "\n" + OURS_BLOCKS.replace("decode worker 701", "hybrid worker 9"))
    assert hybrid["kv_gib"] == round(budget.kv_bytes / GIB, 2) and hybrid["kv_tokens"] == 132752
    vllm = em.parse_server_log(VLLM_LOG)
    assert vllm == {"kv_gib": 41.59, "kv_tokens": 302848, "graphs_gib": 0.62}
    assert em.parse_server_log(VLLM_LOG.splitlines()[1]) == {"kv_gib": 41.59, "kv_tokens": None}
    assert em.parse_server_log("INFO started\n") == {}


def test_rows_and_table() -> None:
    total = 143771  # MiB: an H200's 140.4 GiB
    idle = [em.Sample(110000, 110100, em.PER_PROCESS), em.Sample(110200, 110300, em.PER_PROCESS)]
    load = [em.Sample(118000, 118100, em.PER_PROCESS), em.Sample(116000, 116100, em.PER_PROCESS)]
    kv = em.parse_server_log(OURS_BUDGET + "\n" + OURS_BLOCKS)
    r = em.table_row("rapid", 0.8, total, idle, load, kv, startup_s=61.2)
    assert r["share_gib"] == 112.32 and r["idle_gib"] == 107.62 and r["peak_gib"] == 115.23
    assert r["over_gib"] == 2.91 and r["over_pct_total"] == 2.07 and r["delta_peak_gib"] == 115.33
    assert r["kv_gib"] == 40.52 and r["kv_tokens"] == 132752 and r["method"] == em.PER_PROCESS
    assert r["startup_s"] == 61.2
    under = em.table_row("vllm", 0.8, total, [em.Sample(100000, 100000, "device-delta (x)")], [], {"kv_gib": 41.59})
    assert under["peak_gib"] == under["idle_gib"] == 97.66 and under["over_gib"] < 0  # no load: the idle peak
    mixed = em.table_row("m", 0.8, total, [em.Sample(1, 1, "device-delta (x)")], [em.Sample(2, 2, em.PER_PROCESS)], {})
    assert mixed["method"] == f"device-delta (x); {em.PER_PROCESS}"
    gone = em.table_row("hybrid", 0.8, total, [], [], {}, "did not start: not healthy after 420 s")
    assert gone["peak_gib"] is None and gone["over_pct_total"] is None and gone["method"] == "-"
    lines = em.table([r, gone]).splitlines()
    assert lines[0].startswith("| system | share GiB | idle GiB | peak GiB | peak - share GiB | over, % of total |")
    assert lines[2] == ("| rapid | 112.32 | 107.62 | 115.23 | 2.91 | 2.07 | 115.33 | 40.52 | 132,752 | per-process "
                        "| ok |")
    assert lines[3] == "| hybrid | 112.32 | - | - | - | - | - | - | - | - | did not start: not healthy after 420 s |"
    assert lines[5].startswith("- rapid: KV budget 40.52 GiB = 0.8 x 139.80 GiB")


def test_systems() -> None:
    s = em.memory_systems("rapid,hybrid,vllm")
    assert [(x.label, x.kind, x.flags) for x in s] == [("rapid", "rapidserve", "--mode rapid"),
                                                       ("hybrid", "rapidserve", "--mode hybrid"), ("vllm", "vllm", "")]
    s = em.memory_systems("vllm:--max-num-batched-tokens 2048, always-split")
    assert [(x.label, x.kind) for x in s] == [("vllm:--max-num-batched-tokens 2048", "vllm"),
                                              ("always-split", "rapidserve")]
    for bad, says in (("rapid,nope", "unknown nope"), ("rapid,,vllm", "empty item"), ("ext:http://h:1", "ext:URL"),
                      ("rapid,rapid", "twice")):
        with pytest.raises(ValueError, match=says):
            em.memory_systems(bad)


def test_args() -> None:
    a, systems = em.parse_args(["--vllm-model", "/root/peermodel", "--vllm-serve", "none"])
    assert [s.label for s in systems] == ["rapid", "hybrid", "vllm"] and a.vllm_serve_path is None
    assert a.serve_args == "--max-model-len 8192 --gpu-memory-utilization 0.8"
    assert (a.num_requests, a.input_len, a.output_len, a.interval_s) == (32, 4096, 64, 0.2)
    a, _ = em.parse_args(["--systems", "hybrid", "--serve-args", "--kv-cache-dtype fp8", "--max-model-len", "4200"])
    assert a.serve_args == "--max-model-len 4200 --gpu-memory-utilization 0.8 --kv-cache-dtype fp8"


@pytest.mark.parametrize(("argv", "says"), [
    (["--systems", "rapid", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--systems", "rapid", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--systems", "rapid", "--max-model-len", "0"], "--max-model-len"),
    (["--systems", "rapid", "--max-model-len", "4096"], "--max-model-len"),  # 4096 + 64 tokens do not fit
    (["--systems", "rapid", "--num-requests", "0"], "--num-requests"),
    (["--systems", "rapid", "--input-len", "x"], "--input-len"),
    (["--systems", "rapid", "--interval-s", "0"], "--interval-s"),
    (["--systems", "rapid", "--idle-s", "-1"], "--idle-s"),
    (["--systems", "rapid", "--serve-args", "--api-key 'x"], "--serve-args"),
    (["--systems", "rapid,bogus"], "--systems"),
    (["--systems", "vllm"], "--vllm-model"),
    (["--systems", "vllm", "--vllm-model", "/m", "--vllm-serve", "/no/such/serve_vllm.sh"], "--vllm-serve"),
])
def test_bad_flags_named(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        em.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_sampled_runs_beside_the_work() -> None:
    n = iter(range(1000))
    samples, out = em.sampled(lambda: em.Sample(next(n), 0, em.PER_PROCESS), 0.01, lambda: time.sleep(0.1) or "done")
    assert out == "done" and len(samples) >= 3 and [s.held_mib for s in samples] == sorted(s.held_mib for s in samples)
    assert em.sampled(lambda: None, 0.01, lambda: 7) == ([], 7)  # a failed sample is skipped
