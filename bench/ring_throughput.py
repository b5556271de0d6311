"""ShmRing throughput: one writer process and one reader process, messages per second.

Usage: python bench/ring_throughput.py [--runs 3] [--scale 1.0] [--slots 1024] [--slot-size 1024]
Prints a table, writes bench/results/ring_throughput.json and .md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rapidserve.ipc.ring import ShmRing, new_engine_id, ring_name  # noqa: E402

SIZES: tuple[tuple[int, int], ...] = ((64, 2_000_000), (1024, 1_000_000), (16384, 100_000))  # bytes, count
RESULTS = Path(__file__).resolve().parent / "results"
MACHINE = "2-core CPU dev machine"
DATE = "2026-11-22"


def _writer(name: str, size: int, count: int, start: Any) -> None:
    ring = ShmRing.attach(name)
    msg = bytes(range(256)) * (size // 256) + bytes(size % 256)
    put = ring.put
    start.wait()
    for _ in range(count):
        put(msg, 30.0)
    ring.close()


def _reader(name: str, count: int, start: Any, out: Any) -> None:
    ring = ShmRing.attach(name)
    get = ring.get
    start.wait()
    first = get(30.0)
    t0 = time.perf_counter()
    nbytes = len(first or b"")
    for _ in range(count - 1):
        data = get(30.0)
        if data is None:
            raise RuntimeError("reader timed out")
    t1 = time.perf_counter()
    ring.close()
    out.send((count - 1, t1 - t0, nbytes))


def run_once(size: int, count: int, slots: int, slot_size: int) -> float:
    ctx = mp.get_context("spawn")
    ring = ShmRing.create(ring_name(new_engine_id(), f"bench{size}"), slots, slot_size)
    try:
        start = ctx.Event()
        rx, tx = ctx.Pipe(duplex=False)
        procs = [ctx.Process(target=_reader, args=(ring.name, count, start, tx)),
                 ctx.Process(target=_writer, args=(ring.name, size, count, start))]
        for p in procs:
            p.start()
        time.sleep(0.5)  # let both attach before the clock starts
        start.set()
        if not rx.poll(120):
            raise RuntimeError("benchmark run produced no result")
        n, dt, nbytes = rx.recv()
        for p in procs:
            p.join(30)
            if p.exitcode != 0:
                raise RuntimeError(f"{p.name} exited with {p.exitcode}")
        assert nbytes == size
        return n / dt
    finally:
        ring.close()
        ring.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the message counts")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--slot-size", type=int, default=1024)
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for size, count in SIZES:
        n = max(1000, int(count * args.scale))
        rates = [run_once(size, n, args.slots, args.slot_size) for _ in range(args.runs)]
        med = statistics.median(rates)
        row = {"message_bytes": size, "messages_per_run": n, "runs": args.runs,
               "median_msgs_per_s": round(med), "min_msgs_per_s": round(min(rates)),
               "max_msgs_per_s": round(max(rates)),
               "spread_pct": round(100 * (max(rates) - min(rates)) / med, 1),
               "median_MiB_per_s": round(med * size / 2**20, 1),
               "all_msgs_per_s": [round(r) for r in rates]}
        rows.append(row)
        print(f"{size:>6} B  median {med:>10,.0f} msg/s  (min {min(rates):,.0f}, max {max(rates):,.0f}, "
              f"spread {row['spread_pct']}%)  {row['median_MiB_per_s']} MiB/s", flush=True)
    if args.no_write:
        return
    cmd = "python bench/ring_throughput.py " + " ".join(sys.argv[1:])
    report = {"benchmark": "ShmRing SPSC throughput, writer and reader in two processes",
              "command": cmd.strip(), "machine": MACHINE, "date": DATE,
              "python": platform.python_version(), "cpu": platform.machine(),
              "ring": {"slots": args.slots, "slot_size": args.slot_size},
              "method": "put(msg)/get() one message per call; rate = (n-1) / time from the reader's "
                        "first message to its last; median of runs, spread = (max-min)/median",
              "target": "at least 200,000 msg/s for 64-byte messages", "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ring_throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# ShmRing throughput", "", f"- Command: `{report['command']}`", f"- Machine: {MACHINE}",
             f"- Date: {DATE}", f"- Python {report['python']} ({report['cpu']})",
             f"- Ring: {args.slots} slots x {args.slot_size} bytes; {report['method']}", "",
             "| message | messages/run | median msg/s | min | max | spread | MiB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['message_bytes']} B | {r['messages_per_run']:,} | {r['median_msgs_per_s']:,} | "
              f"{r['min_msgs_per_s']:,} | {r['max_msgs_per_s']:,} | {r['spread_pct']}% | "
              f"{r['median_MiB_per_s']} |" for r in rows]
    (RESULTS / "ring_throughput.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
