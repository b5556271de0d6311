"""The `rapidserve` command line.

Every flag is validated; a bad flag, model path or model file ends with a message that says what
is allowed and exit code 2 (argparse's convention for usage errors).

`main` (the `rapidserve` console script) parses and runs one command; each command's flags and code are its own
module's: cli_generate.py, cli_serve.py (vLLM's serve flags: cli_vllm.py), partition/profile_cmd.py,
benchmark/cli.py; the flags they share, and what those become in the config tree, are cli_args.py's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rapidserve.cli_args import add_model_args, add_partition_args, positive_int
from rapidserve.cli_generate import add_generate_parser
from rapidserve.cli_serve import add_serve_parser
from rapidserve.cli_vllm import CliParser
from rapidserve.config_base import ConfigError
from rapidserve.vllm_serve_flags import refuse_prefixes

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="rapidserve", description=__doc__.splitlines()[0])  # names the flags it refuses
    sub = p.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    for name in ("generate", "serve"):  # vLLM's flags that begin theirs are refused, not taken as abbreviations
        refuse_prefixes(sub.choices[name])

    from rapidserve.partition.profile_cmd import add_profile_parser

    add_profile_parser(sub, add_model_args, add_partition_args, positive_int)
    # imported here, not at the top: a worker process re-imports this module when it was the main one (`python -m
    # rapidserve.cli serve`: multiprocessing's spawn start runs the parent's main module again), and the load
    # generator's imports (aiohttp's client, numpy) cost each worker about 0.7 CPU-s there for nothing
    from rapidserve.benchmark.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def _usage_errors() -> tuple[type[Exception], ...]:
    """What ends a command with a message and EXIT_USAGE: a bad configuration, invalid sampling parameters and
    the like (ValueError), and a model that cannot be loaded (the loader's ModelLoadError, once the command has
    imported the loader: one that never did, `bench` or a flag argparse refused, started without torch)."""
    model_load_error = getattr(sys.modules.get("rapidserve.loader"), "ModelLoadError", None)
    return (ConfigError, ValueError) if model_load_error is None else (ConfigError, ValueError, model_load_error)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except _usage_errors() as e:
        print(f"rapidserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    code = main()
    # The process ends here: the heap (torch, transformers, the tokenizer: millions of objects) is frozen so that the
    # interpreter's last garbage collection at exit skips it. That pass collected nothing worth it and took about
    # 1 CPU-s after a `serve` (0.9 s more between SIGTERM and the exit, measured on 2 cores). Not where Triton is
    # loaded (a GPU run's kernels): its bindings (nanobind) would report every object left alive as a leak.
    if "triton" not in sys.modules:
        import gc

        gc.freeze()
    sys.exit(code)
