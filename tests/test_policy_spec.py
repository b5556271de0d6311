"""The flag compatibility check derived from the policies' declarations (rapidserve/policy_spec.py).

The expected table below is written out by hand from what the engine does (which worker reads which setting),
not from the declarations, so that a declaration that drifts from the engine fails here: every setting x policy x
partition mode x run cell is either accepted or refused with a message naming the flag and the fix.
"""

from __future__ import annotations

import argparse

import pytest

from rapidserve.cli import build_parser, main
from rapidserve.cli_args import partition_config
from rapidserve.config import CacheConfig, RunnerConfig, SchedulerConfig
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.launch_config import LaunchConfig
from rapidserve.partition_config import DEFAULT_POLICY, POLICIES, PartitionConfig
from rapidserve.policy_spec import (
    POLICY_SPECS,
    RUN_SPECS,
    SETTINGS,
    check_settings,
    conflicts,
    given_settings,
    resolve_mode,
    resolve_policy,
)

# One non-default value per setting (what "given" means: differs from the field's default).
VALUES: dict[str, object] = {
    "scheduler.max_num_seqs": 64,
    "scheduler.max_num_batched_tokens": 2048,
    "cache.enable_prefix_caching": False,
    "scheduler.prefill_batch_tokens": 512,
    "scheduler.async_scheduling": False,
    "runner.prefill_graph_tokens": (16, 64),
    "partition.profile": "x.json",
    "partition.backend": "cuda-green",
    "partition.slo_itl_ms": 30.0,
    "partition.hysteresis_steps": 4,
    "partition.decode_shares": (0.25,),
    "partition.slo_ttft_ms": 500.0,
    "partition.slo_ttft_ms_per_1k_tokens": 100.0,
    "partition.drift_prefill_model": (1.0, 0.1),
    "partition.profile_lookup": "interpolate",
    "partition.step_correction": "per-kind",
    "launch.mps": "on",
}
SERVING = {"scheduler.max_num_seqs", "scheduler.max_num_batched_tokens", "cache.enable_prefix_caching"}
RAPID = SERVING | {"launch.mps"}  # the two processes of rapid mode share the GPU through MPS
SPLIT_ADAPTIVE = {"partition.profile", "partition.backend", "partition.slo_itl_ms", "partition.hysteresis_steps",
                  "partition.decode_shares"}
GRAPHS = "runner.prefill_graph_tokens"

# (run, policy, --partition) -> the settings read there. Which worker reads what:
# - every server and LLM read the batch limits and prefix caching; `rapidserve profile` sets its own;
# - the prefill worker's batches (rapid, duet; disagg's prefill is one too) read --prefill-batch-tokens; DRIFT's
#   dispatcher sizes its own; the hybrid worker (fused) and LLM have none;
# - only the hybrid worker and LLM (the one step loop in-process) schedule ahead on request (--async-scheduling);
#   the decode worker beside a prefill worker always does;
# - piecewise prefill graphs: captured by the rapid and hybrid prefill and by LLM, not by drift, disagg, profile;
# - --mps: only rapid mode runs two processes on one GPU (hybrid one process, disagg one per GPU);
# - partition settings: read by the policy that picks configurations under adaptive (rapid, duet, drift); static
#   reads only the backend; off reads none; drift's TTFT SLO and prefill model only by drift; --profile-lookup by
#   rapid and duet (duet's cost model reads the profile), --step-correction by duet alone; profile reads the
#   backend, SLO and decode shares.
READS: dict[tuple[str, str, str], set[str]] = {
    ("rapid", "rapid", "adaptive"): RAPID | SPLIT_ADAPTIVE | {"scheduler.prefill_batch_tokens", GRAPHS,
                                                               "partition.profile_lookup"},
    ("rapid", "rapid", "static"): RAPID | {"scheduler.prefill_batch_tokens", GRAPHS, "partition.backend"},
    ("rapid", "rapid", "off"): RAPID | {"scheduler.prefill_batch_tokens", GRAPHS},
    ("rapid", "duet", "adaptive"): RAPID | SPLIT_ADAPTIVE | {"scheduler.prefill_batch_tokens", GRAPHS,
                                                              "partition.profile_lookup", "partition.step_correction"},
    ("rapid", "drift", "adaptive"): RAPID | SPLIT_ADAPTIVE | {"partition.slo_ttft_ms",
                                                               "partition.slo_ttft_ms_per_1k_tokens",
                                                               "partition.drift_prefill_model"},
    ("hybrid", "fused", "off"): SERVING | {"scheduler.async_scheduling", GRAPHS},
    ("disagg", "rapid", "off"): SERVING | {"scheduler.prefill_batch_tokens"},
    ("offline", DEFAULT_POLICY, "adaptive"): SERVING | {"scheduler.async_scheduling", GRAPHS},
    ("profile", DEFAULT_POLICY, "adaptive"): {"partition.backend", "partition.slo_itl_ms", "partition.decode_shares"},
}
# (run, policy, --partition) that cannot run at all: the policy's workers or partition do not fit the run.
REFUSED: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("hybrid", "rapid", "off", ("--policy rapid", "--mode hybrid", "use --mode rapid")),
    ("hybrid", "duet", "off", ("--policy duet", "--mode hybrid", "use --mode rapid")),
    ("hybrid", "drift", "off", ("--policy drift", "--mode hybrid", "use --mode rapid")),
    ("rapid", "fused", "adaptive", ("--policy fused", "--mode rapid", "use --mode hybrid")),
    ("disagg", "fused", "off", ("--policy fused", "--mode disagg", "use --mode hybrid")),
    ("disagg", "duet", "off", ("--policy duet", "--mode disagg", "use --mode rapid")),
    ("disagg", "drift", "off", ("--policy drift", "--mode disagg", "use --mode rapid")),
    ("rapid", "duet", "static", ("--partition static", "--policy duet", "use --policy rapid")),
    ("rapid", "duet", "off", ("--partition off", "--policy duet", "use --policy rapid")),
    ("rapid", "drift", "static", ("--partition static", "--policy drift", "use --policy rapid")),
    ("rapid", "drift", "off", ("--partition off", "--policy drift", "use --policy rapid")),
    ("hybrid", "fused", "static", ("--partition static", "--mode hybrid", "drop it")),
    ("disagg", "rapid", "static", ("--partition static", "--mode disagg", "drop it")),
]


CELLS = [(run, policy, mode, path) for (run, policy, mode) in READS for path in VALUES]


@pytest.mark.parametrize(("run", "policy", "mode", "path"), CELLS)
def test_every_setting_in_every_cell_is_read_or_refused(run: str, policy: str, mode: str, path: str) -> None:
    given = {path: VALUES[path]}
    if mode != "adaptive" and RUN_SPECS[run].partition is None:
        given["partition.mode"] = mode  # a --partition the user gives (hybrid and disagg fix theirs)
    found = conflicts(run, policy, given)
    if path in READS[run, policy, mode]:
        assert found == [], found
    else:
        flag = next(s for s in SETTINGS if s.path == path)
        assert len(found) == 1, found
        msg = found[0]
        assert (flag.off_flag or flag.flag) in msg and "drop it" in msg and "not read" in msg, msg


def test_the_table_covers_every_runnable_cell() -> None:
    """Every (run, policy, partition mode) the declarations let run is in the expected table, and every other one is
    refused as a whole (REFUSED): no cell is left unchecked."""
    runnable = set()
    for run, r in RUN_SPECS.items():
        policies = POLICIES if r.workers else (DEFAULT_POLICY,)
        modes = ("adaptive", "static", "off") if r.workers else ("adaptive",)
        for policy in policies:
            for mode in modes:
                given = {} if mode == "adaptive" else {"partition.mode": mode}
                if not conflicts(run, policy, given):
                    runnable.add((run, policy, r.partition or mode))
    assert runnable == set(READS)
    assert not {(r, p, m) for r, p, m, _ in REFUSED} & set(READS)


@pytest.mark.parametrize(("run", "policy", "mode", "names"), REFUSED)
def test_policies_that_cannot_run_there_are_refused_saying_how_to_fix_it(run: str, policy: str, mode: str,
                                                                        names: tuple[str, ...]) -> None:
    given = {} if mode == "adaptive" else {"partition.mode": mode}
    found = conflicts(run, policy, given)
    assert len(found) == 1 and all(n in found[0] for n in names), found


@pytest.mark.parametrize("run", ["rapid", "hybrid", "offline"])
def test_enforce_eager_leaves_the_graph_buckets_unread(run: str) -> None:
    policy = {"rapid": "rapid", "hybrid": "fused", "offline": DEFAULT_POLICY}[run]
    assert conflicts(run, policy, {GRAPHS: (16,)}) == []
    (msg,) = conflicts(run, policy, {GRAPHS: (16,)}, eager=True)
    assert "--prefill-graph-tokens" in msg and "--enforce-eager" in msg and "drop it" in msg


@pytest.mark.parametrize(("given", "ok"), [
    ({"partition.mode": "off", "partition.backend": "none"}, True),  # what no partition means anyway
    ({"partition.mode": "off", "partition.backend": "cuda-green"}, False),
    ({"partition.mode": "static", "partition.backend": "none"}, True),  # static reads the backend
])
def test_a_value_the_partition_mode_fixes_is_no_conflict(given: dict[str, object], ok: bool) -> None:
    assert (conflicts("rapid", "rapid", given) == []) == ok


@pytest.mark.parametrize(("run", "policy"), [("hybrid", "fused"), ("disagg", "rapid")])
def test_mps_off_is_what_one_process_per_gpu_runs_anyway(run: str, policy: str) -> None:
    """`--mps off` beside --mode hybrid / disagg (e.g. bench/compare.py's common --serve-args) asks for what runs."""
    assert conflicts(run, policy, {"launch.mps": "off"}) == []
    (msg,) = conflicts(run, policy, {"launch.mps": "on"})
    assert msg.startswith(f"--mps: not read by --mode {run}") and "no MPS" in msg


def test_messages_name_the_readers_as_the_fix() -> None:
    (msg,) = conflicts("rapid", "rapid", {"partition.slo_ttft_ms": 500.0})
    assert msg == "--slo-ttft-ms: not read by --policy rapid --partition adaptive; drop it (read by --policy drift)"
    (msg,) = conflicts("rapid", "rapid", {"scheduler.async_scheduling": False})
    assert msg.startswith("--no-async-scheduling: not read by --mode rapid (its decode worker always schedules one "
                          "step ahead") and msg.endswith("(read by --policy fused (--mode hybrid))")
    (msg,) = conflicts("offline", DEFAULT_POLICY, {"scheduler.prefill_batch_tokens": 512})
    assert msg.startswith("prefill_batch_tokens=512 (--prefill-batch-tokens): not read by LLM and `rapidserve "
                          "generate`")


@pytest.mark.parametrize(("mode", "policy", "want"), [
    (None, None, "rapid"), ("hybrid", None, "hybrid"), (None, "fused", "hybrid"), (None, "drift", "rapid"),
    (None, "rapid", "rapid"), ("rapid", "fused", "rapid"), ("disagg", None, "disagg"),
])
def test_resolve_mode(mode: str | None, policy: str | None, want: str) -> None:
    assert resolve_mode(mode, policy) == want


@pytest.mark.parametrize(("run", "policy", "partition", "want"), [
    ("rapid", None, "adaptive", DEFAULT_POLICY), ("rapid", None, "off", "rapid"), ("rapid", None, "static", "rapid"),
    ("hybrid", None, "adaptive", "fused"), ("disagg", None, "adaptive", "rapid"), ("rapid", "duet", "off", "duet"),
    ("offline", None, "adaptive", DEFAULT_POLICY),
])
def test_resolve_policy(run: str, policy: str | None, partition: str, want: str) -> None:
    assert resolve_policy(run, policy, partition) == want


def test_given_settings_are_the_fields_off_their_defaults() -> None:
    sections = {"scheduler": SchedulerConfig(max_num_seqs=64, async_scheduling=True), "cache": CacheConfig(),
                "runner": RunnerConfig(prefill_graph_tokens=()), "partition": PartitionConfig(mode="off")}
    assert given_settings(sections) == {"scheduler.max_num_seqs": 64, GRAPHS: (), "partition.mode": "off"}


def test_declarations_match_the_config() -> None:
    assert set(POLICY_SPECS) == set(POLICIES)
    for p in POLICY_SPECS.values():
        assert set(p.reads) == set(p.partition_modes)


def test_setting_flags_are_real_flags() -> None:
    """Every flag a message names is one `rapidserve serve` or `rapidserve profile` takes (hysteresis_steps has none:
    it is named by its field)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for name in ("serve", "profile") for a in sub.choices[name]._actions for o in a.option_strings}
    for s in SETTINGS:
        if s.path != "partition.hysteresis_steps":
            assert s.flag in flags and (s.off_flag is None or s.off_flag in flags), s


def test_check_settings_raises_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        check_settings("hybrid", "fused", {"scheduler": SchedulerConfig(prefill_batch_tokens=512),
                                           "partition": PartitionConfig(policy="fused", slo_itl_ms=30.0)})
    msg = str(e.value)
    assert "\n" not in msg and "--prefill-batch-tokens" in msg and "--slo-itl-ms" in msg


# ---- where the tree is built: the CLI, LLM and profile all get it, before the model is looked at ------------------

def test_serve_hybrid_drift_exits_2_with_one_line_naming_both_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--mode", "hybrid", "--policy", "drift", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mode hybrid" in err and "--policy drift" in err, err


@pytest.mark.parametrize(("argv", "names"), [
    (["--mode", "disagg", "--policy", "drift"], ("--mode disagg", "--policy drift")),
    (["--no-async-scheduling"], ("--no-async-scheduling", "--mode rapid")),
    (["--policy", "duet", "--profile-lookup", "interpolate", "--slo-ttft-ms", "500"], ("--slo-ttft-ms",)),
    (["--mode", "hybrid", "--prefill-batch-tokens", "512"], ("--prefill-batch-tokens", "--mode hybrid")),
    (["--mode", "hybrid", "--slo-itl-ms", "30"], ("--slo-itl-ms", "--mode hybrid")),
    (["--drift-prefill-model", "1,0.1"], ("--drift-prefill-model", "--policy drift")),
    (["--partition", "static:0.25", "--policy", "duet"], ("--partition static", "--policy duet")),
    (["--partition", "static:0.25", "--slo-itl-ms", "20"], ("--slo-itl-ms", "--partition static")),
    (["--policy", "fused", "--mode", "rapid"], ("--policy fused", "--mode hybrid")),
    (["--mode", "hybrid", "--mps", "on"], ("--mps", "--mode hybrid")),
])
def test_serve_refuses_ignored_flags_before_loading(argv: list[str], names: tuple[str, ...],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rapidserve: error:") and err.count("\n") == 1 and all(n in err for n in names), err


@pytest.mark.parametrize(("argv", "mode", "policy"), [
    ([], "rapid", DEFAULT_POLICY), (["--mode", "hybrid"], "hybrid", "fused"),
    (["--policy", "fused"], "hybrid", "fused"),
    (["--mode", "hybrid", "--no-async-scheduling"], "hybrid", "fused"), (["--partition", "off"], "rapid", "rapid"),
    (["--policy", "drift", "--slo-ttft-ms", "500"], "rapid", "drift"),
    (["--mode", "disagg", "--prefill-batch-tokens", "512"], "disagg", "rapid"),
])
def test_serve_builds_what_it_accepts(argv: list[str], mode: str, policy: str) -> None:
    from unittest import mock

    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", *argv]) == 0
    _, build, _ = run_.call_args.args  # run(scfg, build, model): the tree is built once the port is bound
    cfg, _ = build()
    assert (cfg.launch.mode, cfg.partition.policy) == (mode, policy)


def test_serve_refuses_them_before_binding_its_port(capsys: pytest.CaptureFixture[str]) -> None:
    """The check needs no model: `rapidserve serve` runs it before `run` binds the port and answers 503."""
    from unittest import mock

    with mock.patch("rapidserve.server.serve.run", side_effect=AssertionError("bound the port")):
        assert main(["serve", "preset:tiny-llama", "--mode", "hybrid", "--policy", "drift"]) == 2
    assert "--policy drift" in capsys.readouterr().err


def test_partition_config_resolves_the_policy_from_the_mode() -> None:
    assert partition_config(build_parser().parse_args(["serve", "--mode", "hybrid"])).policy == "fused"
    assert partition_config(build_parser().parse_args(["serve"])) == PartitionConfig(policy=DEFAULT_POLICY)
    assert DEFAULT_POLICY == "duet"  # the adaptive policy (partition_config.DEFAULT_POLICY's note: measured)
    assert partition_config(build_parser().parse_args(["serve", "--partition", "off"])).policy == "rapid"


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"prefill_batch_tokens": 256}, "prefill_batch_tokens=256"),
    ({"enforce_eager": True, "prefill_graph_tokens": (16,)}, "prefill_graph_tokens=(16,)"),
    ({"partition": PartitionConfig(slo_itl_ms=20.0)}, "--slo-itl-ms"),
    ({"partition": PartitionConfig(mode="off")}, "--partition"),
])
def test_llm_refuses_what_it_does_not_read(kwargs: dict[str, object], flag: str) -> None:
    from rapidserve.llm import LLM

    with pytest.raises(ConfigError, match="not read (by LLM|with --enforce-eager)") as e:
        LLM("/nonexistent", device="cpu", **kwargs)
    assert flag in str(e.value)


def test_builder_checks_the_launch_it_is_given() -> None:
    """The sections passed to the builder are what is checked (not defaults replaced afterwards)."""
    with pytest.raises(ConfigError, match="--no-async-scheduling: not read by --mode rapid"):
        build_engine_config("/nonexistent", async_scheduling=False)
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", async_scheduling=False,
                                 launch=LaunchConfig(mode="hybrid"))
    assert cfg.partition.policy == "fused" and not cfg.scheduler.async_scheduling


# ---- --slo-itl-ms none (no ITL SLO) --------------------------------------------------------------------------------
# Written out from what the engine does with no SLO: duet fuses every step with the whole token budget
# (partition/policies.py); a fixed or no partition, the fused policy (hybrid, disagg) and LLM read no SLO, so none is
# what they run anyway; rapid and drift choose their split by the SLO, and `rapidserve profile` marks its table and
# plot with it: they refuse none, saying why and what to use instead.
INSTEAD = ("give a number of ms", "--policy duet (every step fused with the whole token budget)",
           "--policy fused (--mode hybrid)")
NO_SLO: dict[tuple[str, str, str], tuple[str, ...] | None] = {
    ("rapid", "rapid", "adaptive"): ("--slo-itl-ms none: --policy rapid chooses its split from the ITL SLO", *INSTEAD),
    ("rapid", "rapid", "static"): None,
    ("rapid", "rapid", "off"): None,
    ("rapid", "duet", "adaptive"): None,
    ("rapid", "drift", "adaptive"): ("--slo-itl-ms none: --policy drift chooses its split from the ITL SLO", *INSTEAD),
    ("hybrid", "fused", "off"): None,
    ("disagg", "rapid", "off"): None,
    ("offline", DEFAULT_POLICY, "adaptive"): None,
    ("profile", DEFAULT_POLICY, "adaptive"): ("--slo-itl-ms none: `rapidserve profile` picks each cell's best "
                                              "configuration within the ITL SLO", "give a number of ms"),
}


@pytest.mark.parametrize(("run", "policy", "mode"), list(NO_SLO))
def test_no_itl_slo_in_every_cell_is_run_or_refused_saying_why(run: str, policy: str, mode: str) -> None:
    given: dict[str, object] = {"partition.slo_itl_ms": None}
    if mode != "adaptive" and RUN_SPECS[run].partition is None:
        given["partition.mode"] = mode
    found, want = conflicts(run, policy, given), NO_SLO[run, policy, mode]
    if want is None:
        assert found == [], found
    else:
        assert len(found) == 1 and all(n in found[0] for n in want), found


def test_the_no_slo_table_covers_every_runnable_cell() -> None:
    assert set(NO_SLO) == set(READS)


def test_a_number_of_ms_is_still_refused_where_no_slo_is_read() -> None:
    """What none is accepted for (nothing reads an SLO there) is not a way to give a number that would be ignored."""
    for run, policy, mode in (("hybrid", "fused", "off"), ("offline", DEFAULT_POLICY, "adaptive"),
                              ("rapid", "rapid", "static")):
        given: dict[str, object] = {"partition.slo_itl_ms": 30.0}
        if run == "rapid":
            given["partition.mode"] = mode
        (msg,) = conflicts(run, policy, given)
        assert "--slo-itl-ms" in msg and "not read" in msg and "drop it" in msg, msg


@pytest.mark.parametrize(("argv", "names"), [
    (["--policy", "rapid"], ("--slo-itl-ms none: --policy rapid",)),
    (["--policy", "drift"], ("--slo-itl-ms none: --policy drift",)),
])
def test_serve_refuses_no_slo_where_the_split_needs_one(argv: list[str], names: tuple[str, ...],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nonexistent", "--slo-itl-ms", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rapidserve: error:") and err.count("\n") == 1 and all(n in err for n in names), err


def test_serve_default_policy_takes_no_slo(capsys: pytest.CaptureFixture[str]) -> None:
    """The default policy (duet) reads `--slo-itl-ms none` (every step fused): the flag check lets it through and the
    run goes on to the model, which fails here."""
    assert main(["serve", "--model", "/nonexistent", "--slo-itl-ms", "none"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent" in err and "--slo-itl-ms" not in err, err


def test_profile_refuses_no_slo_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "/nonexistent", "--slo-itl-ms", "none"]) == 2
    err = capsys.readouterr().err
    assert "--slo-itl-ms none: `rapidserve profile`" in err and "give a number of ms" in err, err


@pytest.mark.parametrize(("argv", "mode", "policy"), [
    (["--policy", "duet"], "rapid", "duet"), (["--mode", "hybrid"], "hybrid", "fused"),
    (["--policy", "fused"], "hybrid", "fused"), (["--partition", "off"], "rapid", "rapid"),
    (["--mode", "disagg"], "disagg", "rapid"),
])
def test_serve_builds_no_slo_where_it_runs(argv: list[str], mode: str, policy: str) -> None:
    from unittest import mock

    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", "--slo-itl-ms", "none", *argv]) == 0
    cfg, _ = run_.call_args.args[1]()
    assert (cfg.launch.mode, cfg.partition.policy, cfg.partition.slo_itl_ms) == (mode, policy, None)


def test_serve_refuses_a_static_split_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """A static share needs a partition backend; a CPU has none, so `--partition static:0.25` (with an SLO of none,
    which a static partition runs anyway) is refused by name before any worker starts, not served unsplit."""
    from unittest import mock

    with mock.patch("rapidserve.server.serve.run", side_effect=lambda _s, build, *a, **k: build() and 0) as run_:
        code = main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", "--slo-itl-ms", "none",
                     "--partition", "static:0.25"])
    err = capsys.readouterr().err
    assert run_.called and code == 2 and "--partition static:0.25: no partition backend on cpu" in err, err


def test_llm_runs_without_an_itl_slo() -> None:
    """`LLM` (and `rapidserve generate`, which has no --slo-itl-ms) fuses every step: no SLO is what it runs."""
    from rapidserve import LLM, SamplingParams

    llm = LLM("preset:tiny-llama", device="cpu", show_progress=False, partition=PartitionConfig(slo_itl_ms=None))
    assert llm.config.partition.slo_itl_ms is None
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ConfigError, match="--slo-itl-ms: not read by LLM"):
        LLM("/nonexistent", device="cpu", partition=PartitionConfig(slo_itl_ms=30.0))


@pytest.mark.parametrize(("run", "policy", "mode", "slo", "want"), [
    ("rapid", "duet", "adaptive", 50.0, "policy duet: fused when a step fits the ITL SLO, else split (DuetServe), "
                                        "ITL SLO 50 ms"),
    ("rapid", "duet", "adaptive", None, "policy duet: fused when a step fits the ITL SLO, else split (DuetServe), "
                                        "ITL SLO none"),
    ("rapid", "rapid", "static", 50.0, "policy rapid: always split, the profile's configuration (RAPID-Serve), on the "
                                       "static partition"),
    ("rapid", "drift", "adaptive", 25.0, "policy drift: split, prefill a layer block at a time (DRIFT), ITL SLO 25 ms"),
    ("hybrid", "fused", "off", 50.0, "policy fused: always one mixed step on the whole GPU (vLLM / Sarathi-Serve; "
                                     "--mode hybrid)"),
    ("disagg", "rapid", "off", 50.0, "no step policy: prefill and decode on their own GPUs"),
])
def test_policy_line_names_what_runs(run: str, policy: str, mode: str, slo: float | None, want: str) -> None:
    from rapidserve.policy_spec import policy_line

    assert policy_line(run, policy, mode, slo) == want
