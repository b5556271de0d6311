"""What is sent: prompts of random token ids with given or sampled lengths, multi-turn chats, traces.

Prompts are lists of token ids (sent as the `prompt` of /v1/completions), drawn uniformly from
[token_lo, token_hi) (default [1000, 20000): inside every common vocabulary and clear of the special
tokens at the low end). Token ids let the client measure servers without a tokenizer (presets) and
make the prompt length exact. Every request asks for exactly its output length (`max_tokens` =
`min_tokens` = length, `ignore_eos`). Request i's lengths depend only on (seed, i), so every rate of a
sweep sends the same lengths; its tokens also depend on a per-rate salt, so no rate finds the prompts
of an earlier one in a server's prefix cache.

Workloads:
- `fixed`: every prompt `input_len` tokens, every output `output_len` tokens.
- trace-shaped stand-ins (`TRACES`): lengths drawn from a lognormal with the trace's mean and a
  chosen log-space sigma (the traces are long-tailed; the sigmas are not fitted to them), rounded,
  clipped to [1, ...], and clipped so that prompt + output fits `max_model_len` (the output is kept
  first; clipping lowers the effective mean of the long-input traces when `max_model_len` is small):
  | name                | input mean | sigma | output mean | sigma | source                                   |
  | azure-code          | 2048       | 1.0   | 28          | 1.0   | Azure LLM inference trace 2023, code     |
  | azure-conv          | 1155       | 1.0   | 211         | 0.8   | Azure LLM inference trace 2023, conv.    |
  | mooncake            | 12035      | 0.8   | 343         | 0.8   | Mooncake conversation trace (FAST'25)    |
  | arxiv-summarization | 8000       | 0.5   | 200         | 0.5   | round figures, not a published mean      |
  | lmsys               | 69.5       | 1.2   | 214.5       | 0.9   | LMSYS-Chat-1M per-turn means (2023 paper)|
  The Azure and Mooncake means are those of the released trace files (`--workload trace` replays the
  files themselves), checked against them: azure_code_2023.csv (8,819 requests, the Azure 2023 code
  trace of github Azure/AzurePublicDataset, the trace of Splitwise, ISCA'24): input mean 2047.8
  (median 1469, log-space sd 1.36), output mean 27.9 (median 13, sd 0.85); azure_conv_2023.csv
  (19,366): input 1154.7 (median 1020, sd 0.99), output 211.1 (median 129, sd 0.86); Mooncake
  conversation (12,031, github kvcache-ai/Mooncake FAST25-release/traces): input 12035.1 (median
  6909, sd 1.20), output 342.6 (median 350, sd 1.36). The stand-ins match the means, not the shapes
  (the files' medians are higher than a lognormal of that mean and sigma gives for the Azure inputs).
  LMSYS: the average tokens per prompt and per response of LMSYS-Chat-1M (Zheng et al., ICLR'24,
  arXiv 2309.11998, Table 1; for long conversation contexts use `multiturn`). arXiv summarization:
  ~8K-token inputs and ~200-token outputs, round figures for the summarization workloads of
  serving papers, not a measured mean.
- `multiturn`: conversations of `num_turns` turns. Turn 0's prompt is `input_len` new tokens; turn k's
  prompt is turn k-1's prompt + turn k-1's output + `turn_input_len` new tokens, so every later turn
  resends the whole conversation so far (turns 0..k-1, their outputs included) as its prefix (what
  prefix caching can reuse). The outputs are re-sent as the token ids the server returned when it
  returns them: token-id-only servers always do, vLLM and rapidserve do when asked (`return_token_ids`,
  which the client sends with every multiturn request; other servers ignore the field). A server that
  returns only text (most others) gets a deterministic random stand-in
  of the output's length instead, so the previous output's blocks are not what it cached (the
  earlier prompts still are). A conversation's turns are sent one after another; the arrival
  process and `--num-prompts` count conversations.
- `trace`: a trace file replayed (`replay.py`, `traces.py`): the trace's lengths, its arrival times
  (time-scaled) or Poisson arrivals, and with Mooncake hash ids prompts that share prefixes exactly
  where the trace's do.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rapidserve.benchmark.traces import TraceSpec

WORKLOADS: tuple[str, ...] = ("fixed", "azure-code", "azure-conv", "mooncake", "arxiv-summarization", "lmsys",
                              "multiturn", "trace")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: lognormal with the given mean (sigma in log space)."""

    mean: float
    sigma: float

    def sample(self, rng: np.random.Generator) -> int:
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so that E[X] = mean
        return max(1, int(round(float(rng.lognormal(mu, self.sigma)))))


@dataclass(frozen=True)
class TraceShape:
    input: LengthDist
    output: LengthDist
    source: str


TRACES: dict[str, TraceShape] = {
    "azure-code": TraceShape(LengthDist(2048, 1.0), LengthDist(28, 1.0), "Azure LLM inference trace 2023, code"),
    "azure-conv": TraceShape(LengthDist(1155, 1.0), LengthDist(211, 0.8),
                             "Azure LLM inference trace 2023, conversation"),
    "mooncake": TraceShape(LengthDist(12035, 0.8), LengthDist(343, 0.8), "Mooncake conversation trace (FAST'25)"),
    "arxiv-summarization": TraceShape(LengthDist(8000, 0.5), LengthDist(200, 0.5),
                                      "arXiv summarization (round figures)"),
    "lmsys": TraceShape(LengthDist(69.5, 1.2), LengthDist(214.5, 0.9), "LMSYS-Chat-1M per-turn averages"),
}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "fixed"
    input_len: int = 1024
    output_len: int = 128
    num_turns: int = 4
    turn_input_len: int = 128
    token_lo: int = 1000
    token_hi: int = 20000
    max_model_len: int | None = None  # None: no clipping, no check
    trace: TraceSpec | None = None  # the trace workload's file and replay options

    def check(self) -> None:
        """ValueError (saying what is allowed) when the spec cannot produce valid requests."""
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is not one of {', '.join(WORKLOADS)}")
        for k in ("input_len", "output_len", "num_turns", "turn_input_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 1")
        if not 0 <= self.token_lo < self.token_hi:
            raise ValueError(f"token range [{self.token_lo}, {self.token_hi}) must satisfy 0 <= lo < hi")
        need = self.longest_sequence()
        if self.max_model_len is not None and need is not None and need > self.max_model_len:
            what = ("input_len + output_len" if self.name == "fixed" else
                    "input_len + (num_turns - 1) * turn_input_len + num_turns * output_len")
            raise ValueError(f"the {self.name} workload needs {need} tokens ({what}) but the server's "
                             f"max model length is {self.max_model_len}")
        if (self.name == "trace") != (self.trace is not None):
            raise ValueError("--trace PATH goes with --workload trace, and --workload trace needs --trace PATH")
        if self.trace is not None:
            self.trace.check()
        if self.max_model_len is not None and (self.name in TRACES or self.name == "trace") and self.max_model_len < 2:
            raise ValueError(f"max model length {self.max_model_len} leaves no room for a prompt and an output")

    def longest_sequence(self) -> int | None:
        """Prompt + output tokens of the longest request (None for the sampled, clipped traces)."""
        if self.name == "fixed":
            return self.input_len + self.output_len
        if self.name == "multiturn":
            return self.input_len + (self.num_turns - 1) * self.turn_input_len + self.num_turns * self.output_len
        return None

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {"name": self.name, "token_range": [self.token_lo, self.token_hi],
                                "max_model_len": self.max_model_len}
        if self.name in ("fixed", "multiturn"):
            d.update(input_len=self.input_len, output_len=self.output_len)
        if self.name == "multiturn":
            d.update(num_turns=self.num_turns, turn_input_len=self.turn_input_len)
        if self.trace is not None:
            d.update(trace=self.trace.path, trace_arrivals=self.trace.arrivals, trace_start_s=self.trace.start_s,
                     trace_overflow=self.trace.overflow, block_size=self.trace.block_size)
        if self.name in TRACES:
            t = TRACES[self.name]
            d.update(input_mean=t.input.mean, input_sigma=t.input.sigma, output_mean=t.output.mean,
                     output_sigma=t.output.sigma, source=t.source, distribution="lognormal, clipped")
        return d


@dataclass(frozen=True)
class BenchRequest:
    """One single-turn request: the prompt's token ids and the exact number of tokens to generate."""

    index: int
    prompt: list[int]
    output_len: int


@dataclass
class Conversation:
    """A multi-turn conversation: the new user tokens of each turn and each turn's output length."""

    index: int
    user_turns: list[list[int]]
    output_lens: list[int]
    rng: np.random.Generator  # draws the stand-ins for outputs the server did not return as ids

    def prompt(self, turn: int, history: Sequence[int]) -> list[int]:
        """The prompt of `turn`: the conversation so far (previous prompt + its output) + new tokens."""
        return [*history, *self.user_turns[turn]]

    def standin(self, n: int, spec: WorkloadSpec) -> list[int]:
        return random_tokens(self.rng, n, spec.token_lo, spec.token_hi)


def request_rng(seed: int, index: int, salt: int = 0) -> np.random.Generator:
    """A Generator of request (or conversation) `index`: depends only on (seed, index, salt)."""
    return np.random.default_rng([seed, index, salt, 0x3E9])


def random_tokens(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return rng.integers(lo, hi, size=n).tolist()


def sample_lengths(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[int, int]:
    """(prompt tokens, output tokens) of one single-turn request of `spec`."""
    if spec.name == "fixed":
        return spec.input_len, spec.output_len
    trace = TRACES[spec.name]
    n_in, n_out = trace.input.sample(rng), trace.output.sample(rng)
    return clip_lengths(n_in, n_out, spec.max_model_len)


def clip_lengths(n_in: int, n_out: int, max_model_len: int | None) -> tuple[int, int]:
    """Clip so that prompt + output <= max_model_len, keeping >= 1 of each (the output first: it is
    capped at half the window, then the prompt takes what is left)."""
    n_in, n_out = max(1, n_in), max(1, n_out)
    if max_model_len is None or n_in + n_out <= max_model_len:
        return n_in, n_out
    n_out = max(1, min(n_out, max_model_len // 2))
    return max(1, min(n_in, max_model_len - n_out)), n_out


def make_request(spec: WorkloadSpec, seed: int, index: int, salt: int = 0) -> BenchRequest:
    """Request `index` of a single-turn workload: lengths from (seed, index), tokens from (seed,
    index, salt) (salt >= 0: one per rate of a sweep)."""
    if spec.name == "multiturn":
        raise ValueError("multiturn workloads are made of conversations: use make_conversation")
    if spec.name == "trace":
        raise ValueError("trace requests come from the trace: use replay.build_replay")
    n_in, n_out = sample_lengths(spec, request_rng(seed, index))
    return BenchRequest(index, random_tokens(request_rng(seed, index, salt + 1), n_in, spec.token_lo, spec.token_hi),
                        n_out)


def make_conversation(spec: WorkloadSpec, seed: int, index: int, salt: int = 0) -> Conversation:
    """Conversation `index` of a multiturn workload (tokens from (seed, index, salt))."""
    if spec.name != "multiturn":
        raise ValueError(f"the {spec.name} workload is single-turn: use make_request")
    rng = request_rng(seed, index, salt + 1)
    turns = [random_tokens(rng, spec.input_len if k == 0 else spec.turn_input_len, spec.token_lo, spec.token_hi)
             for k in range(spec.num_turns)]
    return Conversation(index, turns, [spec.output_len] * spec.num_turns, rng)
