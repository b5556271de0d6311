"""The systems bench/compare.py compares: the system specs (ours by name or flags, the real vLLM, an external
server), `--systems` / `--system` parsing, and the command lines of ours and of vLLM (through serve_vllm.sh or vLLM's
server module). Starting, health-waiting on and stopping each one's server is bench/compare_servers.py's.
bench/compare.py's docstring says how they are used.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_slo import SLO_PREFIX, parse_slo_system  # noqa: E402
from make_peer_model import vllm_quantization_flags  # noqa: E402

from rapidserve.benchmark.flags import base_url_arg  # noqa: E402
from rapidserve.redaction import redact_text  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYSTEMS: dict[str, str] = {
    "rapid-adaptive": "--mode rapid --partition adaptive --policy rapid",
    "rapid-adaptive-slo100": "--mode rapid --partition adaptive --policy rapid --slo-itl-ms 100",
    "rapid-duet": "--mode rapid --partition adaptive --policy duet",
    # DRIFT with the bench's goodput rule as its TTFT SLO (1 s per 1K prompt tokens) plus 0.5 s
    "rapid-drift": ("--mode rapid --partition adaptive --policy drift --slo-ttft-ms 500 "
                    "--slo-ttft-ms-per-1k-tokens 1000"),
    "rapid-overallocated": "--mode rapid --partition off",
    "rapid-static-0.25": "--mode rapid --partition static:0.25",
    "rapid-static-0.5": "--mode rapid --partition static:0.5",
    "hybrid-512": "--mode hybrid --max-num-batched-tokens 512",
    "hybrid-1024": "--mode hybrid --max-num-batched-tokens 1024",
    "hybrid-2048": "--mode hybrid --max-num-batched-tokens 2048",
    "hybrid-8192": "--mode hybrid --max-num-batched-tokens 8192",
    # The goodput frontier's three (issue 37): the engine's default policy (whatever `rapidserve serve` runs
    # without flags), always fused (one process, chunked prefill mixed with decodes: vLLM/Sarathi's shape) and
    # always split (two processes, decode and prefill on their own partitions: classic RAPID).
    "rapidserve": "",
    "always-fused": "--mode hybrid",
    "always-split": "--mode rapid --policy rapid",
    "duet": "--mode rapid --policy duet",  # DuetServe's adaptive policy in the one engine (fused or split per step)
    # duet with the piecewise graphs of its fused steps cut to 512 tokens, as the prefill worker's: its fused steps of
    # more tokens launched from Python (the decode worker before 2026-11-30; the A/B of group graphs-ab)
    "duet-g512": "--mode rapid --policy duet --prefill-graph-tokens 16,32,64,128,256,384,512",
    # duet with its fused steps' buckets every 256 tokens from 1024 to 2048, as before 2026-11-30 (the default: every
    # 128): a chunk ends on a bucket or pads to the next (partition/policies.py `on_bucket`; the A/B of group fill-ab)
    "duet-g256": ("--mode rapid --policy duet --prefill-graph-tokens "
                  "16,32,64,128,256,384,512,640,768,896,1024,1280,1536,1792,2048"),
    # duet at SLO 100 ms with buckets on to 4096 tokens (the default stops at 2048, so its ~4K-token fused steps run
    # eager): whether those launches still delay tokens at 100 ms (the A/B of group g4096-ab, beside duet@100)
    "duet100-g4096": ("--mode rapid --policy duet --slo-itl-ms 100 --prefill-graph-tokens "
                      "16,32,64,128,256,384,512,640,768,896,1024,1280,1536,1792,2048,2304,2560,2816,3072,3328,3584,"
                      "3840,4096"),
    # duet reading its profile between buckets rather than at the bucket above (a 1150-token context is read at the
    # 2048 bucket by default; KV reads bound decode at large batches: 1024:256 at 30 req/s runs 140-300 in flight,
    # bench/results/issue37.md); its online correction absorbs a steady bias either way (the A/B of group lookup-ab)
    "duet-interp": "--mode rapid --policy duet --profile-lookup interpolate",
    # duet as it read its profile before 2026-11-30 (`round-up` for the fused composition too, where the default
    # `auto` interpolates it: partition_config.lookup_interpolates); the A/B of group lookup-ab
    "duet-roundup": "--mode rapid --policy duet --profile-lookup round-up",
    # duet at the fixed margin it had before 2026-11-30 (steps planned within 0.9 x SLO) where the default adapts it
    # to the gaps its steps made (partition/margin.py: 0.8-0.97); the A/B of group margin-ab
    "duet-m90": "--mode rapid --policy duet --slo-margin 0.9",
    "duet-perkind": "--mode rapid --policy duet --step-correction per-kind",
    # (and duet@B: duet with --slo-itl-ms B, searched at bound B alone; duet@none: no SLO. bench/compare_slo.py)
    # NPMD disaggregation on the GPUs the others get: its flags follow --serve-args' --tensor-parallel-size N
    # (prefill on N/2, decode on N/2; bench/compare_tp.py), this placeholder is replaced.
    "disagg-npmd": "--mode disagg",
}
FRONTIER_SYSTEMS: tuple[str, ...] = ("rapidserve", "always-fused", "always-split")  # --systems' default: a search
# ... a sweep: the rest, but for the multi-GPU frontier's own (bench/frontier_plan.py's groups), named when wanted
SWEEP_SYSTEMS: tuple[str, ...] = tuple(n for n in SYSTEMS
                                      if n not in (*FRONTIER_SYSTEMS, "hybrid-1024", "disagg-npmd", "duet-g512",
                                                    "duet-g256", "duet100-g4096", "duet-interp", "duet-m90",
                                                    "duet-perkind", "duet-roundup"))

RAPIDSERVE, VLLM, EXT = "rapidserve", "vllm", "ext"
# vLLM's settings the frontier compares ours with (the better vLLM at each bound is the best of them): its
# defaults, its chunked-prefill budget at the two low-latency sizes, and vLLM 0.26's interactivity mode.
VLLM_SETTINGS: tuple[str, ...] = ("", "--max-num-batched-tokens 1024", "--max-num-batched-tokens 2048",
                                  "--performance-mode interactivity")
VLLM_BEST = "vllm-best"  # in --systems: one vLLM system per VLLM_SETTINGS
# Flags of `rapidserve serve` that vLLM's server takes under the same name and meaning: given in
# --serve-args, a vLLM system gets them too.
SHARED_VALUE_FLAGS: tuple[str, ...] = ("--max-model-len", "--gpu-memory-utilization", "--max-num-batched-tokens",
                                       "--max-num-seqs", "--tensor-parallel-size", "--quantization",
                                       "--kv-cache-dtype")
SHARED_SWITCHES: tuple[str, ...] = ("--enforce-eager",)
# Where serve_vllm.sh is looked for (relative to the repo root) when --vllm-serve is not given. The
# ../shared folder does not travel to the GPU machine: bench/vs_vllm.sh's header says how the recipe gets there.
VLLM_SERVE_CANDIDATES: tuple[str, ...] = ("shared/peer_vllm/serve_vllm.sh", "../shared/peer_vllm/serve_vllm.sh",
                                          ".peer/peer_vllm/serve_vllm.sh")
# What serve_vllm.sh sets, for a vLLM started without it.
VLLM_ENV: dict[str, str] = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                            "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------- systems (pure)


class System(NamedTuple):
    """One column of the comparison: our server with `flags`, vLLM with `flags`, or an external `url`."""

    label: str
    kind: str  # RAPIDSERVE, VLLM or EXT
    flags: str = ""  # rapidserve: `rapidserve serve` flags; vllm: vLLM flags after the shared ones
    url: str = ""  # ext only
    only_bounds: tuple[float | None, ...] | None = None  # a goodput search's bounds (duet@B: B alone); None: all

    def describe(self) -> str:
        if self.kind == VLLM:
            return f"vLLM {self.flags}".strip()
        if self.kind == EXT:
            return f"external server at {self.url}"
        return self.flags


def special_system(text: str, label: str | None = None) -> System | None:
    """`vllm`, `vllm:FLAGS` or `ext:URL` as a System (labelled `label`, else by the text, an ext by its URL);
    None for any other text. ValueError for unbalanced quotes in FLAGS or a URL that is not http(s)://."""
    t = text.strip()
    if t == VLLM or t.startswith(VLLM + ":"):
        flags = t[len(VLLM) + 1:].strip()
        shlex.split(flags)
        return System(label or (VLLM if not flags else f"{VLLM}:{flags}"), VLLM, flags)
    if t.startswith(EXT + ":"):
        try:
            url = base_url_arg(t[len(EXT) + 1:].strip())
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
        return System(label or redact_text(url), EXT, url=url)  # labelled without the URL's userinfo
    return None


def vllm_settings() -> list[System]:
    """vLLM at each of VLLM_SETTINGS, labelled `vllm` (its defaults) and `vllm:FLAGS`."""
    return [System(VLLM if not f else f"{VLLM}:{f}", VLLM, f) for f in VLLM_SETTINGS]


def parse_systems(names: str, extra: Sequence[str], search: bool = False) -> list[System]:
    """--systems (comma-separated: SYSTEMS names, duet@B or duet@none, vllm, vllm:FLAGS, vllm-best, ext:URL) then
    each --system LABEL=SPEC (SPEC: vllm, vllm:FLAGS, ext:URL or rapidserve flags). With `search` (--goodput-search) a
    bare `vllm` in --systems is vllm-best (`vllm:` alone: vLLM's defaults only). ValueError saying what is wrong."""
    chosen: list[System] = []
    items = [s.strip() for s in names.split(",")] if names.strip() else []  # "": only --system's systems
    if any(not n for n in items):
        raise ValueError(f"--systems {redact_text(names)!r} has an empty item: give comma-separated system names")
    for n in items:
        if n == VLLM_BEST or (search and n == VLLM):
            chosen += vllm_settings()
            continue
        try:
            s = special_system(n)
        except ValueError as e:
            raise ValueError(f"--systems {redact_text(n)!r}: {e}") from None
        slo = parse_slo_system(n) if s is None else None
        if slo is not None:
            s = System(slo[0], RAPIDSERVE, slo[1], only_bounds=(slo[2],))
        elif s is None:
            if n not in SYSTEMS:
                raise ValueError(f"--systems: unknown {n}; known: {', '.join(SYSTEMS)}, {SLO_PREFIX}B, "
                                 f"{SLO_PREFIX}none, {VLLM}, {VLLM}:FLAGS, {VLLM_BEST}, {EXT}:URL")
            s = System(n, RAPIDSERVE, SYSTEMS[n])
        chosen.append(s)
    for item in extra:
        label, sep, spec = item.partition("=")
        if not sep or not label.strip():
            raise ValueError(f"--system {item!r}: expected LABEL=FLAGS (or LABEL=vllm:FLAGS, LABEL=ext:URL)")
        try:
            s = special_system(spec, label.strip())
            if s is None:
                shlex.split(spec)
                s = System(label.strip(), RAPIDSERVE, spec.strip())
        except ValueError as e:  # unbalanced quotes, an ext: URL that is not one; the item without its secrets
            raise ValueError(f"--system {redact_text(item)!r}: {e}") from None
        chosen.append(s)
    if not chosen:
        raise ValueError("no systems selected")
    seen: set[str] = set()
    for s in chosen:
        if s.label in seen:
            raise ValueError(f"two systems are labelled {s.label!r}: give one a label with --system LABEL=SPEC")
        seen.add(s.label)
    return chosen


def vllm_baseline(systems: Sequence[System], given: str | None) -> str | None:
    """The label the vs-vLLM ratios divide by: `given` (must be a system's), else the first vLLM system's."""
    if given is not None:
        if given not in {s.label for s in systems}:
            labels = ", ".join(s.label for s in systems)
            raise ValueError(f"--vllm-baseline {given!r} is none of the systems ({labels})")
        return given
    return next((s.label for s in systems if s.kind == VLLM), None)


def shared_serve_flags(serve_args: str) -> list[str]:
    """The flags of `serve_args` (ours) that vLLM's server takes under the same name, in their order
    (`--flag value` and `--flag=value`; the switches as they are)."""
    toks = shlex.split(serve_args)
    out: list[str] = []
    i = 0
    while i < len(toks):
        name, eq, value = toks[i].partition("=")
        if name in SHARED_VALUE_FLAGS and eq:
            out += [name, value]
        elif name in SHARED_VALUE_FLAGS and i + 1 < len(toks):
            out += [name, toks[i + 1]]
            i += 1
        elif toks[i] in SHARED_SWITCHES:
            out.append(toks[i])
        i += 1
    return out


def vllm_command(model_dir: str, port: int, serve_args: str, flags: str, serve_script: str | None,
                 python: str = sys.executable) -> list[str]:
    """How a vLLM system is started: through serve_vllm.sh when there is one, else vLLM's OpenAI server
    module directly (dummy weights in bf16, as the script does; `flags` can override both). Where the model folder
    declares its FP8 scheme (bench/make_peer_model.py --fp8), vLLM reads it there and gets no --quantization."""
    vflags = vllm_quantization_flags([*shared_serve_flags(serve_args), *shlex.split(flags)], model_dir)
    if serve_script:
        return ["bash", serve_script, model_dir, str(port), *vflags]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--load-format", "dummy",
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), *vflags]


def serve_command(model: str, port: int, serve_args: str, flags: str) -> list[str]:
    return [sys.executable, "-m", "rapidserve.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(serve_args), *shlex.split(flags)]


def find_vllm_serve(given: str | None, root: str = REPO) -> str | None:
    """serve_vllm.sh's path: `given` ('none' or '': launch vLLM directly), else the first candidate that exists."""
    if given is not None:
        return None if given.strip().lower() in ("", "none") else given
    for rel in VLLM_SERVE_CANDIDATES:
        path = os.path.normpath(os.path.join(root, rel))
        if os.path.isfile(path):
            return path
    return None
