"""The decode worker's HOST time per step of its one loop, by phase, on the CPU (no GPU; the model a stand-in).

    PYTHONPATH=. python bench/host_step_cost.py [--waiting 0,16,64,256,1024] [--rows 32,128,300,512]
        [--chunks 0,512,1024,2048] [--steps 40] [--warmup 5] [--repeats 2] [--label after] [--out DIR]
        [--profile W,R,C] [--tree DIR]

What runs: the real `DecodeWorker` (engine/decode_worker.py) turn by turn, with its real `DecodeScheduler`,
`BlockManager` (prefix caching on, block size 16), `StepCycle`, `launch_step`, the runner's real input building
(runner/inputs.py) and sampling (greedy), and `DuetPolicy` deciding from the committed H200 Qwen3-8B profile with a
50 ms ITL SLO and its adaptive margin, as the measured H200 runs did. Only the model is a stand-in (`StandIn`:
zeros for the hidden states, logits that pick one token), so its time is excluded; its ops/attention are
never called. Messages go through msgspec as on the rings (`WireIO`: NewRequest decoded at the drain, TokenBatch /
Finished / Stats encoded at publish), without shared memory.

One cell (W, R, C): R running requests (contexts 1024..1280 tokens, max_tokens 256: none ends while measured), C
prompt tokens a step (the policy's decision is computed, then the shape is pinned to `Fused(C)`; C = 0 is a
decode-only step), and before every turn the queue is topped up (new 1024-token prompts, max_tokens 1, through the
inbox) to W waiting requests plus the ceil(C / 1024) the step's chunk admits, so the chunk always finds prompt
work and W requests wait beyond it. A prompt's first token ends it, so the decode batch stays at R.

Phases (ms per turn, the median over --steps turns after --warmup, each phase's on its own, so they need not add up
to the host's median; exclusive: a phase's time excludes the phases called inside it; of --repeats passes over the
grid, each cell's pass with the lowest host median is kept, its every pass's host median in the JSON):
- inbox: `io.drain` + `DecodeWorker.handle` (msgspec decode, `DecodeScheduler.add`);
- state: `shape_state` (the policy's view of the queues); decide: `DuetPolicy.decide`;
- plan: `DecodeScheduler.plan` / `schedule` (growth, admission: hashing, block allocation) and `launched`;
- inputs: the runner's input building (`_prefill_arrays`, `_prefill_meta`, `_decode_arrays`, `_dev`);
- launch: the rest of `launch_step` (items, tables, carry, sampling's host work, `to_host`);
- record: `StepCycle._complete` (landed rows, `record`, `chunks_landed`, `observe`);
- publish: `DecodeWorker.publish` (retain, encode TokenBatch / Finished / Stats);
- other: the turn's wall time minus the above and the stand-in model (begin_step's rest, `_step`'s rest);
- host: the turn's wall time minus the stand-in model;
- full gc: one full pass of Python's collector over the cell's state after the turns (start-up's objects frozen,
  as a worker freezes them): the pause a turn takes when a generation-2 collection falls in it.
Times are this machine's (2 CPU cores here); only their ratios carry over to a GPU host. No GPU-side effect is
measured: on a GPU the host also launches the kernels (36 layers of piecewise graphs + attention), not counted here.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch


def _tree() -> str:
    """The rapidserve to measure: `--tree DIR`'s (read before anything imports it), else this checkout's."""
    if "--tree" in sys.argv:
        return os.path.abspath(sys.argv[sys.argv.index("--tree") + 1])
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


sys.path.insert(0, _tree())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_step_standins import StandIn, WireIO  # noqa: E402

from rapidserve.config import EngineConfig  # noqa: E402
from rapidserve.config_builder import build_engine_config  # noqa: E402
from rapidserve.engine import messages as m  # noqa: E402
from rapidserve.engine import step_cycle  # noqa: E402
from rapidserve.engine.decode_worker import DecodeWorker  # noqa: E402
from rapidserve.partition.margin import DEFAULT_MARGIN  # noqa: E402
from rapidserve.partition.plan import PartitionPlan  # noqa: E402
from rapidserve.partition.policies import AdaptiveParams, DuetPolicy  # noqa: E402
from rapidserve.partition.profile import OVERALLOCATED, Configuration, load_profile  # noqa: E402
from rapidserve.partition.runtime import DecodePartition  # noqa: E402
from rapidserve.partition.shape import Fused, ShapeState, StepShape, StepTiming  # noqa: E402
from rapidserve.partition.step_costs import ProfileCosts  # noqa: E402
from rapidserve.partition_config import PartitionConfig  # noqa: E402
from rapidserve.runner.model_runner import ModelRunner, load_runner  # noqa: E402
from rapidserve.runner.prefill_graphs import usable_buckets  # noqa: E402
from rapidserve.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiles" / "nvidia-h200__preset-qwen3-8b.json"
PROMPT = 1024
PHASES = ("inbox", "state", "decide", "plan", "inputs", "launch", "record", "publish", "other", "host")


class Phases:
    """Exclusive wall time per phase of wrapped callables (a phase's callees' phases subtracted)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = (time.perf_counter() - t0) * 1e3
                inner = self._stack.pop()
                self.ms[phase] += dt - inner
                if self._stack:
                    self._stack[-1] += dt
        return timed

    def patch(self, obj: Any, name: str, phase: str) -> None:
        setattr(obj, name, self.wrap(phase, getattr(obj, name)))


class PinnedChunk:
    """The duet policy's decision is made (and timed) every step, then the shape is pinned to `Fused(chunk)`."""

    name, workers, reads_waiting = "pinned", ("decode",), True

    def __init__(self, inner: DuetPolicy, chunk: int) -> None:
        self.inner, self.chunk = inner, chunk
        self.reads_queue_head = getattr(inner, "reads_queue_head", False)  # as the worker would tell duet

    @property
    def last(self) -> Any:
        return self.inner.last

    def decide(self, state: ShapeState) -> StepShape:
        self.inner.decide(state)
        return Fused(self.chunk)

    def observe(self, timing: StepTiming) -> None:
        self.inner.observe(timing)


def duet_policy(cfg: EngineConfig) -> DuetPolicy:
    """`--policy duet` as the H200 runs had it: the committed profile's costs, the GPU's graph buckets."""
    costs = ProfileCosts(load_profile(PROFILE))
    buckets = usable_buckets(cfg.runner.prefill_graph_tokens, cfg.scheduler.max_num_batched_tokens)
    return DuetPolicy(costs, AdaptiveParams(graph_buckets=buckets), margin=DEFAULT_MARGIN)


def engine(max_rows: int, max_model_len: int) -> tuple[EngineConfig, ModelRunner]:
    blocks = max_rows * -(-(PROMPT + 2 * 256 + 16) // 16) + 4 * 2048 // 16 + 64
    cfg, _ = build_engine_config("preset:tiny-qwen3", dtype="float32", device="cpu", max_model_len=max_model_len,
                                 allow_long_max_model_len=True, num_kv_blocks=blocks, max_num_seqs=2048,
                                 max_num_batched_tokens=8192, partition=PartitionConfig(slo_itl_ms=50.0))
    cfg = dataclasses.replace(cfg, runner=dataclasses.replace(cfg.runner, graph_batch_sizes=(1, 2048)))
    runner = load_runner(cfg)
    runner.model = StandIn(runner.model)  # type: ignore[assignment]
    gc.collect()
    gc.freeze()  # as a worker settles its heap after start-up (engine/worker_io.py settle_heap)
    return cfg, runner


class Cell:
    """One (W, R, C) measurement over a fresh worker on the shared runner."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, waiting: int, rows: int, chunk: int, seed: int) -> None:
        self.waiting, self.rows, self.chunk = waiting, rows, chunk
        self.rng = random.Random(seed)
        self.io = WireIO()
        plan = PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 132)], None, "bench")
        self.policy = PinnedChunk(duet_policy(cfg), 8192)
        self.w = DecodeWorker(cfg, runner, self.io, DecodePartition(cfg.partition, plan), None,  # type: ignore[arg-type]
                              self.policy)
        self.n = 0
        self.encode = msgspec.msgpack.Encoder().encode

    def request(self, length: int, max_tokens: int) -> None:
        self.n += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompt = [self.rng.randrange(3, 1500) for _ in range(length)]
        self.io.inbox.append(self.encode(m.NewRequest(f"r{self.n}", prompt, params, time.monotonic())))

    def setup(self) -> None:
        """R running requests (prompts computed through real fused steps), then the queue."""
        for _ in range(self.rows):
            self.request(PROMPT + self.rng.randrange(0, 256), 256)
        s = self.w.sched
        while self.io.inbox or s.waiting or s.chunking or len(s.running) < self.rows or self.w.inflight:
            self.w.turn()
            if not s.waiting and not s.chunking and len(s.running) == self.rows:
                break
        self.policy.chunk = self.chunk
        self.top_up()

    def top_up(self) -> None:
        want = self.waiting + math.ceil(self.chunk / PROMPT)
        for _ in range(max(0, want - len(self.w.sched.waiting))):
            self.request(PROMPT, 1)

    def measure(self, steps: int, warmup: int, profile: cProfile.Profile | None = None) -> dict[str, float]:
        for _ in range(warmup):
            self.w.turn()
            self.io.sent.clear()
            self.top_up()
        ph = Phases()
        w, r = self.w, self.w.runner
        ph.patch(self.io, "drain", "inbox")
        ph.patch(w, "handle", "inbox")
        ph.patch(w.sched, "shape_state", "state")
        ph.patch(self.policy.inner, "decide", "decide")
        for name in ("plan", "schedule", "launched"):
            ph.patch(w.sched, name, "plan")
        for name in ("_prefill_arrays", "_prefill_meta", "_decode_arrays", "_dev"):
            ph.patch(r, name, "inputs")
        model = r.model
        r.model = _Called(model, ph)  # type: ignore[assignment]
        launch = step_cycle.launch_step
        step_cycle.launch_step = ph.wrap("launch", launch)  # type: ignore[assignment]
        ph.patch(w, "_complete", "record")
        ph.patch(w, "publish", "publish")
        turns: list[dict[str, float]] = []
        try:
            for _ in range(steps):
                ph.ms.clear()
                t0 = time.perf_counter()
                if profile is not None:
                    profile.enable()
                w.turn()
                if profile is not None:
                    profile.disable()
                wall = (time.perf_counter() - t0) * 1e3
                turn = {p: ph.ms.get(p, 0.0) for p in PHASES[:-2]}
                turn["host"] = wall - ph.ms.get("model", 0.0)
                turn["other"] = turn["host"] - sum(turn[p] for p in PHASES[:-2])
                turns.append(turn)
                self.io.sent.clear()
                self.top_up()
        finally:
            step_cycle.launch_step = launch  # type: ignore[assignment]
            r.model = model  # type: ignore[assignment]
        # medians over the turns: a turn the OS took the core from (another process) moves no figure
        out = {p: statistics.median(t[p] for t in turns) for p in PHASES}
        out["host_mean"] = statistics.fmean(t["host"] for t in turns)
        out["host_max"] = max(t["host"] for t in turns)
        out["running"] = float(len(w.sched.running))
        t0 = time.perf_counter()
        gc.collect()
        out["full_gc"] = (time.perf_counter() - t0) * 1e3  # one full pass of the collector over this state
        return out


class _Called:
    """The stand-in model, its call and logits timed as "model" (left out of the host's time)."""

    def __init__(self, model: StandIn, ph: Phases) -> None:
        self.ops, self.attn, self.cfg = model.ops, model.attn, model.cfg
        self._call = ph.wrap("model", model.__call__)
        self.compute_logits = ph.wrap("model", model.compute_logits)

    def __call__(self, *a: Any) -> torch.Tensor:
        return self._call(*a)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def table(rows: list[dict[str, Any]], labels: list[str]) -> str:
    """One line per cell: the last label's phases (ms per turn), then each label's host time and full collection."""
    last = labels[-1]
    head = ["W", "R", "C", *(f"{p} ({last})" for p in PHASES[:-1]), *(f"host {lab}" for lab in labels),
            *(f"full gc {lab}" for lab in labels)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells: dict[tuple[int, int, int], dict[str, dict[str, float]]] = defaultdict(dict)
    for row in rows:
        cells[(row["waiting"], row["rows"], row["chunk"])][row["label"]] = row["ms"]
    for (w, r, c), by in sorted(cells.items()):
        phases = by.get(last, {})
        vals = [f"{phases[p]:.2f}" if p in phases else "-" for p in PHASES[:-1]]
        vals += [f"{by[lab][k]:.2f}" if k in by.get(lab, {}) else "-" for k in ("host", "full_gc") for lab in labels]
        lines.append(f"| {w} | {r} | {c} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiting", default="0,16,64,256,1024")
    ap.add_argument("--rows", default="32,128,300,512")
    ap.add_argument("--chunks", default="0,512,1024,2048")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the grid; each cell's fastest kept (another "
                    "process on the machine only ever adds time)")
    ap.add_argument("--max-model-len", type=int, default=40960, help="Qwen3-8B's (the decode block tables' width)")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", type=Path, default=None, help="merge the rows into DIR/host_step_cost.json")
    ap.add_argument("--profile", default=None, help="W,R,C: cProfile that one cell's measured turns instead")
    ap.add_argument("--tree", default=None, help="measure the rapidserve of this folder (a worktree of a base commit)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        w, r, c = ints(args.profile)
        cfg, runner = engine(r, args.max_model_len)
        cell, prof = Cell(cfg, runner, w, r, c, 0), cProfile.Profile()
        cell.setup()
        cell.measure(args.steps, args.warmup, prof)
        for key, n in (("tottime", 30), ("cumulative", 40)):
            pstats.Stats(prof).sort_stats(key).print_stats(n)
        return
    grid = [(w, r, c) for r in ints(args.rows) for w in ints(args.waiting) for c in ints(args.chunks)]
    cfg, runner = engine(max(ints(args.rows)), args.max_model_len)
    best: dict[tuple[int, int, int], dict[str, float]] = {}
    passes: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for k in range(args.repeats):  # whole passes over the grid: a cell's passes minutes apart, its best one kept
        for i, (w, r, c) in enumerate(grid):
            cell = Cell(cfg, runner, w, r, c, i)
            cell.setup()
            ms = cell.measure(args.steps, args.warmup)
            passes[(w, r, c)].append(ms["host"])
            if (w, r, c) not in best or ms["host"] < best[(w, r, c)]["host"]:
                best[(w, r, c)] = ms
            print(f"pass {k}: W={w} R={r} C={c}: host {ms['host']:.2f} ms/turn", file=sys.stderr, flush=True)
            del cell
            gc.collect()
    rows = [{"label": args.label, "waiting": w, "rows": r, "chunk": c, "ms": best[(w, r, c)],
             "host_passes": passes[(w, r, c)]} for (w, r, c) in grid]
    labels = [args.label]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "host_step_cost.json"
        old = json.loads(path.read_text()) if path.exists() else {"runs": {}}
        run = old["runs"].setdefault(args.label, {"runs": [], "rows": []})
        tree = subprocess.run(["git", "-C", _tree(), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        run["runs"].append({  # a label's cells may come from several runs (a grid cut in parts, interleaved)
            "command": "PYTHONPATH=. python bench/host_step_cost.py " + " ".join(sys.argv[1:]),
            "commit": tree.stdout.strip() or "?",  # of the rapidserve measured (--tree's, else this checkout's)
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                       f"torch {torch.__version__}",
        })
        done = {(row["waiting"], row["rows"], row["chunk"]) for row in rows}
        run["rows"] = [row for row in run["rows"] if (row["waiting"], row["rows"], row["chunk"]) not in done] + rows
        path.write_text(json.dumps(old, indent=1))
        labels = list(old["runs"])
        rows = [row for run in old["runs"].values() for row in run["rows"]]
    print(table(rows, labels))


if __name__ == "__main__":
    main()
