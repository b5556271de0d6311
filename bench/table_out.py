"""The `--out DIR` files of a small bench script that prints one markdown table: <stem>.json (its arguments and rows)
and <stem>.md (the command line, then the table). Used by bench/frontend_load.py, bench/margin_sim.py and
bench/vllm_step_profile.py."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def md_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the header `head`, then a line a row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def write_table_files(out: Path | None, stem: str, args: argparse.Namespace, rows: list[dict[str, Any]],
                      md: str, meta: dict[str, Any] | None = None) -> None:
    """Write DIR/<stem>.json and DIR/<stem>.md where `out` is a folder (made if missing); nothing where it is None.
    `meta`: more top-level keys of the JSON, between "args" and "rows" (what was measured on: versions, device)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    given = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (out / f"{stem}.json").write_text(json.dumps({"args": given, **(meta or {}), "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(f"`python bench/{stem}.py {' '.join(sys.argv[1:])}`\n\n{md}\n")
