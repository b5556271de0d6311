"""No credential in what is printed, logged or written (rapidserve/redaction.py): the helper, table-driven; the config
tree's reprs; `rapidserve bench`'s error line and results; bench/compare.py's dry run and its reports and logs of a
real comparison on CPU with --api-key in --serve-args and --bench-args; bench/soak.py's recorded settings; the
command bench/vs_vllm.sh logs."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rapidserve.benchmark.client import Target
from rapidserve.benchmark.runner import BenchConfig
from rapidserve.redaction import (
    REDACTED,
    is_secret_name,
    redact_args,
    redact_argv,
    redact_command,
    redact_mapping,
    redact_text,
    scrub_file,
    secret_values,
)
from rapidserve.server_config import ServerConfig
from tests.test_bench_compare import compare
from tests.test_server import ROOT
from tests.test_soak import soak

SECRET = "sk-Creds-Test-0123456789abcdef"


@pytest.mark.parametrize(("name", "secret"), [
    ("--api-key", True), ("api_key", True), ("--hf-token", True), ("HF_TOKEN", True), ("HUGGING_FACE_HUB_TOKEN", True),
    ("VLLM_API_KEY", True), ("RAPIDSERVE_API_KEY", True), ("--ssl-keyfile", True), ("--ssl-keyfile-password", True),
    ("client_secret", True), ("AWS_SECRET_ACCESS_KEY", True), ("Authorization", True), ("password", True),
    ("--max-tokens", False), ("--max-num-batched-tokens", False), ("--token-ids", False), ("--token-range", False),
    ("--tokenizer", False), ("--api-key-file", False), ("eos_token", False), ("--served-model-name", False),
    ("--kv-cache-dtype", False), ("TOKENIZERS_PARALLELISM", False),
])
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


@pytest.mark.parametrize(("argv", "want"), [
    (["serve", "--api-key", SECRET, "--port", "0"], ["serve", "--api-key", REDACTED, "--port", "0"]),
    (["--api-key=" + SECRET, "--max-tokens", "5"], ["--api-key=" + REDACTED, "--max-tokens", "5"]),
    (["HF_TOKEN=" + SECRET, "python", "x.py"], ["HF_TOKEN=" + REDACTED, "python", "x.py"]),
    (["--hf-token", SECRET, "--ssl-keyfile", "/k.pem"], ["--hf-token", REDACTED, "--ssl-keyfile", REDACTED]),
    (["--serve-args", f"--device cpu --api-key {SECRET}"], ["--serve-args", f"--device cpu --api-key {REDACTED}"]),
    (["--base-url", f"http://user:{SECRET}@h:8000/v1"], ["--base-url", f"http://{REDACTED}@h:8000/v1"]),
    (["-H", f"Authorization: Bearer {SECRET}"], ["-H", f"Authorization: Bearer {REDACTED}"]),
    (["--api-key-file", "/run/key", "--token-ids", "1,2"], ["--api-key-file", "/run/key", "--token-ids", "1,2"]),
])
def test_redact_argv(argv: list[str], want: list[str]) -> None:
    assert redact_argv(argv) == want
    assert SECRET not in redact_command(argv)


@pytest.mark.parametrize("text", [
    f"--api-key {SECRET} --max-model-len 8192", f"--api-key={SECRET}", f"--hf-token '{SECRET}'",
    f"VLLM_API_KEY={SECRET} vllm serve m", f"GET http://u:{SECRET}@host/v1/models", f"Authorization: Bearer {SECRET}",
    f"authorization={SECRET}", f'{{"api_key": "{SECRET}", "max_tokens": 3}}', f"{{'api_key': ['{SECRET}']}}",
    f"ServerConfig(api_key='{SECRET}')", f'--kv-transfer-config {{"kv_connector_extra_config": '
                                         f'{{"client_secret": "{SECRET}"}}}}',
])
def test_redact_text_hides_every_form(text: str) -> None:
    out = redact_text(text)
    assert SECRET not in out and REDACTED in out, out


@pytest.mark.parametrize("text", ["--max-tokens 5 --token-ids 1,2", "the basic idea: a token budget of 512",
                                  "http://127.0.0.1:8000/v1", "--api-key-file /run/key", "prompt_tokens=4 kind=chat"])
def test_redact_text_leaves_plain_text_alone(text: str) -> None:
    assert redact_text(text) == text


def test_redact_args_mapping_values_and_scrub(tmp_path: Path) -> None:
    assert redact_args(f"--device cpu --api-key {SECRET}") == f"--device cpu --api-key '{REDACTED}'"
    assert redact_args("--device cpu") == "--device cpu" and redact_args(None) is None
    assert SECRET not in str(redact_args(f"--api-key '{SECRET}"))  # an open quote: redacted as text
    settings = {"api_key": SECRET, "launch": f"rapidserve serve --api-key {SECRET}", "n": 3, "hf_token": None,
                "nested": [{"password": SECRET}], "base_url": f"http://a:{SECRET}@h"}
    red = redact_mapping(settings)
    assert SECRET not in repr(red) and red["n"] == 3 and red["hf_token"] is None and red["api_key"] == REDACTED
    assert secret_values(["--api-key", SECRET, "--serve-args", f"--hf-token {SECRET}x"]) == [SECRET + "x", SECRET]
    log = tmp_path / "server.log"
    log.write_text(f"non-default args: {{'api_key': ['{SECRET}']}}\nraw {SECRET} end\n")
    assert scrub_file(log, [SECRET]) and SECRET not in log.read_text() and "raw *** end" in log.read_text()
    assert not scrub_file(tmp_path / "missing.log", [SECRET])


def test_config_reprs_hide_the_key() -> None:
    """The config tree's and the benchmark's dataclasses: the key is usable, never in a repr (an exception message
    or a log line that shows the config)."""
    for obj in (ServerConfig(api_key=SECRET), BenchConfig(api_key=SECRET), Target("http://h", "m", SECRET)):
        assert SECRET not in repr(obj) and SECRET not in str(obj), type(obj).__name__
        assert obj.api_key == SECRET  # type: ignore[attr-defined]
    assert dataclasses.replace(ServerConfig(api_key=SECRET), port=1).api_key == SECRET


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=full)


@pytest.mark.parametrize("secret_args", [["--base-url", f"http://user:{SECRET}@127.0.0.1:9"],
                                         ["--base-url", "http://127.0.0.1:9", "--api-key", SECRET]])
def test_bench_error_line_hides_url_userinfo_and_key(secret_args: list[str]) -> None:
    """`rapidserve bench` against a server that is not there: the error line names the server without the URL's
    userinfo; nothing carries --api-key."""
    r = _run([sys.executable, "-m", "rapidserve.cli", "bench", *secret_args, "--num-prompts", "1"])
    assert r.returncode != 0 and "cannot benchmark" in r.stderr, r.stderr[-2000:]
    assert SECRET not in r.stdout + r.stderr


def test_compare_dry_run_hides_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--dry-run", "--system", f"k=--api-key {SECRET}",
                         "--system", f"ext=ext:http://u:{SECRET}@127.0.0.1:9",
                         "--systems", f"rapid-adaptive,vllm,ext:http://v:{SECRET}@127.0.0.1:9", "--vllm-serve", "none",
                         "--vllm-model", "/root/peermodel",
                         "--serve-args", f"--max-model-len 1024 --api-key {SECRET}",
                         "--bench-args", f"--api-key {SECRET}"]) == 0
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and "--api-key" in out.out and REDACTED in out.out, out.out


def test_compare_usage_error_hides_the_bench_key(capsys: pytest.CaptureFixture[str]) -> None:
    """An error path: a workload --bench-args cannot run is named in the error, without its --api-key."""
    with pytest.raises(SystemExit) as e:
        compare.main(["--dry-run", "--bench-args", f"--api-key {SECRET} --input-len x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--api-key" in err and "not an integer" in err and SECRET not in err, err


def test_compare_on_cpu_writes_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real comparison (the tiny preset on CPU) whose server needs --api-key (in --serve-args) and whose client
    sends it (--bench-args): it runs, and no file it writes (reports, per-run results, the server's log) nor what it
    prints holds the key."""
    rc = compare.main(["--model", "preset:tiny-llama", "--serve-args", f"--device cpu --num-kv-blocks 64 --api-key "
                       f"{SECRET}", "--bench-args", f"--api-key {SECRET}", "--systems", "", "--system", "a=",
                       "--workloads", "24:4", "--rates", "inf", "--num-prompts", "4", "--token-range", "3:1000",
                       "--warmup", "1", "--out", str(tmp_path), "--name", "creds"])
    out = capsys.readouterr()
    assert rc == 0, out.out[-3000:]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "creds.json" for p in files) and any(p.suffix == ".log" for p in files), files
    for p in files:
        assert SECRET not in p.read_bytes().decode("utf-8", "replace"), p
    assert SECRET not in out.out + out.err
    assert "--api-key" in (tmp_path / "creds.json").read_text()  # recorded, as REDACTED


def test_soak_records_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/soak.py with --api-key and a --launch command that carries the key (and echoes it, as a server that
    prints its arguments would): its report (settings), tables, the launched server's log and what it prints hold
    none of it. The launched command exits at once: the soak fails, and writes all of that anyway."""
    launch = f"sh -c 'echo started with api_key=$1; echo $1; exit 3' sh {SECRET} --api-key {SECRET}"
    rc = soak.main(["--launch", launch, "--api-key", SECRET, "--rate", "1", "--duration-s", "100",
                    "--launch-timeout-s", "30", "--out-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 1 and (tmp_path / "soak.json").is_file() and (tmp_path / "server.log").is_file(), out.out[-2000:]
    assert "started with api_key=***" in (tmp_path / "server.log").read_text()
    for p in tmp_path.rglob("*"):
        assert not p.is_file() or SECRET not in p.read_bytes().decode("utf-8", "replace"), p
    assert SECRET not in out.out + out.err
    settings = redact_mapping(dict(vars(soak.parse_args(["--url", f"http://u:{SECRET}@127.0.0.1:9", "--rate", "1"]))))
    assert SECRET not in repr(settings)


def test_vs_vllm_logs_its_command_redacted() -> None:
    """bench/vs_vllm.sh logs compare.py's command (SERVE_ARGS in it) through `python -m rapidserve.redaction`."""
    src = Path(ROOT, "bench", "vs_vllm.sh").read_text()
    assert "printf '%q ' \"${cmd[@]}\"" not in src and '-m rapidserve.redaction "${cmd[@]}"' in src
    cmd = ["python", "bench/compare.py", "--serve-args", f"--max-model-len 8192 --api-key {SECRET}", "--out", "w"]
    r = _run([sys.executable, "-m", "rapidserve.redaction", *cmd])
    assert r.returncode == 0 and SECRET not in r.stdout and "--api-key" in r.stdout
    assert shlex.split(r.stdout)[:2] == ["python", "bench/compare.py"]


@pytest.mark.parametrize("argv,want", [
    # a valueless switch whose name ends like a secret hides nothing after it (two configurations stay two)
    (["serve", "m", "--no-allow-credentials", "--max-model-len", "4096"],
     ["serve", "m", "--no-allow-credentials", "--max-model-len", "4096"]),
    # vLLM's --api-key takes several keys: every one is hidden, up to the next flag
    (["vllm", "serve", "m", "--api-key", "K1SECRETAAAA", "K2SECRETBBBB", "--port", "8001"],
     ["vllm", "serve", "m", "--api-key", "***", "***", "--port", "8001"]),
    (["--hf-token", "hf_abc", "model"], ["--hf-token", "***", "model"]),  # one value for the others
    (["--chat-template", "You are a basic assistant. {{ messages }}"],
     ["--chat-template", "You are a basic assistant. {{ messages }}"]),  # prose after Basic / Bearer stays
])
def test_redact_argv_review_cases(argv: list[str], want: list[str]) -> None:
    assert redact_argv(argv) == want


def test_every_key_of_several_is_a_secret_and_lists_under_a_secret_key_are_redacted() -> None:
    argv = ["vllm", "serve", "m", "--api-key", "K1SECRETAAAA", "K2SECRETBBBB", "--port", "8001"]
    assert sorted(secret_values(argv)) == ["K1SECRETAAAA", "K2SECRETBBBB"]
    assert redact_text("{'api_key': ['K1SECRETAAAA', 'K2SECRETBBBB'], 'port': 8001}") == \
        "{'api_key': ['***', '***'], 'port': 8001}"
    assert redact_text("the model uses a basic tokenizer; bearer of news") == \
        "the model uses a basic tokenizer; bearer of news"
    assert redact_text("Authorization: Basic dXNlcjpwYXNz and Bearer sk-abc123def456") == \
        "Authorization: Basic *** and Bearer ***"
    assert redact_args("--no-allow-credentials --max-num-seqs 64") != redact_args(
        "--no-allow-credentials --max-model-len 64")
