"""rapidserve.benchmark arrivals and workloads: schedules and prompts, reproducible from the seed."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from rapidserve.benchmark.arrivals import arrival_times, parse_rates, rate_label, rate_rng
from rapidserve.benchmark.client import completion_payload
from rapidserve.benchmark.workloads import (
    TRACES,
    WorkloadSpec,
    clip_lengths,
    make_conversation,
    make_request,
    sample_lengths,
)

INF = math.inf


@pytest.mark.parametrize("text,want", [
    ("1", (1.0,)), ("1,2,4,inf", (1.0, 2.0, 4.0, INF)), (" 0.5 , 8 ", (0.5, 8.0)), ("inf", (INF,)),
    ("4,1", (4.0, 1.0)),
])
def test_parse_rates(text: str, want: tuple[float, ...]) -> None:
    assert parse_rates(text) == want


@pytest.mark.parametrize("text,needle", [
    ("", "comma-separated"), ("1,,2", "comma-separated"), ("fast", "not a number"), ("0", "not positive"),
    ("-1", "not positive"), ("nan", "not positive"), ("1,1", "twice"),
])
def test_parse_rates_errors(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_rates(text)


def test_rate_label() -> None:
    assert [rate_label(r) for r in (1.0, 0.5, 16.0, INF)] == ["1", "0.5", "16", "inf"]


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    a = arrival_times(4.0, "poisson", rate_rng(7, 0), num=2000)
    b = arrival_times(4.0, "poisson", rate_rng(7, 0), num=2000)
    c = arrival_times(4.0, "poisson", rate_rng(7, 1), num=2000)
    d = arrival_times(4.0, "poisson", rate_rng(8, 0), num=2000)
    assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, d)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0) and len(a) == 2000
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.08)  # exponential: mean 1/rate ...
    assert gaps.std() == pytest.approx(0.25, rel=0.12)  # ... and std 1/rate


@pytest.mark.parametrize("rate,process,num,duration,want", [
    (2.0, "fixed", 4, None, [0.0, 0.5, 1.0, 1.5]),
    (2.0, "fixed", None, 2.0, [0.0, 0.5, 1.0, 1.5]),  # arrivals before the window's end
    (2.0, "fixed", 3, 10.0, [0.0, 0.5, 1.0]),  # both: the count caps the window
    (INF, "poisson", 3, None, [0.0, 0.0, 0.0]),
    (INF, "fixed", 2, 5.0, [0.0, 0.0]),
    (0.1, "fixed", None, 1.0, [0.0]),
])
def test_arrival_times_table(rate: float, process: str, num: int | None, duration: float | None,
                             want: list[float]) -> None:
    got = arrival_times(rate, process, rate_rng(0, 0), num=num, duration_s=duration)
    assert got.tolist() == pytest.approx(want)


def test_poisson_duration_window() -> None:
    t = arrival_times(10.0, "poisson", rate_rng(3, 0), duration_s=30.0)
    assert t.max() < 30.0 and len(t) == pytest.approx(300, rel=0.2)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(rate=1.0, process="bursty", num=1), "not one of"),
    (dict(rate=0.0, process="fixed", num=1), "positive"),
    (dict(rate=1.0, process="fixed"), "number of requests, the duration"),
    (dict(rate=1.0, process="fixed", num=0), ">= 1"),
    (dict(rate=1.0, process="fixed", duration_s=0.0), "positive"),
    (dict(rate=INF, process="fixed", duration_s=5.0), "needs a number"),
])
def test_arrival_times_errors(kwargs: dict[str, object], needle: str) -> None:
    rate, process = kwargs.pop("rate"), kwargs.pop("process")
    with pytest.raises(ValueError, match=needle):
        arrival_times(rate, process, rate_rng(0, 0), **kwargs)  # type: ignore[arg-type]


def test_fixed_workload_requests() -> None:
    spec = WorkloadSpec("fixed", input_len=50, output_len=7, token_lo=100, token_hi=200)
    r = make_request(spec, seed=1, index=3)
    assert len(r.prompt) == 50 and r.output_len == 7 and all(100 <= t < 200 for t in r.prompt)
    assert make_request(spec, 1, 3) == r  # reproducible
    assert make_request(spec, 1, 4).prompt != r.prompt and make_request(spec, 2, 3).prompt != r.prompt
    salted = make_request(spec, 1, 3, salt=1)  # another rate of the sweep: new tokens, same lengths
    assert salted.prompt != r.prompt and len(salted.prompt) == 50


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_shapes_have_their_means(name: str) -> None:
    spec = WorkloadSpec(name)  # no max_model_len: no clipping
    rng = np.random.default_rng(0)
    lens = np.array([sample_lengths(spec, rng) for _ in range(4000)])
    t = TRACES[name]
    tol = 0.12 if max(t.input.sigma, t.output.sigma) > 1.0 else 0.08
    assert lens[:, 0].mean() == pytest.approx(t.input.mean, rel=tol)
    assert lens[:, 1].mean() == pytest.approx(t.output.mean, rel=tol)
    assert lens.min() >= 1


def test_trace_lengths_fit_max_model_len_and_repeat_across_salts() -> None:
    spec = WorkloadSpec("mooncake", max_model_len=8192)
    reqs = [make_request(spec, 0, i) for i in range(300)]
    assert all(len(r.prompt) + r.output_len <= 8192 for r in reqs)
    assert any(len(r.prompt) + r.output_len == 8192 for r in reqs)  # long-tailed: some clipped
    assert [len(make_request(spec, 0, i, salt=5).prompt) for i in range(20)] == [len(r.prompt) for r in reqs[:20]]


@pytest.mark.parametrize("n_in,n_out,mml,want", [
    (100, 10, None, (100, 10)), (100, 10, 110, (100, 10)), (100, 10, 50, (40, 10)),
    (100, 80, 50, (25, 25)), (0, 0, 10, (1, 1)), (5000, 3, 2, (1, 1)),
])
def test_clip_lengths(n_in: int, n_out: int, mml: int | None, want: tuple[int, int]) -> None:
    assert clip_lengths(n_in, n_out, mml) == want


def test_multiturn_turns_share_the_earlier_turns_as_prefix() -> None:
    spec = WorkloadSpec("multiturn", input_len=20, output_len=4, num_turns=3, turn_input_len=6)
    conv = make_conversation(spec, 0, 2)
    history: list[int] = []
    prompts = []
    for turn in range(3):
        p = conv.prompt(turn, history)
        prompts.append(p)
        history = [*p, *conv.standin(4, spec)]
    assert [len(p) for p in prompts] == [20, 30, 40]
    assert prompts[1][:20] == prompts[0] and prompts[2][:30] == prompts[1][:30]
    again = make_conversation(spec, 0, 2)
    assert again.user_turns == conv.user_turns
    assert again.standin(4, spec) == make_conversation(spec, 0, 2).standin(4, spec)
    with pytest.raises(ValueError, match="make_conversation"):
        make_request(spec, 0, 0)
    with pytest.raises(ValueError, match="make_request"):
        make_conversation(WorkloadSpec("fixed"), 0, 0)


@pytest.mark.parametrize("spec,needle", [
    (WorkloadSpec("zipf"), "not one of"),
    (WorkloadSpec(input_len=0), "input_len=0"),
    (WorkloadSpec(token_lo=5, token_hi=5), "token range"),
    (WorkloadSpec(input_len=1000, output_len=100, max_model_len=1024), "needs 1100 tokens"),
    (WorkloadSpec("multiturn", input_len=100, output_len=10, num_turns=3, turn_input_len=20, max_model_len=169),
     "needs 170 tokens"),
])
def test_workload_check(spec: WorkloadSpec, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        spec.check()


def test_workload_check_accepts_what_fits() -> None:
    WorkloadSpec(input_len=1000, output_len=24, max_model_len=1024).check()
    WorkloadSpec("azure-code", max_model_len=1024).check()
    assert WorkloadSpec("azure-code").describe()["input_mean"] == 2048  # azure_code_2023.csv: 2047.8


def test_multiturn_requests_ask_for_the_output_ids() -> None:
    plain = completion_payload("m", [1, 2], 4)
    assert "return_token_ids" not in plain and plain["max_tokens"] == plain["min_tokens"] == 4
    assert completion_payload("m", [1, 2], 4, return_token_ids=True)["return_token_ids"] is True


def test_penalties_flag_adds_the_penalties_to_every_request() -> None:
    from rapidserve.benchmark.cli import PENALTIES, config_from_args
    from rapidserve.cli import build_parser

    on = config_from_args(build_parser().parse_args(["bench", "--penalties"]))
    off = config_from_args(build_parser().parse_args(["bench"]))
    assert on.sampling == PENALTIES and off.sampling == {}
    body = completion_payload("m", [1, 2], 4, sampling=on.sampling)
    assert {k: body[k] for k in PENALTIES} == PENALTIES
    assert body["temperature"] == 0.0 and body["max_tokens"] == body["min_tokens"] == 4 and body["ignore_eos"]


def test_extra_body_is_merged_into_every_request(tmp_path: Path) -> None:
    """`--extra-body`: e.g. a JSON schema on every request (the structured-outputs throughput bench)."""
    from rapidserve.benchmark.flags import extra_body_arg

    body_file = Path(__file__).parent.parent / "bench" / "structured_outputs_body.json"
    extra = extra_body_arg("@" + str(body_file))
    assert extra["structured_outputs"]["json"]["properties"]["text"]["minLength"] == 4000
    got = completion_payload("m", [1, 2], 4, extra={"guided_regex": "a+"})
    assert got["guided_regex"] == "a+" and got["ignore_eos"] is True
    assert extra_body_arg('{"guided_choice": ["x"]}') == {"guided_choice": ["x"]}
    for bad in ("[1]", "{nope", "@" + str(tmp_path / "missing.json")):
        with pytest.raises(argparse.ArgumentTypeError):
            extra_body_arg(bad)
