"""A profile measured where the user runs: `rapidserve serve` on a GPU with no profile for its (GPU, model,
tensor-parallel size, variant: fp8 weights / KV cache, profile.ProfileVariant) measures a short one at start,
caches it, and the next start reads it.

Which profile an adaptive engine reads (`choose_profile`, pure; table-tested):
  `--profile` given > the committed `profiles/<gpu>__<model>.json` > (auto-profile, the default; not with
  `--no-auto-profile`, which keeps the committed-or-roofline choice of before) the user's cache,
  `$XDG_CACHE_HOME/rapidserve/profiles/` or `~/.cache/rapidserve/profiles/` under the committed file name with a
  digest of the model's shape before `.json` (`cache_filename`: two models named alike, folders `/a/model` and
  `/b/model`, keep a cache each instead of measuring over each other at every start) >
  a short profile measured now and cached there > the roofline estimate.
Nothing is measured on a CPU, under tensor parallelism (one rank's shard profile comes from `rapidserve
profile --shard-of-tp N`), or where no profile is read at all (partition off or static, backend none,
hybrid/disagg mode). `--policy duet` reads a measured profile as rapid does (its step costs,
partition/step_costs.ProfileCosts), so it is measured for too: on an H200 (2026-11-29) duet deciding from the
roofline held its 50 ms SLO to 7 req/s where, from a measured profile, it held it to its peak.

Where it runs: `with_auto_profile` (the CLI, after the config is built, before the engine starts) runs
`profile_for_start` in a child process (spawn), because the GPU's name (the profile's key) and the
measurement need the GPU, which the server process itself never initialises. The child looks for the
committed and the cached profile; only when neither loads does it measure (`measure_short`): it loads the
model alone on the GPU, opens every configuration's decode and prefill streams, captures the decode graphs,
measures peaks for the roofline, then the cells of `profile_budget.short_spec` in `cell_order` until
`BUDGET_S` after the child was started (loading included), fills the rest from the roofline scaled by what
it measured, saves the profile atomically in the cache and exits, giving the GPU back before the engine's
workers start. The engine then reads the cached file as it would one given with `--profile`. One log line
says what was done. A child that fails, finds no time left to measure, or overruns (killed at `BUDGET_S` +
`HANG_S`) leaves the roofline in place with a warning: auto-profiling never fails a start. A cached profile
that does not load (corrupt, or for another GPU, model or size under that name) is ignored with a warning
and measured again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import msgspec

from rapidserve.config import EngineConfig
from rapidserve.partition.profile import (
    OVERALLOCATED,
    Configuration,
    Profile,
    ProfileError,
    ProfileVariant,
    default_profiles_dir,
    load_profile,
    model_label,
    model_shape,
    profile_filename,
    save_profile,
    variant_of,
)
from rapidserve.partition_config import PartitionConfig

log = logging.getLogger("rapidserve.partition")

BUDGET_S = 55.0  # the child's whole run, from its start (loading included): under a minute with its exit
HANG_S = 120.0  # past the budget, a child that has not answered is taken as hung and killed

CacheState = Literal["absent", "valid", "corrupt"]
ChoiceKind = Literal["given", "committed", "cached", "measure", "roofline", "unused"]


@dataclass(frozen=True)
class ProfileChoice:
    """Which profile the engine reads: `path` for given/committed/cached (the file) and measure (where the
    measured profile goes); `why` in words for the log."""

    kind: ChoiceKind
    path: Path | None
    why: str


def cache_filename(gpu: str, model: str, tp: int, variant: ProfileVariant | None, shape: str) -> str:
    """The auto-profile cache's file: `profile_filename` with the first 8 hex digits of the SHA-1 of the model's shape
    (`profile.model_shape`) before `.json`, so that models named alike keep a cache each (the profile's own
    model_shape is still checked when it loads)."""
    digest = hashlib.sha1(shape.encode()).hexdigest()[:8]
    return f"{profile_filename(gpu, model, tp, variant).removesuffix('.json')}__{digest}.json"


def profile_cache_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_CACHE_HOME/rapidserve/profiles`, or `~/.cache/rapidserve/profiles` (`$HOME` from `env`)."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base) / "rapidserve" / "profiles"


def choose_profile(*, given: str | None, committed: Path, committed_exists: bool, cached: Path, cache: CacheState,
                   auto: bool, on_gpu: bool, tp: int, reads_profile: bool) -> ProfileChoice:
    """The profile an adaptive engine reads (module docstring), from what is known: `reads_profile` (rapid mode's
    adaptive partition on a backend that splits), the `--profile` given, whether the committed file exists and
    the cached file's state, `auto` (not `--no-auto-profile`), whether the run is on a GPU and its tensor-parallel
    size (every policy that reads a profile, duet included, gets the same choice)."""
    if not reads_profile:
        return ProfileChoice("unused", None, "no profile is read (partition off or static, no partition backend, "
                                             "or not rapid mode)")
    if given:
        return ProfileChoice("given", Path(given), "--profile")
    if committed_exists:
        return ProfileChoice("committed", committed, "the committed profile of this GPU and model")
    if not auto:
        return ProfileChoice("roofline", None, "--no-auto-profile")
    if not on_gpu:
        return ProfileChoice("roofline", None, "no GPU: nothing to measure")
    if tp > 1:
        return ProfileChoice("roofline", None, f"tensor parallel {tp}: `rapidserve profile --shard-of-tp {tp}` "
                                               "measures one rank's shard")
    if cache == "valid":
        return ProfileChoice("cached", cached, "the profile measured and cached at an earlier start")
    return ProfileChoice("measure", cached, "no profile of this GPU and model"
                         + (" (the cached one does not load)" if cache == "corrupt" else ""))


def reads_profile(cfg: EngineConfig) -> bool:
    """Whether the engine `cfg` starts reads a partition profile that can change what it does: not `--policy duet`
    without an ITL SLO, which fuses every step with the whole token budget whatever a profile says (measuring one
    would only delay its start)."""
    p = cfg.partition
    no_slo_duet = p.policy == "duet" and p.slo_itl_ms is None
    return cfg.launch.mode == "rapid" and p.mode == "adaptive" and p.backend != "none" and not no_slo_duet


def cache_state(path: Path, gpu: str, model: str, tp: int = 1,
                variant: ProfileVariant | None = None, shape: str | None = None) -> tuple[CacheState, str]:
    """The cached profile's state, and what is wrong with it when it does not load (any ProfileError: bad
    JSON, a failed validation, another GPU, model, size or variant: fp8 weights, fp8 KV cache; with `shape`
    (profile.model_shape), a model of another shape under the same name)."""
    if not path.exists():
        return "absent", ""
    try:
        load_profile(path, expect_gpu=gpu, expect_model=model_label(model), expect_tp=tp,
                     expect_variant=variant or ProfileVariant(), expect_shape=shape)
    except ProfileError as e:
        return "corrupt", str(e)
    return "valid", ""


# ---- the child process ----------------------------------------------------------------------------------
class ChildResult(msgspec.Struct, frozen=True):
    """The child's one message to the parent (msgpack over a pipe): what it found or did, kind (a ChoiceKind,
    "measured", or "failed"), the profile file the engine should be given (cached or measured), the log line,
    and a warning to log first (a cached profile ignored)."""

    kind: str
    path: str | None
    message: str
    warning: str = ""


def measure_short(cfg: EngineConfig, gpu: str, deadline: float, *, clock: Callable[[], float] = time.monotonic,
                  show_progress: bool = True) -> tuple[Profile | None, str]:
    """Measure `cfg`'s model on this device within `deadline` (`clock`'s time): the short profile, or None and
    why nothing could be measured. Loads the model (a runner of its own: run it where nothing else holds the
    GPU), opens every configuration of `cfg.partition.decode_shares`, measures the roofline's peaks."""
    from tqdm import tqdm

    from rapidserve.loader import resolve_model
    from rapidserve.partition.backend import detect_kind, device_granularity, open_backend, plan_configurations
    from rapidserve.partition.peaks import measure_peaks
    from rapidserve.partition.profile_budget import budgeted_profile, cell_order, measure_within, short_spec
    from rapidserve.partition.profile_cmd import for_profiling
    from rapidserve.partition.profiler import entry_of, prepare
    from rapidserve.partition.roofline_profile import roofline_profile
    from rapidserve.runner import ModelRunner, resolve_device, resolve_dtype

    spec = short_spec(cfg.scheduler.max_num_seqs, cfg.max_model_len, cfg.scheduler.max_num_batched_tokens)
    p = cfg.partition
    pcfg = for_profiling(cfg, spec, PartitionConfig(backend=p.backend, slo_itl_ms=p.slo_itl_ms,
                                                    decode_shares=p.decode_shares))
    dev = resolve_device(pcfg.runner.device)  # as runner.load_runner, with its loading bar
    source = resolve_model(pcfg.model, preset_device=dev, preset_dtype=resolve_dtype(pcfg.runner.dtype, dev))
    runner = ModelRunner(pcfg, source, show_progress=show_progress)
    kind = detect_kind(runner.device) if p.backend == "auto" else p.backend
    g = device_granularity(kind, runner.device)
    configs = (plan_configurations(g, p.decode_shares) if kind != "none"
               else [Configuration(OVERALLOCATED, 0, g.total)])
    backend = open_backend(kind, runner.device, configs, ("decode", "prefill"))
    peaks = measure_peaks(runner.device, runner.dtype, fp8=cfg.quantization.enabled)
    roof = roofline_profile(cfg.model_config, gpu, model_label(cfg.model), peaks, configs, spec.batch_buckets,
                            spec.context_buckets, spec.prefill_tokens, dtype_bytes=runner.dtype.itemsize,
                            kv_bytes=runner.kv_dtype.itemsize, variant=variant_of(cfg), quant=cfg.quantization)
    if clock() >= deadline:
        return None, "loading the model took the whole budget before a cell could be measured"
    prof, pitems = prepare(runner, backend, spec, show_progress=False)
    order = cell_order([c.name for c in configs], spec.batch_buckets, spec.context_buckets)
    left = max(0.0, deadline - clock())
    bar = tqdm(total=len(order), desc=f"auto-profile {model_label(cfg.model)} ({left:.0f} s left)", unit="cell",
               disable=not show_progress)
    measured = measure_within(order, lambda c: entry_of(*c, prof.measure(*c, pitems)), clock, deadline,
                              on_cell=lambda c, done: bar.update(1))
    bar.close()
    if not measured:
        return None, "loading and graph capture took the whole budget before a cell could be measured"
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    roof = msgspec.structs.replace(roof, num_compute_units=g.total)  # the backend's units, as `rapidserve profile`
    return budgeted_profile(measured, roof, stamp), ""


def profile_for_start(cfg: EngineConfig, cache_dir: Path, deadline: float, *, on_gpu: bool | None = None,
                      measure: Callable[..., tuple[Profile | None, str]] = measure_short,
                      clock: Callable[[], float] = time.monotonic) -> ChildResult:
    """The child's work (module docstring): look for the committed and the cached profile of this GPU, measure
    and cache one when neither loads. `on_gpu` None: whether `cfg`'s device is a GPU (tests pass True to run the
    measuring path on a CPU)."""
    from rapidserve.partition.backend import detect_kind
    from rapidserve.partition.plan import gpu_name
    from rapidserve.runner import resolve_device

    device = resolve_device(cfg.runner.device)
    gpu = gpu_name(device)
    if on_gpu is None:
        on_gpu = device.type == "cuda"
        splits = cfg.partition.backend != "auto" or detect_kind(device) != "none"
    else:  # the caller says: as on a GPU that splits
        splits = True
    tp, variant = cfg.parallel.tensor_parallel_size, variant_of(cfg)
    committed = default_profiles_dir() / profile_filename(gpu, cfg.model, tp, variant)
    shape = model_shape(cfg.model_config)
    cached = cache_dir / cache_filename(gpu, cfg.model, tp, variant, shape)
    state, problem = cache_state(cached, gpu, cfg.model, tp, variant, shape)
    choice = choose_profile(given=cfg.partition.profile, committed=committed, committed_exists=committed.exists(),
                            cached=cached, cache=state, auto=True, on_gpu=on_gpu, tp=tp,
                            reads_profile=reads_profile(cfg) and splits)
    if choice.kind != "measure":
        return ChildResult(choice.kind, str(choice.path) if choice.path else None,
                           f"auto-profile: {choice.why}" + (f": {choice.path}" if choice.path else ""))
    warning = (f"auto-profile: the cached profile {cached} does not load ({problem}): ignored, measuring a new one"
               if state == "corrupt" else "")
    t0 = clock()
    prof, why = measure(cfg, gpu, deadline, clock=clock)
    if prof is None:
        return ChildResult("roofline", None, f"auto-profile: {why}; the engine uses the roofline estimate (`rapidserve "
                                             f"profile --model {cfg.model}` measures a profile; --no-auto-profile "
                                             "skips this)", warning)
    save_profile(prof, cached)
    return ChildResult("measured", str(cached),
                       f"auto-profile: measured a short profile of {model_label(cfg.model)} on {gpu} in "
                       f"{clock() - t0:.0f} s ({prof.note}), cached at {cached}: the engine reads it, and so will the "
                       f"next start (`rapidserve profile` measures a full one; --no-auto-profile skips this)", warning)


def _child_main(cfg: EngineConfig, cache_dir: str, deadline_wall: float, conn: Any) -> None:
    """The spawned child: `profile_for_start` with the budget left of the deadline the parent set; any error is
    sent back as a failed result."""
    deadline = time.monotonic() + (deadline_wall - time.time())
    try:
        result = profile_for_start(cfg, Path(cache_dir), deadline)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which starts on the roofline
        result = ChildResult("failed", None, f"auto-profile: measuring failed ({type(e).__name__}: {e}); the "
                                             "engine uses the roofline estimate")
    conn.send_bytes(msgspec.msgpack.encode(result))
    conn.close()


def run_child(cfg: EngineConfig, cache_dir: Path, budget_s: float = BUDGET_S, hang_s: float = HANG_S,
              target: Callable[..., None] = _child_main) -> ChildResult:
    """`target` (the child's entry) in a spawned process, waited for at most `budget_s + hang_s`; killed past
    that, or reported as soon as it died without an answer. It has exited (its GPU memory given back) on
    return."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(cfg, str(cache_dir), time.time() + budget_s, send),
                       name="rapidserve-auto-profile", daemon=True)
    proc.start()
    send.close()
    limit = time.monotonic() + budget_s + hang_s
    try:
        while not recv.poll(0.2) and proc.is_alive() and time.monotonic() < limit:
            pass
        if recv.poll(0):  # an answer, or the end of the pipe (the child died: EOFError)
            result = msgspec.msgpack.decode(recv.recv_bytes(), type=ChildResult)
        elif proc.is_alive():
            proc.kill()
            result = ChildResult("failed", None, f"auto-profile: the measuring process gave no answer in "
                                                 f"{budget_s + hang_s:.0f} s and was killed; the engine uses the "
                                                 "roofline estimate")
        else:
            raise EOFError
    except EOFError:
        proc.join(10)
        result = ChildResult("failed", None, f"auto-profile: the measuring process died (exit code {proc.exitcode}); "
                                             "the engine uses the roofline estimate")
    finally:
        recv.close()
        proc.join(30)  # an answered child exits (and gives its GPU memory back) right after sending
        if proc.is_alive():
            proc.kill()
            proc.join()
    return result


def with_auto_profile(cfg: EngineConfig, *, auto: bool, cache_dir: Path,
                      run: Callable[[EngineConfig, Path], ChildResult] | None = None) -> EngineConfig:
    """`cfg`, given the cached or newly measured profile of its GPU and model when auto-profiling applies
    (module docstring); unchanged otherwise (the engine then finds a committed profile itself, or estimates
    one from the roofline). Says what it did in one log line (and a warning for a cached profile ignored or a
    measurement that failed). `run`: how the child is run (None: `run_child`; tests pass a fake)."""
    from rapidserve.runner import resolve_device

    p = cfg.partition
    before = choose_profile(given=p.profile, committed=Path(), committed_exists=False, cached=cache_dir,
                            cache="absent", auto=auto, on_gpu=resolve_device(cfg.runner.device).type == "cuda",
                            tp=cfg.parallel.tensor_parallel_size, reads_profile=reads_profile(cfg))
    if before.kind != "measure":  # nothing this GPU's name could change: no child
        return cfg
    res = (run or run_child)(cfg, cache_dir)
    if res.warning:
        log.warning(res.warning)
    if res.kind == "failed":
        log.warning(res.message)
        return cfg
    log.info(res.message)
    if res.kind in ("cached", "measured") and res.path is not None:
        return dataclasses.replace(cfg, partition=dataclasses.replace(p, profile=res.path))
    return cfg
