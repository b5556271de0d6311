"""Does llguidance release the GIL while it compiles? (CPU, one process, about a minute.)

A Python thread counts loop turns and its longest pause while the main thread runs each compile call
on a large JSON schema (`--props` string properties with a pattern, the SmolLM2 tokenizer's 49152
tokens). A call that held the GIL would pause the counting thread for the call's whole duration, as
the control (a backtracking `re` match, which holds it) does; one that releases it leaves pauses of a
few ms (the interpreter's switch interval, and the other processes on the machine).

    python bench/experiments/2026-11/grammar_compile_gil.py [--props 5000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections.abc import Callable


def measure(work: Callable[[], object]) -> tuple[float, float, float]:
    """(seconds `work` took, the other thread's turns per second meanwhile, its longest pause)."""
    stop = threading.Event()
    turns, longest = [0], [0.0]

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            turns[0] += 1
            now = time.perf_counter()
            longest[0], last = max(longest[0], now - last), now

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    work()
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
    return dt, turns[0] / dt, longest[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--props", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    import llguidance as llg
    import llguidance.hf

    from rapidserve.loader import load_hf_tokenizer, resolve_model

    tok = llguidance.hf.from_tokenizer(load_hf_tokenizer(resolve_model(None)), n_vocab=49152, eos_token=[2])
    schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"}
                                                          for i in range(a.props)}})
    defaults = {"whitespace_flexible": False}
    text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    evil = re.compile(r"(a+)+$")
    calls: list[tuple[str, Callable[[], object]]] = [
        ("sleep 1 s (baseline)", lambda: time.sleep(1)),
        ("LLMatcher.grammar_from_json_schema", lambda: llg.LLMatcher.grammar_from_json_schema(schema,
                                                                                               defaults=defaults)),
        ("LLMatcher.validate_grammar_with_warnings", lambda: llg.LLMatcher.validate_grammar_with_warnings(text, tok)),
        ("LLMatcher(tokenizer, grammar)", lambda: llg.LLMatcher(tok, text)),
        ("control: re backtracking (holds the GIL)", lambda: evil.match("a" * 25 + "b")),
    ]
    print("| call | s | other thread: M turns/s | its longest pause (ms) |\n|---|---|---|---|")
    for _ in range(a.repeat):
        for name, work in calls:
            dt, rate, pause = measure(work)
            print(f"| {name} | {dt:.3f} | {rate / 1e6:.2f} | {pause * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
