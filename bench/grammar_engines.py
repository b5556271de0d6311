"""xgrammar vs llguidance on the CPU: compile time per JSON schema (cold and cached), per-token
bitmask fill time and robustness, on the schema corpus of tests/data/json_schemas.json, for the
embedded model's tokenizer (SmolLM2, 49152 tokens) and a Qwen-sized vocabulary (151936 tokens,
synthesised from SmolLM2's byte-level BPE by merging pairs of its tokens: no Qwen tokenizer is
cached on this machine and the network may be closed).

    python bench/grammar_engines.py [--steps 48] [--out bench/results/grammar_engines.json]

Per schema and engine: one cold compile (a fresh compiler, its cache empty), one cached compile
(same compiler, same schema), then a random walk of up to --steps tokens (a seeded random allowed
token each step, EOS only when nothing else is allowed), timing each bitmask fill. Robustness: the
schema compiles, the walk never hits an engine error, and a walk that completed parses as JSON and
validates against its schema (`jsonschema`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "json_schemas.json"


def smollm2_tokenizer() -> Any:
    from rapidserve.loader import resolve_model
    from rapidserve.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))
    assert tok is not None
    return tok.hf, tok.eos_token_ids


def widened_tokenizer(hf: Any, size: int) -> Any:
    """A byte-level BPE with `size` tokens: SmolLM2's vocabulary plus merges of its token pairs."""
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    raw = json.loads(hf.backend_tokenizer.to_str())
    vocab: dict[str, int] = raw["model"]["vocab"]
    merges = raw["model"]["merges"]
    n_added = len(raw.get("added_tokens", []))
    words = sorted(vocab, key=vocab.get)[300:20000]
    rng = random.Random(0)
    while len(vocab) + n_added < size:
        a, b = rng.choice(words), rng.choice(words)
        if a + b in vocab:
            continue
        vocab[a + b] = len(vocab) + n_added
        merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
    # added tokens keep their ids below the model's: renumber them above the base vocabulary
    base = len(vocab)
    for t in raw.get("added_tokens", []):
        vocab.pop(t["content"], None)
    for i, t in enumerate(raw.get("added_tokens", [])):
        t["id"] = base + i
    raw["model"]["vocab"] = {k: i for i, k in enumerate(vocab)}
    fast = PreTrainedTokenizerFast(tokenizer_object=RawTokenizer.from_str(json.dumps(raw)),
                                   eos_token=hf.eos_token)
    return fast


class Xgr:
    name = "xgrammar"

    def __init__(self, hf: Any, vocab: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.vocab = vocab

    def compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info, max_threads=8)

    def compile(self, comp: Any, schema: str) -> Any:
        return comp.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, g: Any) -> Any:
        return self.xgr.GrammarMatcher(g)

    def fill(self, m: Any, bm: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bm, 0)

    def accept(self, m: Any, t: int) -> bool:
        return bool(m.accept_token(t))

    def done(self, m: Any) -> bool:
        return bool(m.is_terminated())


class Llg:
    name = "llguidance"

    def __init__(self, hf: Any, vocab: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos[0])
        self.vocab = vocab

    def compiler(self) -> Any:
        return {}

    def compile(self, comp: dict, schema: str) -> Any:
        # llguidance compiles lazily, per matcher: "compile" = grammar text + validation + first matcher
        if schema in comp:
            return comp[schema]
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        is_error, msgs = self.llg.LLMatcher.validate_grammar_with_warnings(g, self.tok)
        if is_error:
            raise ValueError(msgs)
        m = self.llg.LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        comp[schema] = g
        return g

    def matcher(self, g: Any) -> Any:
        return self.llg.LLMatcher(self.tok, g)

    def fill(self, m: Any, bm: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask(m, bm, 0)

    def accept(self, m: Any, t: int) -> bool:
        return bool(m.consume_token(t)) and not m.is_error()

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())


def allowed(bm: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(eng: Any, g: Any, hf: Any, eos: list[int], steps: int, seed: int) -> tuple[list[float], str, list[int]]:
    """Fill times (s), outcome ('complete' | 'cut' | 'error: ...') and the tokens."""
    m = eng.matcher(g)
    rng = random.Random(seed)
    words = (eng.vocab + 31) // 32
    bm = torch.zeros((1, words), dtype=torch.int32)
    times: list[float] = []
    toks: list[int] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.fill(m, bm)
        times.append(time.perf_counter() - t0)
        ok = allowed(bm[0], eng.vocab)
        if len(ok) == 0:
            return times, "error: empty mask", toks
        non_eos = [int(t) for t in ok if int(t) not in eos]
        if not non_eos or rng.random() < 0.02 * len(toks):
            stop = [int(t) for t in ok if int(t) in eos]
            if stop:
                eng.accept(m, stop[0])
                return times, "complete", toks
        t = rng.choice(non_eos) if non_eos else int(ok[0])
        if not eng.accept(m, t):
            return times, f"error: rejected allowed token {t}", toks
        toks.append(t)
        if eng.done(m):
            return times, "complete", toks
    return times, "cut", toks


BENCH_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}},
                "required": ["text"], "additionalProperties": False}


def long_string_fill_us(eng: Any, hf: Any, eos: list[int], steps: int = 200) -> float:
    """Mean fill time over `steps` tokens of the GPU bench's schema (mostly inside one long string)."""
    g = eng.compile(eng.compiler(), json.dumps(BENCH_SCHEMA))
    times, _, _ = walk(eng, g, hf, eos, steps, seed=0)
    return round(1e6 * statistics.fmean(times), 1)


def run(hf: Any, vocab: int, eos: list[int], steps: int) -> dict[str, Any]:
    import jsonschema

    corpus = json.loads(CORPUS.read_text())
    res: dict[str, Any] = {}
    for cls in (Xgr, Llg):
        t0 = time.perf_counter()
        eng = cls(hf, vocab, eos)
        setup = time.perf_counter() - t0
        cold, cached, fills = [], [], []
        failures: list[str] = []
        valid = completed = 0
        for i, item in enumerate(corpus):
            schema = json.dumps(item["schema"])
            comp = eng.compiler()
            try:
                t0 = time.perf_counter()
                g = eng.compile(comp, schema)
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                eng.compile(comp, schema)
                cached.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - counted as a robustness failure
                failures.append(f"{item['name']}: compile: {str(e)[:120]}")
                continue
            times, outcome, toks = walk(eng, g, hf, eos, steps, seed=i)
            fills += times
            if outcome.startswith("error"):
                failures.append(f"{item['name']}: {outcome}")
            elif outcome == "complete":
                completed += 1
                text = hf.decode(toks)
                try:
                    jsonschema.validate(json.loads(text), item["schema"])
                    valid += 1
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{item['name']}: invalid output {text!r}: {str(e)[:80]}")
        ms = lambda xs, q: 1e3 * (statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0])
        res[cls.name] = {
            "tokenizer_setup_s": round(setup, 3),
            "schemas": len(corpus), "compiled": len(cold), "walks_completed": completed, "valid": valid,
            "compile_cold_ms_median": round(1e3 * statistics.median(cold), 3),
            "compile_cold_ms_max": round(1e3 * max(cold), 3),
            "compile_cached_ms_median": round(1e3 * statistics.median(cached), 4),
            "fill_us_median": round(1e3 * ms(fills, 50), 1), "fill_us_p99": round(1e3 * ms(fills, 99), 1),
            "fill_us_mean": round(1e6 * statistics.fmean(fills), 1),
            "fill_count": len(fills), "failures": failures,
            "long_string_fill_us_mean": long_string_fill_us(eng, hf, eos),
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_engines.json"))
    ap.add_argument("--save-tokenizer", default=None, metavar="DIR",
                    help="only save the Qwen-sized (151936) tokenizer to DIR and exit: `rapidserve serve --model "
                         "preset:qwen3-8b --tokenizer DIR` can then serve structured outputs with random weights")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hf, eos = smollm2_tokenizer()
    if args.save_tokenizer:
        wide = widened_tokenizer(hf, 151936)
        wide.save_pretrained(args.save_tokenizer)
        print(f"saved a {len(wide)}-token tokenizer to {args.save_tokenizer}")
        return
    out = {}
    for label, tok in (("smollm2_49152", hf), ("widened_151936", widened_tokenizer(hf, 151936))):
        vocab = len(tok)
        out[label] = {"vocab": vocab, **run(tok, vocab, list(eos), args.steps)}
        print(json.dumps({label: out[label]}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
