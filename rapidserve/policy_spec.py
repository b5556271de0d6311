"""The engine's policies and runs, declared once, and the flag compatibility check derived from them.

Each policy (`--policy`) declares the worker processes it uses, whether its prefill captures piecewise graphs,
the `--partition` modes it runs with and, per partition mode, the settings it reads:

| policy | what | workers | prefill graphs | --partition |
|---|---|---|---|---|
| fused | always one mixed step (vLLM / Sarathi-Serve; `--mode hybrid`) | hybrid | yes | off |
| rapid | always split, the profile's choice (RAPID-Serve; partition/manager.py) | decode, prefill | yes | any |
| duet | fused when a step fits the SLO, else split (DuetServe; policies.py) | decode, prefill | yes | adaptive |
| drift | split, prefill a layer block at a time (DRIFT; partition/drift.py) | decode, prefill | no | adaptive |

(The decode worker carrying out a `StepShape` itself, so that fused and duet's fused steps run there, is the
engine's change of issue 37, not this file's: until it lands, `--policy fused` is `--mode hybrid`'s worker.)

Each run (`RunSpec`: a serving mode, `LLM` / `rapidserve generate`, `rapidserve profile`) declares the
workers it starts, what it reads whatever the policy, whether its prefill can capture graphs and the
partition it fixes. From these alone `conflicts` derives, for a run, a policy and the settings given:
* the policy must use the workers the run starts (`--mode hybrid --policy drift`: refused);
* the partition mode must be one the policy runs with and the run allows (`--mode disagg --policy drift`,
  `--partition static:0.25 --policy duet`: refused);
* every other setting given must be read: by the run, or by the policy under that partition mode; the piecewise
  prefill graphs' buckets only where the run's and the policy's prefill capture graphs and `--enforce-eager` is
  off. Each refusal says how to fix it (drop the flag, or the policies / modes that read it);
* a setting given as None (`--slo-itl-ms none`: no ITL SLO) must not be one its reader `needs`: rapid and drift
  choose their split by the ITL SLO and `rapidserve profile` marks its table and plot with it, so they refuse none,
  saying why and what to use instead; duet reads it and honours none (every step fused with the whole budget).
A value the run or its partition mode runs at anyway is no conflict (`fixes`, `PARTITION_FIXES`): `--mps off` in
hybrid and disagg mode; with no partition `--partition-backend none`; with a fixed or no partition (so under
--policy fused, --mode hybrid and disagg too) and in `LLM`, whose steps are all fused, no ITL SLO (none).
A setting counts as given when its value in the tree differs from the field's default: the tree holds values,
so one given at its default value is not told apart from one left out (it changes nothing either way).
`--mode` and `--policy` left out are resolved from each other (`resolve_mode`, `resolve_policy`) before this.

`config_builder.build_engine_config` runs the check on the tree it builds, before the model is resolved, so the
CLI (`serve`, `generate`), `LLM` and `rapidserve profile` all get it (`ConfigError`, one line; exit code 2 at
the CLI). Pure: tested by table (tests/test_policy_spec.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from rapidserve.config_base import ConfigError
from rapidserve.partition_config import DEFAULT_POLICY, POLICIES, PartitionConfig

ADAPTIVE, STATIC, OFF = "adaptive", "static", "off"
PARTITION_MODES = (ADAPTIVE, STATIC, OFF)


@dataclass(frozen=True)
class Setting:
    """A setting the check polices: its place in the tree, its flag, and its `LLM` / `build_engine_config` keyword."""

    path: str  # section.field of EngineConfig
    flag: str
    kwarg: str | None = None
    off_flag: str | None = None  # a boolean's flag when it is turned off (--no-...)

    def label(self, value: object, api: bool) -> str:
        flag = self.off_flag if value is False and self.off_flag else self.flag
        if api and self.kwarg:
            return f"{self.kwarg}={value!r} ({flag})"
        return flag


SETTINGS: tuple[Setting, ...] = (
    Setting("scheduler.max_num_seqs", "--max-num-seqs", "max_num_seqs"),
    Setting("scheduler.max_num_batched_tokens", "--max-num-batched-tokens", "max_num_batched_tokens"),
    Setting("scheduler.prefill_batch_tokens", "--prefill-batch-tokens", "prefill_batch_tokens"),
    Setting("scheduler.async_scheduling", "--async-scheduling", "async_scheduling", "--no-async-scheduling"),
    Setting("cache.enable_prefix_caching", "--enable-prefix-caching", "enable_prefix_caching",
            "--no-enable-prefix-caching"),
    Setting("runner.prefill_graph_tokens", "--prefill-graph-tokens", "prefill_graph_tokens"),
    Setting("partition.mode", "--partition"),
    Setting("partition.profile", "--profile"),
    Setting("partition.backend", "--partition-backend"),
    Setting("partition.slo_itl_ms", "--slo-itl-ms"),
    Setting("partition.hysteresis_steps", "PartitionConfig.hysteresis_steps"),
    Setting("partition.decode_shares", "--decode-shares"),
    Setting("partition.slo_ttft_ms", "--slo-ttft-ms"),
    Setting("partition.slo_ttft_ms_per_1k_tokens", "--slo-ttft-ms-per-1k-tokens"),
    Setting("partition.drift_prefill_model", "--drift-prefill-model"),
    Setting("partition.profile_lookup", "--profile-lookup"),
    Setting("partition.slo_margin", "--slo-margin"),
    Setting("partition.step_correction", "--step-correction"),
    Setting("launch.mps", "--mps"),
    Setting("kv_events.enable_kv_cache_events", "--kv-events-config", "kv_events_config"),
)
BY_PATH = {s.path: s for s in SETTINGS}
GRAPHS = "runner.prefill_graph_tokens"
# What a partition mode makes of a setting whatever the policy: with no partition the backend is "none", and with a
# fixed or no partition nothing reads an ITL SLO (None: none), so giving exactly that is no conflict.
PARTITION_FIXES: Mapping[str, Mapping[str, object]] = {
    STATIC: {"partition.slo_itl_ms": None}, OFF: {"partition.backend": "none", "partition.slo_itl_ms": None}}
# Where a setting given as None (no ITL SLO) cannot run, what to use instead (the end of each `needs` message).
NO_SLO_INSTEAD = ("give a number of ms, or for throughput without an SLO use --policy duet (every step fused with "
                  "the whole token budget) or --policy fused (--mode hybrid)")

_SERVING = frozenset({"scheduler.max_num_seqs", "scheduler.max_num_batched_tokens", "cache.enable_prefix_caching"})
_SERVER = _SERVING | {"kv_events.enable_kv_cache_events"}  # a server's router publishes the KV events
_SPLIT_ADAPTIVE = frozenset({"partition.backend", "partition.profile", "partition.slo_itl_ms",
                             "partition.hysteresis_steps", "partition.decode_shares"})


@dataclass(frozen=True)
class PolicySpec:
    name: str
    summary: str
    workers: tuple[str, ...]  # the worker processes it uses
    partition_modes: tuple[str, ...]  # --partition values it runs with (the first: its own when none is given)
    reads: Mapping[str, frozenset[str]]  # per partition mode, the settings it reads
    no_graphs: str | None = None  # None: its prefill captures piecewise graphs; else why it does not
    why_not: Mapping[str, str] = field(default_factory=dict)  # why it does not read a setting (messages)
    needs: Mapping[str, str] = field(default_factory=dict)  # settings it reads that None cannot give: why, and the fix
    # of its --partition adaptive settings, those it still reads where the device has no partition backend (a CPU):
    # the rest only choose among partition configurations (`unread_without_partition`)
    without_partition: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RunSpec:
    name: str
    label: str  # how a message names it
    workers: tuple[str, ...]  # the worker processes it starts (): none, the engine runs in this process
    reads: frozenset[str]  # settings read whatever the policy
    partition: str | None = None  # the partition mode it fixes (None: --partition's)
    no_graphs: str | None = None  # None: its prefill may capture piecewise graphs; else why not
    default_policy: str | None = None  # the policy it runs when --policy is left out
    api: bool = False  # its settings come as `LLM` keywords (messages name them both ways)
    why_not: Mapping[str, str] = field(default_factory=dict)
    fixes: Mapping[str, object] = field(default_factory=dict)  # settings it runs at one value (giving it: no conflict)
    needs: Mapping[str, str] = field(default_factory=dict)  # settings it reads that None cannot give: why, and the fix


DECODE_PREFILL = ("decode", "prefill")
POLICY_SPECS: Mapping[str, PolicySpec] = {p.name: p for p in (
    PolicySpec("fused", "always one mixed step on the whole GPU (vLLM / Sarathi-Serve; --mode hybrid)", ("hybrid",),
               (OFF,), {OFF: frozenset({"scheduler.async_scheduling"})},
               why_not={"scheduler.prefill_batch_tokens": "its steps take prompt chunks within "
                                                           "--max-num-batched-tokens, there is no prefill worker"}),
    PolicySpec("rapid", "always split, the profile's configuration (RAPID-Serve)", DECODE_PREFILL,
               (ADAPTIVE, STATIC, OFF),
               {ADAPTIVE: _SPLIT_ADAPTIVE | {"scheduler.prefill_batch_tokens", "partition.profile_lookup"},
                STATIC: frozenset({"scheduler.prefill_batch_tokens", "partition.backend"}),
                OFF: frozenset({"scheduler.prefill_batch_tokens"})},
               why_not={"scheduler.async_scheduling": "its decode worker always schedules one step ahead and its "
                                                      "prefill worker has no steps to schedule ahead"},
               needs={"partition.slo_itl_ms": "--policy rapid chooses its split from the ITL SLO (the profile's "
                                              "configuration with the most prefill throughput within it); "
                                              f"{NO_SLO_INSTEAD}"},
               without_partition=frozenset({"scheduler.prefill_batch_tokens"})),
    PolicySpec("duet", "fused when a step fits the ITL SLO, else split (DuetServe)", DECODE_PREFILL, (ADAPTIVE,),
               {ADAPTIVE: _SPLIT_ADAPTIVE | {"scheduler.prefill_batch_tokens", "partition.profile_lookup",
                                             "partition.slo_margin", "partition.step_correction"}},
               why_not={"scheduler.async_scheduling": "its decode worker always schedules one step ahead and its "
                                                      "prefill worker has no steps to schedule ahead"},
               without_partition=frozenset({"scheduler.prefill_batch_tokens"})),
    PolicySpec("drift", "split, prefill a layer block at a time (DRIFT)", DECODE_PREFILL, (ADAPTIVE,),
               {ADAPTIVE: _SPLIT_ADAPTIVE | {"partition.slo_ttft_ms", "partition.slo_ttft_ms_per_1k_tokens",
                                             "partition.drift_prefill_model"}},
               no_graphs="it launches prefill a layer block at a time, without graphs",
               why_not={"scheduler.prefill_batch_tokens": "DRIFT's dispatcher sizes its own prefill batches, "
                                                           "within --max-num-batched-tokens",
                        "partition.profile_lookup": "DRIFT reads the profile's buckets rounded up",
                        "scheduler.async_scheduling": "its decode worker always schedules one step ahead"},
               needs={"partition.slo_itl_ms": "--policy drift chooses its split from the ITL SLO (the most prefill "
                                              "units whose decode step meets it) and sizes its prefill's layer blocks "
                                              f"to it; {NO_SLO_INSTEAD}"},
               # its prefill worker forms, sizes (to the ITL SLO) and preempts its batches on any device
               without_partition=frozenset({"partition.slo_itl_ms", "partition.slo_ttft_ms",
                                            "partition.slo_ttft_ms_per_1k_tokens", "partition.drift_prefill_model"})),
)}
RUN_SPECS: Mapping[str, RunSpec] = {r.name: r for r in (
    RunSpec("rapid", "--mode rapid", DECODE_PREFILL, _SERVER | {"launch.mps"}, default_policy=DEFAULT_POLICY),
    RunSpec("hybrid", "--mode hybrid", ("hybrid",), _SERVER, partition=OFF, default_policy="fused",
            why_not={"partition": "one worker on the whole GPU", "launch.mps": "one worker process, no MPS"},
            fixes={"launch.mps": "off"}),
    RunSpec("disagg", "--mode disagg", DECODE_PREFILL, _SERVER | {"scheduler.prefill_batch_tokens"}, partition=OFF,
            no_graphs="its prefill worker computes without graphs", default_policy="rapid",
            why_not={"partition": "it runs each phase on its own GPU, with no partition",
                     "launch.mps": "one worker per GPU, no MPS"}, fixes={"launch.mps": "off"}),
    RunSpec("offline", "LLM and `rapidserve generate`", (), _SERVING | {"scheduler.async_scheduling"}, api=True,
            why_not={"scheduler.prefill_batch_tokens": "one process, whose steps max_num_batched_tokens bounds",
                     "kv_events.enable_kv_cache_events": "the KV events are published by a server's router"},
            fixes={"partition.slo_itl_ms": None}),  # every step fused: no ITL SLO is read
    RunSpec("profile", "`rapidserve profile`", (),
            frozenset({"partition.backend", "partition.slo_itl_ms", "partition.decode_shares"}),
            no_graphs="its prefill forwards run eager, as the engine's longer-than-any-bucket ones do",
            why_not={"scheduler.max_num_seqs": "its decode batches are --batch-buckets",
                     "scheduler.max_num_batched_tokens": "its prefill forwards hold --prefill-tokens tokens",
                     "scheduler.prefill_batch_tokens": "its prefill forwards hold --prefill-tokens tokens",
                     "cache.enable_prefix_caching": "it caches no prompts",
                     "kv_events.enable_kv_cache_events": "it caches no prompts",
                     "scheduler.async_scheduling": "it runs no hybrid scheduler"},
            needs={"partition.slo_itl_ms": "`rapidserve profile` picks each cell's best configuration within the ITL "
                                           "SLO in its table and draws the SLO on its plot; give a number of ms (the "
                                           "measurements are the same whatever the SLO: the engine reads them with "
                                           "its own --slo-itl-ms)"}),
)}
assert tuple(sorted(POLICY_SPECS)) == tuple(sorted(POLICIES)), \
    "partition_config.POLICIES and POLICY_SPECS must name the same"


def _workers(w: tuple[str, ...]) -> str:
    return "one hybrid worker" if w == ("hybrid",) else "a decode and a prefill worker"


def _modes_running(policy: PolicySpec) -> list[str]:
    return [r.label for r in RUN_SPECS.values()
            if r.workers == policy.workers and (r.partition is None or r.partition in policy.partition_modes)]


def resolve_mode(mode: str | None, policy: str | None) -> str:
    """`--mode` left out (None): the first serving mode that runs `policy` (fused: hybrid), else rapid."""
    if mode is not None:
        return mode
    if policy is not None:
        for r in RUN_SPECS.values():
            spec = POLICY_SPECS[policy]
            if r.workers == spec.workers and (r.partition is None or r.partition in spec.partition_modes):
                return r.name
    return "rapid"


def resolve_policy(run: str, policy: str | None, partition_mode: str) -> str:
    """`--policy` left out (None): the run's default policy if it runs with the run's partition (`partition_mode`
    where the run fixes none), else rapid (the policy that runs with a fixed or no partition); runs without workers
    keep `partition_config.DEFAULT_POLICY` (not read)."""
    if policy is not None:
        return policy
    r = RUN_SPECS[run]
    want = r.default_policy or DEFAULT_POLICY
    return want if (r.partition or partition_mode) in POLICY_SPECS[want].partition_modes or not r.workers else "rapid"


def policy_line(run: str, policy: str, partition_mode: str, slo_itl_ms: float | None) -> str:
    """How the start-up log names the step policy a run carries out: its name and summary, and the ITL SLO where it
    reads one (an adaptive partition's rapid, duet or drift). A run that splits nothing (hybrid, disagg) names
    what it does instead."""
    if run == "hybrid" or policy == "fused":
        return f"policy fused: {POLICY_SPECS['fused'].summary}"
    if run == "disagg":
        return "no step policy: prefill and decode on their own GPUs"
    line = f"policy {policy}: {POLICY_SPECS[policy].summary}"
    if partition_mode != ADAPTIVE:
        return f"{line}, on the {partition_mode} partition"
    return f"{line}, ITL SLO {'none' if slo_itl_ms is None else f'{slo_itl_ms:g} ms'}"


def _readers(path: str) -> str:
    """Who reads `path`, for a refusal's fix: the policies (and the partition mode where not every one) and runs."""
    out = []
    for p in POLICY_SPECS.values():
        modes = [m for m in p.partition_modes if path in p.reads[m]]
        if modes:
            where = "" if len(modes) == len(p.partition_modes) else f" --partition {'/'.join(modes)}"
            home = resolve_mode(None, p.name)
            out.append(f"--policy {p.name}{where}" + ("" if home == "rapid" else f" (--mode {home})"))
    out += [r.label for r in RUN_SPECS.values() if path in r.reads and r.workers]
    return ", ".join(out)


def conflicts(run: str, policy: str, given: Mapping[str, object], *, eager: bool = False) -> list[str]:
    """Why these settings cannot run together (module docstring), one sentence each with its fix; [] when they can.
    `given`: the settings given (path -> value, `given_settings`); `eager`: --enforce-eager (no CUDA graphs)."""
    r = RUN_SPECS[run]
    p = POLICY_SPECS[policy] if r.workers else None
    out: list[str] = []
    mode = given.get("partition.mode")
    if p is not None:
        if p.workers != r.workers:
            where = " or ".join(_modes_running(p)) or "no mode"
            return [f"--policy {policy} runs {_workers(p.workers)} ({where}); {r.label} runs {_workers(r.workers)}: "
                    f"drop --policy {policy}, or use {where}"]
        if r.partition is not None and r.partition not in p.partition_modes:
            return [f"--policy {policy} picks among partition configurations (--partition "
                    f"{'/'.join(p.partition_modes)}); {r.label} runs with --partition {r.partition} "
                    f"({r.why_not.get('partition', 'fixed')}): drop --policy {policy}, or use "
                    f"{' or '.join(_modes_running(p))}"]
        if mode is not None and ((r.partition is not None and mode != r.partition) or mode not in p.partition_modes):
            out.append(_partition_conflict(r, p, str(mode)))
            mode = None
        pmode = r.partition or str(mode or (ADAPTIVE if ADAPTIVE in p.partition_modes else p.partition_modes[0]))
        reads = r.reads | p.reads[pmode]
        fixes = {**PARTITION_FIXES.get(pmode, {}), **r.fixes}
    else:
        pmode, reads, fixes = None, r.reads, dict(r.fixes)
    for path, value in given.items():
        if fixes.get(path, object()) == value:
            continue
        if value is None and path in reads:
            why = (p.needs.get(path) if p is not None and path in p.reads[pmode] else None) or r.needs.get(path)
            if why is not None:
                out.append(f"{BY_PATH[path].label(value, r.api)} none: {why}")
            continue
        if (path == "partition.mode" and p is not None) or path in reads:
            continue
        label = BY_PATH[path].label(value, r.api)
        if path == GRAPHS:
            by, why = (("with --enforce-eager", "it turns off every CUDA graph") if eager else
                       (f"by {r.label}", r.no_graphs) if r.no_graphs else
                       (f"by --policy {policy}", p.no_graphs) if p is not None and p.no_graphs else (None, None))
            if why is not None:
                out.append(f"{label}: not read {by} ({why}: no prefill graph is captured); drop it")
            continue
        who = r.label
        if p is not None and r.partition is None and _policy_setting(path, r):
            who = f"--policy {policy}" + (f" --partition {pmode}" if len(p.partition_modes) > 1 else "")
        why = ((p.why_not.get(path) if p is not None else None) or r.why_not.get(path)
               or (r.why_not.get("partition") if path.startswith("partition.") else None))
        readers = _readers(path)
        out.append(f"{label}: not read by {who}{f' ({why})' if why else ''}; drop it"
                   + (f" (read by {readers})" if readers else ""))
    return out


def _policy_setting(path: str, r: RunSpec) -> bool:
    """Whether some policy of the run's workers reads `path` under some partition mode (so the policy, not the run,
    is what leaves it unread)."""
    return any(path in q.reads[m] for q in POLICY_SPECS.values() if q.workers == r.workers for m in q.partition_modes)


def _partition_conflict(r: RunSpec, p: PolicySpec, mode: str) -> str:
    if r.partition is not None:
        return (f"--partition {mode}: {r.label} runs with --partition {r.partition} "
                f"({r.why_not.get('partition', 'fixed')}); drop it")
    others = [q.name for q in POLICY_SPECS.values() if mode in q.partition_modes and q.workers == r.workers]
    return (f"--partition {mode}: --policy {p.name} runs with --partition {'/'.join(p.partition_modes)}"
            f"{' (it picks among partition configurations)' if p.partition_modes == (ADAPTIVE,) else ''}; drop "
            f"--partition {mode}" + (f", or use --policy {' or '.join(others)}" if others else ""))


def given_settings(sections: Mapping[str, object]) -> dict[str, object]:
    """The settings of `SETTINGS` whose value in `sections` (section name -> its config dataclass, e.g.
    {"scheduler": SchedulerConfig(...)}) differs from the field's default."""
    out: dict[str, object] = {}
    for s in SETTINGS:
        section, name = s.path.split(".")
        obj = sections.get(section)
        if obj is None:
            continue
        f = next(f for f in dataclasses.fields(obj) if f.name == name)  # type: ignore[arg-type]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        value = getattr(obj, name)
        if value != default:
            out[s.path] = value
    return out


def unread_without_partition(policy: str, given: Mapping[str, object], where: str) -> list[str]:
    """The settings `given` (path -> value) that `policy` reads only to choose among partition configurations, on a
    run whose plan turned out to have none (`where`: why, e.g. "no partition backend on cpu"): the static check
    (`conflicts`) passed them for --partition adaptive, but the device has nothing to choose between, so they would
    change nothing. One sentence each, with its fix; [] when none. A value the policy honours without a partition is
    kept: what the policy declares it reads without one (`PolicySpec.without_partition`), duet's --slo-itl-ms none
    (every step fused), and --partition-backend none (the cause, not a conflict)."""
    p = POLICY_SPECS[policy]
    if ADAPTIVE not in p.partition_modes:
        return []
    plain = p.without_partition | {"partition.backend"}
    out = []
    for path, value in given.items():
        if path not in p.reads[ADAPTIVE] or path in plain or (path == "partition.slo_itl_ms" and value is None):
            continue
        label = BY_PATH[path].label(value, False)
        out.append(f"{label} {value}: not read by --policy {policy} here ({where}: the workers share the whole "
                   "device, with no partition configurations to choose among); drop it, or run where a partition "
                   "backend is (a GPU: --partition-backend auto)")
    return out


def check_without_partition(partition: PartitionConfig, where: str) -> None:
    """Where the run turned out to have no partition (`where`: why, e.g. "no partition backend on cpu"): a static
    split asked for, or the settings only an adaptive partition reads (`unread_without_partition`), are a ConfigError
    (one line); a partition of `off`, or an adaptive one given none of those, passes. Called before the workers start
    where the device is known (config_builder.check_partition_device) and at the plan (partition/plan.py)."""
    if partition.mode == "static":
        raise ConfigError(f"--partition static:{partition.static_decode_share:g}: {where}, so decode cannot be given "
                          "a share of the device (the workers would share all of it, silently unsplit); drop it "
                          "(--partition off runs both workers on the whole device) or run where a partition backend "
                          "is (a GPU: --partition-backend auto)")
    if partition.mode == ADAPTIVE:
        unread = unread_without_partition(partition.policy, given_settings({"partition": partition}), where)
        if unread:
            raise ConfigError("; ".join(unread))


def check_settings(run: str, policy: str, sections: Mapping[str, object], *, eager: bool = False) -> None:
    """`conflicts` of the settings in `sections` (`given_settings`); ConfigError, one line, when there are any."""
    found = conflicts(run, policy, given_settings(sections), eager=eager)
    if found:
        raise ConfigError("; ".join(found))
