"""Versioned decode/prefill partition profiles: schema, validated loading, atomic saving, file naming.

A profile holds, for each decode batch bucket x context bucket x configuration, the decode step
latency alone and beside a running prefill (p50/p95, ms) and the prefill throughput (tokens/s)
under that configuration. `rapidserve profile` writes them to `profiles/<gpu>__<model>.json`. Reading its figures
at a batch and context (rounded up, interpolated, extrapolated) is partition/profile_lookup.py's.

The same model runs at other speeds with fp8 weights (--quantization fp8, an FP8 checkpoint) or an fp8 KV cache
(--kv-cache-dtype fp8): those are other profiles (`ProfileVariant`), recorded in the file (`quantization`,
`kv_cache_dtype`; absent in older files: none and auto) and in its name, `<gpu>__<model>__fp8__kvfp8.json`, so a
profile of one is never read for the other (`load_profile(expect_variant=...)` refuses it by name).

A profile is found by the model's name (`model_label`: a folder's last component), which two models can share
(`/a/model` and `/b/model`, a dense model and a mixture-of-experts one): the file records the model's shape too
(`model_shape`: the whole model's, for a shard profile as well; absent in older files: not checked), and
`load_profile(expect_shape=...)` refuses one measured for another shape, naming both.

A key the schema does not know, at the top level or in a configuration or an entry, is refused by name (a misspelt
optional field would otherwise leave its default in force: `"quantisation": "fp8"` read as a bf16 profile), after the
schema version check (a file of a newer version is refused as that).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from rapidserve.jsonfile import DuplicateKeyError, loads_unique, unknown_key, unknown_key_problem

if TYPE_CHECKING:
    from rapidserve.config import EngineConfig, ModelConfig

SUPPORTED_SCHEMA_VERSIONS: tuple[int, ...] = (1,)
OVERALLOCATED = "overallocated"


class ProfileError(ValueError):
    """A profile file is unreadable, malformed, or for another GPU/model."""


class ProfileVariant(msgspec.Struct, frozen=True):
    """What of a run besides the GPU and model changes its timings: its weights' quantization ("none" or "fp8",
    `QuantizationConfig.method`) and its KV cache's dtype ("auto" or "fp8", `CacheConfig.kv_cache_dtype`)."""

    quantization: str = "none"
    kv_cache_dtype: str = "auto"

    @property
    def suffix(self) -> str:
        """The file name's part for it: "" (bf16 weights and cache), "__fp8", "__kvfp8", "__fp8__kvfp8"."""
        return ("__fp8" if self.quantization == "fp8" else "") + ("__kvfp8" if self.kv_cache_dtype == "fp8" else "")

    def describe(self) -> str:
        return (f"{'fp8' if self.quantization == 'fp8' else 'unquantized'} weights, "
                f"{'an fp8' if self.kv_cache_dtype == 'fp8' else 'the model dtype'} KV cache")


def variant_of(cfg: EngineConfig) -> ProfileVariant:
    """The profile variant `cfg` runs."""
    return ProfileVariant(cfg.quantization.method, cfg.cache.kv_cache_dtype)


class Configuration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A compute split. decode_units == 0 means overallocated: decode (and prefill) use every unit."""

    name: str
    decode_units: int
    prefill_units: int

    @property
    def decode_whole(self) -> bool:
        """Whether decode's stream may use every unit (overallocated)."""
        return self.decode_units == 0


# `rapidserve profile`'s decode batches (--batch-buckets): up to the largest decode graph (runner/decode_graphs.py,
# 512), as with vLLM's 1024-sequence default the decode batch runs past 128 (1024:256 at 30 req/s: 140-300); a batch
# past a profile's largest bucket is read by extrapolation (`profile_lookup.estimate`)
DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512)


class Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    config: str
    batch: int
    context: int
    decode_ms_alone_p50: float
    decode_ms_alone_p95: float
    decode_ms_beside_prefill_p50: float
    decode_ms_beside_prefill_p95: float
    prefill_tokens_per_s: float


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gpu: str
    model: str
    num_compute_units: int
    configurations: list[Configuration]
    batch_buckets: list[int]
    context_buckets: list[int]
    entries: list[Entry]
    created: str
    source: Literal["measured", "roofline"]
    schema_version: int = 1
    # prompt tokens of each prefill forward that the beside-prefill figures ran against (`rapidserve profile
    # --prefill-tokens`, default 4096, which the profiles written before this field was added all used)
    prefill_tokens: int = 4096
    # > 1: one tensor-parallel rank's shard of the model, measured alone on one GPU (`rapidserve profile
    # --shard-of-tp N`): its figures hold no collectives; the engine adds them from the roofline's link model
    # (`roofline_profile.with_collectives`) when it serves at that tensor-parallel size
    tensor_parallel_size: int = 1
    # how the figures were made beyond `source`, for the start-up log (an auto-profile measured at start:
    # how many cells were measured, the others being the roofline's scaled by them; partition/autoprofile.py)
    note: str = ""
    # the run's weights and KV cache (ProfileVariant; the profiles written before these fields: none and auto)
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    # the whole model's shape (`model_shape`; "" in the profiles written before this field: not checked)
    model_shape: str = ""

    @property
    def variant(self) -> ProfileVariant:
        return ProfileVariant(self.quantization, self.kv_cache_dtype)

    def configuration(self, name: str) -> Configuration | None:
        for c in self.configurations:
            if c.name == name:
                return c
        return None

    def effective_decode_units(self, name: str) -> int:
        """Units decode may use under `name` (overallocated counts as all of them)."""
        c = self.configuration(name)
        if c is None:
            raise KeyError(name)
        return self.num_compute_units if c.decode_units == 0 else c.decode_units

    def effective_prefill_units(self, name: str) -> int:
        """Units prefill may use under `name` (overallocated counts as all of them)."""
        c = self.configuration(name)
        if c is None:
            raise KeyError(name)
        return self.num_compute_units if c.decode_units == 0 else c.prefill_units


def _fail(path: str, field: str, msg: str) -> ProfileError:
    return ProfileError(f"profile {path}: field `{field}`: {msg}")


def _check_keys(path: str, top: dict[str, object]) -> None:
    """A ProfileError naming the first key the schema does not know: at the top level (`$`), then in
    `configurations[i]`, then in `entries[i]` (objects of another type are the typed read's to refuse)."""
    objects: list[tuple[str, object, type[msgspec.Struct]]] = [("$", top, Profile)]
    for name, typ in (("configurations", Configuration), ("entries", Entry)):
        items = top.get(name)
        objects += [(f"{name}[{i}]", d, typ) for i, d in enumerate(items)] if isinstance(items, list) else []
    for where, d, typ in objects:
        allowed = tuple(f.encode_name for f in msgspec.structs.fields(typ))
        key = unknown_key(d, allowed) if isinstance(d, dict) else None
        if key is not None:
            field = key if where == "$" else f"{where}.{key}"
            raise _fail(path, field, unknown_key_problem(key, allowed, where))


def _check_buckets(path: str, name: str, values: list[int]) -> None:
    if not values:
        raise _fail(path, name, "must not be empty")
    for i, v in enumerate(values):
        if v <= 0:
            raise _fail(path, f"{name}[{i}]", f"must be positive, got {v}")
        if i and v <= values[i - 1]:
            raise _fail(path, f"{name}[{i}]", f"buckets must be strictly ascending, got {values}")


def validate_profile(p: Profile, path: str = "<profile>") -> None:
    """Raise ProfileError naming the file and field of the first problem found."""
    if p.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        raise _fail(
            path,
            "schema_version",
            f"unsupported version {p.schema_version}; supported versions: {list(SUPPORTED_SCHEMA_VERSIONS)}",
        )
    for field in ("gpu", "model"):
        if not getattr(p, field):
            raise _fail(path, field, "must not be empty")
    if p.num_compute_units <= 0:
        raise _fail(path, "num_compute_units", f"must be positive, got {p.num_compute_units}")
    if p.prefill_tokens <= 0:
        raise _fail(path, "prefill_tokens", f"must be positive, got {p.prefill_tokens}")
    if not p.configurations:
        raise _fail(path, "configurations", "must not be empty")
    names: set[str] = set()
    n = p.num_compute_units
    for i, c in enumerate(p.configurations):
        f = f"configurations[{i}]"
        if not c.name:
            raise _fail(path, f"{f}.name", "must not be empty")
        if c.name in names:
            raise _fail(path, f"{f}.name", f"duplicate configuration {c.name!r}")
        names.add(c.name)
        if not 0 <= c.decode_units <= n:
            raise _fail(path, f"{f}.decode_units", f"must be within 0..{n} (num_compute_units), got {c.decode_units}")
        if not 0 <= c.prefill_units <= n:
            raise _fail(path, f"{f}.prefill_units", f"must be within 0..{n} (num_compute_units), got {c.prefill_units}")
        if c.decode_units and c.decode_units + c.prefill_units > n:
            raise _fail(
                path,
                f"{f}.prefill_units",
                f"decode_units + prefill_units = {c.decode_units + c.prefill_units} exceeds num_compute_units {n}",
            )
    _check_buckets(path, "batch_buckets", p.batch_buckets)
    _check_buckets(path, "context_buckets", p.context_buckets)
    if p.tensor_parallel_size < 1:
        raise _fail(path, "tensor_parallel_size", f"must be >= 1, got {p.tensor_parallel_size}")
    for field, allowed in (("quantization", ("none", "fp8")), ("kv_cache_dtype", ("auto", "fp8"))):
        if getattr(p, field) not in allowed:
            raise _fail(path, field, f"must be one of {', '.join(allowed)}, got {getattr(p, field)!r}")
    seen: set[tuple[str, int, int]] = set()
    for i, e in enumerate(p.entries):
        f = f"entries[{i}]"
        if e.config not in names:
            raise _fail(path, f"{f}.config", f"unknown configuration {e.config!r}")
        if e.batch not in p.batch_buckets:
            raise _fail(path, f"{f}.batch", f"{e.batch} is not one of batch_buckets")
        if e.context not in p.context_buckets:
            raise _fail(path, f"{f}.context", f"{e.context} is not one of context_buckets")
        key = (e.config, e.batch, e.context)
        if key in seen:
            raise _fail(path, f, f"duplicate entry for config={e.config!r} batch={e.batch} context={e.context}")
        seen.add(key)
        for name in (
            "decode_ms_alone_p50",
            "decode_ms_alone_p95",
            "decode_ms_beside_prefill_p50",
            "decode_ms_beside_prefill_p95",
            "prefill_tokens_per_s",
        ):
            v = getattr(e, name)
            if not v > 0 or v == float("inf"):
                raise _fail(path, f"{f}.{name}", f"must be a positive finite number, got {v}")
        for kind in ("alone", "beside_prefill"):
            p50 = getattr(e, f"decode_ms_{kind}_p50")
            p95 = getattr(e, f"decode_ms_{kind}_p95")
            if p95 < p50:
                raise _fail(path, f"{f}.decode_ms_{kind}_p95", f"p95 {p95} is below p50 {p50}")
    for c in p.configurations:
        for b in p.batch_buckets:
            for x in p.context_buckets:
                if (c.name, b, x) not in seen:
                    raise _fail(path, "entries", f"missing entry for config={c.name!r} batch={b} context={x}")


def model_shape(cfg: ModelConfig) -> str:
    """What of a model's architecture its timings follow, in one line (`Profile.model_shape`): the family, layers,
    hidden size, heads, KV heads, head size, MLP features and vocabulary, and a mixture-of-experts model's experts
    (how many, how many a token, each one's features, the layers with a dense MLP)."""
    out = (f"{cfg.arch} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}/{cfg.num_kv_heads}x"
           f"{cfg.head_dim} intermediate={cfg.intermediate_size} vocab={cfg.vocab_size}")
    if cfg.moe is not None:
        out += (f" experts={cfg.moe.num_experts} top_k={cfg.moe.top_k} expert_intermediate={cfg.moe.intermediate_size}"
                f" dense_layers={len(cfg.moe.dense_layers)}")
    return out


def load_profile(
    path: str | os.PathLike[str], expect_gpu: str | None = None, expect_model: str | None = None,
    expect_tp: int | None = None, expect_variant: ProfileVariant | None = None, expect_shape: str | None = None,
) -> Profile:
    """Read and validate a profile (`read_profile`); optionally check it was measured for this GPU, model,
    tensor-parallel size, variant and model shape (`check_profile`)."""
    return check_profile(read_profile(path), path, expect_gpu=expect_gpu, expect_model=expect_model,
                         expect_tp=expect_tp, expect_variant=expect_variant, expect_shape=expect_shape)


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read, parse and validate the profile file `path` (ProfileError names the file and the field). The one place a
    profile file is parsed: a start-up parses the --profile given once (the CLI's flag check) and hands the result
    down (server.serve.start_engine -> the decode worker -> plan.resolve_plan), which checks it with
    `check_profile` where the GPU is known."""
    spath = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ProfileError(f"profile {spath}: cannot read: {exc}") from exc
    try:
        msgspec.json.decode(raw)  # JSON at all, by msgspec's rules (its typed read follows)
        generic = loads_unique(raw, spath)  # no key written twice (msgspec would keep the last)
    except (msgspec.DecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"profile {spath}: invalid JSON: {exc}") from exc
    except DuplicateKeyError as exc:
        raise _fail(spath, exc.where or "$", exc.problem) from None
    if not isinstance(generic, dict):
        raise _fail(spath, "$", "top level must be a JSON object")
    version = generic.get("schema_version", 1)
    if version not in SUPPORTED_SCHEMA_VERSIONS or isinstance(version, bool):
        raise _fail(
            spath,
            "schema_version",
            f"unsupported version {version!r}; supported versions: {list(SUPPORTED_SCHEMA_VERSIONS)}",
        )
    _check_keys(spath, generic)
    try:
        prof = msgspec.json.decode(raw, type=Profile)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        field = msg.rsplit("at `", 1)[1].rstrip("`") if "at `" in msg else "$"
        raise _fail(spath, field, msg) from exc
    validate_profile(prof, spath)
    return prof


def check_profile(
    prof: Profile, path: str | os.PathLike[str], *, expect_gpu: str | None = None, expect_model: str | None = None,
    expect_tp: int | None = None, expect_variant: ProfileVariant | None = None, expect_shape: str | None = None,
) -> Profile:
    """`prof` (read from `path`, which the messages name) when it was measured for this GPU, model, tensor-parallel
    size (a whole model: 1; a rank's shard: the size it was cut for), variant (fp8 weights, fp8 KV cache) and model
    shape (`model_shape` of the whole model; a profile that records none is not checked), each checked where not
    None; else a ProfileError saying how to measure the right one."""
    spath = str(path)
    mismatches = [
        f"{what}: profile is for {have!r}, this run uses {want!r}"
        for what, have, want in (("gpu", prof.gpu, expect_gpu), ("model", prof.model, expect_model))
        if want is not None and have != want
    ]
    if mismatches:
        field = "gpu" if mismatches[0].startswith("gpu") else "model"
        raise _fail(spath, field, "; ".join(mismatches) + ". Run `rapidserve profile` to measure this GPU and model.")
    if expect_shape is not None and prof.model_shape and prof.model_shape != expect_shape:
        raise _fail(spath, "model_shape", f"the profile was measured for another model named {prof.model!r} "
                                          f"({prof.model_shape}); this run's is {expect_shape}. Run `rapidserve "
                                          "profile` to measure this model, or give its own profile with --profile")
    if expect_tp is not None and prof.tensor_parallel_size != expect_tp:
        have, want = prof.tensor_parallel_size, expect_tp
        raise _fail(spath, "tensor_parallel_size",
                    f"the profile measures {'the whole model' if have == 1 else f'a shard of tensor parallel {have}'}, "
                    f"this run uses tensor parallel {want}. Run `rapidserve profile"
                    f"{f' --shard-of-tp {want}' if want > 1 else ''}` to measure it.")
    if expect_variant is not None and prof.variant != expect_variant:
        raise _fail(spath, "kv_cache_dtype" if prof.quantization == expect_variant.quantization else "quantization",
                    f"the profile measures {prof.variant.describe()}, this run uses {expect_variant.describe()}. Run "
                    "`rapidserve profile` with this run's --quantization / --kv-cache-dtype to measure it.")
    return prof


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Validate and write atomically (temp file in the same directory, then rename)."""
    target = Path(path)
    validate_profile(profile, str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.json.format(msgspec.json.encode(profile), indent=2)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def slug(text: str) -> str:
    """Lower-case, runs of other characters as one '-': 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    out = "".join(ch.lower() if ch.isalnum() else "-" for ch in text)
    return "-".join(p for p in out.split("-") if p)


def model_label(model: str) -> str:
    """The model name a profile records: presets keep 'preset:NAME', paths their last component (a Hub cache
    snapshot its repository's name, `dummy:` the model it randomizes: the same shapes, the same timings)."""
    from rapidserve.loader.hub import display_name

    return display_name(model)


def profile_filename(gpu: str, model: str, tp: int = 1, variant: ProfileVariant | None = None) -> str:
    """`<gpu>__<model>.json`, both slugged (`...__fp8__kvfp8` for fp8 weights and KV cache, `ProfileVariant.suffix`;
    `...__tp<N>.json` for a rank's shard under tensor parallel N): where `rapidserve profile` writes and the engine
    looks."""
    return (f"{slug(gpu)}__{slug(model_label(model))}{(variant or ProfileVariant()).suffix}"
            f"{f'__tp{tp}' if tp > 1 else ''}.json")


def default_profiles_dir() -> Path:
    """The repository's profiles/ folder (next to the package); RAPIDSERVE_PROFILES_DIR overrides it."""
    env = os.environ.get("RAPIDSERVE_PROFILES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "profiles"
