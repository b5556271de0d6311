"""rapid's prefill batch (`take_prefill_batch`): whole prompts in queue order up to the token budget,
no more once the batch holds `--prefill-batch-tokens`, an over-budget prompt alone in a chunk."""

from __future__ import annotations

from collections import deque

import pytest

from rapidserve.config import SchedulerConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine import messages as m
from rapidserve.engine.prefill_worker import Job, take_prefill_batch
from rapidserve.sampling_params import SamplingParams

# (name, budget, target, jobs as (id, prompt tokens, done), hold, the batch as "id:tokens,...")
CASES = [
    ("target = budget: as before, whole prompts up to the budget", 8192, 8192,
     [("a", 2048, 0), ("b", 2048, 0), ("c", 2048, 0), ("d", 2048, 0), ("e", 2048, 0)], "",
     "a:2048,b:2048,c:2048,d:2048"),
    ("a prompt as long as the target goes alone", 8192, 2048,
     [("a", 2048, 0), ("b", 2048, 0)], "", "a:2048"),
    ("short prompts are taken until the target is reached", 8192, 2048,
     [("a", 1024, 0), ("b", 1024, 0), ("c", 1024, 0)], "", "a:1024,b:1024"),
    ("the prompt that crosses the target is taken whole", 8192, 2048,
     [("a", 1500, 0), ("b", 1500, 0), ("c", 1500, 0)], "", "a:1500,b:1500"),
    ("but not past the budget", 4096, 4096,
     [("a", 3000, 0), ("b", 3000, 0)], "", "a:3000"),
    ("an over-budget prompt goes alone, in a budget-sized chunk", 8192, 2048,
     [("a", 10000, 0), ("b", 10, 0)], "", "a:8192"),
    ("its last chunk may be followed by others up to the target", 8192, 2048,
     [("a", 10000, 8192), ("b", 100, 0), ("c", 4000, 0)], "", "a:1808,b:100,c:4000"),
    ("a cached prefix counts as done", 8192, 2048,
     [("a", 4096, 3072), ("b", 512, 0), ("c", 512, 0)], "", "a:1024,b:512,c:512"),
    ("held jobs are passed over and take no budget", 8192, 2048,
     [("a", 1024, 0), ("b", 1024, 0), ("c", 1024, 0)], "a", "b:1024,c:1024"),
    ("nothing waiting: nothing", 8192, 2048, [], "", ""),
    ("all held: nothing", 8192, 2048, [("a", 10, 0)], "a", ""),
    ("target 1: one prompt per batch", 8192, 1,
     [("a", 5, 0), ("b", 5, 0)], "", "a:5"),
]


@pytest.mark.parametrize("name,budget,target,jobs,hold,batch", CASES, ids=[c[0] for c in CASES])
def test_take_prefill_batch(name: str, budget: int, target: int, jobs: list[tuple[str, int, int]], hold: str,
                            batch: str) -> None:
    waiting = deque(Job(m.NewRequest(rid, list(range(n)), SamplingParams(), 0.0), list(range(n)), [], 0,
                        done_tokens=done) for rid, n, done in jobs)
    got = take_prefill_batch(waiting, budget, target, frozenset(hold.split(",")) - {""})
    assert ",".join(f"{j.req.req_id}:{n}" for j, n in got) == batch
    assert [j.req.req_id for j in waiting] == [j[0] for j in jobs]  # taking a batch moves nothing
    assert sum(n for _, n in got) <= budget


@pytest.mark.parametrize("tokens", [0, -5, 8193])
def test_prefill_batch_tokens_outside_one_to_the_budget_is_refused_saying_the_range(tokens: int) -> None:
    with pytest.raises(ConfigError, match=r"prefill_batch_tokens=.* must be between 1 and max_num_batched_tokens=8192"):
        SchedulerConfig(max_num_batched_tokens=8192, prefill_batch_tokens=tokens)


def test_the_cli_flag_reaches_the_config_and_bad_values_exit_naming_it() -> None:
    from rapidserve.cli import build_parser
    from rapidserve.cli_args import engine_kwargs

    a = build_parser().parse_args(["serve", "--prefill-batch-tokens", "2048"])
    assert engine_kwargs(a, env={})["prefill_batch_tokens"] == 2048
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill-batch-tokens", "0"])


@pytest.mark.parametrize("args", [["serve", "--mode", "hybrid"], ["serve", "--policy", "drift"],
                                  ["generate", "--prompt", "hi"]], ids=["serve-hybrid", "serve-drift", "generate"])
def test_the_flag_where_no_prefill_worker_runs_exits_2_saying_what_to_do(args: list[str],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_cli import usage_error

    err = usage_error(capsys, *args, "--model", "preset:tiny-llama", "--device", "cpu", "--prefill-batch-tokens", "512")
    assert "--prefill-batch-tokens" in err and "drop" in err.lower(), err


def test_serve_rapid_takes_the_flag_into_the_config() -> None:
    from unittest import mock

    from rapidserve.cli import main

    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", "--prefill-batch-tokens", "512"]) == 0
    _, build, _ = run_.call_args.args  # run(scfg, build, model): the tree is built once the port is bound
    assert build()[0].scheduler.prefill_batch_tokens == 512


def test_llm_refuses_the_setting_before_loading_anything() -> None:
    from rapidserve.llm import LLM

    with pytest.raises(ConfigError, match=r"prefill_batch_tokens=512 \(--prefill-batch-tokens\): not read by LLM .*"
                                          "drop it"):
        LLM("/nonexistent", device="cpu", prefill_batch_tokens=512)  # refused before the model path is looked at
