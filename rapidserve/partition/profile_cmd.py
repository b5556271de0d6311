"""The `rapidserve profile` command: measure, save, plot, and check the roofline estimate against it.

    rapidserve profile --model preset:llama-3-8b [--slo-itl-ms 50] [--out profiles/...json]

Writes the profile (validated JSON, schema in profile.py), a PNG next to it (decode step latency
beside prefill against the decode share, a line per batch size, the SLO drawn in; prefill tokens/s
against the share) and `<name>.roofline.md`, the roofline model's error against these measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.partition.profile import DEFAULT_BATCH_BUCKETS, OVERALLOCATED, Profile, model_shape
from rapidserve.partition_config import PartitionConfig

if TYPE_CHECKING:
    from rapidserve.partition.profiler import ProfileSpec


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1,8,32") from None
    if not vals or any(v <= 0 for v in vals) or list(vals) != sorted(set(vals)):
        raise argparse.ArgumentTypeError(f"{text!r}: give strictly ascending positive integers, e.g. 1,8,32")
    return vals


def _share_list(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated shares in (0, 1)") from None
    if not vals or any(not 0 < v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: every decode share must be in (0, 1)")
    return vals


def add_profile_parser(sub: Any, add_model_args: Callable[[argparse.ArgumentParser], None],
                       add_partition_args: Callable[..., None], positive_int: Callable[[str], int]) -> None:
    p = sub.add_parser("profile", help="measure decode latency vs compute share (the partition profile)",
                       allow_abbrev=False)
    add_model_args(p)
    add_partition_args(p, with_mode=False)
    p.add_argument("--out", default=None, help="profile path (default: profiles/<gpu>__<model>.json; with fp8 "
                                               "weights and/or KV cache <gpu>__<model>__fp8__kvfp8.json)")
    p.add_argument("--batch-buckets", type=_int_list, default=DEFAULT_BATCH_BUCKETS)
    p.add_argument("--context-buckets", type=_int_list, default=(512, 2048, 8192))
    p.add_argument("--prefill-tokens", type=positive_int, default=4096, help="tokens per concurrent prefill forward")
    p.add_argument("--decode-shares", type=_share_list, default=(0.125, 0.25, 0.375, 0.5),
                   help="decode shares of the splits to measure (rounded to the device's granularity)")
    p.add_argument("--decode-reps", type=positive_int, default=20)
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline comparison")
    p.add_argument("--shard-of-tp", type=positive_int, default=1, metavar="N",
                   help="measure one rank's shard of the model under tensor parallel N, alone on this GPU "
                        "(random weights of the shard's shapes; the engine adds the collectives from its link "
                        "model when it serves with -tp N); written to profiles/<gpu>__<model>__tpN.json")
    p.set_defaults(func=cmd_profile)


def cmd_profile(a: argparse.Namespace) -> int:
    unread = unread_model_flags(a)  # before anything loads
    if unread:
        raise ConfigError("; ".join(unread))
    from rapidserve.config_builder import allow_long_max_model_len, build_engine_config
    from rapidserve.partition.backend import detect_kind, device_granularity, open_backend, plan_configurations
    from rapidserve.partition.plan import gpu_name
    from rapidserve.partition.profile import (
        Configuration,
        default_profiles_dir,
        profile_filename,
        save_profile,
        variant_of,
    )
    from rapidserve.partition.profiler import ProfileSpec, run_profile
    from rapidserve.runner import ModelRunner

    spec = ProfileSpec(a.batch_buckets, a.context_buckets, a.prefill_tokens, a.decode_reps)
    # The model flags are built as given, so that the one flag check (policy_spec, run "profile") refuses those the
    # profile does not read before anything loads; then `for_profiling` puts the profile's own sizes in their place.
    # --max-model-len is checked against the model's max_position_embeddings as in every run (unless
    # $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN); the length the buckets need may pass it: they measure timings, not text.
    # --slo-itl-ms none is refused there too (policy_spec: the profile run `needs` the SLO for its table and plot)
    cfg, source = build_engine_config(
        a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
        allow_long_max_model_len=allow_long_max_model_len(os.environ),
        gpu_memory_utilization=a.gpu_memory_utilization, block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
        kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        prefill_batch_tokens=a.prefill_batch_tokens, enable_prefix_caching=a.enable_prefix_caching,
        async_scheduling=a.async_scheduling, prefill_graph_tokens=a.prefill_graph_tokens,
        enforce_eager=a.enforce_eager, seed=a.seed, attention_backend=a.attention_backend,
        quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, run="profile",
        revision=a.revision, download_dir=a.download_dir, load_format=a.load_format,
        partition=PartitionConfig(backend=a.partition_backend, slo_itl_ms=a.slo_itl_ms, decode_shares=a.decode_shares))
    whole = model_shape(cfg.model_config)  # what the profile records, a shard's too (the engine checks the whole's)
    if a.shard_of_tp > 1:
        cfg, source = shard_of_tp(cfg, source, a.shard_of_tp)
    cfg = for_profiling(cfg, spec, PartitionConfig(backend=a.partition_backend, slo_itl_ms=a.slo_itl_ms,
                                                   decode_shares=a.decode_shares))
    runner = ModelRunner(cfg, source)
    kind = detect_kind(runner.device) if a.partition_backend == "auto" else a.partition_backend
    g = device_granularity(kind, runner.device)
    configs = plan_configurations(g, a.decode_shares) if kind != "none" else [Configuration(OVERALLOCATED, 0, g.total)]
    backend = open_backend(kind, runner.device, configs, ("decode", "prefill"))
    gpu = gpu_name(runner.device)
    print(f"rapidserve profile: {cfg.model} on {gpu}, backend {kind}, configurations "
          f"{[c.name for c in configs]}, {len(configs) * len(spec.batch_buckets) * len(spec.context_buckets)} cells",
          file=sys.stderr, flush=True)
    run = run_profile(runner, backend, spec, gpu, cfg.model)
    if a.shard_of_tp > 1:
        run = dataclasses.replace(run, profile=msgspec.structs.replace(run.profile, tensor_parallel_size=a.shard_of_tp,
                                                                       model_shape=whole))
    out = Path(a.out) if a.out else default_profiles_dir() / profile_filename(gpu, cfg.model, a.shard_of_tp,
                                                                              variant_of(cfg))
    save_profile(run.profile, out)
    summary: dict[str, Any] = {"profile": str(out), "seconds": round(run.seconds, 1),
                               "solo_prefill_tokens_per_s": round(run.solo_prefill_tokens_per_s, 1)}
    png = out.with_suffix(".png")
    if plot_profile(run.profile, png, a.slo_itl_ms):
        summary["plot"] = str(png)
    if not a.no_roofline:
        summary["roofline"] = roofline_check(cfg, runner, run.profile, spec, out)
    print(slo_table(run.profile, a.slo_itl_ms))
    print(json.dumps(summary, indent=2))
    return 0


def unread_model_flags(a: argparse.Namespace) -> list[str]:
    """The model flags (every command's, `cli_args.add_model_args`) given to `rapidserve profile` that it does not
    read, one sentence each with its fix; those the engine's settings check refuses (policy_spec, run "profile") are
    its. --tokenizer: the forwards are of token ids; --seed: nothing is sampled (random weights are seeded by their
    names)."""
    out = []
    if a.tokenizer is not None:
        out.append(f"--tokenizer {a.tokenizer}: `rapidserve profile` times forwards of token ids and reads no "
                   "tokenizer; drop it")
    if a.seed != 0:
        out.append(f"--seed {a.seed}: `rapidserve profile` samples no tokens (it times forwards; random weights are "
                   "seeded by their names); drop it")
    return out


def for_profiling(cfg: EngineConfig, spec: ProfileSpec, partition: PartitionConfig) -> EngineConfig:
    """`cfg` as the profiler runs it (here and at a serve's start, partition/autoprofile.py): one process and
    GPU, decode graphs of the batch buckets, a scheduler holding the largest batch, forwards of `prefill_tokens`
    and the longest context or forward (past the model's positions if need be: timings, not text)."""
    from rapidserve.config import ParallelConfig
    from rapidserve.launch_config import LaunchConfig

    longest = max(max(spec.context_buckets), spec.prefill_tokens) + cfg.cache.block_size
    sched = dataclasses.replace(cfg.scheduler, max_num_seqs=max(spec.batch_buckets),
                                max_num_batched_tokens=spec.prefill_tokens, prefill_batch_tokens=None,
                                max_model_len=max(longest, cfg.scheduler.max_model_len or 0),
                                allow_long_max_model_len=True)
    return dataclasses.replace(cfg, scheduler=sched, partition=partition, parallel=ParallelConfig(),
                               launch=LaunchConfig(),
                               runner=dataclasses.replace(cfg.runner, graph_batch_sizes=spec.batch_buckets))


def shard_of_tp(cfg: Any, source: Any, tp: int) -> tuple[Any, Any]:
    """The config and weights of tensor-parallel rank 0's shard of `cfg.model`, as a model of its own for one
    GPU (no collectives): its heads, KV heads, MLP features and vocabulary rows (`parallel.shard`), and random
    weights of those shapes (a profile measures timings, not text; no file is read). A model that does not
    split `tp` ways is a usage error naming the size that does not divide."""
    from rapidserve.parallel.shard import ShardError, shard_config, tp_layout

    try:
        shard = shard_config(cfg.model_config, tp_layout(cfg.model_config, tp, 0))
    except ShardError as e:
        raise SystemExit(f"rapidserve profile: --shard-of-tp {tp}: {e}") from None
    from rapidserve.runner import resolve_device, resolve_dtype

    device = resolve_device(cfg.runner.device)  # made where and as a preset's would be (config_builder)
    src = dataclasses.replace(source, config=shard, shard_weights=None,
                              weights=random_weights(shard, device, resolve_dtype(cfg.runner.dtype, device)),
                              description=f"{source.description}, shard 1 of {tp} (random weights)")
    return dataclasses.replace(cfg, model_config=shard), src


def random_weights(shard: Any, device: Any, dtype: Any) -> Callable[[], Any]:
    """A fresh stream of the shard's tensors in load order, random as a preset's (made on `device`)."""
    from rapidserve.loader.presets import preset_tensor
    from rapidserve.loader.source import expected_tensor_shapes

    shapes = expected_tensor_shapes(shard)

    def weights() -> Any:
        for name, shape in shapes.items():
            yield name, preset_tensor(f"shard:{shard.name}", shard, name, shape, device=device, dtype=dtype)

    return weights


def roofline_check(cfg: Any, runner: Any, measured: Profile, spec: Any, out: Path) -> dict[str, Any]:
    """Predict the same table with the roofline model fed with peaks measured now; report its error."""
    from rapidserve.partition.peaks import measure_peaks
    from rapidserve.partition.roofline_error import compare
    from rapidserve.partition.roofline_profile import roofline_profile

    peaks = measure_peaks(runner.device, runner.dtype, fp8=cfg.quantization.enabled)
    predicted = roofline_profile(cfg.model_config, measured.gpu, measured.model, peaks, measured.configurations,
                                 measured.batch_buckets, measured.context_buckets, spec.prefill_tokens,
                                 kv_bytes=runner.kv_dtype.itemsize, variant=measured.variant, quant=cfg.quantization)
    report = compare(measured, predicted)
    md = out.with_suffix(".roofline.md")
    md.write_text(report.to_markdown() + "\n")
    stats = {m: {"median_abs_error": round(s.median_abs, 4), "p90_abs_error": round(s.p90_abs, 4),
                 "median_signed_error": round(s.median_signed, 4)} for m, s in report.stats.items()}
    return {"report": str(md), "peaks": {"matmul_flops": peaks.matmul_flops, "hbm_bw": peaks.hbm_bw,
                                         "num_compute_units": peaks.num_compute_units,
                                         "fp8_matmul_flops": peaks.fp8_matmul_flops}, "errors": stats}


def slo_table(p: Profile, slo_itl_ms: float) -> str:
    """Per batch bucket and context: the configuration giving prefill the most tokens/s with decode p95
    beside prefill within the SLO (the manager itself keeps a 10% margin below the SLO)."""
    lines = [f"| batch | context | best configuration (p95 beside prefill <= {slo_itl_ms:g} ms) | decode p95 ms "
             "| prefill tok/s |", "|---|---|---|---|---|"]
    for b in p.batch_buckets:
        for x in p.context_buckets:
            cells = [e for e in p.entries if e.batch == b and e.context == x]
            ok = [e for e in cells if e.decode_ms_beside_prefill_p95 <= slo_itl_ms]
            if ok:
                e = max(ok, key=lambda e: e.prefill_tokens_per_s)
                lines.append(f"| {b} | {x} | {e.config} | {e.decode_ms_beside_prefill_p95:.2f} | "
                             f"{e.prefill_tokens_per_s:,.0f} |")
            else:
                e = min(cells, key=lambda e: e.decode_ms_beside_prefill_p95)
                lines.append(f"| {b} | {x} | none meets it (lowest: {e.config}) | "
                             f"{e.decode_ms_beside_prefill_p95:.2f} | {e.prefill_tokens_per_s:,.0f} |")
    return "\n".join(lines)


def plot_profile(p: Profile, path: Path, slo_itl_ms: float) -> bool:
    """Decode p95 beside prefill and prefill tokens/s against the decode share. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("rapidserve profile: matplotlib is not installed; no plot written (pip install matplotlib)",
              file=sys.stderr)
        return False
    share = {c.name: (p.effective_decode_units(c.name) / p.num_compute_units) for c in p.configurations}
    order = sorted(share, key=lambda n: (share[n], n != OVERALLOCATED))
    contexts = p.context_buckets
    fig, axes = plt.subplots(2, len(contexts), figsize=(5 * len(contexts), 8), squeeze=False)
    for j, x in enumerate(contexts):
        ax, ax2 = axes[0][j], axes[1][j]
        for b in p.batch_buckets:
            cells = {e.config: e for e in p.entries if e.batch == b and e.context == x}
            xs = [share[n] for n in order]
            ax.plot(xs, [cells[n].decode_ms_beside_prefill_p95 for n in order], marker="o", label=f"batch {b}")
            ax2.plot(xs, [cells[n].prefill_tokens_per_s for n in order], marker="o", label=f"batch {b}")
        ax.axhline(slo_itl_ms, color="red", linestyle="--", label=f"SLO {slo_itl_ms:g} ms")
        ax.set_yscale("log")
        ax.set_title(f"{p.model} on {p.gpu}\ncontext {x}: decode step p95 beside prefill", fontsize=9)
        ax.set_xlabel("decode share of compute units (1.0 = overallocated)")
        ax.set_ylabel("ms")
        ax2.set_title(f"context {x}: prefill throughput beside decode", fontsize=9)
        ax2.set_xlabel("decode share of compute units (1.0 = overallocated)")
        ax2.set_ylabel("prefill tokens/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
