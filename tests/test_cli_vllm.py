"""vLLM's command line on rapidserve (issue 38): `serve MODEL`, Hub ids from a local Hugging Face cache (a fake
cache tree holding a tiny model folder), --load-format dummy, several --served-model-name, the log flags, and
the flags rapidserve refuses by name. In this process; `serve` never starts (its `run` is replaced)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from rapidserve.cli import build_parser, main
from rapidserve.cli_serve import server_config
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.loader import ModelLoadError, resolve_model
from rapidserve.loader.hub import display_name, find_snapshot, hub_cache_dirs, is_repo_id, local_model_spec
from rapidserve.loader.presets import load_preset, save_as_hf_folder

REPO = "acme/tiny-chat"
COMMIT, OTHER = "a" * 40, "b" * 40


def fake_cache(root: Path, refs: dict[str, str] | None = None, snapshots: tuple[str, ...] = (COMMIT,)) -> Path:
    """A Hugging Face hub cache under `root` holding REPO: refs/<name> -> commit, each snapshot a tiny model
    folder (tiny-llama's shapes, its weights)."""
    repo = root / "models--acme--tiny-chat"
    for name, commit in (refs if refs is not None else {"main": COMMIT}).items():
        (repo / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
    for commit in snapshots:
        save_as_hf_folder(load_preset("tiny-llama"), repo / "snapshots" / commit)
    return repo


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    fake_cache(root, {"main": COMMIT, "v1": OTHER, "pr/1": OTHER}, (COMMIT, OTHER))
    return root


def serve_args(*args: str) -> tuple[Any, Any, str | None]:
    """`rapidserve serve ARGS` up to its `run`: (the ServerConfig, the EngineConfig `build` makes, the model as
    given)."""
    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--device", "cpu", *args]) == 0
    scfg, build, model = run_.call_args.args
    ecfg, _ = build()
    return scfg, ecfg, model


def exit_2(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    with mock.patch("rapidserve.server.serve.run", side_effect=lambda s, build, m, **k: build() and 0):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- MODEL, positional


def test_positional_model_as_vllm_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ecfg, model = serve_args("preset:tiny-llama")
    assert model == "preset:tiny-llama" and ecfg.model == "preset:tiny-llama"
    _, ecfg, _ = serve_args("preset:tiny-llama", "--model", "preset:tiny-llama")  # both, the same: fine
    assert ecfg.model_config.name == "tiny-llama"
    _, ecfg, model = serve_args("--model", "preset:tiny-qwen3")  # --model as before
    assert model == "preset:tiny-qwen3" and ecfg.model_config.arch == "qwen3"


def test_positional_and_flag_that_differ_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = exit_2(capsys, "serve", "preset:tiny-llama", "--model", "preset:tiny-qwen3")
    assert "'preset:tiny-llama'" in err and "'preset:tiny-qwen3'" in err and "give one" in err


# ---------------------------------------------------------------- Hub ids from the local cache


@pytest.mark.parametrize("spec,hub", [("Qwen/Qwen3-8B", True), ("gpt2", True), ("/models/x", False),
                                      ("./x", False), ("a/b/c", False), ("x.gguf", False), ("~/m", False),
                                      ("../m", False), ("preset:tiny-llama", False)])
def test_what_is_a_hub_id(spec: str, hub: bool) -> None:
    assert is_repo_id(spec) is hub


@pytest.mark.parametrize("env,download_dir,want", [
    ({}, "/dl", ["/dl"]),
    ({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}, None, ["/c"]),
    ({"HUGGINGFACE_HUB_CACHE": "/old"}, None, ["/old"]),
    ({"HF_HOME": "/h"}, None, ["/h/hub"]),
    ({"XDG_CACHE_HOME": "/x"}, None, ["/x/huggingface/hub"]),
    ({"HF_HOME": "/h"}, "/dl", ["/dl"]),  # --download-dir alone, as vLLM's cache_dir
])
def test_cache_folders_in_huggingface_hub_order(env: dict[str, str], download_dir: str | None,
                                                want: list[str]) -> None:
    assert hub_cache_dirs(env, download_dir) == want


def test_default_cache_folder_is_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dirs({}) == [str(tmp_path / ".cache" / "huggingface" / "hub")]


@pytest.mark.parametrize("revision,commit", [(None, COMMIT), ("main", COMMIT), ("v1", OTHER), ("pr/1", OTHER),
                                             (OTHER, OTHER)])
def test_revision_is_a_ref_or_a_commit(cache: Path, revision: str | None, commit: str) -> None:
    snap = find_snapshot(REPO, revision, [str(cache)])
    assert snap == str(cache / "models--acme--tiny-chat" / "snapshots" / commit)


def test_unknown_revision_lists_what_the_cache_has(cache: Path) -> None:
    with pytest.raises(ModelLoadError) as ei:
        find_snapshot(REPO, "v9", [str(cache)])
    msg = str(ei.value)
    assert "'v9'" in msg and "main" in msg and "pr/1" in msg and COMMIT in msg and "does not download" in msg


def test_without_refs_main_the_only_snapshot_is_taken(tmp_path: Path) -> None:
    fake_cache(tmp_path, refs={})
    assert find_snapshot(REPO, None, [str(tmp_path)]).endswith(COMMIT)
    fake_cache(tmp_path, refs={}, snapshots=(OTHER,))  # now two, and no ref says which
    with pytest.raises(ModelLoadError, match="revision 'main'"):
        find_snapshot(REPO, None, [str(tmp_path)])


def test_absent_model_says_no_download_and_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as ei:
        local_model_spec("acme/absent", None, None, {"HF_HOME": str(tmp_path)})
    msg = str(ei.value)
    assert "does not download" in msg and str(tmp_path / "hub" / "models--acme--absent") in msg
    assert "hf download acme/absent" in msg


def test_hub_id_resolves_from_hf_home_without_network(cache: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "hub").parent.mkdir(parents=True)
    os.symlink(cache, home / "hub")
    cfg, source = build_engine_config(REPO, device="cpu", env={"HF_HOME": str(home)})
    assert cfg.model == str(home / "hub" / "models--acme--tiny-chat" / "snapshots" / COMMIT)
    assert cfg.model_config == load_preset("tiny-llama").config.__class__(
        **{**load_preset("tiny-llama").config.__dict__, "name": "tiny-chat"})
    a = dict(load_preset("tiny-llama").weights())
    b = dict(resolve_model(cfg.model).weights())  # what a worker resolves from the config: the same weights
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg, _ = build_engine_config(REPO, device="cpu", revision="v1", download_dir=str(cache), env={})
    assert cfg.model.endswith(OTHER)


def test_tokenizer_flag_takes_a_hub_id_too(cache: Path) -> None:
    cfg, source = build_engine_config("preset:tiny-llama", device="cpu", tokenizer=REPO,
                                      env={"HF_HUB_CACHE": str(cache)})
    assert cfg.tokenizer == str(cache / "models--acme--tiny-chat" / "snapshots" / COMMIT)
    assert source.tokenizer_dir == cfg.tokenizer  # type: ignore[attr-defined]


def test_local_path_wins_and_hub_flags_need_a_hub_id(cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "acme" / "tiny-chat"
    save_as_hf_folder(load_preset("tiny-qwen3"), local)
    monkeypatch.chdir(tmp_path)
    cfg, _ = build_engine_config(REPO, device="cpu", env={"HF_HUB_CACHE": str(cache)})
    assert cfg.model == REPO and cfg.model_config.arch == "qwen3"  # the folder ./acme/tiny-chat
    for flag in ({"revision": "v1"}, {"download_dir": str(cache)}):
        with pytest.raises(ModelLoadError, match=f"--{next(iter(flag)).replace('_', '-')}"):
            build_engine_config("preset:tiny-llama", device="cpu", **flag)  # type: ignore[arg-type]


def test_serve_takes_a_hub_id_and_answers_to_it(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidserve.server.serve import served_names

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    scfg, ecfg, model = serve_args(REPO, "--revision", "v1")
    assert ecfg.model.endswith(OTHER) and model == REPO
    assert served_names(scfg, ecfg, model) == (REPO,)  # what vLLM's users send as `model`
    assert display_name(ecfg.model) == "tiny-chat"  # the profile's label, the logs
    scfg, ecfg, model = serve_args("--model", REPO, "--served-model-name", "chat", "tiny", "--download-dir", str(cache))
    assert served_names(scfg, ecfg, model) == ("chat", "tiny")
    scfg, ecfg, model = serve_args("preset:tiny-llama")
    assert served_names(scfg, ecfg, model) == ("preset:tiny-llama",)


def test_hub_id_absent_exits_2_naming_the_cache(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    err = exit_2(capsys, "serve", "acme/absent", "--device", "cpu")
    assert "does not download" in err and str(tmp_path) in err


# ---------------------------------------------------------------- --load-format


def test_load_format_dummy_random_weights_of_any_config(tmp_path: Path) -> None:
    folder = tmp_path / "cfg-only"
    save_as_hf_folder(load_preset("tiny-qwen2"), folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()  # a config.json alone: nothing but its shapes is read
    cfg, source = build_engine_config(str(folder), device="cpu", load_format="dummy")
    assert cfg.model == f"dummy:{folder}" and cfg.model_config.arch == "qwen2"
    first = dict(source.weights())  # type: ignore[attr-defined]
    again = dict(resolve_model(cfg.model).weights())  # a worker's resolution: the same numbers
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    norm = first["model.norm.weight"]
    assert norm.shape == (128,) and 0.5 < float(norm.mean()) < 1.5  # drawn as a preset's
    with pytest.raises(ModelLoadError, match="safetensors"):
        build_engine_config(str(folder), device="cpu")  # auto still wants the weights


def test_load_format_dummy_serves_through_llm(tmp_path: Path) -> None:
    from rapidserve.llm import LLM
    from rapidserve.sampling_params import SamplingParams

    save_as_hf_folder(load_preset("tiny-llama"), tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", show_progress=False, num_kv_blocks=32)
    out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_load_format_dummy_in_the_engines_matches_llm(tmp_path: Path, mode: str) -> None:
    """The workers resolve `dummy:<folder>` themselves (a folder without weight files): the same random weights
    as the offline LLM, so the same greedy tokens, in both engine modes."""
    import asyncio
    import dataclasses

    from rapidserve.engine.client import AsyncEngine
    from rapidserve.launch_config import LaunchConfig
    from rapidserve.llm import LLM
    from rapidserve.sampling_params import SamplingParams

    save_as_hf_folder(load_preset("tiny-llama"), tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    prompts = [[1, 5, 9, 11], [7] * 30]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw: dict[str, Any] = dict(load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=32,
                              max_model_len=256)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), show_progress=False, **kw).generate(
        prompts, params, use_tqdm=False)]
    cfg, _ = build_engine_config(str(tmp_path), **kw)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300))  # type: ignore[arg-type]

    async def main() -> list[list[int]]:
        engine = await AsyncEngine.start(cfg)
        try:
            out = []
            for i, p in enumerate(prompts):
                out.append([t.token_id async for t in engine.generate(f"r{i}", p, params)])
            return out
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want


@pytest.mark.parametrize("model,fmt,needle", [
    (None, "dummy", "GGUF"), ("x.gguf", "safetensors", "is a GGUF file"), ("/m", "gguf", "not a .gguf"),
    ("preset:tiny-llama", "safetensors", "preset"),
])
def test_load_format_that_does_not_fit_the_model(model: str | None, fmt: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_engine_config(model, device="cpu", load_format=fmt)


def test_load_format_dummy_of_a_preset_is_the_preset() -> None:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", load_format="dummy")
    assert cfg.model == "preset:tiny-llama"


def test_load_format_reaches_every_command(tmp_path: Path) -> None:
    save_as_hf_folder(load_preset("tiny-llama"), tmp_path)
    _, ecfg, _ = serve_args(str(tmp_path), "--load-format", "dummy")
    assert ecfg.model == f"dummy:{tmp_path}"
    from rapidserve.cli_args import engine_kwargs

    a = build_parser().parse_args(["generate", "--prompt", "x", "--load-format", "dummy", "--revision", "r",
                                   "--download-dir", "/d"])
    kw = engine_kwargs(a, env={})
    assert (kw["load_format"], kw["revision"], kw["download_dir"]) == ("dummy", "r", "/d")
    p = build_parser().parse_args(["profile", "--load-format", "dummy"])
    assert p.load_format == "dummy"


# ---------------------------------------------------------------- names, logs, vLLM's other flags


def test_served_model_names_and_log_flags_map_to_the_configs() -> None:
    scfg, ecfg, _ = serve_args("preset:tiny-llama", "--served-model-name", "a", "b", "--disable-log-requests",
                               "--log-level", "debug", "--uvicorn-log-level", "trace")
    assert scfg.served_model_name == ("a", "b") and scfg.log_requests is False
    assert (scfg.log_level, scfg.http_log_level, ecfg.launch.log_level) == ("debug", "trace", "debug")
    scfg = server_config(build_parser().parse_args(["serve", "--enable-log-requests"]), {})
    assert scfg.served_model_name == () and scfg.log_requests is True and scfg.log_level == "info"


@pytest.mark.parametrize("args,needle", [
    (["--served-model-name", "a", "a"], "distinct"),
    (["--log-level", "loud"], "--log-level"),
    (["--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
])  # --disable-log-requests with --enable-log-requests: the last wins (test_log_requests_switches_last_wins)
def test_bad_name_and_log_flags_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    assert needle in exit_2(capsys, "serve", "preset:tiny-llama", "--device", "cpu", *args)


@pytest.fixture
def restore_logging() -> Any:
    names = ("rapidserve", "rapidserve.requests", "aiohttp.access", "aiohttp.server", "aiohttp.web",
             "aiohttp.internal")
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def test_configure_logging_levels(restore_logging: Any) -> None:
    from rapidserve.server.startup import configure_logging

    configure_logging("warning", "trace", log_requests=False)
    assert logging.getLogger("rapidserve.server").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("aiohttp.access").level == logging.DEBUG
    assert not logging.getLogger("rapidserve.requests").isEnabledFor(logging.INFO)
    configure_logging("debug", "error", log_requests=True)
    assert logging.getLogger("rapidserve.requests").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("aiohttp.server").level == logging.ERROR


@pytest.mark.parametrize("args,needle", [
    (["--quantization", "awq"], "--quantization 'awq' (quantization='awq'): rapidserve quantizes weights with fp8 "
                                "only"),
    (["-q", "gptq"], "--quantization 'gptq'"),  # main's flag: fp8/none/auto accepted (test_quantized_checkpoints)
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size: rapidserve does not support '2' (no pipeline "
                                        "parallelism: tensor (-tp)"),
    (["--enable-lora"], "no LoRA"),
    (["-O3"], "does not support vLLM's -O3 (no torch.compile"),
    (["--frobnicate=1"], "rapidserve serve does not support --frobnicate"),
    (["--no-enable-chunked-prefill"], "always chunks"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype 'fp8_e5m2' (kv_cache_dtype='fp8_e5m2'): e5m2"),
    (["--kv-cache-dtype", "float16", "--dtype", "bfloat16"], "--kv-cache-dtype float16: the model computes in "
                                                              "bfloat16 (--dtype)"),
    (["--calculate-kv-scales"], "does not support vLLM's --calculate-kv-scales (fp8 KV cache scales are the "
                                "checkpoint's"),
    (["--scheduling-policy", "priority"], "--scheduling-policy"),
])
def test_vllm_flags_rapidserve_lacks_are_refused_by_name(capsys: pytest.CaptureFixture[str], args: list[str],
                                                         needle: str) -> None:
    assert needle in exit_2(capsys, "serve", "preset:tiny-llama", *args)


def test_quantization_fp8_reaches_the_tree() -> None:
    _, ecfg, _ = serve_args("preset:tiny-llama", "-q", "fp8")
    assert ecfg.quantization.method == "fp8" and ecfg.quantization.online


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "FP8"])
def test_kv_cache_dtype_fp8_reaches_the_tree(value: str) -> None:
    _, ecfg, _ = serve_args("preset:tiny-llama", "--kv-cache-dtype", value)
    assert ecfg.cache.kv_cache_dtype == "fp8" and ecfg.cache.kv_scales is None


def test_reasoning_parser_reaches_the_server_config(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("qwen3", "deepseek_r1"):
        scfg, _, _ = serve_args("preset:tiny-llama", "--reasoning-parser", name)
        assert scfg.reasoning_parser == name
    assert serve_args("preset:tiny-llama")[0].reasoning_parser is None
    err = exit_2(capsys, "serve", "preset:tiny-llama", "--reasoning-parser", "granite")
    assert "--reasoning-parser: invalid choice: 'granite'" in err and "'deepseek_r1', 'qwen3'" in err, err
    assert "does not support" not in err


def test_vllm_flags_that_change_nothing_are_accepted() -> None:
    _, ecfg, _ = serve_args("preset:tiny-llama", "--trust-remote-code", "--disable-log-stats",
                            "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--scheduling-policy", "fcfs",
                            "--tokenizer-mode", "auto", "--dtype", "half", "--num-gpu-blocks-override", "40")
    assert ecfg.runner.dtype == "float16" and ecfg.cache.num_blocks == 40
    a: argparse.Namespace = build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "float"])
    assert a.dtype == "float32"


# ---------------------------------------------------------------- --kv-events-config

KV_ON = '{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/rapidserve-kv-test", "topic": "kv"}'


@pytest.mark.parametrize("mode", ["rapid", "hybrid", "disagg"])
def test_kv_events_config_reaches_the_tree_seeded_by_pythonhashseed(monkeypatch: pytest.MonkeyPatch,
                                                                    mode: str) -> None:
    pytest.importorskip("zmq")
    from rapidserve.kv_events import make_none_hash

    monkeypatch.setenv("PYTHONHASHSEED", "7")
    _, ecfg, _ = serve_args("preset:tiny-llama", "--mode", mode, "--kv-events-config", KV_ON)
    kv = ecfg.kv_events
    assert kv.publishing and kv.publisher == "zmq" and kv.topic == "kv" and kv.endpoint.endswith("kv-test")
    assert kv.none_hash == make_none_hash("7")
    _, ecfg, _ = serve_args("preset:tiny-llama", "--mode", mode)  # left out: off
    assert not ecfg.kv_events.publishing and ecfg.kv_events.none_hash == b""


@pytest.mark.parametrize("args,needle", [
    (["--kv-events-config", "{"], "not valid JSON"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "port": 1}'], "unknown key(s) 'port'"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'], "hwm=0"),
    (["--kv-events-config", KV_ON, "--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
])
def test_bad_kv_events_config_exits_2_before_the_port_is_bound(capsys: pytest.CaptureFixture[str], args: list[str],
                                                               needle: str) -> None:
    capsys.readouterr()
    with mock.patch("rapidserve.server.serve.run", side_effect=AssertionError("the port was bound")):
        code = main(["serve", "preset:tiny-llama", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,want", [
    (["--enable-log-requests", "--no-enable-log-requests"], False), (["--no-enable-log-requests",
                                                                      "--enable-log-requests"], True),
    (["--disable-log-requests", "--enable-log-requests"], True), (["--enable-log-requests"], True), ([], True),
])
def test_log_requests_switches_last_wins(argv: list[str], want: bool) -> None:
    """vLLM's pair is a BooleanOptionalAction: given both, the last wins (it was an argparse 'not allowed with')."""
    from rapidserve.cli import build_parser

    assert build_parser().parse_args(["serve", *argv]).log_requests is want


def _pairs() -> list[str]:
    """Every vLLM switch `--X` that `serve` refuses by name while it takes `--no-X` (NO_OP: it asks for nothing)."""
    from rapidserve.vllm_serve_flags import refusal

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    opts = sub.choices["serve"]._option_string_actions
    return sorted("--" + f[len("--no-"):] for f, a in opts.items() if f.startswith("--no-") and a.nargs == 0
                  and "--" + f[len("--no-"):] not in opts and refusal("--" + f[len("--no-"):]) is not None)


@pytest.mark.parametrize("flag", _pairs())
def test_a_refused_switch_negated_after_it_is_off_and_accepted(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --X / --no-X are a BooleanOptionalAction: given both, the last wins. `--enable-lora --no-enable-lora`
    is LoRA off, which rapidserve does anyway: accepted (it was refused at --enable-lora). The other order, or --X
    last again, asks for it: refused by name, as --X alone."""
    no = "--no-" + flag[2:]
    build_parser().parse_args(["serve", flag, no])
    build_parser().parse_args(["serve", flag.replace("-", "_").replace("__", "--", 1), no, flag, no])
    for argv in ([no, flag], [flag, no, flag], [flag, "--", no]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", *argv])
        assert e.value.code == 2 and f"does not support vLLM's {flag} (" in capsys.readouterr().err


def test_the_last_switch_wins_on_rapidserves_own_and_always_on_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(_pairs()) > 30 and "--enable-lora" in _pairs()
    # --enable-chunked-prefill is always on: --no-... then --enable-... is on (was refused at the --no- form)
    build_parser().parse_args(["serve", "--no-enable-chunked-prefill", "--enable-chunked-prefill"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-chunked-prefill", "--no-enable-chunked-prefill"])
    assert "rapidserve always chunks prompts" in capsys.readouterr().err
    for argv, want in ((["--enforce-eager", "--no-enforce-eager"], False),
                       (["--no-enforce-eager", "--enforce-eager"], True),
                       (["--enforce-eager", "--no-enforce-eager", "--enforce-eager"], True)):
        assert build_parser().parse_args(["serve", *argv]).enforce_eager is want
    for argv, want in ((["--enable-prefix-caching", "--no-enable-prefix-caching"], False),
                       (["--no-enable-prefix-caching", "--enable-prefix-caching"], True)):
        assert build_parser().parse_args(["serve", *argv]).enable_prefix_caching is want
    # not a vLLM pair: `bench --plot` is no flag at all, and stays refused beside --no-plot
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--plot", "--no-plot"])
    assert "--plot" in capsys.readouterr().err
