"""What a served engine really holds on the GPU against its `--gpu-memory-utilization` share, beside vLLM 0.26.

    python bench/engine_memory.py [--systems rapid,hybrid,vllm] [--model preset:qwen3-8b] --vllm-model DIR
        [--max-model-len 8192] [--gpu-memory-utilization 0.8] [--num-requests 32] [--input-len 4096]
        [--output-len 64] [--interval-s 0.2] [--out DIR]

The share is per instance (vLLM's meaning; runner/kv_budget.py): an engine, all its processes, should hold about
U x total. The KV budget charges the weights, the step peaks and what was in use when the pool was sized, not yet the
CUDA graphs' pools (decode; piecewise prefill in both workers) nor CUDA contexts made later: this measures the sum.
Per system (`rapid`, `hybrid`: ours in that --mode; `vllm`, `vllm:FLAGS`: vLLM on --vllm-model; compare_systems.SYSTEMS'
names), started and stopped by compare_servers.make_server at the same --max-model-len and --gpu-memory-utilization:
GPU memory idle after start-up (the most of --idle-s of samples), and at its peak under a burst of --num-requests
prompts of --input-len random token ids at once (--output-len tokens each; rapidserve.benchmark.run_benchmark), sampled
every --interval-s. A sample: `nvidia-smi --query-compute-apps` summed over the server's process tree (its pid and
descendants, /proc/<pid>/task/*/children) and any MPS server that came up with it (`per-process`); where that list is
empty, [N/A] or names none of the tree's pids (a container's pid namespace), the device's used memory less what was in
use before the server started (`device-delta (why)`; `device delta peak` is that figure at the peak in every case).
The KV pool, from each server's log: ours the pool owner's `KV budget X GiB = ...` and `KV cache: N blocks of B
tokens`, vLLM's `Available KV cache memory: X GiB` and `GPU KV cache size: N tokens` (and `CUDA graph pool memory`).
Writes <out>/engine_memory.json and .md (after every system), the servers' logs in <out>/engine_memory_logs/; prints
the table last. Needs a GPU (the CPU tests cover the parsing, the process-tree sum, the rows and the flags).

On the GPU machine (one H200, preset:qwen3-8b; ~1.5 min vLLM's install, ~1 min each of ours, ~3 min vLLM): after the
N back-to-back stash calls of bench/vs_vllm.sh's header, steps 0-1 (here `bash bench/vs_vllm.sh --split` says N; then
run(command="bash bench/vs_vllm.sh --stash", carry=[".peer/cK", ".peer/peer_vllm"], timeout_s=120), K = 0 .. N-1),
ONE call: `vs_vllm.sh --prepare` installs vLLM into /root/peersite, links its FlashAttention-3 build into /root/fa3site
(ours serves with FA3, as beside vLLM in vs_vllm.sh), the carried wheels into /tmp/site, writes /root/peermodel:
    run(command="bash bench/vs_vllm.sh --prepare && PYTHONPATH=/tmp/site:/root/fa3site timeout -k 15 "
                "$((575 - SECONDS)) python3 bench/engine_memory.py --vllm-model /root/peermodel "
                "--vllm-serve /root/peerstash/peer_vllm/serve_vllm.sh --out $OUT", carry=[".whl"], timeout_s=600)
Another preset: PRESET=NAME before --prepare, --model preset:NAME --vllm-model /root/peermodel-NAME.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_flags import flags_arg  # noqa: E402
from compare_search import RUN_ERRORS  # noqa: E402
from compare_servers import ScriptVllm, Server, _append_log, free_port, make_server  # noqa: E402
from compare_systems import EXT, RAPIDSERVE, VLLM, System, find_vllm_serve, parse_systems  # noqa: E402
from table_out import write_table_files  # noqa: E402

from rapidserve.benchmark import BenchConfig, WorkloadSpec, run_benchmark  # noqa: E402
from rapidserve.benchmark.cli import safe_name  # noqa: E402
from rapidserve.benchmark.flags import nonneg_float, nonneg_int, positive_float, positive_int  # noqa: E402

OURS: dict[str, str] = {"rapid": "--mode rapid", "hybrid": "--mode hybrid"}  # --systems' own short names
PER_PROCESS, DEVICE_DELTA = "per-process", "device-delta"
MPS_SERVER = "nvidia-cuda-mps-server"


class App(NamedTuple):  # one line of `nvidia-smi --query-compute-apps=pid,process_name,used_memory`
    pid: int
    name: str
    mib: int | None  # None: [N/A]


class Sample(NamedTuple):
    held_mib: int  # what the engine holds (per its method)
    delta_mib: int  # the device's used memory less what was used before the server started
    method: str


def _mib(text: str) -> int | None:
    t = text.strip()
    return int(float(t)) if re.fullmatch(r"\d+(\.\d+)?", t) else None


def parse_gpu_csv(text: str | None) -> tuple[int, int] | None:
    """`nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits` -> (total, used) MiB of the
    first GPU listed; None where there is no line of two numbers."""
    rows = [[_mib(c) for c in line.split(",")] for line in (text or "").splitlines()]
    return next(((int(c[0] or 0), int(c[1] or 0)) for c in rows if len(c) == 2 and None not in c), None)


def parse_apps_csv(text: str | None) -> list[App]:
    """`nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits` (empty when no
    process is listed; `[N/A]` where the driver does not say) -> one App a line that starts with a pid."""
    rows = [[c.strip() for c in line.split(",")] for line in (text or "").splitlines()]
    return [App(int(c[0]), ",".join(c[1:-1]), _mib(c[-1])) for c in rows if len(c) >= 2 and c[0].isdigit()]


def tree_pids(root: int | None, children: Mapping[int, Iterable[int]]) -> set[int]:
    """`root` and every descendant of it in `children` (pid -> its children's pids)."""
    seen: set[int] = set()
    todo = [] if root is None else [root]
    while todo:
        if (pid := todo.pop()) not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return seen


def held_mib(apps: Sequence[App], pids: set[int], before: set[int], device_used: int,
             baseline_used: int) -> tuple[int, str]:
    """MiB the engine holds and how it was found: the per-process figures of its processes (`pids`) and of MPS servers
    not running before it started (`before`: the pids listed then); else the device's used memory less the baseline."""
    ours = [x for x in apps if x.pid in pids]
    mine = ours + [x for x in apps if MPS_SERVER in x.name and x.pid not in before and x.pid not in pids]
    if ours and all(x.mib is not None for x in mine):
        return sum(x.mib or 0 for x in mine), PER_PROCESS
    why = ("the per-process query is empty" if not apps else "[N/A] per process" if ours
           else "no pid of the server's in the per-process query")
    return max(0, device_used - baseline_used), f"{DEVICE_DELTA} ({why})"


# ours: the pool owner's lines (a prefill worker attaches that pool: its `KV cache` line, if any, says the same)
_OURS_BUDGET = re.compile(r"(?P<line>KV budget (?P<gib>[\d.]+) GiB = .*)")
_OURS_BLOCKS = re.compile(r"KV cache: (?P<blocks>\d+) blocks of (?P<size>\d+) tokens")
_VLLM_KV = re.compile(r"Available KV cache memory: (?P<gib>[\d.]+) GiB")
_VLLM_TOKENS = re.compile(r"GPU KV cache size: (?P<tokens>[\d,]+) tokens")
_VLLM_GRAPHS = re.compile(r"CUDA graph pool memory: (?P<gib>[\d.]+) GiB \(actual\)")


def parse_server_log(text: str) -> dict[str, Any]:
    """A server's KV pool from its start-up log: kv_gib (ours: the budget; vLLM: its available KV cache memory),
    kv_tokens, and where given kv_line (ours: the budget's terms) and graphs_gib (vLLM's CUDA graph pool). Empty
    where neither server's lines are found."""
    budget, blocks = _OURS_BUDGET.search(text), _OURS_BLOCKS.search(text)
    if budget is not None or blocks is not None:
        return {"kv_gib": None if budget is None else float(budget["gib"]),
                "kv_tokens": None if blocks is None else int(blocks["blocks"]) * int(blocks["size"]),
                **({"kv_line": budget["line"].strip()} if budget is not None else {})}
    kv, tokens, graphs = _VLLM_KV.search(text), _VLLM_TOKENS.search(text), _VLLM_GRAPHS.search(text)
    if kv is None and tokens is None:
        return {}
    return {"kv_gib": None if kv is None else float(kv["gib"]),
            "kv_tokens": None if tokens is None else int(tokens["tokens"].replace(",", "")),
            **({"graphs_gib": float(graphs["gib"])} if graphs is not None else {})}


def _gib(mib: float | None) -> float | None:
    return None if mib is None else round(mib / 1024, 2)


def table_row(label: str, utilization: float, total_mib: int, idle: Sequence[Sample], load: Sequence[Sample],
              kv: Mapping[str, Any], status: str = "ok", **extra: Any) -> dict[str, Any]:
    """One system's row (GiB): its share (U x total), the most it held idle and at all (its peak), the peak over the
    share (and as % of the device), the device delta at the peak, the method(s), `kv` (parse_server_log), `extra`."""
    rest = max(idle, key=lambda x: x.held_mib, default=None)
    peak = max([*idle, *load], key=lambda x: x.held_mib, default=None)
    share = utilization * total_mib
    over = None if peak is None else peak.held_mib - share
    methods = list(dict.fromkeys(s.method for s in (rest, peak) if s is not None))
    return {"system": label, "status": status, "share_gib": _gib(share),
            "idle_gib": None if rest is None else _gib(rest.held_mib),
            "peak_gib": None if peak is None else _gib(peak.held_mib), "over_gib": _gib(over),
            "over_pct_total": None if over is None else round(100 * over / total_mib, 2),
            "delta_peak_gib": None if peak is None else _gib(peak.delta_mib), "kv_gib": None,
            "kv_tokens": None, **kv, "method": "; ".join(methods) or "-", **extra}


COLUMNS: dict[str, str] = {"system": "system", "share_gib": "share GiB", "idle_gib": "idle GiB", "peak_gib": "peak GiB",
                           "over_gib": "peak - share GiB", "over_pct_total": "over, % of total",
                           "delta_peak_gib": "device delta peak GiB", "kv_gib": "KV pool GiB",
                           "kv_tokens": "KV tokens", "method": "method", "status": "status"}


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: a row per system (`-` where not measured), then each of ours' KV budget line."""
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)

    out = ["| " + " | ".join(COLUMNS.values()) + " |", "|---" * len(COLUMNS) + "|"]
    out += ["| " + " | ".join(cell(r.get(k)) for k in COLUMNS) + " |" for r in rows]
    notes = [f"- {r['system']}: {r['kv_line']}" for r in rows if r.get("kv_line")]
    return "\n".join(out + ([""] + notes if notes else []))


def memory_systems(text: str) -> list[System]:
    """--systems: `rapid` and `hybrid` (ours in that mode), vllm / vllm:FLAGS, any name of compare_systems' SYSTEMS;
    ValueError for an unknown or repeated name, and for an external server (ext:URL: its processes are not here)."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise ValueError(f"--systems {text!r} has an empty item: give comma-separated system names")
    systems = [s for t in items for s in ([System(t, RAPIDSERVE, OURS[t])] if t in OURS else parse_systems(t, []))]
    if any(s.kind == EXT for s in systems):
        raise ValueError("--systems: an ext:URL server's processes are not this machine's to sample; give rapid, "
                         "hybrid, vllm or a system name")
    if len({s.label for s in systems}) < len(systems):
        raise ValueError(f"--systems {text!r} names a system twice")
    return systems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--systems", default="rapid,hybrid,vllm", help="comma-separated, in this order: rapid, hybrid, "
                   "vllm, vllm:FLAGS, compare_systems.SYSTEMS' names")
    p.add_argument("--model", default="preset:qwen3-8b", help="our servers' --model")
    p.add_argument("--serve-args", type=flags_arg, default="", help="more flags for ours; vLLM gets those it shares")
    p.add_argument("--max-model-len", type=positive_int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=positive_float, default=0.8, help="every server's share, (0, 1]")
    p.add_argument("--num-requests", type=positive_int, default=32, help="the burst's requests, sent at once")
    p.add_argument("--input-len", type=positive_int, default=4096, help="each request's random prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="each request's max_tokens")
    p.add_argument("--interval-s", type=positive_float, default=0.2, help="between samples")
    p.add_argument("--idle-s", type=nonneg_float, default=3.0, help="idle samples for this long after start-up")
    p.add_argument("--gpu", type=nonneg_int, default=0, help="the GPU nvidia-smi reads (-i)")
    p.add_argument("--startup-timeout-s", type=positive_float, default=420.0)
    p.add_argument("--vllm-model", default=None, metavar="DIR", help="vLLM's model folder of the preset's shape")
    p.add_argument("--vllm-serve", default=None, metavar="PATH", help="serve_vllm.sh, or none (compare.py's flag)")
    p.add_argument("--vllm-run-dir", default="/root", help="where serve_vllm.sh writes vllm_PORT.pid and .log")
    p.add_argument("--vllm-site", default="/root/peersite", help="without serve_vllm.sh: vLLM's pip --target folder")
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_memory"))
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[System]]:
    """The flags and the systems; exits 2 naming the flag that is wrong. Sets a.vllm_serve_path (make_server's)."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.gpu_memory_utilization > 1:
        p.error(f"--gpu-memory-utilization must be in (0, 1]; got {a.gpu_memory_utilization}")
    if a.input_len + a.output_len > a.max_model_len:
        p.error(f"--input-len {a.input_len} + --output-len {a.output_len} exceed --max-model-len {a.max_model_len}")
    try:
        systems = memory_systems(a.systems)
    except ValueError as e:
        p.error(str(e))
    a.vllm_serve_path = find_vllm_serve(a.vllm_serve)
    if any(s.kind == VLLM for s in systems):
        if not a.vllm_model:
            p.error("--systems has vllm: give --vllm-model DIR (bench/vs_vllm.sh --prepare writes /root/peermodel)")
        if a.vllm_serve_path and not os.path.isfile(a.vllm_serve_path):
            p.error(f"--vllm-serve {a.vllm_serve_path}: no such file")
    a.serve_args = (f"--max-model-len {a.max_model_len} --gpu-memory-utilization {a.gpu_memory_utilization} "
                    + a.serve_args).strip()
    return a, systems


def smi(gpu: int, query: str) -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "-i", str(gpu), query, "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def apps_now(gpu: int) -> list[App]:
    return parse_apps_csv(smi(gpu, "--query-compute-apps=pid,process_name,used_memory"))


def gpu_now(gpu: int) -> tuple[int, int] | None:
    return parse_gpu_csv(smi(gpu, "--query-gpu=memory.total,memory.used"))


def proc_children(root: int | None) -> dict[int, list[int]]:
    """pid -> children for `root` and its descendants, from /proc/<pid>/task/*/children."""
    out: dict[int, list[int]] = {}
    todo = [] if root is None else [root]
    while todo:
        pid = todo.pop()
        kids: list[int] = []
        for path in glob.glob(f"/proc/{pid}/task/*/children"):
            with contextlib.suppress(OSError), open(path) as f:
                kids += [int(x) for x in f.read().split()]
        out[pid] = kids
        todo += [k for k in kids if k not in out]
    return out


def sample(gpu: int, root: int | None, before: set[int], baseline_used: int) -> Sample | None:
    if (dev := gpu_now(gpu)) is None:
        return None
    mib, method = held_mib(apps_now(gpu), tree_pids(root, proc_children(root)), before, dev[1], baseline_used)
    return Sample(mib, max(0, dev[1] - baseline_used), method)


def sampled(take: Callable[[], Sample | None], interval_s: float, work: Callable[[], Any]) -> tuple[list[Sample], Any]:
    """`work()`'s result and the samples `take` made every `interval_s` while it ran."""
    samples: list[Sample] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            if (s := take()) is not None:
                samples.append(s)
            done.wait(max(0.0, interval_s - (time.monotonic() - t0)))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        return samples, work()
    finally:
        done.set()
        thread.join()


def root_pid(server: Server) -> int | None:
    """The server's own process: serve_vllm.sh's vLLM from its pid file, else the child this script started."""
    proc = getattr(server, "proc", None)  # a ChildServer's
    return server.server_pid() if isinstance(server, ScriptVllm) else None if proc is None else int(proc.pid)


def wait_released(gpu: int, floor_used: int, timeout_s: float = 60.0, slack_mib: int = 1024) -> None:
    """Wait until the device's used memory is back within `slack_mib` of `floor_used` (the last server's freed)."""
    end = time.monotonic() + timeout_s
    while (dev := gpu_now(gpu)) is not None and dev[1] > floor_used + slack_mib and time.monotonic() < end:
        time.sleep(1.0)


def burst(a: argparse.Namespace, url: str, label: str) -> dict[str, Any]:
    """The load: --num-requests prompts of --input-len random token ids at once; the completed and failed counts."""
    cfg = BenchConfig(base_url=url, label=label, workload=WorkloadSpec("fixed", a.input_len, a.output_len),
                      rates=(math.inf,), num_prompts=a.num_requests, quiet=True, timeout_s=300.0)
    try:
        res = asyncio.run(run_benchmark(cfg))
    except RUN_ERRORS as e:
        return {"error": f"{type(e).__name__}: {e}"}
    summary = res["runs"][0]["summary"] if res.get("runs") else {}
    failed = summary.get("failed")  # a failed request's load is missing from the peak: the status says so
    return {"completed": summary.get("completed"), "failed": failed,
            **({"error": f"{failed} of {a.num_requests} requests failed"} if failed else {})}


def measure(a: argparse.Namespace, system: System, total_mib: int, floor_used: int) -> dict[str, Any]:
    """Start `system`'s server, sample it idle and under the burst, stop it; its table row."""
    wait_released(a.gpu, floor_used)
    baseline = floor_used if (dev := gpu_now(a.gpu)) is None else dev[1]
    before, port = {x.pid for x in apps_now(a.gpu)}, free_port()
    url, server = f"http://127.0.0.1:{port}", make_server(a, system, port)
    log_path = a.out / "engine_memory_logs" / f"{safe_name(system.label)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"== {system.label}: {' '.join(server.cmd or [])}", flush=True)
    idle: list[Sample] = []
    peak: list[Sample] = []  # under the burst
    extra: dict[str, Any] = {"baseline_used_gib": _gib(baseline), "log": str(log_path)}
    status, t0 = "ok", time.monotonic()
    with open(log_path, "wb") as log:
        server.start(log)
    try:
        why = server.wait_ready(url, a.startup_timeout_s)
        extra["startup_s"] = round(time.monotonic() - t0, 1)
        if why is not None:
            status = f"did not start: {why}"
        else:
            take = partial(sample, a.gpu, root_pid(server), before, baseline)
            idle, _ = sampled(take, a.interval_s, partial(time.sleep, a.idle_s))
            peak, extra["burst"] = sampled(take, a.interval_s, partial(burst, a, url, system.label))
            if "error" in extra["burst"]:
                status = f"burst failed: {extra['burst']['error']}"
    finally:
        extra["exit_code"] = server.stop()
        own = server.extra_log()  # serve_vllm.sh's vLLM log, read whole (appended to ours, only its tail)
        kv = parse_server_log("\n".join(Path(f).read_text(errors="replace") for f in (str(log_path), own)
                                        if f and os.path.isfile(f)))
        _append_log(str(log_path), own)
    return table_row(system.label, a.gpu_memory_utilization, total_mib, idle, peak, kv, status,
                     samples=len(idle) + len(peak), **extra)


def main(argv: Sequence[str] | None = None) -> int:
    a, systems = parse_args(argv)
    if (first := gpu_now(a.gpu)) is None:
        print(f"engine_memory: nvidia-smi reads no GPU {a.gpu}", file=sys.stderr)
        return 2
    name = (smi(a.gpu, "--query-gpu=name") or "GPU").strip()
    head = (f"GPU memory held per engine, {a.model} on {name} ({first[0] / 1024:.2f} GiB; {first[1]} MiB in use "
            f"before), --gpu-memory-utilization {a.gpu_memory_utilization:g}, --max-model-len {a.max_model_len}; "
            f"peak under {a.num_requests} x {a.input_len}:{a.output_len} at once, sampled every {a.interval_s:g} s "
            "(GiB; share = U x total; method: bench/engine_memory.py's docstring):\n\n")
    rows: list[dict[str, Any]] = []
    try:
        for s in systems:
            rows.append(measure(a, s, first[0], first[1]))
            write_table_files(a.out, "engine_memory", a, rows, head + table(rows))
    finally:
        done = {r["system"] for r in rows}
        rows += [table_row(s.label, a.gpu_memory_utilization, first[0], [], [], {}, "interrupted: not measured")
                 for s in systems if s.label not in done]
        write_table_files(a.out, "engine_memory", a, rows, head + table(rows))
    print(head + table(rows), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda n, _: sys.exit(128 + n))  # unwinds: the server stopped, the rows written
    sys.exit(main())
