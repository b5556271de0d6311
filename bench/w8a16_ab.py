"""bench/decode_profile.py's W8A16 A/B (issue 39, ops/triton_w8a16.py): the `w8a16` variant and the table it writes.

    python bench/decode_profile.py --quantization fp8 --variants fused,w8a16 --batches 1,16,64 [--write-w8a16-table]

The `w8a16` variant is the engine's fp8 bundle with W8A16 forced at every row count the kernel takes
(`ops.with_w8a16(bundle, w8a16_table.forced(gpu))`: the fp8 projections of a decode step of up to 64 rows run W8A16
on the tiles `triton_w8a16.plan` gives, the norms, the attention and SiLU-and-mul are the bf16 path's kernels, gate|up
takes SiLU-and-mul in its epilogue), captured and timed as its own graph set beside `fused` (W8A8, the engine as it
runs), each batch launched as the GPU's PDL table chooses, so the two step times sit side by side in one process.
From them `measured_entry` (ops/w8a16_table.py: W8A16 up to the largest batch where it beats W8A8 by more than 1% at
it and at every smaller batch measured) gives this GPU's entry, written with the packaged table's other entries as
<out>/w8a16_table.json and, with `--write-w8a16-table`, into rapidserve/ops/w8a16_table.json of this checkout, where
the engine loads it: commit it from there. Measure with the batches the engine captures around the threshold (e.g.
--batches 1,8,16,24,32,48,64): the entry is a threshold, so a batch not measured below it runs W8A16 too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidserve.ops import Ops, with_w8a16
from rapidserve.ops import w8a16_table as wt

VARIANT = "w8a16"
BASE = "fused"  # the variant W8A16 is measured against: W8A8, the engine's bundle


def variant_ops(fused: Ops, gpu: str) -> Ops:
    """The `w8a16` variant's bundle: `fused` with W8A16 forced on `gpu` (module docstring)."""
    return with_w8a16(fused, wt.forced(gpu))


def measured(rows: list[dict[str, Any]]) -> list[wt.W8a16Row]:
    """Each batch that both variants measured: (batch, W8A8's replay ms, W8A16's), in batch order."""
    by = {(r["variant"], r["batch"]): float(r["replay_ms"]) for r in rows}
    return [wt.W8a16Row(b, by[BASE, b], by[VARIANT, b]) for v, b in sorted(by, key=lambda key: key[1])
            if v == VARIANT and (BASE, b) in by]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """decode_profile.md's section: each batch's step with W8A8 and with W8A16, the change, the launches a step."""
    launches = {(r["variant"], r["batch"]): r.get("launches") for r in rows}
    out = ["\n## W8A16 against W8A8 (`w8a16` against `fused`: graph replay medians, ops/w8a16_table.py)\n",
           "| batch | W8A8 ms | W8A16 ms | W8A16 vs W8A8 | launches a step (W8A8 / W8A16) |", "|---|---|---|---|---|"]
    for m in measured(rows):
        la, lb = launches.get((BASE, m.batch)), launches.get((VARIANT, m.batch))
        steps = f"{la:.0f} / {lb:.0f}" if la is not None and lb is not None else "-"
        out.append(f"| {m.batch} | {m.w8a8_ms:.3f} | {m.w8a16_ms:.3f} | {m.w8a16_ms / m.w8a8_ms - 1:+.1%} | {steps} |")
    return out


def write_table(rows: list[dict[str, Any]], gpu: str, source: str, out: str | Path, repo_path: Path | None,
                packaged: wt.W8a16Table = wt.W8A16_TABLE) -> list[str]:
    """This GPU's W8A16 entry from the two variants' step times (`w8a16_table.measured_entry`), written with the
    `packaged` table's other entries to <out>/w8a16_table.json and, given `repo_path` (rapidserve/ops/w8a16_table.json),
    there too; returns each batch's A/B, the entry and where it went."""
    pairs = measured(rows)
    if not pairs:
        return [f"no W8A16 table written: measure both the `{BASE}` and the `{VARIANT}` variants"]
    notes = [f"batch {m.batch}: W8A16 {m.w8a16_ms / m.w8a8_ms - 1:+.1%} against W8A8" for m in pairs]
    entry = wt.measured_entry(pairs, source)
    table = wt.with_entry(packaged, gpu, entry)
    paths = [Path(out) / "w8a16_table.json", *([repo_path] if repo_path is not None else [])]
    for path in paths:
        wt.write_table(path, table)
    before = packaged.get(gpu)
    notes.append(f"{gpu}: W8A16 up to {entry.max_rows} rows (the engine's until now: "
                 f"{before.max_rows if before is not None else 0})")
    return [*notes, "W8A16 table written: " + ", ".join(map(str, paths))]


__all__ = ["BASE", "VARIANT", "measured", "summary", "variant_ops", "write_table"]
